// The prepared NVFP4 layout (PreparedWeights of format nvfp4, docs/formats.md), the order the
// GEMM reads. Codes: the codec's
// packing (two E2M1 codes a byte, low nibble first) with the 32 bits of every whole 4-byte word
// of a row (8 consecutive elements) permuted so that the GEMM decodes them with 5 LOP3 and 4
// shifts (cuda/gemm/grouped_gemm_nvfp4.cu): pair i = elements (2i, 2i + 1) of the word
// comes out as a bf16x2 word. Hopper has no E2M1 conversion instruction.
//
// Decoded pair layout (bf16x2, first element in the low half): code bits m, e0, e1 at bits 6, 7, 8
// and s at bit 15 of a half. That is the bf16 of e2m1 * 2^-126 exactly (bf16's exponent bias
// 127 is E2M1's plus 126, and E2M1's subnormal 0.5 becomes bf16's subnormal 2^-127), so the
// GEMM's block-scale multiply brings it back (kNvfp4DecodeScaleLog2).
//
// In the word, pairs 0, 1, 2 sit rotated right by 0, 4, 10 (a bit with target t at (t - r) mod
// 32); pair 3 splits: its e1 bits (targets 8 and 24) by 14, the rest by 6. The four placements fill
// the 32 bits exactly once (no four rotations of one pair's targets can tile 32 bits, so one pair
// needs two; tests/cpp/test_formats.cpp checks the tiling). A partial word at the end of a row
// (P % 4 != 0 bytes) keeps the codec's order.
//
// Block scales: [G, C, N, 8] with C = ceil(L / 128): a row's 8 scales of one 128-element chunk
// side by side, a chunk's rows in order, so one copy brings a slab of rows' scales for a chunk
// (the codec's [G, N, S], S = ceil(L / 16), reordered; blocks S .. 8C - 1 are 0).
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace epmoe {

// Target bits of a decoded pair: the low element's m, e0, e1 at 6..8 and s at 15, the high's at
// 22..24 and 31.
constexpr uint32_t kNvfp4PairMask = 0x81c081c0u;
constexpr uint32_t kNvfp4Pair3ByRot6 = 0x80c080c0u;   // pair 3's bits rotated by 6
constexpr uint32_t kNvfp4Pair3ByRot14 = 0x01000100u;  // pair 3's e1 bits, rotated by 14
constexpr int kNvfp4Pair1Rot = 4, kNvfp4Pair2Rot = 10;  // pair 0 is not rotated
// The decoded pairs are e2m1 * 2^-126 (above).
constexpr int kNvfp4DecodeScaleLog2 = -126;

EPMOE_HD uint32_t rotl32(uint32_t x, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, x, static_cast<unsigned>(r));
#else
  r &= 31;
  return r == 0 ? x : (x << r) | (x >> (32 - r));
#endif
}
EPMOE_HD uint32_t rotr32(uint32_t x, int r) { return rotl32(x, (32 - (r & 31)) & 31); }

// Two E2M1 codes (low nibbles) at their decoded bit positions (first in the low half).
EPMOE_HD uint32_t nvfp4_place_pair(uint32_t first, uint32_t second) {
  return ((first & 7u) << 6) | ((first & 8u) << 12) | ((second & 7u) << 22) | ((second & 8u) << 28);
}
// The inverse on a decoded pair: code of element h (0 first, 1 second).
EPMOE_HD uint32_t nvfp4_pair_code(uint32_t pair, int h) {
  const uint32_t half = pair >> (16 * h);
  return ((half >> 6) & 7u) | ((half >> 12) & 8u);
}

// The 4 decoded pairs of a prepared word: p[i] = elements (2i, 2i + 1) as bf16x2 bits of
// e2m1 * 2^-126. 5 LOP3, 2 funnel shifts and 2 plain left shifts (no table, no multiply): the
// rotations by 4 and 6 wrap only bits their masks drop, so they are shifts, which the compiler
// may put on the FMA pipe (IMAD.SHL) beside the integer pipe's LOP3s.
EPMOE_HD void nvfp4_decode_word(uint32_t w, uint32_t (&p)[4]) {
  p[0] = w & kNvfp4PairMask;
  p[1] = (w << kNvfp4Pair1Rot) & kNvfp4PairMask;
  p[2] = rotl32(w, kNvfp4Pair2Rot) & kNvfp4PairMask;
  p[3] = ((w << 6) & kNvfp4Pair3ByRot6) | (rotl32(w, 14) & kNvfp4Pair3ByRot14);
}

// A codec word (8 codes, element j in nibble j) in the prepared order, and back.
EPMOE_HD uint32_t nvfp4_gemm_word(uint32_t codec) {
  uint32_t pair[4];
  for (int i = 0; i < 4; ++i) {
    pair[i] = nvfp4_place_pair((codec >> (8 * i)) & 0xfu, (codec >> (8 * i + 4)) & 0xfu);
  }
  return pair[0] | rotr32(pair[1], kNvfp4Pair1Rot) | rotr32(pair[2], kNvfp4Pair2Rot) |
         rotr32(pair[3] & kNvfp4Pair3ByRot6, 6) | rotr32(pair[3] & kNvfp4Pair3ByRot14, 14);
}
EPMOE_HD uint32_t nvfp4_codec_word(uint32_t gemm) {
  uint32_t pair[4];
  nvfp4_decode_word(gemm, pair);
  uint32_t w = 0;
  for (int i = 0; i < 4; ++i) {
    w |= (nvfp4_pair_code(pair[i], 0) | (nvfp4_pair_code(pair[i], 1) << 4)) << (8 * i);
  }
  return w;
}

// Every whole word of `rows` rows of P code bytes each, in place, through `convert`
// (little-endian words; a row's last P % 4 bytes unchanged). Host loops; the CUDA prepare runs
// cuda::nvfp4_codes_to_gemm_order.
template <class Convert>
void nvfp4_convert_words(uint8_t* q, int64_t rows, int64_t P, Convert convert) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b + 4 <= P; b += 4) {
      uint8_t* p = q + r * P + b;
      const uint32_t w = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
      const uint32_t v = convert(w);
      for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
    }
  }
}
inline void nvfp4_codes_to_gemm_order(uint8_t* q, int64_t rows, int64_t P) {
  nvfp4_convert_words(q, rows, P, nvfp4_gemm_word);
}
inline void nvfp4_codes_to_codec_order(uint8_t* q, int64_t rows, int64_t P) {
  nvfp4_convert_words(q, rows, P, nvfp4_codec_word);
}

// Block scales of a 128-element chunk, and chunks of a row of L elements.
constexpr int kNvfp4ChunkBlocks = 8;
EPMOE_HD int64_t nvfp4_scale_chunks(int64_t L) { return (L + 127) / 128; }

// The prepared position of block b of row n (of N rows a group) in group g.
EPMOE_HD int64_t nvfp4_prepared_scale_index(int64_t g, int64_t n, int64_t b, int64_t N, int64_t C) {
  return ((g * C + b / kNvfp4ChunkBlocks) * N + n) * kNvfp4ChunkBlocks + b % kNvfp4ChunkBlocks;
}

// The codec's scales [G, N, S] of rows of L elements into the prepared [G, C, N, 8] (padding 0),
// and back.
inline void nvfp4_scales_to_gemm_order(const uint8_t* codec_GNS, int64_t G, int64_t N, int64_t L,
                                       uint8_t* prepared_GCN8) {
  const int64_t S = (L + 15) / 16, C = nvfp4_scale_chunks(L);
  for (int64_t i = 0; i < G * C * N * kNvfp4ChunkBlocks; ++i) prepared_GCN8[i] = 0;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t b = 0; b < S; ++b) {
        prepared_GCN8[nvfp4_prepared_scale_index(g, n, b, N, C)] = codec_GNS[(g * N + n) * S + b];
      }
    }
  }
}
inline void nvfp4_scales_to_codec_order(const uint8_t* prepared_GCN8, int64_t G, int64_t N,
                                        int64_t L, uint8_t* codec_GNS) {
  const int64_t S = (L + 15) / 16, C = nvfp4_scale_chunks(L);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t b = 0; b < S; ++b) {
        codec_GNS[(g * N + n) * S + b] = prepared_GCN8[nvfp4_prepared_scale_index(g, n, b, N, C)];
      }
    }
  }
}

}  // namespace epmoe
