// E2M1 codes -> bf16 bit patterns with byte permutes (the NVFP4 GEMM's decode; Hopper has no E2M1
// conversion instruction). Every E2M1 value is exact in bf16. Host and device compute the same
// bits: on the device byte_perm is the PRMT instruction, on the host its emulation, so the CPU
// tests check the exact decode the kernel runs (tests/cpp/test_formats.cpp).
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace epmoe {

// PRMT (default mode) on the low 16 bits of `sel`: result byte i is byte (sel nibble i) & 7 of the
// 8-byte value {hi:lo}, or that byte's sign replicated when the nibble's bit 3 is set (the decode
// below never sets it).
EPMOE_HD uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(lo, hi, sel);
#else
  const uint64_t v = (static_cast<uint64_t>(hi) << 32) | lo;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>(v >> (8 * (n & 7u))) & 0xffu;
    if ((n & 8u) != 0) byte = (byte & 0x80u) != 0 ? 0xffu : 0u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// bf16 bits of the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), split into their high
// and low bytes, as two 8-byte PRMT tables.
constexpr uint32_t kE2m1Bf16HighLo = 0x3f3f3f00u, kE2m1Bf16HighHi = 0x40404040u;
constexpr uint32_t kE2m1Bf16LowLo = 0xc0800000u, kE2m1Bf16LowHi = 0xc0804000u;
// The magnitudes as bf16x2 words (codes 0|1, 2|3, 4|5, 6|7; the first in the low half).
constexpr uint32_t kE2m1Bf16x2_01 = 0x3f000000u, kE2m1Bf16x2_23 = 0x3fc03f80u;
constexpr uint32_t kE2m1Bf16x2_45 = 0x40404000u, kE2m1Bf16x2_67 = 0x40c04080u;

// The four E2M1 codes in bits 0..15 of `w` (element j in nibble j; upper bits ignored) as two
// bf16x2 words: e01 = (e0 | e1 << 16), e23 = (e2 | e3 << 16). 7 integer instructions.
EPMOE_HD void e2m1x4_to_bf16x2(uint32_t w, uint32_t& e01, uint32_t& e23) {
  const uint32_t mag = w & 0x7777u;
  const uint32_t high = byte_perm(kE2m1Bf16HighLo, kE2m1Bf16HighHi, mag);  // byte j: element j
  const uint32_t low = byte_perm(kE2m1Bf16LowLo, kE2m1Bf16LowHi, mag);
  // Sign of element j (bit 4j + 3) to the top of byte j: bits 3 and 11 of w << 4 are bytes 0 and
  // 1's tops (elements 0, 2), bits 7 and 15 of w those of elements 1, 3.
  const uint32_t sign = byte_perm(w << 4, w, 0x5140u) & 0x80808080u;
  const uint32_t high_signed = high | sign;
  e01 = byte_perm(low, high_signed, 0x5140u);
  e23 = byte_perm(low, high_signed, 0x7362u);
}

// A block's decode table: the bf16 magnitudes of codes 0..7 times the block scale, as PRMT tables
// of their high bytes and of their low bytes. Built from the four bf16x2 words v[i] = (code 2i,
// code 2i + 1) * scale (exact in bf16: <= 6 significant bits; the kernel multiplies kE2m1Bf16x2_*
// by the scale with mul.rn.bf16x2), so decoding needs no multiply per element.
struct E2m1Bf16Table {
  uint32_t high_lo, high_hi, low_lo, low_hi;
};
EPMOE_HD E2m1Bf16Table e2m1_bf16_table(uint32_t v01, uint32_t v23, uint32_t v45, uint32_t v67) {
  // bytes 1, 3 of each word are the high bytes of its two values, bytes 0, 2 the low ones.
  return {byte_perm(v01, v23, 0x7531u), byte_perm(v45, v67, 0x7531u),
          byte_perm(v01, v23, 0x6420u), byte_perm(v45, v67, 0x6420u)};
}

// The eight E2M1 codes of `w` (element j in nibble j) through a block's table, as four bf16x2
// words e[i] = (element 2i | element 2i + 1 << 16), the sign of each code applied. 15 integer
// instructions.
EPMOE_HD void e2m1x8_to_bf16x2(uint32_t w, const E2m1Bf16Table& t, uint32_t (&e)[4]) {
  const uint32_t mag = w & 0x77777777u, shifted = w << 4;
  // Signs to the tops of the bytes of the high-byte words (as in e2m1x4_to_bf16x2; 0x7362 takes
  // bytes 2 and 3, elements 4..7). A NaN table entry stays NaN with any sign.
  const uint32_t high0 = byte_perm(t.high_lo, t.high_hi, mag) |
                         (byte_perm(shifted, w, 0x5140u) & 0x80808080u);
  const uint32_t high1 = byte_perm(t.high_lo, t.high_hi, mag >> 16) |
                         (byte_perm(shifted, w, 0x7362u) & 0x80808080u);
  const uint32_t low0 = byte_perm(t.low_lo, t.low_hi, mag);
  const uint32_t low1 = byte_perm(t.low_lo, t.low_hi, mag >> 16);
  e[0] = byte_perm(low0, high0, 0x5140u);
  e[1] = byte_perm(low0, high0, 0x7362u);
  e[2] = byte_perm(low1, high1, 0x5140u);
  e[3] = byte_perm(low1, high1, 0x7362u);
}

}  // namespace epmoe
