// NVFP4: E2M1 elements, one E4M3 scale per 16 consecutive elements, and one fp32 global scale
// per tensor (per expert for weights; any row group: see codecs.h). The two-level recipe:
//   global      = amax_tensor / (448 * 6)            (fp32; so block scales fit in E4M3)
//   block scale = e4m3((amax_block / 6) / global)    (RNE, saturating at 448)
//   s           = e4m3_to_float(block scale) * global   (fp32; the element scale)
//   elements    = e2m1(x / s), value e2m1_to_float(q) * s
// Our choices (docs/formats.md):
//   - the block scale is at least 2^-9 (the smallest E4M3 subnormal), as Dist-MoE clamps it: a
//     non-zero block never gets scale 0, and a zero block needs no special case (0 / s = 0).
//   - global is floored at 2^-126 (smallest fp32 normal): an all-zero (or denormal) tensor still
//     gets a finite, non-zero global and no 0 / 0.
//   - amax_tensor counts finite elements only; a block holding a NaN or an infinity gets the
//     E4M3 NaN as its scale (it decodes to NaN; its elements are written as e2m1(NaN) = +6),
//     and the other blocks of the tensor are unaffected.
//   - elements can saturate: s rounds amax_block / 6 to 3 mantissa bits, so x / s can exceed 6
//     by up to 1/16 and those elements become +-6.
#pragma once

#include <cstdint>

#include "core/formats/e2m1.h"
#include "core/formats/e4m3.h"
#include "core/formats/float_bits.h"
#include "core/hd.h"

namespace epmoe {

constexpr int kNvfp4Block = 16;
constexpr float kNvfp4GlobalDivisor = 2688.0f;  // 448 * 6: the largest E4M3 x the largest E2M1
constexpr uint32_t kNvfp4MinBlockScaleBits = 0x3b000000u;  // 2^-9, the smallest E4M3 subnormal

// Tensor amax over finite elements: non-finite |x| is left out.
EPMOE_HD uint32_t finite_amax_bits_add(uint32_t amax_bits, float x) {
  const uint32_t m = f32_bits(x) & kF32AbsMask;
  return (m < kF32InfBits && m > amax_bits) ? m : amax_bits;
}

EPMOE_HD float nvfp4_global_scale(uint32_t finite_amax_bits) {
  const float g = f32_from_bits(finite_amax_bits) / kNvfp4GlobalDivisor;
  return f32_bits(g) < kF32MinNormalBits ? f32_from_bits(kF32MinNormalBits) : g;
}

EPMOE_HD uint8_t nvfp4_block_scale(uint32_t block_amax_bits, float global) {
  if (amax_is_nonfinite(block_amax_bits)) return kE4m3NaN;
  const float s = (f32_from_bits(block_amax_bits) / 6.0f) / global;
  // NaN-free here (global >= 2^-126 and amax finite); Inf (amax_block >> amax_tensor, an input
  // mismatch) saturates to 448 below.
  return e4m3_from_float(f32_bits(s) < kNvfp4MinBlockScaleBits ? f32_from_bits(kNvfp4MinBlockScaleBits) : s);
}

// The scale every element of a block is divided by (encode) and multiplied by (decode).
EPMOE_HD float nvfp4_element_scale(uint8_t block_scale, float global) {
  return e4m3_to_float(block_scale) * global;
}
EPMOE_HD uint8_t nvfp4_encode(float x, float element_scale) { return e2m1_from_float(x / element_scale); }
EPMOE_HD float nvfp4_decode(uint8_t q, float element_scale) {
  return canonical_nan(e2m1_to_float(q) * element_scale);
}

}  // namespace epmoe
