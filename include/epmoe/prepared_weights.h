// PreparedWeights: caller-owned low-precision copies of a bf16 weight tensor [G, N, L] (G experts,
// N output rows, L the contraction axis of the forward GEMM), made once and refilled in place
// after every optimizer step (addresses stay put, so a captured CUDA graph keeps using them).
// Layouts are the ones the GEMMs read (docs/formats.md):
//   fp8_block_fp32 / fp8_block_ue8m0   data u8 E4M3 [G, N, L] (K-major), scales [G, ceil(N/128),
//                                      ceil(L/128)] f32 / u8 (UE8M0 codes), one per 128x128 block
//   mxfp8                              data u8 E4M3 [G, N, L], scales u8 E8M0 [G, N, ceil(L/32)]
//   nvfp4                              data u8 packed E2M1 [G, N, ceil(L/2)] in the GEMM's
//                                      bit order (each whole 4-byte word's bits permuted),
//                                      scales u8 E4M3 [G, ceil(L/128), N, 8] (a row's 8 scales
//                                      of a 128-element chunk together; blocks past ceil(L/16)
//                                      zero), global_scale f32 [G] (one per expert); both orders
//                                      in core/formats/nvfp4_gemm_order.h
// The FP8 training path (Config.precision = fp8_block) reads fp8_block_fp32 weights: w13 as
// [E, 2F, D], w2 as [E, D, F]; its DGRADs read the same 128x128 blocks transposed, which the
// caller prepares too (data_t / scales_t, filled by prepare_weights beside data / scales) so no
// backward call transposes them. NVFP4 weight-only inference (Config.precision = nvfp4) reads
// nvfp4 weights of the same shapes, MXFP8 inference (Config.precision = mxfp8) mxfp8 ones.
#pragma once

#include <cstdint>

#include "epmoe/tensor.h"

namespace epmoe {

enum class WeightFormat : int { fp8_block_fp32, fp8_block_ue8m0, mxfp8, nvfp4 };
const char* to_string(WeightFormat format);

// Shapes and dtypes of the three tensors of one prepared weight (global_scale: ndim 0 when the
// format has none).
struct PreparedWeightShapes {
  TensorRef data, scales, global_scale;  // data pointers are null: shapes, dtypes, strides only
  // fp8_block_fp32 only (ndim 0 otherwise): the transposed copy, codes u8 [G, L, N] and f32
  // scales [G, ceil(L/128), ceil(N/128)] (a 128x128 block's scale is its transpose's).
  TensorRef data_t, scales_t;
};
PreparedWeightShapes prepared_weight_shapes(WeightFormat format, int64_t G, int64_t N, int64_t L);

// Views of caller-owned memory (host or one CUDA device; all three on the same device).
struct PreparedWeights {
  WeightFormat format = WeightFormat::fp8_block_fp32;
  int64_t G = 0, N = 0, L = 0;
  TensorRef data;
  TensorRef scales;
  TensorRef global_scale;  // nvfp4 only
  // Optional (fp8_block_fp32): the transposed copy of data / scales (PreparedWeightShapes);
  // given when data_t.data != nullptr. Required by an fp8_block training backward
  // (BackwardArgs), whose DGRADs read it.
  TensorRef data_t, scales_t;
  bool has_transposed() const { return data_t.data != nullptr || scales_t.data != nullptr; }
};

// Checks `prepared` against prepared_weight_shapes(format, G, N, L) and `device`; errors name
// `name` (e.g. "ForwardArgs.w13_prepared") and the tensor.
void check_prepared_weights(const PreparedWeights& prepared, const char* name,
                            const Device& device);

// Quantizes w_GNL (bf16 [G, N, L], contiguous, on prepared's device) into prepared's buffers in
// place: the same bits on the host (core/formats/codecs.h) and on CUDA (src/cuda/formats/, on
// `stream`; NVFP4 zeroes then fills global_scale, so the call is graph-capturable). With the
// transposed copy given, fills it too: bitwise the explicit transpose of data / scales.
void prepare_weights(const TensorRef& w_GNL, const PreparedWeights& prepared,
                     void* stream = nullptr);

}  // namespace epmoe
