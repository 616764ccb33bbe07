// CUDA encoders/decoders of the block-scaled formats: launchers only (plain pointers to device
// memory, sizes, and a cudaStream_t passed as void*). Same shapes, layouts, argument checks and
// bits as the host codecs of core/formats/codecs.h (read that file for the letters and the
// layouts); inputs are fp32 or bf16 (bf16 widens exactly, so a bf16 tensor quantizes like its fp32
// copy). Work is enqueued on `stream`; nothing synchronizes.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace epmoe::cuda {

// ---- FP8 E4M3, 1x128 row blocks; fp32 scales (float*) or UE8M0 codes (uint8_t*) ----
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS, void* stream);
void fp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS, void* stream);
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream);
void fp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream);
// The same codes and fp32 scales, scales stored S-major: scale of (row n, block s) at
// scales_SN[s * ld + n], ld >= N (the FP8 grouped GEMM's activation-scale layout, gemm/fp8_gemm.h).
void fp8_quantize_rows_s_major(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_SN,
                               int64_t ld, void* stream);
void fp8_quantize_rows_s_major(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_SN,
                               int64_t ld, void* stream);
// bf16 rows whose count is known only on the device (a stage's live or received rows): rows
// [0, clamp(*count_1, 0, N)) are quantized (all N when count_1 is null), none when *skip_1 != 0
// (nullable); N sizes the launch and the buffers, so one launch serves every count (CUDA graphs).
// Scales fp32, S-major at scales[s * ld + n] when ld > 0 (ld >= N), row-major [N, S] when ld == 0.
void fp8_quantize_rows_counted(const bf16_t* x_NL, int64_t N, int64_t L, const int32_t* count_1,
                               const int32_t* skip_1, uint8_t* q_NL, float* scales, int64_t ld,
                               void* stream);
// The same with x at x_base + *x_offset_1 bytes (device memory): a layer's saved x, whose place
// in the activation arena only the device knows.
void fp8_quantize_rows_counted_at(const bf16_t* x_base, const int64_t* x_offset_1, int64_t N,
                                  int64_t L, const int32_t* count_1, const int32_t* skip_1,
                                  uint8_t* q_NL, float* scales, int64_t ld, void* stream);
void fp8_dequantize_rows(const uint8_t* q_NL, const float* scales_NS, int64_t N, int64_t L, float* x_NL,
                         void* stream);
void fp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL,
                         void* stream);

// ---- FP8 E4M3, 128x128 blocks of G matrices [N, L]; scales_GBS [G, ceil(N/128), ceil(L/128)] ----
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS, void* stream);
void fp8_quantize_weights(const bf16_t* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS, void* stream);
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS, void* stream);
void fp8_quantize_weights(const bf16_t* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS, void* stream);
void fp8_dequantize_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N, int64_t L,
                            float* w_GNL, void* stream);
void fp8_dequantize_weights(const uint8_t* q_GNL, const uint8_t* scales_GBS, int64_t G, int64_t N, int64_t L,
                            float* w_GNL, void* stream);

// The explicit transpose of G weights in 128x128 blocks: codes [G, N, L] -> [G, L, N], scales
// [G, S_N, S_L] -> [G, S_L, S_N] (cpu::fp8_transpose_weights; the CUDA DGRAD operand).
void fp8_transpose_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                           int64_t L, uint8_t* qt_GLN, float* scales_t_GSB, void* stream);

// ---- FP8 E4M3, 128x1 column blocks along the rows of each expert (weight-gradient operands) ----
// cpu::fp8_quantize_cols on the device, codes transposed for the FP8 WGRAD
// (cpu::fp8_transpose_cols of the CPU's codes): expert e's rows [offsets_E1[e], offsets_E1[e + 1])
// in blocks of 128 from its first row; codes qt_LK [L, K] with K = 128 * max_blocks
// (core/fp8_terms.h fp8_col_k, max_blocks = fp8_col_blocks), block b at k = 128 b, each block's
// rows past its expert's end +0, the k range past the last block untouched; scales_BL
// [blocks, L] fp32 with room for max_blocks. qt_LK 16-byte aligned. Nothing when *skip_1 != 0
// (nullable). The _from_rows variant reads E4M3 rows decoded exactly (fp8_rows_bytes layout at
// clamp(*rows_1, 0, M) rows, at rows + *rows_offset_1 bytes; rows_offset_1 nullable, both
// device memory): the received x rows; rows past the count quantize as absent (+0).
void fp8_quantize_cols_transposed(const bf16_t* x_ML, int64_t M, int64_t L,
                                  const int32_t* offsets_E1, int E, const int32_t* skip_1,
                                  uint8_t* qt_LK, float* scales_BL, int64_t max_blocks,
                                  void* stream);
void fp8_quantize_cols_transposed_from_rows(const char* rows, const int64_t* rows_offset_1,
                                            const int32_t* rows_1, int64_t M, int64_t L,
                                            const int32_t* offsets_E1, int E,
                                            const int32_t* skip_1, uint8_t* qt_LK,
                                            float* scales_BL, int64_t max_blocks, void* stream);

// ---- FP8 E4M3 rows decoded to bf16 (Config.fp8_wgrad = bf16: the W13 WGRAD's x) ----
// cpu::fp8_decode_rows_bf16 on the device: E4M3 rows in the fp8_rows_bytes layout at
// n = clamp(*rows_1, 0, M) rows, at rows + *rows_offset_1 bytes (rows_offset_1 nullable; both
// device memory), each value bf16(fp32 code * scale) into x_ML [M, L] (16-byte aligned), rows
// [0, n) only. L % 8 == 0. Nothing when *skip_1 != 0 (nullable). M sizes the launch (CUDA graphs).
void fp8_decode_rows_bf16_counted(const char* rows, const int64_t* rows_offset_1,
                                  const int32_t* rows_1, int64_t M, int64_t L,
                                  const int32_t* skip_1, bf16_t* x_ML, void* stream);

// ---- MXFP8: E4M3 + E8M0 per 1x32 ----
void mxfp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream);
void mxfp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream);
// bf16 rows whose count is known only on the device: rows [0, clamp(*count_1, 0, N)) (all N when
// count_1 is null), none when *skip_1 != 0 (nullable); one launch serves every count (CUDA graphs).
void mxfp8_quantize_rows_counted(const bf16_t* x_NL, int64_t N, int64_t L, const int32_t* count_1,
                                 const int32_t* skip_1, uint8_t* q_NL, uint8_t* scales_NS,
                                 void* stream);
void mxfp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL,
                           void* stream);

// ---- NVFP4: packed E2M1 + E4M3 per 1x16 + fp32 global per group of N / groups rows ----
// global_G is computed on the device (no host round trip): zeroed, an atomic integer max of the
// finite |x| bits (order-free, so deterministic), then nvfp4_global_scale in place.
void nvfp4_global_scales(const float* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G, void* stream);
void nvfp4_global_scales(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G, void* stream);
void nvfp4_quantize_rows(const float* x_NL, int64_t groups, int64_t N, int64_t L, const float* global_G,
                         uint8_t* q_NP, uint8_t* scales_NS, void* stream);
void nvfp4_quantize_rows(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L, const float* global_G,
                         uint8_t* q_NP, uint8_t* scales_NS, void* stream);
void nvfp4_dequantize_rows(const uint8_t* q_NP, const uint8_t* scales_NS, const float* global_G, int64_t groups,
                           int64_t N, int64_t L, float* x_NL, void* stream);
// nvfp4_quantize_rows with the scales in the prepared order, [groups, C, N / groups, 8]
// (core/formats/nvfp4_gemm_order.h; the padding blocks 0): the host codec's bits reordered.
void nvfp4_quantize_rows_prepared(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L,
                                  const float* global_G, uint8_t* q_NP, uint8_t* scales_GCN8,
                                  void* stream);
// The quantizer's codes [N, P] into the prepared order (core/formats/nvfp4_gemm_order.h), in place:
// the bits of the host nvfp4_codes_to_gemm_order.
void nvfp4_codes_to_gemm_order(uint8_t* q_NP, int64_t N, int64_t P, void* stream);

}  // namespace epmoe::cuda
