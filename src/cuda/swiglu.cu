// Unfused SwiGLU: grid-stride over 8-column vectors of the rows, rows m >= M do nothing. The math is
// core/activation.h's (the same functions the CPU reference and the fused GEMM epilogues call):
// bf16 inputs widened to fp32, one rounding per stored element.
#include "cuda/swiglu.h"

#include <cstdlib>
#include <cstring>

#include "core/activation.h"
#include "cuda/formats/fp8_row_vectors.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"
#include "cuda/swiglu_backward_run8.cuh"

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
  Fp8RowsOut q;               // kQuantize: the E4M3 rows of h / grad_h13 (fp8_rows_bytes)
  int64_t F, capacity, chunks;
  ActivationParams act;
};

// kQuantize (FP8, F % 128 == 0): h is also quantized 1x128 into p.q as fp8_quantize_rows_counted
// would from the stored rows. A row holds a multiple of 16 vectors and the stride is a multiple of
// 32, so each half warp holds one 1x128 block of one row, lane j elements 8j .. 8j + 7
// (fp8_row_vectors.cuh).
template <bool kQuantize>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(const SwigluParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const bf16_t* h13_M2F = p.h13.get<const bf16_t>();  // [capacity, 2F]
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t vecs_per_row = p.F / kVec;
  const int64_t total = M * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const unsigned block_lanes = 0xffffu << ((threadIdx.x % 32) & 16u);  // a 1x128 block's 16 lanes
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / vecs_per_row;
    const int64_t f = (j % vecs_per_row) * kVec;
    const bf16_t* row_2F = h13_M2F + m * 2 * p.F;  // [2F]
    const Bf16x8 gate = unpack8(load_vec(row_2F + f));
    const Bf16x8 up = unpack8(load_vec(row_2F + p.F + f));
    Bf16x8 h;
#pragma unroll
    for (int e = 0; e < kVec; ++e) h.v[e] = ::epmoe::swiglu_forward(gate.v[e], up.v[e], p.act);
    const uint4 h_8 = pack8(h);
    store_vec(p.h_MF + m * p.F + f, h_8);
    if constexpr (kQuantize) {
      store_fp8_run8(p.q, m, p.F, f, fp8_quantize_run8(h_8, true, block_lanes));
    }
  }
}

// Backward: items (row m, 64-column chunk c, 8-column segment s), s fastest, so the 8 segments of
// a chunk are lanes 8a .. 8a + 7 of one warp, as in the W2 DGRAD epilogues (gemm/epilogues.cuh,
// gemm/fp8_swiglu_epilogue.cuh; the FP8 one shares swiglu_backward_run8), whose math and
// grad_scores partials this repeats bit for bit: with row scores grad_h = dh is
// unscaled, the SwiGLU backward takes score * dh, h is stored as bf16(score * act), and
// <dh, bf16(act)> goes to score_parts_MC[m, c] (8 columns in order, then the xor tree).
// kQuantize (FP8 training, F % 128 == 0): grad_h13 is also quantized 1x128 into p.q as
// fp8_quantize_rows_counted would from the stored rows. Chunks 2b and 2b + 1 of a row are the 16
// lanes of a half warp (chunks is even, the stride a multiple of 32), which then hold gate block b
// and up block F / 128 + b, lane j of the half elements 8j .. 8j + 7 of both (fp8_row_vectors.cuh).
template <bool kQuantize>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(const SwigluParams p) {
  if (layout_skip(p.header)) return;
  const bf16_t* h13_M2F = p.h13.get<const bf16_t>();  // [capacity, 2F]
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t total = M * p.chunks * 8;  // a multiple of 8: a row's chunk is all in or all out
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;  // a multiple of 32
  const bool scored = p.row_scores_M != nullptr;                          // kernel-uniform
  const unsigned row_lanes = 0xffu << ((threadIdx.x % 32) & ~7u);        // the chunk's 8 lanes
  const unsigned block_lanes = 0xffffu << ((threadIdx.x % 32) & 16u);    // a 1x128 block's 16 lanes
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / (p.chunks * 8);
    const int64_t c = (j / 8) % p.chunks;
    const int64_t f = c * kScoreChunkCols + (j % 8) * kVec;
    float dot = 0.0f;
    uint4 d_gate_8 = make_uint4(0u, 0u, 0u, 0u), d_up_8 = make_uint4(0u, 0u, 0u, 0u);
    if (f < p.F) {  // F % 8 == 0: a segment is all in or all out
      const float score = scored ? p.row_scores_M[m] : 1.0f;
      const bf16_t* row_2F = h13_M2F + m * 2 * p.F;  // [2F]
      const SwigluBackwardRun8 r = swiglu_backward_run8(load_vec(row_2F + f), load_vec(row_2F + p.F + f),
                                                        load_vec(p.grad_h_MF + m * p.F + f), scored,
                                                        score, p.act);
      dot = r.dot;
      store_vec(p.h_MF + m * p.F + f, r.h);
      bf16_t* grad_2F = p.grad_h13_M2F + m * 2 * p.F;  // [2F]
      d_gate_8 = r.d_gate;
      d_up_8 = r.d_up;
      store_vec(grad_2F + f, d_gate_8);
      store_vec(grad_2F + p.F + f, d_up_8);
    }
    if constexpr (kQuantize) {  // f < F on every lane (F % 128 == 0); the half warp is all in
      const Fp8Run8 q_gate = fp8_quantize_run8(d_gate_8, f < p.F, block_lanes);
      const Fp8Run8 q_up = fp8_quantize_run8(d_up_8, f < p.F, block_lanes);
      if (f < p.F) {
        store_fp8_run8(p.q, m, 2 * p.F, f, q_gate);
        store_fp8_run8(p.q, m, 2 * p.F, p.F + f, q_up);
      }
    }
    if (scored) {
      dot = chunk_dot_sum(dot, row_lanes);
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

// The E4M3 rows a kernel writes beside h or grad_h13: F % 128 == 0 (a half warp is one block, and
// no block of [gate | up] spans both halves).
void check_fp8_rows(const Step& s, const uint8_t* codes, const float* scales_SM, int64_t ld,
                    const char* codes_name) {
  EPMOE_CHECK_ARG(s.dims.F % kFp8RowBlock == 0, "Config.intermediate_dim",
                  "a multiple of 128 for the SwiGLU kernels' E4M3 rows", s.dims.F);
  EPMOE_CHECK_ARG(ld >= s.capacity_rows, "ld", ">= the capacity rows", ld);
  EPMOE_CHECK_ARG(codes != nullptr && scales_SM != nullptr, codes_name,
                  "the E4M3 rows' codes and scales", "nullptr");
  check_aligned16(codes, codes_name);
}

}  // namespace

void swiglu_forward(const Step& s) {
  SwigluParams p = swiglu_params(s);
  p.replay_skip = replay_skip_flag(s);
  const int64_t items = s.capacity_rows * (s.dims.F / kVec);
  swiglu_forward_kernel<false><<<grid_for(items, kThreads), kThreads, 0,
                                 static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void swiglu_forward_fp8_rows(const Step& s, uint8_t* q_MF, float* scales_SM, int64_t ld) {
  check_fp8_rows(s, q_MF, scales_SM, ld, "q_MF");
  SwigluParams p = swiglu_params(s);
  p.replay_skip = replay_skip_flag(s);
  p.q = Fp8RowsOut{q_MF, scales_SM, ld};
  const int64_t items = s.capacity_rows * (s.dims.F / kVec);
  swiglu_forward_kernel<true><<<grid_for(items, kThreads), kThreads, 0,
                                static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(const Step& s) {
  EPMOE_CHECK_ARG(s.grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  const SwigluParams p = swiglu_params(s);
  const int64_t items = s.capacity_rows * p.chunks * 8;
  swiglu_backward_kernel<false><<<grid_for(items, kThreads), kThreads, 0,
                                  static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void swiglu_backward_fp8_rows(const Step& s, uint8_t* q_M2F, float* scales_SM, int64_t ld) {
  EPMOE_CHECK_ARG(s.grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  check_fp8_rows(s, q_M2F, scales_SM, ld, "q_M2F");
  SwigluParams p = swiglu_params(s);
  p.q = Fp8RowsOut{q_M2F, scales_SM, ld};
  const int64_t items = s.capacity_rows * p.chunks * 8;
  swiglu_backward_kernel<true><<<grid_for(items, kThreads), kThreads, 0,
                                 static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

bool swiglu_backward_in_epilogue() {
  const char* env = std::getenv("EPMOE_SWIGLU_BACKWARD");
  EPMOE_CHECK_ARG(env == nullptr || std::strcmp(env, "epilogue") == 0 || std::strcmp(env, "kernel") == 0,
                  "EPMOE_SWIGLU_BACKWARD", "epilogue or kernel", env);
  return env != nullptr && env[0] == 'e';
}

}  // namespace epmoe::cuda
