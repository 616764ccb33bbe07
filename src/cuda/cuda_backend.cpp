#include "cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <string>

#include "cuda/check.h"
#include "cuda/combine_partials.h"
#include "cuda/device_scope.h"
#include "cuda/dispatch.h"
#include "cuda/fp8_backward.h"
#include "cuda/fp8_forward.h"
#include "cuda/gemm/expert_gemm.h"
#include "cuda/mxfp8_forward.h"
#include "cuda/nvfp4_forward.h"
#include "cuda/publish.h"
#include "cuda/reduce.h"
#include "cuda/slots.h"
#include "cuda/route.h"
#include "cuda/scatter.h"
#include "cuda/swiglu.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"

namespace epmoe {
namespace cuda {
namespace {

// Makes the backend's device current for the scope (the caller's thread may use another one).
using cuda::DeviceScope;

}  // namespace

CudaBackend::CudaBackend(int device_ordinal) : ordinal_(device_ordinal) {
  const int count = cuda_device_count();
  EPMOE_EXPECT(device_ordinal >= 0 && device_ordinal < count, backend, "Device",
               "a CUDA ordinal in [0, " + std::to_string(count) + ")",
               "cuda:" + std::to_string(device_ordinal));
  DeviceScope scope(ordinal_);
  fork_ = std::make_unique<StreamFork>();
}

void CudaBackend::validate(const Config& config, int ep_size) const {
  // The FP8, NVFP4 and MXFP8 paths are defined by the CPU reference (docs/formats.md). The FP8
  // forward and backward, the NVFP4 weight-only forward and the MXFP8 forward run on CUDA.
  const Precision precision = config.fields().precision;
  if (precision == Precision::mxfp8) {
    EPMOE_CHECK_ARG(config.D() % 32 == 0, "Config.hidden_dim",
                    "a multiple of 32 with mxfp8 on CUDA (whole MX blocks: W13's K)", config.D());
    EPMOE_CHECK_ARG(config.F() % 32 == 0, "Config.intermediate_dim",
                    "a multiple of 32 with mxfp8 on CUDA (whole MX blocks: W2's K)", config.F());
  }
  if (precision == Precision::fp8_block) {
    EPMOE_CHECK_ARG(config.D() % 16 == 0, "Config.hidden_dim",
                    "a multiple of 16 with fp8_block on CUDA (16-byte E4M3 rows; the FP8 GEMM's K)",
                    config.D());
    EPMOE_CHECK_ARG(config.F() % 16 == 0, "Config.intermediate_dim",
                    "a multiple of 16 with fp8_block on CUDA (16-byte E4M3 rows; the FP8 GEMM's K)",
                    config.F());
  }
  if (precision == Precision::nvfp4) {
    EPMOE_CHECK_ARG(config.D() % 32 == 0, "Config.hidden_dim",
                    "a multiple of 32 with nvfp4 on CUDA (W13's K: 16-byte NVFP4 code rows for TMA)",
                    config.D());
    EPMOE_CHECK_ARG(config.F() % 32 == 0, "Config.intermediate_dim",
                    "a multiple of 32 with nvfp4 on CUDA (W2's K: 16-byte NVFP4 code rows for TMA)",
                    config.F());
  }
  EPMOE_CHECK_ARG(config.D() % 8 == 0, "Config.hidden_dim",
                  "a multiple of 8 on CUDA (16-byte bf16 rows for TMA and vector loads)", config.D());
  EPMOE_CHECK_ARG(config.F() % 8 == 0, "Config.intermediate_dim",
                  "a multiple of 8 on CUDA (16-byte bf16 rows for TMA and vector loads)", config.F());
  EPMOE_CHECK_ARG(config.num_experts() <= kMaxGlobalExperts, "Config.num_experts",
                  "at most " + std::to_string(kMaxGlobalExperts) + " global experts on CUDA",
                  config.num_experts());
  const long long routes = static_cast<long long>(ep_size) * config.T() * config.K();
  EPMOE_CHECK_ARG(routes <= INT_MAX, "Config.max_tokens_per_rank",
                  "R * T * K <= " + std::to_string(INT_MAX) + " (int32 route ids)",
                  std::to_string(ep_size) + " * " + std::to_string(config.T()) + " * " +
                      std::to_string(config.K()) + " = " + std::to_string(routes));
}

void* CudaBackend::allocate(std::size_t bytes) {
  DeviceScope scope(ordinal_);
  void* ptr = nullptr;
  EPMOE_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  EPMOE_CUDA_CHECK(cudaMemset(ptr, 0, bytes));
  return ptr;
}

void CudaBackend::release(void* ptr) {
  if (ptr == nullptr) return;
  DeviceScope scope(ordinal_);
  EPMOE_CUDA_CHECK(cudaFree(ptr));
}

Backend::HostBacked CudaBackend::allocate_host_backed(std::size_t device_bytes,
                                                      std::size_t host_bytes) {
  const HostBackedArena a = create_host_backed_arena(ordinal_, device_bytes, host_bytes);
  host_backed_.push_back(a);
  return {a.ptr, a.device_held, a.host_held};
}

void CudaBackend::release_host_backed(void* ptr) {
  for (auto it = host_backed_.begin(); it != host_backed_.end(); ++it) {
    if (it->ptr != ptr) continue;
    const HostBackedArena a = *it;
    host_backed_.erase(it);
    DeviceScope scope(ordinal_);
    destroy_host_backed_arena(a);
    return;
  }
  EPMOE_EXPECT(false, internal, "ptr", "a range from allocate_host_backed", "an unknown pointer");
}

void CudaBackend::copy_to_device(void* dst, const void* src, std::size_t bytes) {
  DeviceScope scope(ordinal_);
  EPMOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void CudaBackend::copy_to_host(void* dst, const void* src, std::size_t bytes) {
  DeviceScope scope(ordinal_);
  EPMOE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void CudaBackend::synchronize(void* stream) {
  DeviceScope scope(ordinal_);
  if (stream == nullptr) {
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
}

// ---- stages: each makes the device current and enqueues its launches ----
// bf16 W2 DGRAD + SwiGLU backward (one stage): by default the GEMM stores grad_h into h's rows
// and swiglu_backward reads it there (each thread loads its 8 grad_h values before storing the 8
// h values in their place; h's rows hold nothing else the backward needs until then), so the stage
// needs no grad_h buffer; EPMOE_SWIGLU_BACKWARD=epilogue runs the math in the GEMM's epilogue.
// The same bits either way (swiglu.h, swiglu_backward_in_epilogue).
namespace {
void w2_dgrad_then_swiglu(const Step& s) {
  if (swiglu_backward_in_epilogue()) {
    w2_dgrad(s, true);
    return;
  }
  Step t = s;
  t.grad_h_MF = s.h_MF;
  w2_dgrad(t, false);
  swiglu_backward(t);
}
}  // namespace

#define EPMOE_STAGE(name, ...)                   \
  void CudaBackend::name(const Step& s) {        \
    DeviceScope scope(ordinal_);                 \
    __VA_ARGS__;                                 \
  }

EPMOE_STAGE(publish_forward, cuda::publish_forward(s))
EPMOE_STAGE(route, cuda::route(s))
EPMOE_STAGE(plan_forward, cuda::plan_forward(s))
EPMOE_STAGE(save_input, cuda::save_input(s))
EPMOE_STAGE(dispatch, cuda::dispatch(s))
// FP8 (s.fp8): the E4M3 GEMMs, and h quantized by the unfused SwiGLU kernel (fp8_forward.h).
// NVFP4 (s.nvfp4): the weight-only GEMMs on bf16 rows (nvfp4_forward.h). MXFP8 (s.mxfp8): the
// rows quantized 1x32, then the MXFP8 GEMMs (mxfp8_forward.h).
EPMOE_STAGE(w13_gemm, if (s.fp8) cuda::fp8_w13_fprop(s);
            else if (s.nvfp4) cuda::nvfp4_w13_fprop(s, fork_->view());
            else if (s.mxfp8) cuda::mxfp8_w13_fprop(s); else cuda::w13_fprop(s, false))
EPMOE_STAGE(swiglu_forward, if (s.fp8) cuda::fp8_swiglu_forward(s); else cuda::swiglu_forward(s))
EPMOE_STAGE(w13_swiglu, if (s.fp8) cuda::fp8_w13_swiglu(s);
            else if (s.nvfp4) cuda::nvfp4_w13_swiglu(s, fork_->view());
            else if (s.mxfp8) cuda::mxfp8_w13_swiglu(s); else cuda::w13_fprop(s, true))
EPMOE_STAGE(w2_gemm, if (s.fp8) cuda::fp8_w2_fprop(s, false);
            else if (s.nvfp4) cuda::nvfp4_w2_fprop(s, false, fork_->view());
            else if (s.mxfp8) cuda::mxfp8_w2_fprop(s, false); else cuda::w2_fprop(s, false))
EPMOE_STAGE(scatter_rows, cuda::scatter_rows(s))
EPMOE_STAGE(w2_scatter, if (s.fp8) cuda::fp8_w2_fprop(s, true);
            else if (s.nvfp4) cuda::nvfp4_w2_fprop(s, true, fork_->view());
            else if (s.mxfp8) cuda::mxfp8_w2_fprop(s, true); else cuda::w2_fprop(s, true))
EPMOE_STAGE(combine_send_forward, cuda::send_partials(s, true))
EPMOE_STAGE(reduce_forward, s.combine_per_rank
                                ? cuda::reduce_partials(s, s.y_TD, "y_TD", nullptr)
                                : cuda::reduce_forward(s))

EPMOE_STAGE(plan_backward, cuda::plan_backward(s))
EPMOE_STAGE(restore_input, cuda::restore_input(s))
EPMOE_STAGE(publish_backward, cuda::publish_backward(s))
EPMOE_STAGE(grad_scores, cuda::grad_scores(s))
// FP8 (s.fp8): grad_h3 and grad_h13 quantized by the bf16 kernels that write them; the DGRADs
// on the FP8 GEMM, the WGRADs on FP8-quantized operands (fp8_backward.h), or with s.fp8_wgrad =
// bf16 (Config.fp8_wgrad as the plan resolved it) the bf16 WGRADs (x decoded to bf16 first).
EPMOE_STAGE(gather_grad, if (s.fp8) cuda::fp8_gather_grad(s); else cuda::gather_grad(s))
EPMOE_STAGE(w2_dgrad, if (s.fp8) cuda::fp8_w2_dgrad(s, false); else cuda::w2_dgrad(s, false))
EPMOE_STAGE(swiglu_backward,
            if (s.fp8) cuda::fp8_swiglu_backward(s); else cuda::swiglu_backward(s))
EPMOE_STAGE(w2_dgrad_swiglu, if (s.fp8) cuda::fp8_w2_dgrad(s, true); else w2_dgrad_then_swiglu(s))
EPMOE_STAGE(w2_wgrad, if (s.fp8 && s.fp8_wgrad == Fp8Wgrad::fp8) cuda::fp8_w2_wgrad(s);
            else cuda::w2_wgrad(s))
EPMOE_STAGE(w13_dgrad, if (s.fp8) cuda::fp8_w13_dgrad(s, false); else cuda::w13_dgrad(s, false))
EPMOE_STAGE(w13_dgrad_scatter,
            if (s.fp8) cuda::fp8_w13_dgrad(s, true); else cuda::w13_dgrad(s, true))
EPMOE_STAGE(w13_wgrad, if (s.fp8 && s.fp8_wgrad == Fp8Wgrad::fp8) cuda::fp8_w13_wgrad(s);
            else if (s.fp8) cuda::fp8_w13_wgrad_bf16(s); else cuda::w13_wgrad(s))
EPMOE_STAGE(combine_send_backward, cuda::send_partials(s, false))
EPMOE_STAGE(reduce_backward, s.combine_per_rank
                                 ? cuda::reduce_partials(s, s.grad_x_TD, "grad_x_TD",
                                                         s.grad_scores_TK)
                                 : cuda::reduce_backward(s))

#undef EPMOE_STAGE

}  // namespace cuda

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear the error, report none
    return 0;
  }
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal) {
  return std::make_unique<cuda::CudaBackend>(device_ordinal);
}

}  // namespace epmoe
