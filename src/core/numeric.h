// bf16 storage, fp32 arithmetic: conversions shared by both backends.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/hd.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

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

// Round to nearest, ties to even; NaN stays a NaN. On the device this is the hardware conversion
// (one instruction; the same bits for every non-NaN input).
EPMOE_HD bf16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<bf16_t>((bits >> 16) | 0x0040u);
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding) >> 16);
#endif
}

// Two values rounded and packed (lo in the low half, as in memory): one cvt on the device.
EPMOE_HD uint32_t pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
#else
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
#endif
}

EPMOE_HD float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

EPMOE_HD bool is_finite_bf16(bf16_t v) { return (v & 0x7f80u) != 0x7f80u; }

}  // namespace epmoe
