// E8M0 (OCP MX v1.0 scale format, also the "UE8M0" of DeepSeek-style FP8 scales): an unsigned
// 8-bit biased exponent, value 2^(code - 127) for codes 0..254 (2^-127 .. 2^127), 0xFF = NaN.
// No zero, no sign, no infinity.
#pragma once

#include <cstdint>

#include "core/formats/float_bits.h"
#include "core/hd.h"

namespace epmoe {

constexpr int kE8m0Bias = 127;
constexpr int kE8m0MinExp = -127;
constexpr int kE8m0MaxExp = 127;
constexpr uint8_t kE8m0NaN = 0xff;

// Scale value 2^(code - 127) (2^-127 is an fp32 denormal; exact), NaN for 0xFF.
EPMOE_HD float e8m0_to_float(uint8_t code) {
  return code == kE8m0NaN ? f32_nan() : exp2i(static_cast<int>(code) - kE8m0Bias);
}

// 1 / scale = 2^(127 - code), the multiplier encoders apply (exact, so x * (1 / scale) is
// x / scale); NaN for 0xFF, so every element of a NaN block encodes as NaN.
EPMOE_HD float e8m0_inverse(uint8_t code) {
  return code == kE8m0NaN ? f32_nan() : exp2i(kE8m0Bias - static_cast<int>(code));
}

// Code of 2^e, e clamped to the E8M0 range [-127, 127].
EPMOE_HD uint8_t e8m0_from_exponent(int e) {
  const int c = e < kE8m0MinExp ? kE8m0MinExp : (e > kE8m0MaxExp ? kE8m0MaxExp : e);
  return static_cast<uint8_t>(c + kE8m0Bias);
}

}  // namespace epmoe
