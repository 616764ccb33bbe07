// FP8 E4M3 with 128x1 column blocks along the rows of each expert (the weight-gradient operands,
// cpu::fp8_quantize_cols): block b of expert e covers rows first_e + 128 i .. (its last block may be
// partial), b = sum_{e' < e} ceil(rows_e' / 128) + i. Codes go transposed, [L, K] for the FP8
// WGRAD (K-major, K = 128 * max_blocks, block b at k = 128 b, zero-padded to 128 rows).
//
// One CTA per (block b, run of kTilesPerCta column tiles of 128): the CTA finds b's expert once
// (a warp prefix over the experts' block counts), then per tile
//   1. loads the block's rows of the tile into shared memory, coalesced (16-byte vectors of 8 bf16
//      per lane, kept as bf16; or words of 4 E4M3 codes, kept as codes beside the rows' 1x128
//      scales: tile columns align to the row-scale blocks, so one scale per row; element loads
//      where L or the base is not aligned; rows past the block's end and columns past L are
//      stored as zeros, so the loads and the amax need no guards), each thread keeping the amax
//      of its columns over its rows (an integer max of |x| bits: exact and order-free) for shared
//      memory;
//   2. thread c < 128 turns column c's partial amaxes into its scale (stored, coalesced) and the
//      encode bounds; thread (lane q, warp g) encodes columns 4 q .. 4 q + 3, rows 16 g .. 16 g + 15
//      (a warp reads whole tile rows) without a divide per element (e4m3_bounded.cuh) into
//      shared memory, swizzled; its codes of rows past the block's end are masked to +0 (the
//      tile's zeros there encode as NaN under a NaN column scale, a column holding Inf or NaN);
//   3. a warp stores 4 whole 128-byte rows of qt per instruction.
// The codec functions are the host's (core/formats/fp8_block.h), so codes and scales are bitwise.
#include <type_traits>

#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "cuda/formats/fp8_cols_tile.cuh"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

using namespace fp8_cols;  // the tile's find_block, encode and staged store (fp8_cols_tile.cuh)
constexpr int kColsThreads = kEncodeThreads;
constexpr int kTilesPerCta = 4;  // column tiles per CTA: one expert search serves them
static_assert(kColsThreads == kThreads, "the kernel_common block size");

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

// Step 1 loads rows [0, n) x columns [0, width) of the tile into shared memory (rows past n and
// columns past width as zeros: they change no amax; step 2 masks rows past n to +0 and step 3
// stores no column past width) and takes the column amaxes on the way: each thread keeps the amax
// of its columns over its rows (a row group g) and stores it at amax_GC[g][column]; it returns the
// number of row groups G, which partition the rows, so the max over g of amax_GC[g][c] is column
// c's amax (integer max of |x| bits: exact and order-free).
constexpr int kMaxGroups = 8;

// bf16 tile_RC [128, 128] as loaded. vec: L % 8 == 0 and x 16-byte aligned, so a row's 8-element
// vectors are whole; thread t takes the vector j = t % 16 of rows t / 16 + 16 i, and lanes t and
// t ^ 16 (rows of the same warp) combine their amaxes: group = warp, 8 groups.
__device__ __forceinline__ int load_tile(const bf16_t* x_ML, int64_t L, int64_t m0, int64_t l0,
                                         int n, int width, bool vec, bf16_t* tile_RC,
                                         uint32_t (*amax_GC)[kTile]) {
  const int t = static_cast<int>(threadIdx.x);
  if (vec) {
    constexpr int kPerRow = kTile / 8, kSteps = kBlock * kPerRow / kThreads;
    static_assert(kPerRow == 16 && kThreads / 32 <= kMaxGroups, "two row groups per warp");
    const int j = t % kPerRow, g = t / kPerRow;
    const bool active = 8 * j < width;
    uint4 v[kSteps] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {  // all loads first: kSteps vectors in flight per thread
      const int r = g + i * (kThreads / kPerRow);
      if (active && r < n) v[i] = *reinterpret_cast<const uint4*>(x_ML + (m0 + r) * L + l0 + 8 * j);
    }
    // Per column pair, the max of the |x| bf16 bits in two 16-bit lanes (one VIMNMX per pair):
    // the fp32 bits of a bf16 are its bits << 16, so the max shifted is amax_bits_add's amax.
    uint32_t amax2[4] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = g + i * (kThreads / kPerRow);
      *reinterpret_cast<uint4*>(tile_RC + r * kTile + 8 * j) = v[i];
      amax2[0] = __vmaxu2(amax2[0], v[i].x & 0x7fff7fffu);
      amax2[1] = __vmaxu2(amax2[1], v[i].y & 0x7fff7fffu);
      amax2[2] = __vmaxu2(amax2[2], v[i].z & 0x7fff7fffu);
      amax2[3] = __vmaxu2(amax2[3], v[i].w & 0x7fff7fffu);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) amax2[k] = __vmaxu2(amax2[k], __shfl_xor_sync(0xffffffffu, amax2[k], 16));
    if (t % 32 < kPerRow) {
      uint4* amax_C = reinterpret_cast<uint4*>(&amax_GC[t / 32][8 * j]);
      amax_C[0] = make_uint4(amax2[0] << 16, amax2[0] & 0xffff0000u, amax2[1] << 16, amax2[1] & 0xffff0000u);
      amax_C[1] = make_uint4(amax2[2] << 16, amax2[2] & 0xffff0000u, amax2[3] << 16, amax2[3] & 0xffff0000u);
    }
    return kThreads / 32;
  }
  // Elements: thread t takes column t % 128 of rows t / 128 + 2 i (2 groups).
  const int c = t % kTile, g = t / kTile;
  uint32_t amax = 0;
#pragma unroll 8
  for (int r = g; r < kBlock; r += kThreads / kTile) {
    const bf16_t x = c < width && r < n ? x_ML[(m0 + r) * L + l0 + c] : bf16_t{0};
    tile_RC[r * kTile + c] = x;
    amax = amax_bits_add(amax, bf16_to_float(x));
  }
  amax_GC[g][c] = amax;
  return kThreads / kTile;
}

// E4M3 rows: codes_ML [*, L] with their scales (scales_SM[s * ld + m], s = tile). The tile keeps
// the codes (tile_RC [128, 128] bytes) and scale_R the rows' scales (0 past n); both steps decode.
// vec: L % 4 == 0 and the codes 4-byte aligned; thread t takes the word j = t % 32 (codes 4 j ..
// 4 j + 3) of rows t / 32 + 8 i: a warp reads one row's 128 codes (group = warp, 8 groups).
__device__ __forceinline__ int load_tile(const uint8_t* codes_ML, const float* scales_SM, int64_t ld,
                                         int64_t tile, int64_t L, int64_t m0, int64_t l0, int n,
                                         int width, bool vec, uint8_t* tile_RC, float* scale_R,
                                         uint32_t (*amax_GC)[kTile]) {
  const int t = static_cast<int>(threadIdx.x);
  const float* scale_M = scales_SM + tile * ld + m0;
  if (t < kBlock) scale_R[t] = t < n ? scale_M[t] : 0.0f;
  if (vec) {
    constexpr int kPerRow = kTile / 4, kSteps = kBlock * kPerRow / kThreads;
    constexpr int kGroups = kThreads / kPerRow;
    static_assert(kPerRow == 32 && kSteps <= 32 && kGroups <= kMaxGroups, "step i: warp w reads row w + 8 i");
    const int j = t % kPerRow, g = t / kPerRow;
    const bool active = 4 * j < width;
    // Lane i holds the scale of the warp's row of step i, shuffled to the warp at the decode
    // (every lane runs the loops, so every lane reaches the shuffles).
    const int scale_row = g + kGroups * j;
    const float scale_lane = j < kSteps && scale_row < n ? scale_M[scale_row] : 0.0f;
    uint32_t w[kSteps] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = g + i * kGroups;
      if (active && r < n) w[i] = *reinterpret_cast<const uint32_t*>(codes_ML + (m0 + r) * L + l0 + 4 * j);
    }
    uint32_t amax[4] = {};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int r = g + i * kGroups;
      const float row_scale = __shfl_sync(0xffffffffu, scale_lane, i);
      *reinterpret_cast<uint32_t*>(tile_RC + r * kTile + 4 * j) = w[i];
      const float4 f = decode4(w[i], row_scale);  // rows past n: code 0, scale 0
      amax[0] = amax_bits_add(amax[0], f.x);
      amax[1] = amax_bits_add(amax[1], f.y);
      amax[2] = amax_bits_add(amax[2], f.z);
      amax[3] = amax_bits_add(amax[3], f.w);
    }
    *reinterpret_cast<uint4*>(&amax_GC[g][4 * j]) = make_uint4(amax[0], amax[1], amax[2], amax[3]);
    return kGroups;
  }
  const int c = t % kTile, g = t / kTile;
  uint32_t amax = 0;
#pragma unroll 8
  for (int r = g; r < kBlock; r += kThreads / kTile) {
    const uint8_t code = c < width && r < n ? codes_ML[(m0 + r) * L + l0 + c] : uint8_t{0};
    tile_RC[r * kTile + c] = code;
    amax = amax_bits_add(amax, fp8_decode_fp32(code, r < n ? scale_M[r] : 0.0f));
  }
  amax_GC[g][c] = amax;
  return kThreads / kTile;
}

// Step 2 of thread (lane, warp): the codes of its 4 columns x 16 rows into codes_LC (fp8_cols_tile.cuh):
// the bounded codes staged first, then each word with an undecided element again element by
// element, dividing there, after the stores, so that the divides' subroutine calls find few live
// registers.
template <class Elem>
__device__ __forceinline__ void encode_chunks(const Elem* tile_RC, const float* scale_R, ColumnScales s, int n,
                                              int lane, int warp, uint4* codes_LC) {
  uint32_t w[4][4];
  uint32_t flags = encode_bounded(tile_RC, scale_R, s, lane, warp, w);
  stage_chunk(w, n, lane, warp, codes_LC);
  while (flags != 0) {  // rare per word (about 2 % on bf16 data)
    const int bit = __ffs(static_cast<int>(flags)) - 1;
    flags &= flags - 1;
    const int c = 4 * lane + bit / 4, r = kRowsPerGroup * warp + 4 * (bit % 4);
    const uint32_t word = encode_exact_word(tile_RC, scale_R, s, lane, warp, bit) & present_bytes(n - r);
    reinterpret_cast<uint32_t*>(codes_LC + chunk_slot(c, warp))[bit % 4] = word;
  }
}

// Shared memory: the tile (32 KiB of bf16 or 16 KiB of E4M3 codes) and the staged codes (16 KiB)
// dynamic, 5.5 KiB static: 4 CTAs per SM with the bf16 tile, which the registers must allow too.
template <bool kFromE4m3>
__global__ void __launch_bounds__(kColsThreads, 4) quantize_cols_kernel(const ColsArgs a, bool vec_x) {
  using Elem = std::conditional_t<kFromE4m3, uint8_t, bf16_t>;  // shared tile element
  extern __shared__ __align__(16) unsigned char smem[];
  Elem* tile_RC = reinterpret_cast<Elem*>(smem);  // [128 rows, 128 columns]
  uint4* codes_LC = reinterpret_cast<uint4*>(smem + kBlock * kTile * sizeof(Elem));
  __shared__ __align__(16) uint32_t amax_GC[kMaxGroups][kTile];  // step 1's partial amaxes
  __shared__ __align__(16) float scale_C[kTile], lo_C[kTile], hi_C[kTile];  // per column
  __shared__ __align__(16) float scale_R[kFromE4m3 ? kBlock : 1];  // E4M3 rows' scales

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
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
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
      int groups = 0;
      if constexpr (kFromE4m3) {
        groups = load_tile(codes_ML, row_scales_SM, ld, tile, a.L, m0, l0, n, width, vec, tile_RC, scale_R, amax_GC);
      } else {
        groups = load_tile(a.x_ML, a.L, m0, l0, n, width, vec, tile_RC, amax_GC);
      }
      __syncthreads();
      if (t < kTile) {  // column t's scale (coalesced store) and bounds, once per column
        uint32_t amax = 0;
        for (int g = 0; g < groups; ++g) amax = umax(amax, amax_GC[g][t]);
        const float scale = fp8_scale_fp32(amax);
        const Fp8Fp32Bounds bounds = fp8_fp32_bounds(scale);
        scale_C[t] = scale;
        lo_C[t] = bounds.lo;
        hi_C[t] = bounds.hi;
        if (t < width) a.scales_BL[b * a.L + l0 + t] = scale;
      }
      __syncthreads();
      encode_chunks(tile_RC, scale_R, ColumnScales{scale_C, lo_C, hi_C}, n, lane, warp, codes_LC);
      __syncthreads();
      store_staged(codes_LC, a.qt_LK, K, b, l0, width, lane, warp);
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
  using Elem = std::conditional_t<kFromE4m3, uint8_t, bf16_t>;
  constexpr int kSmem = kBlock * kTile * static_cast<int>(sizeof(Elem) + 1);  // tile and staged codes
  set_shared_memory_limit<quantize_cols_kernel<kFromE4m3>>(kSmem);  // with the static arrays, past 48 KiB
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
