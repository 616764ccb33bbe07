// E4M3 encoding with fp32 block scales without a divide per element (core/formats/fp8_block.h:
// fp8_encode_fp32_bounded): two products per element and one paired hardware conversion per two,
// the codes of x * lo and x * hi compared a word at a time; an element whose bounds disagree is
// divided (fp8_encode_fp32's code either way, so the codes stay bitwise the host's). On bf16 data
// about one element in 200 is left to the divide, nearly all exact ties (x / scale a rounding
// midpoint: scales with few significant bits), so the divides run outside the vector path.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "core/formats/fp8_block.h"

namespace epmoe::cuda {

// Codes of (a, b), a in the low byte: one cvt.rn.satfinite.e4m3x2.f32, per element the
// conversion e4m3_from_float uses on the device.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// The codes of x0..x3 under bounds b as a little-endian word (x0 in the low byte), valid where
// `miss` gets no bit: miss |= the bytes whose lower and upper codes differ.
__device__ __forceinline__ uint32_t e4m3x4_bounded(float x0, float x1, float x2, float x3, Fp8Fp32Bounds b,
                                                   uint32_t& miss) {
  const uint32_t lo = e4m3x2(x0 * b.lo, x1 * b.lo) | (e4m3x2(x2 * b.lo, x3 * b.lo) << 16);
  const uint32_t hi = e4m3x2(x0 * b.hi, x1 * b.hi) | (e4m3x2(x2 * b.hi, x3 * b.hi) << 16);
  miss |= lo ^ hi;
  return lo;
}

// fp8_encode_fp32(x, scale): the bounded code, or the division where the bounds disagree.
__device__ __forceinline__ uint8_t fp8_encode_fp32_exact(float x, float scale, Fp8Fp32Bounds b) {
  uint8_t code = 0;
  return fp8_encode_fp32_bounded(x, b, code) ? code : fp8_encode_fp32(x, scale);
}

// Eight elements v[0..7] as two words (element 0 in the low byte of w.x), fp8_encode_fp32's codes
// under bounds b = fp8_fp32_bounds(scale): an element whose bounds disagree (its byte of `miss`
// nonzero) is divided.
__device__ __forceinline__ uint2 fp8_encode8_fp32(const float* v, float scale, Fp8Fp32Bounds b) {
  uint32_t miss[2] = {0u, 0u};
  uint32_t w[2] = {e4m3x4_bounded(v[0], v[1], v[2], v[3], b, miss[0]),
                   e4m3x4_bounded(v[4], v[5], v[6], v[7], b, miss[1])};
  if ((miss[0] | miss[1]) != 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int shift = 8 * (i % 4);
      if ((miss[i / 4] >> shift & 0xffu) != 0) {
        w[i / 4] = (w[i / 4] & ~(0xffu << shift)) | uint32_t{fp8_encode_fp32(v[i], scale)} << shift;
      }
    }
  }
  return make_uint2(w[0], w[1]);
}

}  // namespace epmoe::cuda
