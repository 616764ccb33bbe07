// Whole-tensor encoders and decoders on the host: the reference the CUDA kernels of
// src/cuda/formats/ reproduce bitwise (both call the EPMOE_HD block and element functions of
// fp8_block.h, mxfp8.h and nvfp4.h; the amax is an integer max, so reduction order is free).
//
// Shape letters (docs/formats.md): N rows, L row length (the blocked axis, the GEMM contraction
// axis), S = ceil(L / block) scale blocks per row, P = ceil(L / 2) packed bytes per row (NVFP4),
// G groups (weight matrices / experts), B = ceil(N / 128) row blocks of a weight. Tensors are
// dense row-major. L need not be a multiple of the block: the last block of a row is partial and
// its amax covers the elements that exist. Errors: Error(invalid_argument) naming the argument.
#pragma once

#include <cstdint>

#include "core/formats/fp8_block.h"
#include "core/formats/mxfp8.h"
#include "core/formats/nvfp4.h"
#include "core/hd.h"

namespace epmoe {

EPMOE_HD int64_t scale_blocks(int64_t length, int64_t block) { return (length + block - 1) / block; }
EPMOE_HD int64_t nvfp4_packed_bytes(int64_t length) { return (length + 1) / 2; }

// ---- argument checks (shared with the CUDA launchers, so both raise the same errors) ----

// N >= 0, L >= 0 (named `rows_arg` / `cols_arg`).
void check_codec_shape(int64_t N, int64_t L, const char* rows_arg, const char* cols_arg);
// A non-null pointer whenever the tensor has elements.
void check_codec_pointer(const void* p, int64_t elements, const char* name);
// G >= 0 matrices of N >= 0 rows of L >= 0.
void check_codec_weights(int64_t G, int64_t N, int64_t L);
// groups >= 1 and N % groups == 0.
void check_codec_groups(int64_t groups, int64_t N);

// ---- FP8 E4M3, 1x128 row blocks (activations) ----
// x_NL fp32 -> q_NL E4M3 codes, scales_NS (fp32, or UE8M0 codes for the uint8_t overload).
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS);
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS);
void fp8_dequantize_rows(const uint8_t* q_NL, const float* scales_NS, int64_t N, int64_t L, float* x_NL);
void fp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL);

// ---- FP8 E4M3, 128x128 blocks of G matrices [N, L] (weights) ----
// scales_GBS [G, ceil(N / 128), ceil(L / 128)].
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS);
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS);
void fp8_dequantize_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                            int64_t L, float* w_GNL);
void fp8_dequantize_weights(const uint8_t* q_GNL, const uint8_t* scales_GBS, int64_t G, int64_t N,
                            int64_t L, float* w_GNL);

// ---- MXFP8: E4M3 + E8M0 per 1x32 ----
void mxfp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS);
void mxfp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L,
                           float* x_NL);

// ---- NVFP4: E2M1 (packed) + E4M3 per 1x16 + fp32 global per group of N / groups rows ----
// global_G[g] from the finite amax of rows [g * N / groups, (g + 1) * N / groups).
void nvfp4_global_scales(const float* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G);
// q_NP packed E2M1 (first element of a pair in the low nibble; an odd L leaves the last high
// nibble 0), scales_NS E4M3 codes.
void nvfp4_quantize_rows(const float* x_NL, int64_t groups, int64_t N, int64_t L,
                         const float* global_G, uint8_t* q_NP, uint8_t* scales_NS);
void nvfp4_dequantize_rows(const uint8_t* q_NP, const uint8_t* scales_NS, const float* global_G,
                           int64_t groups, int64_t N, int64_t L, float* x_NL);

}  // namespace epmoe
