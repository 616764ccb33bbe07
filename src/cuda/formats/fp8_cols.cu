// FP8 E4M3 with 128x1 column blocks along the rows of each expert (the weight-gradient operands,
// cpu::fp8_quantize_cols): block b of expert e covers rows first_e + 128 i .. (its last block may be
// partial), b = sum_{e' < e} ceil(rows_e' / 128) + i. Codes go transposed, [L, K] for the FP8
// WGRAD (K-major, K = 128 * max_blocks, block b at k = 128 b, zero-padded past the block's rows).
// One CTA per (block, 64 columns), through shared memory: the block's rows are read as 16-byte
// row vectors into a column-major tile, four lanes per column take the amax (an integer max of
// |x| bits, exact and order-free) over 32 rows each and combine it by shuffles, then each writes
// its 32 codes as two 16-byte vectors, so the four lanes of a column store its 128 contiguous
// bytes. The codec functions are the host's (core/formats/fp8_block.h): codes and scales bitwise.
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

constexpr int kColsThreads = 256;
constexpr int kTileCols = 64;                        // columns per CTA: 4 lanes per column
constexpr int kTileRows = static_cast<int>(kFp8RowBlock);
constexpr int kPitch = kTileRows + 1;                // column-major tile, padded against conflicts

template <bool kFromE4m3>
__global__ void __launch_bounds__(kColsThreads) quantize_cols_kernel(const ColsArgs a) {
  if (a.skip_1 != nullptr && *a.skip_1 != 0) return;  // uniform over the grid
  __shared__ float tile[kTileCols * kPitch];          // tile[c * kPitch + r] = x[m0 + r, l0 + c]
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
  const int64_t l0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t cols = a.L - l0 < kTileCols ? a.L - l0 : kTileCols;
  // Whole 16-byte row vectors: the tile's columns all exist and every row starts aligned.
  const int64_t elem_bytes = kFromE4m3 ? 1 : 2;
  const bool vectors = cols == kTileCols && (a.L * elem_bytes) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(kFromE4m3 ? static_cast<const void*>(codes_ML)
                                                             : static_cast<const void*>(a.x_ML)) %
                               16 == 0;
  const int tid = static_cast<int>(threadIdx.x);
  const int c = tid / 4, q = tid % 4;  // this lane's column and quarter (rows 32 q .. 32 q + 31)
  for (int64_t b = blockIdx.y; b < a.max_blocks; b += gridDim.y) {  // CTA-uniform
    // The expert holding block b and the block's rows [m0, m1).
    int64_t base = 0, m0 = -1, m1 = -1;
    for (int e = 0; e < a.E; ++e) {
      const int64_t first = a.offsets_E1[e];
      const int64_t rows = a.offsets_E1[e + 1] - first;
      const int64_t blocks = rows > 0 ? (rows + kTileRows - 1) / kTileRows : 0;
      if (b < base + blocks) {
        m0 = first + (b - base) * kTileRows;
        m1 = m0 + kTileRows < first + rows ? m0 + kTileRows : first + rows;
        break;
      }
      base += blocks;
    }
    if (m0 < 0) break;  // past the last block (later b too)
    m1 = m1 < valid_rows ? m1 : valid_rows;
    const int n = static_cast<int>(m1 > m0 ? m1 - m0 : 0);  // rows of the block holding data

    __syncthreads();  // the previous block's reads of the tile are done
    if (vectors) {
      constexpr int kPerVec = kFromE4m3 ? 16 : 8;           // elements per 16-byte vector
      constexpr int kVecsPerRow = kTileCols / kPerVec;
      for (int i = tid; i < kTileRows * kVecsPerRow; i += kColsThreads) {
        const int r = i / kVecsPerRow, c0 = (i % kVecsPerRow) * kPerVec;
        float v[kPerVec];
        if (r < n) {
          const int64_t m = m0 + r;
          if constexpr (kFromE4m3) {
            const uint4 w = *reinterpret_cast<const uint4*>(codes_ML + m * a.L + l0 + c0);
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
            const float scale = row_scales_SM[(l0 / kTileRows) * ld + m];  // 64 | 128: one block
#pragma unroll
            for (int j = 0; j < kPerVec; ++j) {
              v[j] = fp8_decode_fp32(static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4))), scale);
            }
          } else {
            const uint4 w = *reinterpret_cast<const uint4*>(a.x_ML + m * a.L + l0 + c0);
            const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < kPerVec; ++j) {
              v[j] = bf16_to_float(static_cast<bf16_t>(words[j / 2] >> (16 * (j % 2))));
            }
          }
        } else {
#pragma unroll
          for (int j = 0; j < kPerVec; ++j) v[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kPerVec; ++j) tile[(c0 + j) * kPitch + r] = v[j];
      }
    } else {
      for (int i = tid; i < kTileRows * kTileCols; i += kColsThreads) {
        const int r = i / kTileCols, cc = i % kTileCols;
        float v = 0.0f;
        if (r < n && cc < cols) {
          const int64_t m = m0 + r, l = l0 + cc;
          if constexpr (kFromE4m3) {
            v = fp8_decode_fp32(codes_ML[m * a.L + l], row_scales_SM[(l / kTileRows) * ld + m]);
          } else {
            v = bf16_to_float(a.x_ML[m * a.L + l]);
          }
        }
        tile[cc * kPitch + r] = v;
      }
    }
    __syncthreads();

    const float* col = tile + c * kPitch + 32 * q;
    uint32_t amax = 0;
#pragma unroll 8
    for (int r = 0; r < 32; ++r) amax = amax_bits_add(amax, col[r]);
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the column's four lanes
    amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float scale = fp8_scale_fp32(amax);
    if (c < cols) {
      const int64_t l = l0 + c;
      if (q == 0) a.scales_BL[b * a.L + l] = scale;
      uint8_t* codes_K = a.qt_LK + l * (kTileRows * a.max_blocks) + b * kTileRows + 32 * q;
      uint32_t w[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t word = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int r = 32 * q + 4 * j + k;  // rows past the block's data: zero codes
          const uint32_t code = r < n ? uint32_t{fp8_encode_fp32(col[4 * j + k], scale)} : 0u;
          word |= code << (8 * k);
        }
        w[j] = word;
      }
      reinterpret_cast<uint4*>(codes_K)[0] = make_uint4(w[0], w[1], w[2], w[3]);  // 16-byte aligned
      reinterpret_cast<uint4*>(codes_K)[1] = make_uint4(w[4], w[5], w[6], w[7]);
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
  const unsigned columns = static_cast<unsigned>((a.L + kTileCols - 1) / kTileCols);
  const unsigned blocks = static_cast<unsigned>(a.max_blocks < 65535 ? a.max_blocks : 65535);
  quantize_cols_kernel<kFromE4m3><<<dim3(columns, blocks), kColsThreads, 0,
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
