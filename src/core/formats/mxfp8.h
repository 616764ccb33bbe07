// MXFP8 (OCP Microscaling Formats v1.0, E4M3 elements): one E8M0 shared scale X per 32
// consecutive elements. Per the spec's conversion (section 6.3):
//   shared_exp = floor(log2(amax)) - emax_elem, emax_elem = 8 for E4M3; X = 2^shared_exp;
//   P_i = e4m3(V_i / X), normal values clamped to the largest E4M3 value (saturation).
// amax / X lies in [256, 512), so elements above 448 * X saturate to 448 * X: the spec's rounding
// of the scale down, unlike the UE8M0 FP8 recipe (fp8_block.h) that rounds it up.
// Interpretations (docs/formats.md):
//   - zero block: log2(0) is -inf; the exponent clamps to the E8M0 minimum, X = 2^-127 (code
//     0x00), elements +-0, decode +-0 (E8M0 has no zero).
//   - fp32-denormal amax and any shared_exp below -127 clamp to -127 the same way; for finite
//     fp32 input shared_exp <= 127 - 8, so the upper end never overflows.
//   - a NaN or infinity in the block: X = NaN (0xFF; the spec decodes every element of a
//     NaN-scaled block as NaN) and the elements are written as the E4M3 NaN too.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/formats/e4m3.h"
#include "core/formats/e8m0.h"
#include "core/formats/float_bits.h"
#include "core/hd.h"

namespace epmoe {

constexpr int kMxBlock = 32;

EPMOE_HD uint8_t mx_scale_e8m0(uint32_t amax_bits) {
  if (amax_is_nonfinite(amax_bits)) return kE8m0NaN;
  if (amax_bits < kF32MinNormalBits) return e8m0_from_exponent(kE8m0MinExp);  // zero, denormal
  const int floor_log2 = static_cast<int>(amax_bits >> 23) - 127;
  return e8m0_from_exponent(floor_log2 - kE4m3Emax);
}
EPMOE_HD uint8_t mxfp8_encode(float x, uint8_t scale_code) {
  return e4m3_from_float(x * e8m0_inverse(scale_code));
}
EPMOE_HD float mxfp8_decode(uint8_t q, uint8_t scale_code) {
  return canonical_nan(e4m3_to_float(q) * e8m0_to_float(scale_code));
}

// A product block's partial sum (fp32) times 2^(sa + sw) of the two operands' E8M0 scale codes:
// ldexp, exact unless the result leaves fp32's normal range (then rounded once: to a denormal,
// zero or infinity); NaN when either scale is NaN. The CPU and CUDA MXFP8 GEMMs' block step.
EPMOE_HD float mx_block_scaled(float partial, uint8_t scale_a, uint8_t scale_w) {
  if (scale_a == kE8m0NaN || scale_w == kE8m0NaN) return f32_nan();
  const int e = static_cast<int>(scale_a) + static_cast<int>(scale_w) - 2 * kE8m0Bias;
#if defined(__CUDA_ARCH__)
  // A normal power of two multiplies exactly, rounded once like ldexp. Otherwise the product is
  // exact in double (|e| <= 254) and rounds once to fp32 (denormal, zero or infinity).
  if (e >= -126 && e <= 127) return __fmul_rn(partial, exp2i(e));
  const double scale = __longlong_as_double(static_cast<long long>(e + 1023) << 52);
  return __double2float_rn(__dmul_rn(static_cast<double>(partial), scale));
#else
  return std::ldexp(partial, e);
#endif
}

// Scale policy (see fp8_block.h): MXFP8 rows share the FP8 row-block encoder.
struct Mxfp8Scale {
  using Scale = uint8_t;
  static EPMOE_HD Scale from_amax(uint32_t amax_bits) { return mx_scale_e8m0(amax_bits); }
  static EPMOE_HD uint8_t encode(float x, Scale s) { return mxfp8_encode(x, s); }
  static EPMOE_HD float decode(uint8_t q, Scale s) { return mxfp8_decode(q, s); }
};

}  // namespace epmoe
