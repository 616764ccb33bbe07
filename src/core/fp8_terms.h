// Byte terms of the FP8 training path (Config.precision = fp8_block), shared by plan_memory() and
// the code that carves the buffers (docs/formats.md, "FP8 training"). A(n) = align_bytes(n);
// S_L = ceil(L / 128) scale blocks of a row of L; M = capacity rows; E = local experts.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/formats/fp8_block.h"
#include "core/hd.h"
#include "core/plan_terms.h"
#include "epmoe/config.h"

namespace epmoe {

EPMOE_HD int64_t fp8_blocks(int64_t length) {
  return (length + kFp8RowBlock - 1) / kFp8RowBlock;
}

// Row-quantized rows (1x128 along L) as the GEMMs read them: codes [rows, L] E4M3, then the fp32
// scales S-major [S_L, ld] (scale of (row m, block s) at s * ld + m) with ld = rows rounded up to
// 4, at a 16-byte boundary (the FP8 grouped GEMM loads 16-byte rows of scales: cuda/gemm/fp8_gemm.h).
EPMOE_HD int64_t fp8_rows_ld(int64_t rows) { return (rows + 3) / 4 * 4; }
EPMOE_HD int64_t fp8_rows_scales_offset(int64_t rows, int64_t L) { return (rows * L + 15) / 16 * 16; }
EPMOE_HD int64_t fp8_rows_bytes(int64_t rows, int64_t L) {
  return fp8_rows_scales_offset(rows, L) + fp8_blocks(L) * fp8_rows_ld(rows) * 4;
}

// Column-quantized operands of the weight gradients (128x1 blocks along the rows of each expert,
// from its first row): at most ceil(M / 128) + E row blocks for M rows in E experts.
inline int64_t fp8_col_blocks(int64_t M, int E) { return (M + kFp8RowBlock - 1) / kFp8RowBlock + E; }
// Their codes transposed for the FP8 WGRAD (K-major, K = the rows): [L, fp8_col_k(M, E)], block b
// at k = 128 b, an expert's partial last block zero-padded to 128.
inline int64_t fp8_col_k(int64_t M, int E) { return kFp8RowBlock * fp8_col_blocks(M, E); }

// The dispatch buffer in FP8: x quantized at the source, codes [T, D] | scales [T, S_D] f32
// (row-major). grad_y still crosses in bf16 [T, D], so the buffer holds the larger of the two.
struct Fp8DispatchLayout {
  int64_t codes, scales, total;
};
inline Fp8DispatchLayout fp8_dispatch_layout(int64_t T, int64_t D) {
  Fp8DispatchLayout l;
  l.codes = 0;
  l.scales = align_bytes(T * D);
  l.total = l.scales + align_bytes(T * fp8_blocks(D) * 4);
  return l;
}

// FP8 operand scratch at M rows, after the call scratch:
//   h_q      [M, F] rows (W2 FPROP)     | grad_h3_q [M, D] rows (W2 DGRAD)
//   grad_h13_q [M, 2F] rows (W13 DGRAD) | then, by Config.fp8_wgrad:
//   fp8:  col_a, col_b: the two column-quantized operands of one weight gradient (W2: grad_h3
//         [M, D], h [M, F]; then W13: grad_h13 [M, 2F], x [M, D]): codes [A, Kc] (room for
//         [M, A] too) | scales [Bc, A] f32 with A = max(D, 2F) for col_a, max(F, D) for col_b,
//         Bc = fp8_col_blocks(M, E), Kc = fp8_col_k(M, E) = 128 Bc.
//   bf16: x_bf16 [M, max(D, F)] bf16 at col_a: the received x rows decoded for the bf16 W13 WGRAD
//         ([M, D]); no column operands (col_a_scales .. col_b_scales = total, empty).
// Both: col_a holds >= M * F bf16, the fused W2 DGRAD's grad_h before the SwiGLU backward (free
// until the WGRADs).
// Row operands are laid out as fp8_rows_bytes(M, L).
struct Fp8ScratchLayout {
  int64_t h_q, grad_h3_q, grad_h13_q, col_a, col_a_scales, col_b, col_b_scales, x_bf16, total;
};
inline Fp8ScratchLayout fp8_scratch_layout(const Dims& d, int64_t M, Fp8Wgrad wgrad) {
  const int64_t A = std::max(d.D, 2 * d.F), B = std::max(d.F, d.D);
  const int64_t Bc = fp8_col_blocks(M, d.E), Kc = fp8_col_k(M, d.E);
  Fp8ScratchLayout l;
  l.h_q = 0;
  l.grad_h3_q = l.h_q + align_bytes(fp8_rows_bytes(M, d.F));
  l.grad_h13_q = l.grad_h3_q + align_bytes(fp8_rows_bytes(M, d.D));
  l.col_a = l.grad_h13_q + align_bytes(fp8_rows_bytes(M, 2 * d.F));
  l.x_bf16 = l.col_a;
  if (wgrad == Fp8Wgrad::bf16) {
    l.total = l.col_a + align_bytes(M * std::max(d.D, d.F) * 2);
    l.col_a_scales = l.col_b = l.col_b_scales = l.total;
    return l;
  }
  l.col_a_scales = l.col_a + align_bytes(Kc * A);
  l.col_b = l.col_a_scales + align_bytes(Bc * A * 4);
  l.col_b_scales = l.col_b + align_bytes(Kc * B);
  l.total = l.col_b_scales + align_bytes(Bc * B * 4);
  return l;
}
// Weights quantized per call when the caller prepares none (Config.prepared_weights = false),
// in the PreparedWeights fp8_block_fp32 layout: w13 [E, 2F, D] | scales [E, S_2F, S_D] |
// w2 [E, D, F] | scales [E, S_D, S_F].
struct Fp8WeightLayout {
  int64_t w13_q, w13_scales, w2_q, w2_scales, total;
};
inline Fp8WeightLayout fp8_weight_layout(const Dims& d) {
  const int64_t E = d.E;
  Fp8WeightLayout l;
  l.w13_q = 0;
  l.w13_scales = align_bytes(E * 2 * d.F * d.D);
  l.w2_q = l.w13_scales + align_bytes(E * fp8_blocks(2 * d.F) * fp8_blocks(d.D) * 4);
  l.w2_scales = l.w2_q + align_bytes(E * d.D * d.F);
  l.total = l.w2_scales + align_bytes(E * fp8_blocks(d.D) * fp8_blocks(d.F) * 4);
  return l;
}

// grad_h13's column operand (codes [2F, Kc] | scales [Bc, 2F] f32) where the SwiGLU backward
// writes it in the FP8 steps with FP8 WGRADs and EPMOE_FP8_COL_QUANT=swiglu (cuda
// swiglu_backward_fp8_cols, fp8_swiglu_backward_writes_cols): the call scratch's
// grad_h13 rows ([M, 2F] bf16 = 4 F M bytes), which that path never stores. It lives there from
// the SwiGLU backward to the W13 WGRAD, while col_a and col_b serve the W2 WGRAD. It fits when
// 132 Bc <= 2 M (about M >= 137 E): always at the FP8 WGRAD's rows (Config.fp8_wgrad by_shape
// picks it from 512 rows per expert); otherwise the SwiGLU backward stores grad_h13 in bf16 and
// the W13 WGRAD quantizes it into col_a (the same bits).
struct Fp8GradH13ColsLayout {
  int64_t codes, scales, total;
};
inline Fp8GradH13ColsLayout fp8_grad_h13_cols_layout(const Dims& d, int64_t M) {
  Fp8GradH13ColsLayout l;
  l.codes = 0;
  l.scales = align_bytes(2 * d.F * fp8_col_k(M, d.E));
  l.total = l.scales + align_bytes(fp8_col_blocks(M, d.E) * 2 * d.F * 4);
  return l;
}
inline bool fp8_grad_h13_cols_fit(const Dims& d, int64_t M) {
  return fp8_grad_h13_cols_layout(d, M).total <= align_bytes(M * 2 * d.F * 2);
}

// One weight transposed for its DGRAD (training contexts): codes [E, K, N] | scales [E, S_K, S_N]
// of a weight [E, N, K] (the FP8 grouped GEMM reads B as [E, N', K'] with N' = N, K' = K of the
// DGRAD). W2's transpose and then W13's use the same region, sized for the larger, W13's.
struct Fp8TransposedLayout {
  int64_t codes, scales, total;
};
inline Fp8TransposedLayout fp8_transposed_layout(const Dims& d) {
  Fp8TransposedLayout l;
  l.codes = 0;
  l.scales = align_bytes(d.E * 2 * d.F * d.D);
  l.total = l.scales + align_bytes(d.E * fp8_blocks(2 * d.F) * fp8_blocks(d.D) * 4);
  return l;
}

}  // namespace epmoe
