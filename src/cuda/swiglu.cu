// Unfused SwiGLU: grid-stride over [capacity, F/8] vectors, rows m >= M do nothing. The math is
// core/activation.h's (the same functions the CPU reference and the fused GEMM epilogues call):
// bf16 inputs widened to fp32, one rounding per stored element.
#include "cuda/swiglu.h"

#include "core/activation.h"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"

namespace epmoe::cuda {
namespace {

struct SwigluParams {
  const int32_t* header;      // layout header
  Placed h13;                 // [capacity, 2F] bf16: gate [0, F) | up [F, 2F) (layer plan)
  const int32_t* replay_skip; // nullable: the backward replay's predicate (placed.h)
  const bf16_t* grad_h_MF;    // [capacity, F] bf16 (backward)
  bf16_t* h_MF;               // [capacity, F] bf16
  bf16_t* grad_h13_M2F;       // [capacity, 2F] bf16 (backward)
  int64_t F, capacity;
  ActivationParams act;
};

template <bool kBackward>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const SwigluParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const bf16_t* h13_M2F = p.h13.get<const bf16_t>();  // [capacity, 2F]
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t vecs_per_row = p.F / kVec;
  const int64_t total = M * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / vecs_per_row;
    const int64_t f = (j % vecs_per_row) * kVec;
    const bf16_t* row_2F = h13_M2F + m * 2 * p.F;  // [2F]
    const Bf16x8 gate = unpack8(load_vec(row_2F + f));
    const Bf16x8 up = unpack8(load_vec(row_2F + p.F + f));
    Bf16x8 h;
#pragma unroll
    for (int e = 0; e < kVec; ++e) h.v[e] = ::epmoe::swiglu_forward(gate.v[e], up.v[e], p.act);
    store_vec(p.h_MF + m * p.F + f, pack8(h));
    if constexpr (kBackward) {
      const Bf16x8 dh = unpack8(load_vec(p.grad_h_MF + m * p.F + f));
      Bf16x8 d_gate, d_up;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        ::epmoe::swiglu_backward(gate.v[e], up.v[e], dh.v[e], p.act, d_gate.v[e], d_up.v[e]);
      }
      bf16_t* grad_2F = p.grad_h13_M2F + m * 2 * p.F;  // [2F]
      store_vec(grad_2F + f, pack8(d_gate));
      store_vec(grad_2F + p.F + f, pack8(d_up));
    }
  }
}

template <bool kBackward>
void launch_swiglu(const Step& s) {
  SwigluParams p{};
  p.header = s.layout.header;
  p.h13 = placed_h13(s);
  p.replay_skip = kBackward ? nullptr : replay_skip_flag(s);
  p.grad_h_MF = s.grad_h_MF;
  p.h_MF = s.h_MF;
  p.grad_h13_M2F = s.grad_h13_M2F;
  p.F = s.dims.F;
  p.capacity = s.capacity_rows;
  p.act = s.act;
  const int64_t items = s.capacity_rows * (s.dims.F / kVec);
  swiglu_kernel<kBackward><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void swiglu_forward(const Step& s) { launch_swiglu<false>(s); }
void swiglu_backward(const Step& s) {
  EPMOE_CHECK_ARG(s.grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  launch_swiglu<true>(s);
}

}  // namespace epmoe::cuda
