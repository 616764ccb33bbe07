// FP8 E4M3 (OCP 8-bit floating point, "E4M3FN"): S.EEEE.MMM, exponent bias 7, no infinities,
// one NaN pattern per sign (S.1111.111). Normals 2^(E-7) * (1 + M/8) for E in 1..15 (largest
// 1.75 * 2^8 = 448 at 0x7E); subnormals M * 2^-9 for E = 0 (smallest 2^-9 at 0x01).
#pragma once

#include <cstdint>

#include "core/formats/float_bits.h"
#include "core/hd.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace epmoe {

constexpr float kE4m3Max = 448.0f;
constexpr int kE4m3Emax = 8;               // 448 = 1.75 * 2^8: the "emax_elem" of the MX spec
constexpr uint8_t kE4m3MaxCode = 0x7e;     // +448
constexpr uint8_t kE4m3NaN = 0x7f;         // canonical NaN (0xFF is the other NaN)
constexpr uint32_t kE4m3MaxBits = 0x43e00000u;  // fp32 bits of 448

// fp32 -> E4M3, round to nearest even. Saturating (our choice, the CUDA __NV_SATFINITE mode and
// what block-scaled quantizers want): every finite |x| > 448 and +-Inf give +-448, so a scale
// that is a rounding short never turns an element into NaN. NaN gives the canonical 0x7F.
// The sign of zero is kept (-0 -> 0x80).
EPMOE_HD uint8_t e4m3_from_float(float x) {
#if defined(__CUDA_ARCH__)
  // One cvt.rn.satfinite.e4m3x2.f32: equal to the code below on every fp32 input
  // (test_formats EncodeEqualsCudaSatfiniteConversion), a fraction of its instructions.
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  const uint32_t bits = f32_bits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & kF32AbsMask;
  if (mag > kF32InfBits) return kE4m3NaN;
  if (mag >= kE4m3MaxBits) return static_cast<uint8_t>(sign | kE4m3MaxCode);
  return static_cast<uint8_t>(sign | round_to_minifloat<3, -6>(mag));
#endif
}

// E4M3 -> fp32 (exact: every E4M3 value is an fp32 value). Both NaN codes give a quiet NaN.
EPMOE_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t e = (code >> 3) & 0xfu;
  const uint32_t m = code & 0x7u;
  if (e == 0xfu && m == 0x7u) return f32_from_bits(sign | kF32QuietNaN);
  if (e == 0) return f32_from_bits(sign | f32_bits(static_cast<float>(m) * exp2i(-9)));
  return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));  // 2^(e-7): fp32 biased e-7+127
}

EPMOE_HD bool e4m3_is_nan(uint8_t code) { return (code & 0x7fu) == 0x7fu; }

}  // namespace epmoe
