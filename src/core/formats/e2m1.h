// FP4 E2M1 (OCP MX v1.0 element format): S.EE.M, exponent bias 1, no infinities and no NaN.
// Magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 1 is the only subnormal).
// Packing: two elements per byte, the element with the lower index in the low nibble (bits 0-3),
// the next in the high nibble (the order NVIDIA's NVFP4 tensors and PyTorch's float4_e2m1fn_x2
// use; PTX cvt.*.e2m1x2 puts its first operand in the HIGH nibble, so pass (second, first)).
#pragma once

#include <cstdint>

#include "core/formats/float_bits.h"
#include "core/hd.h"

namespace epmoe {

constexpr float kE2m1Max = 6.0f;
constexpr uint8_t kE2m1MaxCode = 0x7;       // +6
constexpr uint32_t kE2m1MaxBits = 0x40c00000u;  // fp32 bits of 6

// fp32 -> E2M1 (a 4-bit code in the low nibble), round to nearest even on the grid above,
// saturating: |x| > 6 and +-Inf give +-6. E2M1 has no NaN; a NaN gives +6 (our choice; it is what
// CUDA's __nv_cvt_float_to_fp4 does). Block formats make a NaN visible through the block scale.
EPMOE_HD uint8_t e2m1_from_float(float x) {
  const uint32_t bits = f32_bits(x);
  const uint32_t sign = (bits >> 28) & 0x8u;
  const uint32_t mag = bits & kF32AbsMask;
  if (mag > kF32InfBits) return kE2m1MaxCode;
  if (mag >= kE2m1MaxBits) return static_cast<uint8_t>(sign | kE2m1MaxCode);
  return static_cast<uint8_t>(sign | round_to_minifloat<1, 0>(mag));
}

// E2M1 code (low nibble) -> fp32, exact.
EPMOE_HD float e2m1_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x8u) << 28;
  const uint32_t e = (code >> 1) & 0x3u;
  const uint32_t m = code & 0x1u;
  if (e == 0) return f32_from_bits(sign | (m != 0 ? 0x3f000000u : 0u));  // 0 or 0.5
  return f32_from_bits(sign | ((e + 126u) << 23) | (m << 22));  // 2^(e-1) * (1 + m/2)
}

// Two codes in one byte: `first` (lower element index) in the low nibble.
EPMOE_HD uint8_t pack_e2m1x2(uint8_t first, uint8_t second) {
  return static_cast<uint8_t>((first & 0xfu) | ((second & 0xfu) << 4));
}
EPMOE_HD uint8_t e2m1_first(uint8_t packed) { return static_cast<uint8_t>(packed & 0xfu); }
EPMOE_HD uint8_t e2m1_second(uint8_t packed) { return static_cast<uint8_t>(packed >> 4); }

}  // namespace epmoe
