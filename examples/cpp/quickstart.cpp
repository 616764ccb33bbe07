// Quickstart: one MoE layer, forward + backward on R = 2 ranks played by threads (CPU backend).
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "epmoe/context.h"
#include "epmoe/error.h"

using namespace epmoe;

uint16_t bf16(float f) {  // float -> bf16 by truncation, enough for an example
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

// One rank: its tokens, its experts' weights, one forward and one backward.
void run_rank(const Config& config, std::shared_ptr<Transport> transport, int R) {
  const int64_t T = config.T(), D = config.D(), F = config.F(), K = config.K();
  const int64_t E = config.local_experts(R);      // rank r owns global experts [r*E, (r+1)*E)
  auto ctx = Context::create(config, transport);  // collective over the R ranks
  std::vector<uint16_t> x(T * D), grad_y(T * D), w13(E * 2 * F * D), w2(E * D * F), y(T * D);
  for (size_t i = 0; i < x.size(); ++i) x[i] = grad_y[i] = bf16(0.01f * float(i % 97) - 0.5f);
  for (size_t i = 0; i < w13.size(); ++i) w13[i] = bf16(0.002f * float(i % 89) - 0.09f);
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = bf16(0.003f * float(i % 61) - 0.09f);
  std::vector<int32_t> ids(T * K);  // global expert ids in [0, E*R); -1 = inactive route
  std::vector<float> scores(T * K, 0.5f);
  for (int64_t i = 0; i < T * K; ++i) ids[i] = int32_t((i + transport->rank()) % (E * R));

  ForwardArgs fa;  // num_tokens_1 left empty: every token is live
  fa.x_TD = TensorRef::contiguous(x.data(), DType::bf16, {T, D});
  fa.topk_ids_TK = TensorRef::contiguous(ids.data(), DType::i32, {T, K});
  fa.topk_scores_TK = TensorRef::contiguous(scores.data(), DType::f32, {T, K});
  fa.w13_EFD = TensorRef::contiguous(w13.data(), DType::bf16, {E, 2 * F, D});
  fa.w2_EDF = TensorRef::contiguous(w2.data(), DType::bf16, {E, D, F});
  fa.y_TD = TensorRef::contiguous(y.data(), DType::bf16, {T, D});
  const SavedLayer saved = ctx->forward(fa);  // collective: every rank calls it, in the same order

  std::vector<uint16_t> grad_x(T * D), grad_w13(w13.size()), grad_w2(w2.size());
  std::vector<float> grad_scores(T * K);
  BackwardArgs ba;
  ba.saved = saved;
  ba.grad_y_TD = TensorRef::contiguous(grad_y.data(), DType::bf16, {T, D});
  ba.topk_ids_TK = fa.topk_ids_TK;
  ba.topk_scores_TK = fa.topk_scores_TK;
  ba.w13_EFD = fa.w13_EFD;
  ba.w2_EDF = fa.w2_EDF;
  ba.grad_x_TD = TensorRef::contiguous(grad_x.data(), DType::bf16, {T, D});
  ba.grad_scores_TK = TensorRef::contiguous(grad_scores.data(), DType::f32, {T, K});
  ba.grad_w13_EFD = TensorRef::contiguous(grad_w13.data(), DType::bf16, {E, 2 * F, D});
  ba.grad_w2_EDF = TensorRef::contiguous(grad_w2.data(), DType::bf16, {E, D, F});
  ctx->backward(ba);
  ctx->check();  // throws the step's recorded error (e.g. capacity overflow), if any
  std::printf("rank %d: grad_scores[0, 0] = %g\n", transport->rank(), double(grad_scores[0]));
}

int main() {
  const int R = 2;
  const Config config(ConfigFields{.max_tokens_per_rank = 16,
                                   .hidden_dim = 64,
                                   .intermediate_dim = 32,
                                   .top_k = 2,
                                   .num_experts = 4,
                                   .capacity_factor = R});
  ThreadTransportGroup group(R);  // R ranks as threads of this process
  std::atomic<int> failed = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        run_rank(config, group.transport(r), R);
      } catch (const Error& e) {  // kind, argument, expected vs got, file:line
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        failed = 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  return failed;
}
