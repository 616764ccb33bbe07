// Unfused SwiGLU: grid-stride over 8-column vectors of the rows, rows m >= M do nothing. The math is
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
  const float* row_scores_M;  // [capacity] f32 (backward), nullable: grad_h is already scaled
  float* score_parts_MC;      // [capacity, chunks] f32 (backward, with row scores)
  int64_t F, capacity, chunks;
  ActivationParams act;
};

__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(const SwigluParams p) {
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
  }
}

// Backward: items (row m, 64-column chunk c, 8-column segment s), s fastest, so the 8 segments of
// a chunk are lanes 8a .. 8a + 7 of one warp, as in the W2 DGRAD epilogue (gemm/epilogues.cuh),
// whose math and grad_scores partials this repeats bit for bit: with row scores grad_h = dh is
// unscaled, the SwiGLU backward takes score * dh, h is stored as bf16(score * act), and
// <dh, bf16(act)> goes to score_parts_MC[m, c] (8 columns in order, then the xor tree).
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(const SwigluParams p) {
  if (layout_skip(p.header)) return;
  const bf16_t* h13_M2F = p.h13.get<const bf16_t>();  // [capacity, 2F]
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t total = M * p.chunks * 8;  // a multiple of 8: a row's chunk is all in or all out
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;  // a multiple of 32
  const bool scored = p.row_scores_M != nullptr;                          // kernel-uniform
  const unsigned row_lanes = 0xffu << ((threadIdx.x % 32) & ~7u);        // the chunk's 8 lanes
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / (p.chunks * 8);
    const int64_t c = (j / 8) % p.chunks;
    const int64_t f = c * kScoreChunkCols + (j % 8) * kVec;
    float dot = 0.0f;
    if (f < p.F) {  // F % 8 == 0: a segment is all in or all out
      const float score = scored ? p.row_scores_M[m] : 1.0f;
      const bf16_t* row_2F = h13_M2F + m * 2 * p.F;  // [2F]
      const Bf16x8 gate = unpack8(load_vec(row_2F + f));
      const Bf16x8 up = unpack8(load_vec(row_2F + p.F + f));
      const Bf16x8 dh = unpack8(load_vec(p.grad_h_MF + m * p.F + f));
      Bf16x8 h, d_gate, d_up;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        ::epmoe::swiglu_backward(gate.v[e], up.v[e], scored ? __fmul_rn(score, dh.v[e]) : dh.v[e],
                                 p.act, d_gate.v[e], d_up.v[e]);
        const float act = ::epmoe::swiglu_forward(gate.v[e], up.v[e], p.act);
        const float act16 = bf16_to_float(float_to_bf16(act));
        dot = __fadd_rn(dot, __fmul_rn(dh.v[e], act16));
        h.v[e] = scored ? __fmul_rn(score, act) : act;
      }
      store_vec(p.h_MF + m * p.F + f, pack8(h));
      bf16_t* grad_2F = p.grad_h13_M2F + m * 2 * p.F;  // [2F]
      store_vec(grad_2F + f, pack8(d_gate));
      store_vec(grad_2F + p.F + f, pack8(d_up));
    }
    if (scored) {
      dot = __fadd_rn(dot, __shfl_xor_sync(row_lanes, dot, 4));
      dot = __fadd_rn(dot, __shfl_xor_sync(row_lanes, dot, 2));
      dot = __fadd_rn(dot, __shfl_xor_sync(row_lanes, dot, 1));
      if (j % 8 == 0) p.score_parts_MC[m * p.chunks + c] = dot;
    }
  }
}

SwigluParams swiglu_params(const Step& s) {
  SwigluParams p{};
  p.header = s.layout.header;
  p.h13 = placed_h13(s);
  p.grad_h_MF = s.grad_h_MF;
  p.h_MF = s.h_MF;
  p.grad_h13_M2F = s.grad_h13_M2F;
  p.row_scores_M = s.row_scores_M;
  p.score_parts_MC = s.score_parts_MC;
  p.F = s.dims.F;
  p.capacity = s.capacity_rows;
  p.chunks = score_chunks(s.dims.F);
  p.act = s.act;
  return p;
}

}  // namespace

void swiglu_forward(const Step& s) {
  SwigluParams p = swiglu_params(s);
  p.replay_skip = replay_skip_flag(s);
  const int64_t items = s.capacity_rows * (s.dims.F / kVec);
  swiglu_forward_kernel<<<grid_for(items, kThreads), kThreads, 0,
                          static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const Step& s) {
  EPMOE_CHECK_ARG(s.grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  const SwigluParams p = swiglu_params(s);
  const int64_t items = s.capacity_rows * p.chunks * 8;
  swiglu_backward_kernel<<<grid_for(items, kThreads), kThreads, 0,
                           static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
