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

}  // namespace epmoe
