// FP8 E4M3 with 128x1 column blocks along the rows of each expert (the weight-gradient operands,
// cpu::fp8_quantize_cols): block b of expert e covers rows first_e + 128 i .. (its last block may be
// partial), b = sum_{e' < e} ceil(rows_e' / 128) + i. Codes go transposed, [L, K] for the FP8
// WGRAD (K-major, K = 128 * max_blocks, block b at k = 128 b, zero-padded to 128 rows).
//
// One CTA per (block b, run of kTilesPerCta column tiles of 128): the CTA finds b's expert once
// (a warp prefix over the experts' block counts), then per tile
//   1. loads the block's rows of the tile into shared memory, coalesced (16-byte vectors of 8 bf16
//      per lane, kept as bf16; or words of 4 E4M3 codes, decoded to fp32 with the row's 1x128
//      scale: tile columns align to the row-scale blocks, so one scale per row); element loads
//      where L or the base is not aligned; rows past the block's end are not loaded;
//   2. thread (column c, half h) takes the amax of rows 64 h .. 64 h + 63 of column c (an integer
//      max of |x| bits: exact and order-free); a warp reads 32 consecutive columns of one row, so
//      shared reads are conflict-free; the two halves meet through shared memory;
//   3. the same thread encodes its 64 rows with the column's scale and stores them as 64 contiguous
//      bytes (four 16-byte vectors) of row l of qt; the h = 0 threads store the scales (coalesced).
// The codec functions are the host's (core/formats/fp8_block.h), so codes and scales are bitwise.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kBlock = kFp8RowBlock;  // rows of a column block
constexpr int kTile = 128;            // columns of a tile (= the 1x128 row-scale block)
constexpr int kHalf = kBlock / 2;     // rows per thread in steps 2 and 3
constexpr int kColsThreads = kTile * 2;
constexpr int kTilesPerCta = 4;       // column tiles per CTA: one expert search serves them
static_assert(kColsThreads == kThreads, "one thread per (column, half)");

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

// Rows [m0, m1) of column block b, or false past the last block. Every lane of the warp calls it;
// the experts go 32 at a time through an inclusive shuffle scan of their block counts.
__device__ bool find_block(const int32_t* offsets_E1, int E, int64_t b, int64_t& m0, int64_t& m1) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int64_t base = 0;  // blocks of the experts before this group of 32
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    int64_t first = 0, rows = 0;
    if (e < E) {
      first = offsets_E1[e];
      rows = offsets_E1[e + 1] - first;
    }
    const int64_t blocks = rows > 0 ? (rows + kBlock - 1) / kBlock : 0;
    int64_t end = blocks;  // inclusive prefix: the group's blocks up to expert e
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t other = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end += other;
    }
    // The first expert whose blocks end past b holds it (it has blocks: its start is <= b).
    const unsigned hit = __ballot_sync(0xffffffffu, e < E && b < base + end);
    if (hit != 0) {
      const int src = __ffs(static_cast<int>(hit)) - 1;
      const int64_t start = base + __shfl_sync(0xffffffffu, end - blocks, src);
      const int64_t f = __shfl_sync(0xffffffffu, first, src);
      const int64_t r = __shfl_sync(0xffffffffu, rows, src);
      m0 = f + (b - start) * kBlock;
      m1 = m0 + kBlock < f + r ? m0 + kBlock : f + r;
      return true;
    }
    base += __shfl_sync(0xffffffffu, end, 31);
  }
  return false;
}

__device__ __forceinline__ float tile_value(bf16_t v) { return bf16_to_float(v); }
__device__ __forceinline__ float tile_value(float v) { return v; }

// Step 1, bf16: rows [0, n) x columns [0, width) of the tile at x_ML + m0 * L + l0 into tile_RC
// [128, 128]. vec: L % 8 == 0 and x 16-byte aligned, so a row's 8-element vectors are whole.
__device__ __forceinline__ void load_tile(const bf16_t* x_ML, int64_t L, int64_t m0, int64_t l0,
                                          int n, int width, bool vec, bf16_t* tile_RC) {
  const int t = static_cast<int>(threadIdx.x);
  if (vec) {
    constexpr int kPerRow = kTile / 8, kSteps = kBlock * kPerRow / kThreads;
    uint4 v[kSteps] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {  // all loads first: kSteps vectors in flight per thread
      const int r = (t + i * kThreads) / kPerRow, j = (t + i * kThreads) % kPerRow;
      if (r < n && 8 * j < width) {
        v[i] = *reinterpret_cast<const uint4*>(x_ML + (m0 + r) * L + l0 + 8 * j);
      }
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = (t + i * kThreads) / kPerRow, j = (t + i * kThreads) % kPerRow;
      if (r < n && 8 * j < width) *reinterpret_cast<uint4*>(tile_RC + r * kTile + 8 * j) = v[i];
    }
  } else {
#pragma unroll 8
    for (int i = t; i < kBlock * kTile; i += kThreads) {
      const int r = i / kTile, c = i % kTile;
      if (r < n && c < width) tile_RC[i] = x_ML[(m0 + r) * L + l0 + c];
    }
  }
}

// fp8_decode_fp32 of the four codes of a little-endian word with one scale, through the exact
// hardware E4M3 -> f16 conversion (every E4M3 value is an f16) instead of the integer decode: the
// same product for every non-NaN code, a NaN for a NaN code, and canonical_nan makes both the
// same bits. The instructions it saves keep the E4M3 variant at the memory roofline.
__device__ __forceinline__ float4 decode4(uint32_t w, float scale) {
  const __half2_raw lo_raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi_raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 lo = __half22float2(__half2(lo_raw)), hi = __half22float2(__half2(hi_raw));
  return make_float4(canonical_nan(lo.x * scale), canonical_nan(lo.y * scale),
                     canonical_nan(hi.x * scale), canonical_nan(hi.y * scale));
}

// Step 1, E4M3 rows: codes_ML [*, L] decoded with their scales (scales_SM[s * ld + m], s = tile).
// vec: L % 4 == 0 and the codes 4-byte aligned; a warp reads one row's 128 codes as 32 words.
__device__ __forceinline__ void load_tile(const uint8_t* codes_ML, const float* scales_SM,
                                          int64_t ld, int64_t tile, int64_t L, int64_t m0,
                                          int64_t l0, int n, int width, bool vec, float* tile_RC) {
  const int t = static_cast<int>(threadIdx.x);
  const float* scale_M = scales_SM + tile * ld + m0;
  if (vec) {
    constexpr int kPerRow = kTile / 4, kSteps = kBlock * kPerRow / kThreads;
    static_assert(kPerRow == 32 && kSteps <= 32, "step i: warp w reads row w + 8 i");
    // Lane i holds the scale of the warp's row of step i, shuffled to the warp at the decode.
    const int warp = t / 32, lane = t % 32;
    const int scale_row = warp + (kThreads / 32) * lane;
    const float scale_lane = lane < kSteps && scale_row < n ? scale_M[scale_row] : 0.0f;
    uint32_t w[kSteps] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = (t + i * kThreads) / kPerRow, j = (t + i * kThreads) % kPerRow;
      if (r < n && 4 * j < width) {
        w[i] = *reinterpret_cast<const uint32_t*>(codes_ML + (m0 + r) * L + l0 + 4 * j);
      }
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = (t + i * kThreads) / kPerRow, j = (t + i * kThreads) % kPerRow;
      const float s = __shfl_sync(0xffffffffu, scale_lane, i);
      if (r < n && 4 * j < width) {
        *reinterpret_cast<float4*>(tile_RC + r * kTile + 4 * j) = decode4(w[i], s);
      }
    }
  } else {
#pragma unroll 8
    for (int i = t; i < kBlock * kTile; i += kThreads) {
      const int r = i / kTile, c = i % kTile;
      if (r < n && c < width) tile_RC[i] = fp8_decode_fp32(codes_ML[(m0 + r) * L + l0 + c], scale_M[r]);
    }
  }
}

// Resident CTAs per SM the registers must allow: 4 with the 32 KB bf16 tile, 3 with the 64 KB
// fp32 tile of decoded E4M3 rows (their shared memory allows as many).
template <bool kFromE4m3>
__global__ void __launch_bounds__(kColsThreads, kFromE4m3 ? 3 : 4) quantize_cols_kernel(const ColsArgs a, bool vec_x) {
  using Elem = std::conditional_t<kFromE4m3, float, bf16_t>;  // shared tile element
  extern __shared__ __align__(16) unsigned char smem[];
  Elem* tile_RC = reinterpret_cast<Elem*>(smem);  // [128 rows, 128 columns]
  __shared__ uint32_t half_amax_HC[2][kTile];

  if (a.skip_1 != nullptr && *a.skip_1 != 0) return;  // uniform over the grid
  int64_t valid_rows = a.M;
  const uint8_t* codes_ML = nullptr;     // E4M3 input
  const float* row_scales_SM = nullptr;  // its 1x128 scales, S-major [S, ld]
  int64_t ld = 0;
  bool vec = vec_x;
  if constexpr (kFromE4m3) {
    const char* base = a.rows + (a.rows_offset_1 != nullptr ? *a.rows_offset_1 : 0);
    const int64_t count = *a.rows_1;
    valid_rows = count < 0 ? 0 : (count < a.M ? count : a.M);
    codes_ML = reinterpret_cast<const uint8_t*>(base);
    row_scales_SM = reinterpret_cast<const float*>(base + fp8_rows_scales_offset(valid_rows, a.L));
    ld = fp8_rows_ld(valid_rows);
    vec = a.L % 4 == 0 && reinterpret_cast<uintptr_t>(base) % 4 == 0;
  }
  const int64_t tiles = (a.L + kTile - 1) / kTile;
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * kTilesPerCta;
  const int64_t tile1 = tile0 + kTilesPerCta < tiles ? tile0 + kTilesPerCta : tiles;
  const int c = static_cast<int>(threadIdx.x) % kTile;  // this thread's column of the tile
  const int h = static_cast<int>(threadIdx.x) / kTile;  // and half of the block's rows
  const int64_t K = kBlock * a.max_blocks;

  for (int64_t b = blockIdx.y; b < a.max_blocks; b += gridDim.y) {  // CTA-uniform
    int64_t m0 = 0, m1 = 0;
    if (!find_block(a.offsets_E1, a.E, b, m0, m1)) break;  // past the last block (later b too)
    m1 = m1 < valid_rows ? m1 : valid_rows;
    const int n = m1 > m0 ? static_cast<int>(m1 - m0) : 0;  // rows present; the rest encode +0
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      const int64_t l0 = tile * kTile;
      const int width = a.L - l0 < kTile ? static_cast<int>(a.L - l0) : kTile;
      __syncthreads();  // the previous tile's shared reads are done
      if constexpr (kFromE4m3) {
        load_tile(codes_ML, row_scales_SM, ld, tile, a.L, m0, l0, n, width, vec, tile_RC);
      } else {
        load_tile(a.x_ML, a.L, m0, l0, n, width, vec, tile_RC);
      }
      __syncthreads();
      const int r0 = h * kHalf;
      const int r1 = n < r0 + kHalf ? n : r0 + kHalf;
      if (c < width) {
        uint32_t amax = 0;
        for (int r = r0; r < r1; ++r) amax = amax_bits_add(amax, tile_value(tile_RC[r * kTile + c]));
        half_amax_HC[h][c] = amax;
      }
      __syncthreads();
      if (c < width) {
        const uint32_t amax0 = half_amax_HC[0][c], amax1 = half_amax_HC[1][c];
        const float scale = fp8_scale_fp32(amax0 > amax1 ? amax0 : amax1);
        const int64_t l = l0 + c;
        if (h == 0) a.scales_BL[b * a.L + l] = scale;
        uint8_t* codes_K = a.qt_LK + l * K + b * kBlock + r0;  // 16-byte aligned
#pragma unroll
        for (int g = 0; g < kHalf; g += 16) {
          uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int r = r0 + g + j;
            if (r < n) {
              w[j / 4] |= uint32_t{fp8_encode_fp32(tile_value(tile_RC[r * kTile + c]), scale)}
                          << (8 * (j % 4));
            }
          }
          *reinterpret_cast<uint4*>(codes_K + g) = make_uint4(w[0], w[1], w[2], w[3]);
        }
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
  const int64_t tiles = (a.L + kTile - 1) / kTile;
  const unsigned runs = static_cast<unsigned>((tiles + kTilesPerCta - 1) / kTilesPerCta);
  const unsigned blocks = static_cast<unsigned>(a.max_blocks < 65535 ? a.max_blocks : 65535);
  using Elem = std::conditional_t<kFromE4m3, float, bf16_t>;
  constexpr int kSmem = kBlock * kTile * static_cast<int>(sizeof(Elem));
  if constexpr (kSmem > 48 * 1024) {
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(quantize_cols_kernel<kFromE4m3>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  const bool vec_x = a.L % 8 == 0 && reinterpret_cast<uintptr_t>(a.x_ML) % 16 == 0;
  quantize_cols_kernel<kFromE4m3><<<dim3(runs, blocks), kColsThreads, kSmem,
                                    static_cast<cudaStream_t>(stream)>>>(a, vec_x);
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
