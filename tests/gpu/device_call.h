// GPU test support: one rank's routed-experts call with every tensor in device memory (inputs
// uploaded from moe_case.h's RankInputs, outputs poisoned with NaN before each run and downloaded
// as RankOutputs), and one forward + backward through a Context.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "epmoe/context.h"
#include "moe_case.h"

namespace epmoe::test {

template <class T>
T* upload(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(T)), cudaSuccess);
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return d;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// One rank's call with every tensor in device memory of cuda:device (the calling thread's current
// device); outputs poisoned with NaN before each run.
struct DeviceCall {
  DeviceCall(const Problem& problem, const RankInputs& in, int device_ordinal = 0)
      : p(problem), host(problem, in), device(device_ordinal) {
    const int64_t T = in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
    const int64_t E = p.local_experts();
    x = upload(in.x_TD);
    grad_y = upload(in.grad_y_TD);
    w13 = upload(in.w13_EFD);
    w2 = upload(in.w2_EDF);
    ids32 = upload(host.ids32);
    ids64 = upload(host.ids64);
    scores32 = upload(host.scores32);
    scores16 = upload(host.scores16);
    live = upload(std::vector<int32_t>{host.live});
    y = upload(std::vector<bf16_t>(static_cast<size_t>(T * D)));
    grad_x = upload(std::vector<bf16_t>(static_cast<size_t>(T * D)));
    grad_scores = upload(std::vector<float>(static_cast<size_t>(T * K)));
    const size_t wsize = element_size(p.wgrad_dtype);
    w13_bytes = static_cast<size_t>(E * 2 * F * D) * wsize;
    w2_bytes = static_cast<size_t>(E * D * F) * wsize;
    grad_w13 = upload(std::vector<char>(w13_bytes));
    grad_w2 = upload(std::vector<char>(w2_bytes));
    poison();
  }
  ~DeviceCall() {
    for (void* ptr : {(void*)x, (void*)grad_y, (void*)w13, (void*)w2, (void*)ids32, (void*)ids64,
                      (void*)scores32, (void*)scores16, (void*)live, (void*)y, (void*)grad_x,
                      (void*)grad_scores, (void*)grad_w13, (void*)grad_w2}) {
      cudaFree(ptr);
    }
  }
  DeviceCall(const DeviceCall&) = delete;
  DeviceCall& operator=(const DeviceCall&) = delete;

  void poison() {
    EXPECT_EQ(cudaMemset(y, 0xff, host.y.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMemset(grad_x, 0xff, host.grad_x.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMemset(grad_scores, 0xff, host.grad_scores.size() * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(grad_w13, 0xff, w13_bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(grad_w2, 0xff, w2_bytes), cudaSuccess);
  }

  // New ids, scores and live count at the same device addresses (graph replays see them). A call
  // built with live = -1 passes num_tokens_1 = nullptr, so a graph captured from it never reads
  // `live`: a live count given here would be ignored, and the replay would run all T tokens.
  void set_routing(const RankInputs& in) {
    EXPECT_TRUE(host.in.live >= 0 || in.live < 0)
        << "set_routing: live " << in.live
        << " on a call built without num_tokens_1 (live = -1); build the call with live >= 0";
    RankCall next(p, in);
    EXPECT_EQ(cudaMemcpy(ids32, next.ids32.data(), next.ids32.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ids64, next.ids64.data(), next.ids64.size() * 8, cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(scores32, next.scores32.data(), next.scores32.size() * 4,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(scores16, next.scores16.data(), next.scores16.size() * 2,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(live, &next.live, 4, cudaMemcpyHostToDevice), cudaSuccess);
  }

  ForwardArgs forward_args(cudaStream_t stream) const {
    const int64_t T = host.in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
    const int64_t E = p.local_experts();
    const Device dev = Device::cuda(device);
    ForwardArgs a;
    a.x_TD = TensorRef::contiguous(x, DType::bf16, {T, D}, dev);
    if (host.in.live >= 0) a.num_tokens_1 = TensorRef::contiguous(live, DType::i32, {1}, dev);
    a.topk_ids_TK = host.in.ids_i64 ? TensorRef::contiguous(ids64, DType::i64, {T, K}, dev)
                                    : TensorRef::contiguous(ids32, DType::i32, {T, K}, dev);
    a.topk_scores_TK = host.in.scores_bf16
                           ? TensorRef::contiguous(scores16, DType::bf16, {T, K}, dev)
                           : TensorRef::contiguous(scores32, DType::f32, {T, K}, dev);
    a.w13_EFD = TensorRef::contiguous(w13, DType::bf16, {E, 2 * F, D}, dev);
    a.w2_EDF = TensorRef::contiguous(w2, DType::bf16, {E, D, F}, dev);
    a.y_TD = TensorRef::contiguous(y, DType::bf16, {T, D}, dev);
    a.stream = stream;
    return a;
  }

  BackwardArgs backward_args(const SavedLayer& saved, cudaStream_t stream) const {
    const ForwardArgs f = forward_args(stream);
    const int64_t T = host.in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
    const int64_t E = p.local_experts();
    const Device dev = Device::cuda(device);
    BackwardArgs b;
    b.saved = saved;
    b.grad_y_TD = TensorRef::contiguous(grad_y, DType::bf16, {T, D}, dev);
    b.num_tokens_1 = f.num_tokens_1;
    b.topk_ids_TK = f.topk_ids_TK;
    b.topk_scores_TK = f.topk_scores_TK;
    b.w13_EFD = f.w13_EFD;
    b.w2_EDF = f.w2_EDF;
    b.grad_x_TD = TensorRef::contiguous(grad_x, DType::bf16, {T, D}, dev);
    b.grad_scores_TK = TensorRef::contiguous(grad_scores, DType::f32, {T, K}, dev);
    b.grad_w13_EFD = TensorRef::contiguous(grad_w13, p.wgrad_dtype, {E, 2 * F, D}, dev);
    b.grad_w2_EDF = TensorRef::contiguous(grad_w2, p.wgrad_dtype, {E, D, F}, dev);
    b.stream = stream;
    return b;
  }

  RankOutputs outputs() {
    RankCall out(p, host.in);
    out.y = download(y, host.y.size());
    out.grad_x = download(grad_x, host.grad_x.size());
    out.grad_scores = download(grad_scores, host.grad_scores.size());
    out.grad_w13 = download(static_cast<const char*>(grad_w13), w13_bytes);
    out.grad_w2 = download(static_cast<const char*>(grad_w2), w2_bytes);
    return out.outputs();
  }

  Problem p;
  RankCall host;  // host-side typed copies (ids as i32/i64, scores as f32/bf16, live)
  int device;
  bf16_t *x, *grad_y, *w13, *w2;
  int32_t* ids32;
  int64_t* ids64;
  float* scores32;
  bf16_t* scores16;
  int32_t* live;
  bf16_t *y, *grad_x;
  float* grad_scores;
  void *grad_w13, *grad_w2;
  size_t w13_bytes, w2_bytes;
};

// Forward + backward on a context; check() on success; returns the outputs.
inline RankOutputs run_once(Context& ctx, DeviceCall& call, cudaStream_t stream) {
  call.poison();
  const SavedLayer saved = ctx.forward(call.forward_args(stream));
  ctx.backward(call.backward_args(saved, stream));
  ctx.check();
  return call.outputs();
}

// Forward only (nothing saved: an inference context); check() on success; returns y.
inline std::vector<bf16_t> run_forward_once(Context& ctx, DeviceCall& call, cudaStream_t stream) {
  call.poison();
  ForwardArgs a = call.forward_args(stream);
  a.save_for_backward = false;
  ctx.forward(a);
  ctx.check();
  return download(call.y, call.host.y.size());
}

}  // namespace epmoe::test
