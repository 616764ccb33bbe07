// fp32 bit access and the one rounding routine every low-precision codec shares: a non-negative
// fp32 magnitude rounded to the nearest value of a small binary float format, ties to even.
// Integer arithmetic only, so the host and the device give the same bits whatever their FP
// environment (no FMA contraction, no flush-to-zero, no libm).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/hd.h"

namespace epmoe {

EPMOE_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

EPMOE_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32AbsMask = 0x7fffffffu;
constexpr uint32_t kF32InfBits = 0x7f800000u;    // +Inf; |x| bits above it are NaN
constexpr uint32_t kF32QuietNaN = 0x7fc00000u;
constexpr uint32_t kF32MinNormalBits = 0x00800000u;  // 2^-126

EPMOE_HD float f32_nan() { return f32_from_bits(kF32QuietNaN); }

// A NaN produced by arithmetic differs in its bits between the backends (x86 keeps the NaN
// operand's sign and payload, the GPU returns 0x7FFFFFFF); decoders pass their products through
// this so every NaN they return is 0x7FC00000 on both.
EPMOE_HD float canonical_nan(float v) { return v != v ? f32_nan() : v; }

// 2^e exactly, for e in [-149, 127] (below -126 the result is an fp32 denormal).
EPMOE_HD float exp2i(int e) {
  return e >= -126 ? f32_from_bits(static_cast<uint32_t>(e + 127) << 23)
                   : f32_from_bits(1u << (e + 149));
}

// Block amax as the bits of |x|: non-negative floats order like their bits as unsigned
// integers, and NaN bits sort above +Inf, so one integer max gives the amax and flags a
// non-finite block (result >= kF32InfBits). Integer max is exact and associative, so any
// reduction order (serial on the CPU, shuffles on the GPU) gives the same bits.
EPMOE_HD uint32_t amax_bits_add(uint32_t amax_bits, float x) {
  const uint32_t m = f32_bits(x) & kF32AbsMask;
  return m > amax_bits ? m : amax_bits;
}
EPMOE_HD bool amax_is_nonfinite(uint32_t amax_bits) { return amax_bits >= kF32InfBits; }

// Rounds a finite magnitude (the bits of |x|, sign cleared) to the grid of a binary float format
// with kMan mantissa bits whose smallest normal is 2^kEmin (exponent bias 1 - kEmin), round to
// nearest, ties to even (the neighbour whose mantissa is even). Returns the magnitude code
// (biased exponent << kMan | mantissa). The caller saturates: |x| must not exceed the format's
// largest finite value, which is on the grid, so rounding never carries past it.
template <int kMan, int kEmin>
EPMOE_HD uint32_t round_to_minifloat(uint32_t mag_bits) {
  static_assert(kMan >= 1 && kMan <= 10, "a small float format");
  const uint32_t exp_field = mag_bits >> 23;
  const uint32_t frac = mag_bits & 0x007fffffu;
  if (exp_field == 0) return 0;  // zero or an fp32 denormal (< 2^-126): far below any target step
  const int e = static_cast<int>(exp_field) - 127;
  if (e >= kEmin) {
    // Normal in the target: keep kMan of the 23 fraction bits. A round-up of an all-ones
    // mantissa carries into the exponent field, which is the next binade's code.
    constexpr int kDrop = 23 - kMan;
    const uint32_t keep = frac >> kDrop;
    const uint32_t rem = frac & ((1u << kDrop) - 1u);
    constexpr uint32_t kHalf = 1u << (kDrop - 1);
    uint32_t code = (static_cast<uint32_t>(e - kEmin + 1) << kMan) + keep;
    if (rem > kHalf || (rem == kHalf && (keep & 1u) != 0)) ++code;
    return code;
  }
  // Subnormal in the target: the value in units of the smallest subnormal 2^(kEmin - kMan) is
  // significand * 2^-shift, significand = 1.frac as a 24-bit integer.
  const int shift = 23 + kEmin - kMan - e;  // >= 24 - kMan
  if (shift >= 25) return 0;                // below a quarter step: under half, rounds to 0
  const uint32_t sig = frac | 0x00800000u;
  uint32_t keep = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (keep & 1u) != 0)) ++keep;
  return keep;  // 1 << kMan when it rounds up to the smallest normal: that is its code
}

}  // namespace epmoe
