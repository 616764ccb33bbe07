// The steps of the FP8 training path (Config.precision = fp8_block) on the CPU: each quantization
// and each GEMM direction as one small function, so the CUDA kernels can be checked against them
// one by one (docs/formats.md, "FP8 training"). E4M3 codes with fp32 scales throughout; the
// block math is core/formats/fp8_block.h (the codecs' definition).
//
// Letters: M rows (received rows, grouped by expert), L row length (blocked axis), S_L =
// ceil(L / 128), B column blocks (128 rows of one expert each), E local experts, K / N / P / Q GEMM
// axes as named at each function.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace epmoe::cpu {

// ---- quantizations ----

// Rows of bf16 x_ML, 1x128 blocks along L: codes q_ML [rows, L]; scales S-major, the scale of
// (row m, block s) at scales_SM[s * ld + m] (the layout the FP8 grouped GEMM reads).
void fp8_quantize_rows_s_major(const bf16_t* x_ML, int64_t rows, int64_t L, uint8_t* q_ML,
                               float* scales_SM, int64_t ld);
// Decoded values q * scale (exact in fp32) of rows quantized as above.
void fp8_dequantize_rows_s_major(const uint8_t* q_ML, const float* scales_SM, int64_t ld,
                                 int64_t rows, int64_t L, float* x_ML);

// The same rows decoded to bf16 (Config.fp8_wgrad = bf16: the W13 WGRAD's x operand): each value
// bf16(fp32 code * scale), the fp32 decode above rounded once to nearest even (the product is not
// always a bf16: a 4-bit code significand times a 24-bit scale).
void fp8_decode_rows_bf16(const uint8_t* q_ML, const float* scales_SM, int64_t ld, int64_t rows,
                          int64_t L, bf16_t* x_ML);

// First column block of expert e: sum over earlier experts of ceil(rows / 128).
int64_t fp8_col_block_base(const int32_t* offsets_E1, int e);
// Column quantization for the weight gradients: 128x1 blocks along the rows of each expert,
// starting at its first row (the last block of an expert may be partial). Codes q_ML [M, L] (rows
// outside every expert untouched); the scale of (block b, column l) at scales_BL[b * L + l], with
// b = fp8_col_block_base(e) + (m - first row of e) / 128.
void fp8_quantize_cols(const float* x_ML, int64_t L, const int32_t* offsets_E1, int E,
                       uint8_t* q_ML, float* scales_BL);
// The codes of fp8_quantize_cols transposed, as the CUDA FP8 WGRAD reads them (K-major, K = the
// rows): qt_LK [L, K] with K >= 128 * (blocks of all experts); the code of row m (block b, row i
// of the block) and column l at qt_LK[l * K + 128 b + i]. Each block's rows past its expert's
// end are +0 (a zero-padded partial block); columns past the last block are untouched.
void fp8_transpose_cols(const uint8_t* q_ML, int64_t L, const int32_t* offsets_E1, int E,
                        int64_t K, uint8_t* qt_LK);

// The explicit transpose of G weights quantized in 128x128 blocks: codes q_GNL [G, N, L] ->
// qt_GLN [G, L, N], scales [G, S_N, S_L] -> [G, S_L, S_N] (a block's scale is its transpose's):
// the DGRAD operand of the CUDA backend, which runs the FPROP GEMM on it.
void fp8_transpose_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                           int64_t L, uint8_t* qt_GLN, float* scales_t_GSB);

// ---- GEMM directions (two-level accumulation as gemm_fp8_reference.h: exact E4M3 products
// summed per 128-deep block in ascending order, each block promoted into the total with one fma
// by its two scales, ascending blocks, from +0) ----

// DGRAD: out[m, n] = bf16(sum_k a[m, k] * w_e[k, n]) for the rows of each expert, with a rows
// quantized along K (scales S-major, ld_sa) and the weight w_EKN [E, K, N] in 128x128 blocks,
// scales w_scales_EBS [E, S_K, S_N] (the prepared weight, used transposed: its rows are K).
void fp8_grouped_dgrad_reference(const uint8_t* a_MK, const float* a_scales_SM, int64_t ld_sa,
                                 const uint8_t* w_EKN, const float* w_scales_EBS,
                                 const int32_t* offsets_E1, int E, int64_t K, int64_t N,
                                 bf16_t* out_MN, int64_t ld_out);

// WGRAD of expert e: acc_PQ[p, q] = sum over its rows m of a[m, p] * b[m, q] (fp32, for the
// caller to round once), both operands column-quantized (fp8_quantize_cols). An expert without
// rows gives zeros.
void fp8_wgrad_expert_reference(const uint8_t* a_MP, const float* a_scales_BP, int64_t P,
                                const uint8_t* b_MQ, const float* b_scales_BQ, int64_t Q,
                                const int32_t* offsets_E1, int e, float* acc_PQ);

}  // namespace epmoe::cpu
