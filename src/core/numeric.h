// bf16 storage, fp32 arithmetic: conversions shared by both backends.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/hd.h"

namespace epmoe {

// bf16 as stored: the upper 16 bits of an IEEE-754 float. Bit-compatible with __nv_bfloat16.
using bf16_t = uint16_t;

EPMOE_HD float bf16_to_float(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
#if defined(__CUDA_ARCH__)
  f = __uint_as_float(bits);
#else
  std::memcpy(&f, &bits, sizeof(f));
#endif
  return f;
}

// Round to nearest, ties to even (what __float2bfloat16_rn does); NaN stays a quiet NaN.
EPMOE_HD bf16_t float_to_bf16(float f) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(f);
#else
  std::memcpy(&bits, &f, sizeof(bits));
#endif
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<bf16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding) >> 16);
}

EPMOE_HD float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

EPMOE_HD bool is_finite_bf16(bf16_t v) { return (v & 0x7f80u) != 0x7f80u; }

}  // namespace epmoe
