#include "cuda/fp8_backward.h"

#include <cstdlib>
#include <cstring>

#include "core/formats/fp8_block.h"
#include "core/fp8_terms.h"
#include "core/plan_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/dispatch.h"
#include "cuda/fp8_forward.h"
#include "cuda/gemm/expert_gemm.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/fp8_wgrad.h"
#include "cuda/placed.h"
#include "cuda/swiglu.h"
#include "cuda/swiglu_backward_cols.h"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

// Row operand of the FP8 scratch at capacity rows (fp8_rows_bytes(M, L) at `offset`).
struct ScratchRows {
  uint8_t* codes;
  float* scales_SM;
  int64_t ld;
};
ScratchRows scratch_rows(const Step& s, int64_t offset, int64_t L) {
  const int64_t M = s.capacity_rows;
  char* base = s.fp8_scratch + offset;
  return {reinterpret_cast<uint8_t*>(base),
          reinterpret_cast<float*>(base + fp8_rows_scales_offset(M, L)), fp8_rows_ld(M)};
}

void quantize_rows(const Step& s, const bf16_t* x_ML, int64_t offset, int64_t L) {
  const ScratchRows r = scratch_rows(s, offset, L);
  fp8_quantize_rows_counted(x_ML, s.capacity_rows, L, s.layout.header + kLayoutRows,
                            s.layout.header + kLayoutSkip, r.codes, r.scales_SM, r.ld, s.stream);
}

// The transposed weight a DGRAD reads (codes [E, K, N], scales [E, S_K, S_N]).
struct Transposed {
  const uint8_t* codes;
  const float* scales;
};

// out[m, :] = bf16(a[m, :] @ w[e]) for w [E, N, K] (E4M3, 128x128 scales [E, S_N, S_K]) read
// transposed: the FP8 grouped GEMM (FPROP form: B as [E, N', K'] = w^T) runs on w^T [E, K, N],
// contracting N (docs/formats.md: the DGRAD is bitwise the FPROP twin applied to the explicit
// transpose). w^T is the caller's prepared copy when given (`prepared`, made by prepare_weights
// with the same transpose); otherwise it is built into the transposed-weight scratch, one region
// for both DGRADs: stream order puts W13's transpose after W2's GEMM.
Fp8GroupedGemmArgs dgrad_args(const Step& s, const ScratchRows& a_rows, const uint8_t* w_ENK,
                              const float* w_scales_EBS, Transposed prepared, int64_t N,
                              int64_t K) {
  const uint8_t* wt_EKN = prepared.codes;
  const float* wt_scales = prepared.scales;
  if (wt_EKN == nullptr || wt_scales == nullptr) {
    EPMOE_CHECK_ARG(s.fp8_transposed != nullptr, "Step.fp8_transposed",
                    "the transposed-weight scratch of a training context (fp8_transposed_layout) "
                    "or the prepared weights' transposed copies",
                    "nullptr");
    const Fp8TransposedLayout l = fp8_transposed_layout(s.dims);
    uint8_t* codes = reinterpret_cast<uint8_t*>(s.fp8_transposed + l.codes);
    float* scales = reinterpret_cast<float*>(s.fp8_transposed + l.scales);
    fp8_transpose_weights(w_ENK, w_scales_EBS, s.dims.E, N, K, codes, scales, s.stream);
    wt_EKN = codes;
    wt_scales = scales;
  }
  Fp8GroupedGemmArgs a;
  a.a_MK = a_rows.codes;
  a.a_scales_SM = a_rows.scales_SM;
  a.ld_a_scales = a_rows.ld;
  a.b_ENK = wt_EKN;  // [E, K, N]: the GEMM's N is the weight's K
  a.b_scales_EBS = wt_scales;
  a.offsets_E1 = s.layout.expert_offsets_E1;
  a.skip = s.layout.header + kLayoutSkip;
  a.E = s.dims.E;
  a.M = s.capacity_rows;
  a.N = K;
  a.K = N;
  a.trim_rows = fp8_trim_rows_rule(balanced_rows_per_expert(s.dims), fp8_tile_from_env());
  a.band_rows = gemm::select_fp8_band_rows(s);
  return a;
}

// The operands of one weight gradient, quantized 128x1 along each expert's rows into the column
// scratch: codes transposed (col_a [N, Kc], col_b [L, Kc], K-major for the FP8 WGRAD), scales
// [blocks, N] and [blocks, L].
struct ColOperands {
  uint8_t* qa;
  float* sa;
  uint8_t* qb;
  float* sb;
  int64_t max_blocks;
};
ColOperands col_operands(const Step& s) {
  const Fp8ScratchLayout l = fp8_scratch_layout(s);
  return {reinterpret_cast<uint8_t*>(s.fp8_scratch + l.col_a),
          reinterpret_cast<float*>(s.fp8_scratch + l.col_a_scales),
          reinterpret_cast<uint8_t*>(s.fp8_scratch + l.col_b),
          reinterpret_cast<float*>(s.fp8_scratch + l.col_b_scales),
          fp8_col_blocks(s.capacity_rows, s.dims.E)};
}

// grad_h13's column operand where swiglu_backward_fp8_cols writes it (fp8_grad_h13_cols_layout:
// over the call scratch's bf16 grad_h13 rows, which that path never stores).
Fp8ColsOut grad_h13_cols(const Step& s) {
  char* base = reinterpret_cast<char*>(s.grad_h13_M2F);
  const Fp8GradH13ColsLayout l = fp8_grad_h13_cols_layout(s.dims, s.capacity_rows);
  return {reinterpret_cast<uint8_t*>(base + l.codes), reinterpret_cast<float*>(base + l.scales)};
}

void quantize_cols(const Step& s, const bf16_t* x_ML, int64_t L, uint8_t* qt, float* scales,
                   int64_t max_blocks) {
  fp8_quantize_cols_transposed(x_ML, s.capacity_rows, L, s.layout.expert_offsets_E1, s.dims.E,
                               s.layout.header + kLayoutSkip, qt, scales, max_blocks, s.stream);
}

// grad_w[e] [N, L] (+)= a[e]^T b[e] on the column operands, as the bf16 WGRAD stores it.
void wgrad(const Step& s, const ColOperands& c, int64_t N, int64_t L, void* grad_w_ENL) {
  Fp8WgradArgs a;
  a.a_NK = c.qa;
  a.a_scales_BN = c.sa;
  a.b_LK = c.qb;
  a.b_scales_BL = c.sb;
  a.offsets_E1 = s.layout.expert_offsets_E1;
  a.skip = s.layout.header + kLayoutSkip;
  a.replay_skip = replay_skip_flag(s);
  a.E = s.dims.E;
  a.N = N;
  a.L = L;
  a.K = fp8_col_k(s.capacity_rows, s.dims.E);
  a.out_ENL = grad_w_ENL;
  a.out_dtype = s.wgrad_dtype;
  a.accumulate = s.accumulate_wgrad;
  fp8_grouped_wgrad(a, s.stream);
}

}  // namespace

void fp8_quantize_grad_h3(const Step& s) {
  quantize_rows(s, s.grad_h3_MD, fp8_scratch_layout(s).grad_h3_q, s.dims.D);
}

void fp8_quantize_grad_h13(const Step& s) {
  quantize_rows(s, s.grad_h13_M2F, fp8_scratch_layout(s).grad_h13_q, 2 * s.dims.F);
}

void fp8_gather_grad(const Step& s) {
  if (!fp8_rows_quantized_by_producer()) {
    gather_grad(s);
    fp8_quantize_grad_h3(s);
    return;
  }
  const ScratchRows q = scratch_rows(s, fp8_scratch_layout(s).grad_h3_q, s.dims.D);
  gather_grad_fp8_rows(s, q.codes, q.scales_SM, q.ld);
}

bool fp8_swiglu_backward_writes_cols(const Step& s) {
  const char* env = std::getenv("EPMOE_FP8_COL_QUANT");
  EPMOE_CHECK_ARG(env == nullptr || std::strcmp(env, "swiglu") == 0 || std::strcmp(env, "separate") == 0,
                  "EPMOE_FP8_COL_QUANT", "swiglu or separate", env);
  const bool in_swiglu = env != nullptr && std::strcmp(env, "swiglu") == 0;  // opt-in: measured slower
  return in_swiglu && s.fp8_wgrad == Fp8Wgrad::fp8 && s.dims.F % kFp8RowBlock == 0 &&
         fp8_rows_quantized_by_producer() && !fp8_swiglu_backward_in_epilogue(s) &&
         s.grad_h13_M2F != nullptr && fp8_grad_h13_cols_fit(s.dims, s.capacity_rows);
}

void fp8_swiglu_backward(const Step& s) {
  if (fp8_swiglu_backward_writes_cols(s)) {
    const Fp8ScratchLayout l = fp8_scratch_layout(s);
    const ScratchRows q = scratch_rows(s, l.grad_h13_q, 2 * s.dims.F);
    const ColOperands c = col_operands(s);  // h's columns go to col_b for the W2 WGRAD
    swiglu_backward_fp8_cols(s, q.codes, q.scales_SM, q.ld, grad_h13_cols(s), Fp8ColsOut{c.qb, c.sb},
                             c.max_blocks);
    return;
  }
  // A 1x128 block of grad_h13 [gate | up] spans both halves unless F % 128 == 0: then separate.
  if (s.dims.F % kFp8RowBlock != 0 || !fp8_rows_quantized_by_producer()) {
    swiglu_backward(s);
    fp8_quantize_grad_h13(s);
    return;
  }
  const ScratchRows q = scratch_rows(s, fp8_scratch_layout(s).grad_h13_q, 2 * s.dims.F);
  swiglu_backward_fp8_rows(s, q.codes, q.scales_SM, q.ld);
}

bool fp8_swiglu_backward_in_epilogue(const Step& s) {
  return swiglu_backward_in_epilogue() && s.dims.F % kFp8RowBlock == 0 &&
         fp8_rows_quantized_by_producer() && fp8_tile_from_env() == Fp8Tile::m128_n128;
}

void fp8_w2_dgrad(const Step& s, bool swiglu_backward_after) {
  const int64_t D = s.dims.D, F = s.dims.F;
  const Fp8ScratchLayout l = fp8_scratch_layout(s);
  const ScratchRows g = scratch_rows(s, l.grad_h3_q, D);
  // w2 [E, D, F]: the DGRAD contracts D, so the GEMM reads w2^T [E, F, D].
  Fp8GroupedGemmArgs a =
      dgrad_args(s, g, s.w2_q_EDF, s.w2_scales_EBS, {s.w2_qt_EFD, s.w2_scales_t_EBS}, D, F);
  if (swiglu_backward_after && fp8_swiglu_backward_in_epilogue(s)) {
    // The SwiGLU backward and grad_h13's E4M3 rows from the accumulators: grad_h is not stored.
    const ScratchRows q = scratch_rows(s, l.grad_h13_q, 2 * F);
    Fp8SwigluBackwardOut& o = a.swiglu_backward;
    o.h13 = placed_h13(s);
    o.grad_h13_M2F = s.grad_h13_M2F;
    o.h_MF = s.h_MF;
    o.q_M2F = q.codes;
    o.q_scales_SM = q.scales_SM;
    o.q_ld = q.ld;
    o.row_scores_M = s.row_scores_M;
    o.score_parts_MC = s.score_parts_MC;
    o.act = s.act;
    a.tile = Fp8Tile::m128_n128;
    fp8_grouped_gemm(a, s.stream);
    return;
  }
  // Fused otherwise (F % 128 != 0, EPMOE_SWIGLU_BACKWARD unset or =kernel, EPMOE_FP8_ROW_QUANT=separate
  // or the 64 x 256 tile): grad_h goes to the column scratch (col_a holds M * max(D, 2F) >= M * F bf16 and is
  // free until the WGRADs), then the unfused SwiGLU backward reads it.
  bf16_t* grad_h_MF =
      swiglu_backward_after ? reinterpret_cast<bf16_t*>(s.fp8_scratch + l.col_a) : s.grad_h_MF;
  EPMOE_CHECK_ARG(grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  a.out_MN = grad_h_MF;
  a.ld_out = F;
  fp8_grouped_gemm(a, s.stream);
  if (!swiglu_backward_after) return;
  Step t = s;
  t.grad_h_MF = grad_h_MF;
  fp8_swiglu_backward(t);
}

void fp8_w13_dgrad(const Step& s, bool scatter) {
  const int64_t D = s.dims.D, F = s.dims.F;
  const ScratchRows g = scratch_rows(s, fp8_scratch_layout(s).grad_h13_q, 2 * F);
  // w13 [E, 2F, D]: the DGRAD contracts 2F, so the GEMM reads w13^T [E, D, 2F].
  Fp8GroupedGemmArgs a = dgrad_args(s, g, s.w13_q_EFD, s.w13_scales_EBS,
                                    {s.w13_qt_EDF, s.w13_scales_t_EBS}, 2 * F, D);
  fp8_rows_output(s, scatter, a);
  a.tile = fp8_tile_for_d_rows(a.N, a.K, balanced_rows_per_expert(s.dims));
  a.trim_rows = fp8_trim_rows_rule(balanced_rows_per_expert(s.dims), a.tile);
  fp8_grouped_gemm(a, s.stream);
}

// grad_w2[e] [D, F] = grad_h3[e]^T h[e]: col_a grad_h3 along D, col_b h along F (already there when
// the SwiGLU backward wrote it), then the FP8 WGRAD.
void fp8_w2_wgrad(const Step& s) {
  const ColOperands c = col_operands(s);
  quantize_cols(s, s.grad_h3_MD, s.dims.D, c.qa, c.sa, c.max_blocks);
  if (!fp8_swiglu_backward_writes_cols(s)) quantize_cols(s, s.h_MF, s.dims.F, c.qb, c.sb, c.max_blocks);
  wgrad(s, c, s.dims.D, s.dims.F, s.grad_w2_EDF);
}

// grad_w13[e] [2F, D] = grad_h13[e]^T x[e]: col_a grad_h13 along 2F (or its columns where the SwiGLU
// backward wrote them), col_b x decoded from the
// received E4M3 rows (where the layer plan placed them) along D, then the FP8 WGRAD.
void fp8_w13_wgrad(const Step& s) {
  const int64_t D = s.dims.D, F = s.dims.F;
  ColOperands c = col_operands(s);
  if (fp8_swiglu_backward_writes_cols(s)) {
    const Fp8ColsOut g = grad_h13_cols(s);
    c.qa = g.qt_LK;
    c.sa = g.scales_BL;
  } else {
    quantize_cols(s, s.grad_h13_M2F, 2 * F, c.qa, c.sa, c.max_blocks);
  }
  const Placed x = placed_x_gathered(s);
  fp8_quantize_cols_transposed_from_rows(x.base, x.offset, s.layout.header + kLayoutRows,
                                         s.capacity_rows, D, s.layout.expert_offsets_E1, s.dims.E,
                                         s.layout.header + kLayoutSkip, c.qb, c.sb, c.max_blocks,
                                         s.stream);
  wgrad(s, c, 2 * F, D, s.grad_w13_EFD);
}

// grad_w13[e] [2F, D] = grad_h13[e]^T x[e] on the bf16 WGRAD: x decoded from the received E4M3
// rows (where the layer plan placed them) into the FP8 scratch's x_bf16, which the GEMM reads as
// plain [capacity, D] rows (no layer plan: its only other use there, the replay skip, is off in
// backward stages).
void fp8_w13_wgrad_bf16(const Step& s) {
  bf16_t* x_MD = reinterpret_cast<bf16_t*>(s.fp8_scratch + fp8_scratch_layout(s).x_bf16);
  const Placed x = placed_x_gathered(s);
  fp8_decode_rows_bf16_counted(x.base, x.offset, s.layout.header + kLayoutRows, s.capacity_rows,
                               s.dims.D, s.layout.header + kLayoutSkip, x_MD, s.stream);
  Step t = s;
  t.layer_plan = nullptr;
  t.x_gathered_MD = x_MD;
  w13_wgrad(t);
}

}  // namespace epmoe::cuda
