// FP8 with DeepSeek-style block scales (DESIGN.md §5, reference/peers.md §6): E4M3 elements, one
// scale per block: 1x128 for activations (128 consecutive elements of a row, along the GEMM
// contraction axis) and 128x128 for weights. Scales are fp32 or power-of-two UE8M0 (E8M0 codes).
//
// Per block, with amax = max |x| over the block:
//   fp32:   scale = amax / 448 (one fp32 division), elements e4m3(x / scale), value q * scale.
//   UE8M0:  scale = 2^e, the smallest power of two with 448 * 2^e >= amax (so no element
//           saturates), elements e4m3(x * 2^-e) (exact scaling), value q * 2^e.
// Our choices (docs/formats.md):
//   - zero block: scale 1 (fp32 1.0f, UE8M0 code 127): elements are +-0 and decode to +-0.
//   - fp32 scales are floored at 2^-126 (the smallest normal): a block whose amax is below
//     448 * 2^-126 never gets a denormal or zero scale (no x / 0, no precision lost in the scale).
//   - UE8M0 exponents are clamped to the E8M0 range [-127, 127] (only denormal-range blocks
//     reach the lower clamp; amax <= FLT_MAX keeps e <= 120).
//   - a block holding a NaN or an infinity: scale NaN (fp32 NaN, UE8M0 0xFF) and every element
//     the E4M3 NaN, so the whole block decodes to NaN (the MX spec's rule for NaN scales).
#pragma once

#include <cstdint>

#include "core/formats/e4m3.h"
#include "core/formats/e8m0.h"
#include "core/formats/float_bits.h"
#include "core/hd.h"

namespace epmoe {

constexpr int kFp8RowBlock = 128;     // activations: 1 x 128
constexpr int kFp8WeightBlock = 128;  // weights: 128 x 128

enum class Fp8ScaleFormat : int { fp32, ue8m0 };

// ---- fp32 scales ----

EPMOE_HD float fp8_scale_fp32(uint32_t amax_bits) {
  if (amax_is_nonfinite(amax_bits)) return f32_nan();
  if (amax_bits == 0) return 1.0f;
  const float s = f32_from_bits(amax_bits) / kE4m3Max;
  return f32_bits(s) < kF32MinNormalBits ? f32_from_bits(kF32MinNormalBits) : s;
}
EPMOE_HD uint8_t fp8_encode_fp32(float x, float scale) { return e4m3_from_float(x / scale); }
EPMOE_HD float fp8_decode_fp32(uint8_t q, float scale) { return canonical_nan(e4m3_to_float(q) * scale); }

// Division-free encode for the kernels' inner loops (one fp32 divide per element is a dozen
// instructions and a branch on the device). With r = RN(1 / scale), lo = RN(r * (1 - 2^-20)) and
// hi = RN(r * (1 + 2^-20)), the products x * lo and x * hi bracket z = RN(x / scale) in magnitude:
// |x * lo| <= |x / scale| (1 - 2^-20)(1 + 2^-24)^3 < |z| <= |x * hi| while the values are normal
// (z is within 2^-24 relative of x / scale, and 4 * 2^-24 < 2^-20); below 2^-100 all three round to
// the E4M3 zero of x's sign. scale >= 2^-126 (fp8_scale_fp32), so 1 / scale is normal. The E4M3
// rounding is monotone in magnitude, so when x * lo and x * hi give the same code it is e4m3(z),
// fp8_encode_fp32's code; otherwise (x / scale within 2^-20 of a rounding midpoint, mostly exact
// ties) the caller divides. NaN scale or x: both codes the NaN, as the division's.
struct Fp8Fp32Bounds {
  float lo, hi;
};
EPMOE_HD Fp8Fp32Bounds fp8_fp32_bounds(float scale) {
  const float r = 1.0f / scale;
  return {r * (1.0f - 0x1p-20f), r * (1.0f + 0x1p-20f)};
}
// The code of x when the bounds decide it (returns false: use fp8_encode_fp32).
EPMOE_HD bool fp8_encode_fp32_bounded(float x, Fp8Fp32Bounds b, uint8_t& code) {
  code = e4m3_from_float(x * b.lo);
  return code == e4m3_from_float(x * b.hi);
}

// ---- UE8M0 scales ----

// amax = 1.f * 2^E; 448 * 2^(E-8) = 1.75 * 2^E, so e = E - 8 when 1.f <= 1.75 (fraction bits
// <= 0x600000), else E - 7. Exact integer test, no rounding of amax / 448.
EPMOE_HD uint8_t fp8_scale_ue8m0(uint32_t amax_bits) {
  if (amax_is_nonfinite(amax_bits)) return kE8m0NaN;
  if (amax_bits == 0) return static_cast<uint8_t>(kE8m0Bias);  // 2^0
  if (amax_bits < kF32MinNormalBits) return e8m0_from_exponent(kE8m0MinExp);  // E <= -127
  const int E = static_cast<int>(amax_bits >> 23) - 127;
  const int e = E - kE4m3Emax + ((amax_bits & 0x007fffffu) > 0x00600000u ? 1 : 0);
  return e8m0_from_exponent(e);
}
EPMOE_HD uint8_t fp8_encode_ue8m0(float x, uint8_t scale_code) {
  return e4m3_from_float(x * e8m0_inverse(scale_code));
}
EPMOE_HD float fp8_decode_ue8m0(uint8_t q, uint8_t scale_code) {
  return canonical_nan(e4m3_to_float(q) * e8m0_to_float(scale_code));
}

// ---- scale policies: one block encoder (CPU loops, CUDA kernels) serves every E4M3 format ----
// Scale: the stored scale type; from_amax: the block rule; encode/decode: one element.

struct Fp8Fp32Scale {
  using Scale = float;
  static EPMOE_HD Scale from_amax(uint32_t amax_bits) { return fp8_scale_fp32(amax_bits); }
  static EPMOE_HD uint8_t encode(float x, Scale s) { return fp8_encode_fp32(x, s); }
  static EPMOE_HD float decode(uint8_t q, Scale s) { return fp8_decode_fp32(q, s); }
};

struct Fp8Ue8m0Scale {
  using Scale = uint8_t;
  static EPMOE_HD Scale from_amax(uint32_t amax_bits) { return fp8_scale_ue8m0(amax_bits); }
  static EPMOE_HD uint8_t encode(float x, Scale s) { return fp8_encode_ue8m0(x, s); }
  static EPMOE_HD float decode(uint8_t q, Scale s) { return fp8_decode_ue8m0(q, s); }
};

}  // namespace epmoe
