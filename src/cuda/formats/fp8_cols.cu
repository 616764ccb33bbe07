// FP8 E4M3 with 128x1 column blocks along the rows of each expert (the weight-gradient operands,
// cpu::fp8_quantize_cols): block b of expert e covers rows first_e + 128 i .. (its last block may be
// partial), b = sum_{e' < e} ceil(rows_e' / 128) + i. One thread per (block, column): pass 1 the
// amax (an integer max of |x| bits over the block's rows, exact and order-free), pass 2 the codes
// with the block scale; threads of a warp take consecutive columns, so each row read is coalesced.
// Codes go transposed, [L, K] for the FP8 WGRAD (K-major, K = 128 * max_blocks, block b at
// k = 128 b): each thread writes its block's 128 codes, zero-padded, as 16-byte vectors.
// The codec functions are the host's (core/formats/fp8_block.h), so codes and scales are bitwise.
#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

struct ColsArgs {
  const bf16_t* x_ML = nullptr;         // bf16 input [M, L]
  const char* rows = nullptr;           // or E4M3 rows (fp8_rows_bytes layout) at rows + *rows_offset_1
  const int64_t* rows_offset_1 = nullptr;
  const int32_t* rows_1 = nullptr;      // their count (device)
  int64_t M = 0, L = 0;
  const int32_t* offsets_E1 = nullptr;  // device [E + 1]
  int E = 0;
  const int32_t* skip_1 = nullptr;
  uint8_t* qt_LK = nullptr;             // [L, 128 * max_blocks]
  float* scales_BL = nullptr;
  int64_t max_blocks = 0;
};

template <bool kFromE4m3>
__global__ void __launch_bounds__(kThreads) quantize_cols_kernel(const ColsArgs a) {
  if (a.skip_1 != nullptr && *a.skip_1 != 0) return;  // uniform over the grid
  constexpr int64_t kBlock = kFp8RowBlock;
  int64_t valid_rows = a.M;
  const uint8_t* codes_ML = nullptr;     // E4M3 input
  const float* row_scales_SM = nullptr;  // its 1x128 scales, S-major [S, ld]
  int64_t ld = 0;
  if constexpr (kFromE4m3) {
    const char* base = a.rows + (a.rows_offset_1 != nullptr ? *a.rows_offset_1 : 0);
    const int64_t count = *a.rows_1;
    valid_rows = count < 0 ? 0 : (count < a.M ? count : a.M);
    codes_ML = reinterpret_cast<const uint8_t*>(base);
    row_scales_SM = reinterpret_cast<const float*>(base + fp8_rows_scales_offset(valid_rows, a.L));
    ld = fp8_rows_ld(valid_rows);
  }
  auto load = [&](int64_t m, int64_t l) -> float {
    if constexpr (kFromE4m3) {
      return fp8_decode_fp32(codes_ML[m * a.L + l], row_scales_SM[(l / kBlock) * ld + m]);
    } else {
      return bf16_to_float(a.x_ML[m * a.L + l]);
    }
  };
  for (int64_t b = blockIdx.y; b < a.max_blocks; b += gridDim.y) {  // CTA-uniform
    // The expert holding block b and the block's rows [m0, m1).
    int64_t base = 0, m0 = -1, m1 = -1;
    for (int e = 0; e < a.E; ++e) {
      const int64_t first = a.offsets_E1[e];
      const int64_t rows = a.offsets_E1[e + 1] - first;
      const int64_t blocks = rows > 0 ? (rows + kBlock - 1) / kBlock : 0;
      if (b < base + blocks) {
        m0 = first + (b - base) * kBlock;
        m1 = m0 + kBlock < first + rows ? m0 + kBlock : first + rows;
        break;
      }
      base += blocks;
    }
    if (m0 < 0) break;  // past the last block (later b too)
    m1 = m1 < valid_rows ? m1 : valid_rows;
    for (int64_t l = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; l < a.L;
         l += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      uint32_t amax = 0;
      for (int64_t m = m0; m < m1; ++m) amax = amax_bits_add(amax, load(m, l));
      const float scale = fp8_scale_fp32(amax);
      a.scales_BL[b * a.L + l] = scale;
      uint8_t* block_K = a.qt_LK + l * (kBlock * a.max_blocks) + b * kBlock;  // 16-byte aligned
      for (int64_t c = 0; c < kBlock; c += 16) {
        uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int64_t m = m0 + c + j;
          if (m < m1) w[j / 4] |= uint32_t{fp8_encode_fp32(load(m, l), scale)} << (8 * (j % 4));
        }
        *reinterpret_cast<uint4*>(block_K + c) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

template <bool kFromE4m3>
void launch_cols(const ColsArgs& a, void* stream) {
  check_codec_shape(a.M, a.L, "M", "L");
  EPMOE_CHECK_ARG(a.E >= 1, "E", ">= 1 experts", a.E);
  EPMOE_CHECK_ARG(a.max_blocks >= 0, "max_blocks", ">= 0", a.max_blocks);
  check_codec_pointer(a.qt_LK, a.L * kFp8RowBlock * a.max_blocks, "qt_LK");
  EPMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(a.qt_LK) % 16 == 0, "qt_LK",
                  "a 16-byte aligned pointer (16-byte code vectors)",
                  reinterpret_cast<uintptr_t>(a.qt_LK));
  check_codec_pointer(a.scales_BL, a.max_blocks * a.L, "scales_BL");
  EPMOE_CHECK_ARG(a.offsets_E1 != nullptr, "offsets_E1", "device expert offsets [E + 1]", "nullptr");
  if (a.M * a.L == 0 || a.max_blocks == 0) return;
  const unsigned columns = grid_for(a.L, kThreads);
  const unsigned blocks = static_cast<unsigned>(a.max_blocks < 65535 ? a.max_blocks : 65535);
  quantize_cols_kernel<kFromE4m3><<<dim3(columns, blocks), kThreads, 0,
                                    static_cast<cudaStream_t>(stream)>>>(a);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void fp8_quantize_cols_transposed(const bf16_t* x_ML, int64_t M, int64_t L,
                                  const int32_t* offsets_E1, int E, const int32_t* skip_1,
                                  uint8_t* qt_LK, float* scales_BL, int64_t max_blocks,
                                  void* stream) {
  check_codec_pointer(x_ML, M * L, "x_ML");
  launch_cols<false>(ColsArgs{.x_ML = x_ML, .M = M, .L = L, .offsets_E1 = offsets_E1, .E = E,
                              .skip_1 = skip_1, .qt_LK = qt_LK, .scales_BL = scales_BL,
                              .max_blocks = max_blocks},
                     stream);
}

void fp8_quantize_cols_transposed_from_rows(const char* rows, const int64_t* rows_offset_1,
                                            const int32_t* rows_1, int64_t M, int64_t L,
                                            const int32_t* offsets_E1, int E,
                                            const int32_t* skip_1, uint8_t* qt_LK,
                                            float* scales_BL, int64_t max_blocks, void* stream) {
  check_codec_pointer(rows, M * L, "rows");
  EPMOE_CHECK_ARG(rows_1 != nullptr, "rows_1", "the device count of the E4M3 rows", "nullptr");
  launch_cols<true>(ColsArgs{.rows = rows, .rows_offset_1 = rows_offset_1, .rows_1 = rows_1,
                             .M = M, .L = L, .offsets_E1 = offsets_E1, .E = E, .skip_1 = skip_1,
                             .qt_LK = qt_LK, .scales_BL = scales_BL, .max_blocks = max_blocks},
                    stream);
}

}  // namespace epmoe::cuda
