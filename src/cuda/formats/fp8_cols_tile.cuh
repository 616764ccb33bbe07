// One 128-row x 128-column tile of a 128x1 column quantization (cpu::fp8_quantize_cols), as the
// column quantizer (fp8_cols.cu) and the SwiGLU backward that writes its own column codes
// (swiglu_backward_cols.cu) run it on a tile held in shared memory:
//   - find_block: the rows of column block b of the expert layout;
//   - encode_bounded / encode_exact_word: thread (lane q, warp g) of 8 warps encodes columns
//     4 q .. 4 q + 3, rows 16 g .. 16 g + 15 (a warp reads whole tile rows: conflict-free), as one
//     16-byte chunk of codes per column, without a divide per element (e4m3_bounded.cuh), then
//     the rare words with an undecided element exactly;
//   - stage_chunk / store_staged: the codes staged as codes_LC [128 columns][8 chunks of 16 rows],
//     then a warp stores 4 whole 128-byte rows of the transposed codes qt_LK per instruction.
// The codec functions are the host's (core/formats/fp8_block.h), so codes and scales are bitwise.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/formats/fp8_block.h"
#include "cuda/formats/e4m3_bounded.cuh"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda::fp8_cols {

constexpr int kBlock = kFp8RowBlock;  // rows of a column block
constexpr int kTile = 128;            // columns of a tile (= the 1x128 row-scale block)
constexpr int kEncodeThreads = 256;   // the encode's 8 warps
constexpr int kQuads = kTile / 4;                           // lanes of a warp
constexpr int kRowsPerGroup = kBlock / (kEncodeThreads / kQuads);  // rows of a warp
static_assert(kQuads == 32 && kRowsPerGroup == 16, "a warp: 32 column quads x 16 rows (one chunk)");

// Rows [m0, m1) of column block b, or false past the last block: block b of expert e covers rows
// first_e + 128 i .. (its last block may be partial), b = sum_{e' < e} ceil(rows_e' / 128) + i.
// Every lane of the warp calls it; the experts go 32 at a time through an inclusive shuffle scan
// of their block counts.
__device__ __forceinline__ bool find_block(const int32_t* offsets_E1, int E, int64_t b, int64_t& m0,
                                           int64_t& m1) {
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

// The four codes of a little-endian word times one scale, through the exact hardware E4M3 -> f16
// conversion (every E4M3 value is an f16) instead of the integer decode: fp8_decode_fp32's value
// for every non-NaN code. A NaN code gives a NaN whose payload is not canonicalized: no output
// depends on it (its |x| bits exceed +Inf's, so the block's scale is the canonical NaN, and every
// x / NaN encodes to 0x7F).
__device__ __forceinline__ float4 decode4(uint32_t w, float scale) {
  const __half2_raw lo_raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi_raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 lo = __half22float2(__half2(lo_raw)), hi = __half22float2(__half2(hi_raw));
  return make_float4(lo.x * scale, lo.y * scale, hi.x * scale, hi.y * scale);
}

// Row r, columns c0 .. c0 + 3 of a tile [128, 128] of bf16 (or of E4M3 codes times the rows'
// scales scale_R) as values; one value.
__device__ __forceinline__ float4 tile_row4(const bf16_t* tile_RC, const float*, int r, int c0) {
  const uint2 u = *reinterpret_cast<const uint2*>(tile_RC + r * kTile + c0);
  return make_float4(bf16_to_float(static_cast<bf16_t>(u.x & 0xffffu)), bf16_to_float(static_cast<bf16_t>(u.x >> 16)),
                     bf16_to_float(static_cast<bf16_t>(u.y & 0xffffu)), bf16_to_float(static_cast<bf16_t>(u.y >> 16)));
}
__device__ __forceinline__ float4 tile_row4(const uint8_t* tile_RC, const float* scale_R, int r, int c0) {
  return decode4(*reinterpret_cast<const uint32_t*>(tile_RC + r * kTile + c0), scale_R[r]);
}
__device__ __forceinline__ float tile_value(const bf16_t* tile_RC, const float*, int r, int c) {
  return bf16_to_float(tile_RC[r * kTile + c]);
}
__device__ __forceinline__ float tile_value(const uint8_t* tile_RC, const float* scale_R, int r, int c) {
  return fp8_decode_fp32(tile_RC[r * kTile + c], scale_R[r]);
}

// Per column of the tile: its scale and the encode bounds.
struct ColumnScales {
  const float* scale_C;
  const float* lo_C;
  const float* hi_C;
};

// The bounded pass of thread (lane, warp): w[i][k] = the codes of column 4 lane + i, rows
// 16 warp + 4 k .. + 3 (the first in the low byte). Returns the words holding an element whose
// bounds disagree (bit 4 i + k), for encode_exact_word.
template <class Elem>
__device__ __forceinline__ uint32_t encode_bounded(const Elem* tile_RC, const float* scale_R, ColumnScales s,
                                                   int lane, int warp, uint32_t (&w)[4][4]) {
  const int c0 = 4 * lane, r0 = kRowsPerGroup * warp;
  const float4 lo = *reinterpret_cast<const float4*>(s.lo_C + c0), hi = *reinterpret_cast<const float4*>(s.hi_C + c0);
  const Fp8Fp32Bounds bounds[4] = {{lo.x, hi.x}, {lo.y, hi.y}, {lo.z, hi.z}, {lo.w, hi.w}};
  uint32_t flags = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float4 v[4];  // rows r0 + 4 k + j
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = tile_row4(tile_RC, scale_R, r0 + 4 * k + j, c0);
    uint32_t miss[4] = {0u, 0u, 0u, 0u};
    w[0][k] = e4m3x4_bounded(v[0].x, v[1].x, v[2].x, v[3].x, bounds[0], miss[0]);
    w[1][k] = e4m3x4_bounded(v[0].y, v[1].y, v[2].y, v[3].y, bounds[1], miss[1]);
    w[2][k] = e4m3x4_bounded(v[0].z, v[1].z, v[2].z, v[3].z, bounds[2], miss[2]);
    w[3][k] = e4m3x4_bounded(v[0].w, v[1].w, v[2].w, v[3].w, bounds[3], miss[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) flags |= (miss[i] != 0 ? 1u : 0u) << (4 * i + k);
  }
  return flags;
}

// Word `bit` of encode_bounded's flags, element by element (fp8_encode_fp32's codes, dividing
// where the bounds disagree): column 4 lane + bit / 4, rows 16 warp + 4 (bit % 4) .. + 3.
template <class Elem>
__device__ __forceinline__ uint32_t encode_exact_word(const Elem* tile_RC, const float* scale_R, ColumnScales s,
                                                   int lane, int warp, int bit) {
  const int c = 4 * lane + bit / 4, r = kRowsPerGroup * warp + 4 * (bit % 4);
  const float scale = s.scale_C[c];
  const Fp8Fp32Bounds b{s.lo_C[c], s.hi_C[c]};
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    word |= uint32_t{fp8_encode_fp32_exact(tile_value(tile_RC, scale_R, r + j, c), scale, b)} << (8 * j);
  }
  return word;
}

// The bytes of a word of 4 rows r .. r + 3 (row r in the low byte) that hold rows of the block,
// given rows = n - r: all when rows >= 4, none when rows <= 0. The others are padding, +0 in qt.
__device__ __forceinline__ uint32_t present_bytes(int rows) {
  return rows >= 4 ? 0xffffffffu : rows <= 0 ? 0u : (1u << (8 * rows)) - 1u;
}

// Staged codes codes_LC [128 tile columns][8 chunks of 16 rows], chunk p of column l at
// p ^ ((l / 4) % 8): the encode's writes (8 lanes: 8 column quads, one chunk each) and the row
// reads (8 lanes: one column's 8 chunks) are conflict-free.
__device__ __forceinline__ int chunk_slot(int l, int p) { return l * 8 + (p ^ ((l >> 2) & 7)); }

// Thread (lane, warp)'s words w (encode_bounded's, exact where flagged) into codes_LC, rows n and
// past (the block's end) masked to +0: their tile zeros would encode as 0x7F under a NaN scale.
__device__ __forceinline__ void stage_chunk(const uint32_t (&w)[4][4], int n, int lane, int warp, uint4* codes_LC) {
  const int c0 = 4 * lane, r0 = kRowsPerGroup * warp;
  uint32_t keep[4];  // word k: the bytes of rows r0 + 4 k .. r0 + 4 k + 3 below n
#pragma unroll
  for (int k = 0; k < 4; ++k) keep[k] = present_bytes(n - r0 - 4 * k);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    codes_LC[chunk_slot(c0 + i, warp)] =
        make_uint4(w[i][0] & keep[0], w[i][1] & keep[1], w[i][2] & keep[2], w[i][3] & keep[3]);
  }
}

// Thread (lane, warp)'s words exact: encode_bounded, then each flagged word again element by
// element (rare: about 2 % of words on bf16 data), selected into w without indexing it by a
// variable (which would put w in local memory).
template <class Elem>
__device__ __forceinline__ void encode_words(const Elem* tile_RC, const float* scale_R, ColumnScales s, int lane,
                                             int warp, uint32_t (&w)[4][4]) {
  uint32_t flags = encode_bounded(tile_RC, scale_R, s, lane, warp, w);
  while (flags != 0) {
    const int bit = __ffs(static_cast<int>(flags)) - 1;
    flags &= flags - 1;
    const uint32_t word = encode_exact_word(tile_RC, scale_R, s, lane, warp, bit);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int k = 0; k < 4; ++k) w[i][k] = bit == 4 * i + k ? word : w[i][k];
    }
  }
}

// Step 3: a warp stores 4 rows of qt (4 whole 128-byte runs) per instruction: tile columns
// l < width of block b, qt_LK [L, K] row l0 + l at k = 128 b.
__device__ __forceinline__ void store_staged(const uint4* codes_LC, uint8_t* qt_LK, int64_t K, int64_t b, int64_t l0,
                                             int width, int lane, int warp) {
#pragma unroll
  for (int k = 0; k < kRowsPerGroup / 4; ++k) {
    const int l = kRowsPerGroup * warp + 4 * k + lane / 8, p = lane % 8;
    if (l < width) {
      *reinterpret_cast<uint4*>(qt_LK + (l0 + l) * K + b * kBlock + 16 * p) = codes_LC[chunk_slot(l, p)];
    }
  }
}

}  // namespace epmoe::cuda::fp8_cols
