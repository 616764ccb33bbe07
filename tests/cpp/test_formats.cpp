// Format codecs (core/formats): E4M3, E2M1 and E8M0 elements, FP8 block scales (fp32 / UE8M0),
// MXFP8 and NVFP4, checked against values worked out by hand from the specs (literal bit patterns;
// the arithmetic is in the comments), and argument errors. Properties on random data:
// test_formats_property.cpp.
#include <gtest/gtest.h>

#if __has_include(<cuda_fp8.h>)
#include <cuda_fp8.h>
#endif

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "epmoe/error.h"
#include "tolerances.h"

namespace epmoe {
namespace {

float fbits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t bitsf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Same value including the sign of zero; any NaN matches any NaN.
void expect_same_value(float want, float got, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what << ": got " << got;
  } else {
    EXPECT_EQ(bitsf(want), bitsf(got)) << what << ": want " << want << ", got " << got;
  }
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%02X", v);
  return buf;
}

// ================================ E4M3 ================================

// Spec table (OCP FP8 E4M3FN): code S.EEEE.MMM; E = 0: M * 2^-9; E >= 1: (8 + M) * 2^(E - 10);
// S.1111.111 = NaN. Checked for all 256 codes against that formula (std::ldexp, not the codec)
// and at hand-written points.
TEST(FormatsE4m3, EveryCodeDecodesToItsSpecValue) {
  for (unsigned c = 0; c < 256; ++c) {
    const unsigned e = (c >> 3) & 0xf, m = c & 7;
    const double sign = (c & 0x80) != 0 ? -1.0 : 1.0;
    const float got = e4m3_to_float(static_cast<uint8_t>(c));
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(got)) << hex(c);
      continue;
    }
    const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9)
                              : std::ldexp(static_cast<double>(8 + m), static_cast<int>(e) - 10);
    expect_same_value(static_cast<float>(sign * mag), got, "E4M3 code " + hex(c));
  }
  // Hand-written points.
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  expect_same_value(-0.0f, e4m3_to_float(0x80), "0x80 = -0");
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);   // 2^-9, smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 0.013671875f);   // 7 * 2^-9, largest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), 0.015625f);      // 2^-6, smallest normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);           // E = 7: 2^0
  EXPECT_EQ(e4m3_to_float(0x3C), 1.5f);           // 2^0 * (1 + 4/8)
  EXPECT_EQ(e4m3_to_float(0x45), 3.25f);          // E = 8, M = 5: 2 * 1.625
  EXPECT_EQ(e4m3_to_float(0x77), 240.0f);         // E = 14, M = 7: 128 * 1.875
  EXPECT_EQ(e4m3_to_float(0x78), 256.0f);         // E = 15, M = 0
  EXPECT_EQ(e4m3_to_float(0x7D), 416.0f);         // 256 * 1.625
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);         // 256 * 1.75, largest finite
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
  // Every finite code encodes back to itself (the grid is a fixed point of RNE).
  for (unsigned c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(static_cast<uint8_t>(c))), c) << hex(c);
  }
}

struct EncodeCase {
  float x;
  unsigned code;
  const char* why;
};

TEST(FormatsE4m3, EncodeRoundsToNearestEven) {
  const EncodeCase cases[] = {
      {1.0625f, 0x38, "1 + 1/16: tie of 1.0 (M=0) and 1.125 (M=1) -> even M=0"},
      {fbits(0x3F880001u), 0x39, "one fp32 ulp above that tie -> 1.125"},
      {1.1875f, 0x3A, "1.125 + 1/16: tie of M=1 and 1.25 (M=2) -> M=2"},
      {fbits(0x3F97FFFFu), 0x39, "one fp32 ulp below that tie -> 1.125"},
      {-1.0625f, 0xB8, "negative tie -> -1.0"},
      {1.9375f, 0x40, "tie of 1.875 (0x3F, M=7) and 2.0 (M=0): carries into the exponent"},
      {3.14159f, 0x45, "3.0 (M=4) vs 3.25 (M=5): |pi-3.25| = 0.108 < 0.142 -> 3.25"},
      {248.0f, 0x78, "tie of 240 (0x77, M=7) and 256 (0x78, M=0) -> 256"},
      {400.0f, 0x7C, "tie of 384 (M=4) and 416 (M=5) -> 384"},
      {432.0f, 0x7E, "tie of 416 (M=5) and 448 (M=6) -> 448"},
  };
  for (const auto& c : cases) EXPECT_EQ(e4m3_from_float(c.x), c.code) << c.why;
}

TEST(FormatsE4m3, EncodeSubnormals) {
  const EncodeCase cases[] = {
      {0.001953125f, 0x01, "2^-9, smallest subnormal"},
      {0.0009765625f, 0x00, "2^-10 = half of 2^-9: tie of 0 and M=1 -> 0"},
      {fbits(0x3A800001u), 0x01, "one fp32 ulp above 2^-10 -> 2^-9"},
      {0.0029296875f, 0x02, "3 * 2^-10 = 1.5 steps: tie of M=1 and M=2 -> 2"},
      {0.0048828125f, 0x02, "5 * 2^-10 = 2.5 steps: tie of 2 and 3 -> 2"},
      {0.0068359375f, 0x04, "7 * 2^-10 = 3.5 steps: tie of 3 and 4 -> 4"},
      {0.0146484375f, 0x08, "15 * 2^-10 = 7.5 steps: tie of 0x07 and 2^-6 (0x08, M=0) -> 0x08"},
      {0.015625f, 0x08, "2^-6, smallest normal"},
      {0.017578125f, 0x09, "2^-6 * 1.125"},
      {0.00048828125f, 0x00, "2^-11, a quarter step"},
      {1e-30f, 0x00, "far below"},
      {fbits(0x00000001u), 0x00, "fp32 denormal 2^-149"},
      {fbits(0x80000001u), 0x80, "-2^-149 -> -0 (the sign is kept)"},
      {-0.001953125f, 0x81, "-2^-9"},
  };
  for (const auto& c : cases) EXPECT_EQ(e4m3_from_float(c.x), c.code) << c.why;
}

TEST(FormatsE4m3, EncodeSaturatesAndKeepsNaN) {
  const EncodeCase cases[] = {
      {448.0f, 0x7E, "largest finite"},
      {449.0f, 0x7E, "above 448 saturates (RNE alone would also give 448 below 464)"},
      {464.0f, 0x7E, "the 448/480 midpoint: 480 does not exist, saturate"},
      {1.0e6f, 0x7E, "far above"},
      {std::numeric_limits<float>::max(), 0x7E, "FLT_MAX"},
      {-500.0f, 0xFE, "negative saturates to -448"},
      {kInf, 0x7E, "+Inf -> +448 (satfinite; E4M3 has no infinity)"},
      {-kInf, 0xFE, "-Inf -> -448"},
      {kNaN, 0x7F, "NaN -> canonical NaN"},
      {-kNaN, 0x7F, "-NaN -> canonical NaN"},
      {0.0f, 0x00, "+0"},
      {-0.0f, 0x80, "-0"},
  };
  for (const auto& c : cases) EXPECT_EQ(e4m3_from_float(c.x), c.code) << c.why;
}

// The encoder equals CUDA's conversion (cuda_fp8.h's __nv_cvt_float_to_fp8 with __NV_SATFINITE,
// the host emulation of cvt.rn.satfinite.e4m3x2.f32) on a stride-251 sample of all 2^32 fp32 bit
// patterns and densely around the E4M3 range (|x| < 2^10). The whole 2^32 agreed when checked
// once (2026-11-30): a device kernel may use the hardware conversion after the division by the
// scale and keep its codes bitwise the host's.
#if __has_include(<cuda_fp8.h>)
TEST(FormatsE4m3, EncodeEqualsCudaSatfiniteConversion) {
  auto cuda_code = [](float x) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
  };
  int64_t checked = 0, bad = 0;
  auto check = [&](uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, 4);
    ++checked;
    if (e4m3_from_float(x) != cuda_code(x) && bad++ < 5) {
      ADD_FAILURE() << "x bits 0x" << std::hex << bits << ": ours " << int{e4m3_from_float(x)}
                    << ", cuda " << int{cuda_code(x)};
    }
  };
  for (uint64_t b = 0; b <= 0xffffffffull; b += 251) check(static_cast<uint32_t>(b));
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t m = 0; m < 0x44800000u; m += 7) check(sign | m);  // |x| < 1024, every 7th
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
}
#endif

// ================================ E2M1 ================================

TEST(FormatsE2m1, EveryCodeDecodesToItsSpecValue) {
  // OCP MX v1.0 table: S.EE.M, bias 1; 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6.
  const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (unsigned c = 0; c < 16; ++c) {
    expect_same_value(want[c], e2m1_to_float(static_cast<uint8_t>(c)), "E2M1 code " + hex(c));
    EXPECT_EQ(e2m1_from_float(want[c]), c) << hex(c);
  }
}

TEST(FormatsE2m1, EncodeRoundsToNearestEvenAndSaturates) {
  const EncodeCase cases[] = {
      {0.25f, 0x0, "tie of 0 (M=0) and 0.5 (M=1) -> 0"},
      {0.26f, 0x1, "above the tie -> 0.5"},
      {0.75f, 0x2, "tie of 0.5 (code 1, M=1) and 1.0 (code 2, M=0) -> 1.0"},
      {1.25f, 0x2, "tie of 1.0 (M=0) and 1.5 (M=1) -> 1.0"},
      {1.75f, 0x4, "tie of 1.5 (M=1) and 2.0 (code 4, M=0) -> 2.0"},
      {2.5f, 0x4, "tie of 2 (M=0) and 3 (M=1) -> 2"},
      {3.5f, 0x6, "tie of 3 (M=1) and 4 (code 6, M=0) -> 4"},
      {5.0f, 0x6, "tie of 4 (M=0) and 6 (M=1) -> 4"},
      {5.01f, 0x7, "above the tie -> 6"},
      {7.0f, 0x7, "above 6 saturates"},
      {100.0f, 0x7, "far above"},
      {kInf, 0x7, "+Inf -> +6"},
      {-kInf, 0xF, "-Inf -> -6"},
      {kNaN, 0x7, "NaN -> +6 (no NaN in E2M1; CUDA's choice too)"},
      {-0.75f, 0xA, "-1.0"},
      {-5.0f, 0xE, "-4"},
      {0.1f, 0x0, "below 0.25, half of the smallest step -> 0"},
      {-0.1f, 0x8, "-0 keeps the sign"},
      {-0.0f, 0x8, "-0"},
  };
  for (const auto& c : cases) EXPECT_EQ(e2m1_from_float(c.x), c.code) << c.why;
}

TEST(FormatsE2m1, PackingPutsTheFirstElementInTheLowNibble) {
  EXPECT_EQ(pack_e2m1x2(0x1, 0xF), 0xF1);  // first 0.5, second -6
  EXPECT_EQ(e2m1_first(0xF1), 0x1);
  EXPECT_EQ(e2m1_second(0xF1), 0xF);
}

// ============================ NVFP4 GEMM code order ============================
// core/formats/nvfp4_gemm_order.h: the prepared weights' permutation of each 4-byte code word and
// the GEMM's decode of it (the kernel runs the same functions).

// Every bit of a codec word lands on exactly one bit of the prepared word: the four pair
// placements tile the 32 bits.
TEST(Nvfp4GemmOrder, PlacementsTileTheWord) {
  uint32_t seen = 0;
  for (int b = 0; b < 32; ++b) {
    const uint32_t w = nvfp4_gemm_word(uint32_t{1} << b);
    ASSERT_EQ(std::popcount(w), 1) << "codec bit " << b;
    ASSERT_EQ(seen & w, 0u) << "codec bit " << b << " lands on a taken bit";
    seen |= w;
  }
  EXPECT_EQ(seen, 0xffffffffu);
}

TEST(Nvfp4GemmOrder, RoundTripsEveryCodeInEveryPosition) {
  std::mt19937 rng(7);
  std::vector<uint32_t> words;
  for (uint32_t c = 0; c < 16; ++c) words.push_back(c * 0x11111111u);
  for (int j = 0; j < 8; ++j) {
    for (uint32_t c = 0; c < 16; ++c) words.push_back(c << (4 * j));
  }
  for (int i = 0; i < 20000; ++i) words.push_back(static_cast<uint32_t>(rng()));
  for (uint32_t w : words) ASSERT_EQ(nvfp4_codec_word(nvfp4_gemm_word(w)), w) << hex(w);
}

// The decode of a prepared word: pair i holds elements 2i, 2i + 1 as the bf16 bits of
// e2m1 * 2^-126 (0.5 as bf16's subnormal 2^-127), the sign of zero included.
TEST(Nvfp4GemmOrder, DecodeGivesEveryCodesBf16BitsTimesTwoToTheMinus126) {
  std::mt19937 rng(8);
  std::vector<uint32_t> words;
  for (uint32_t c = 0; c < 16; ++c) words.push_back(c * 0x11111111u);
  for (int i = 0; i < 20000; ++i) words.push_back(static_cast<uint32_t>(rng()));
  for (uint32_t w : words) {
    uint32_t pair[4];
    nvfp4_decode_word(nvfp4_gemm_word(w), pair);
    for (int j = 0; j < 8; ++j) {
      const uint8_t code = static_cast<uint8_t>((w >> (4 * j)) & 0xfu);
      const uint32_t bf16 = (pair[j / 2] >> (16 * (j % 2))) & 0xffffu;
      const float got = std::ldexp(fbits(bf16 << 16), -kNvfp4DecodeScaleLog2);
      ASSERT_EQ(bitsf(got), bitsf(e2m1_to_float(code))) << "word " << hex(w) << " element " << j;
    }
  }
  EXPECT_EQ(nvfp4_place_pair(0x1, 0x9), 0x80400040u);  // 0.5 and -0.5: subnormal bf16 0x0040
  EXPECT_EQ(nvfp4_place_pair(0x7, 0x8), 0x800001c0u);  // 6 = 1.5 * 2^2 (exponent 3), and -0
}

// Rows of P bytes: whole words converted, a partial last word (P % 4 bytes) left as it is.
TEST(Nvfp4GemmOrder, BufferConversionKeepsPartialWords) {
  std::mt19937 rng(9);
  const int64_t rows = 3, P = 11;  // two whole words and 3 bytes a row
  std::vector<uint8_t> q(static_cast<size_t>(rows * P));
  for (uint8_t& b : q) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> g = q;
  nvfp4_codes_to_gemm_order(g.data(), rows, P);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t w = 0; w < 2; ++w) {
      uint32_t in = 0, out = 0;
      std::memcpy(&in, q.data() + r * P + 4 * w, 4);
      std::memcpy(&out, g.data() + r * P + 4 * w, 4);
      EXPECT_EQ(out, nvfp4_gemm_word(in)) << "row " << r << " word " << w;
    }
    for (int64_t b = 8; b < P; ++b) {
      EXPECT_EQ(g[static_cast<size_t>(r * P + b)], q[static_cast<size_t>(r * P + b)]) << "row " << r;
    }
  }
  nvfp4_codes_to_codec_order(g.data(), rows, P);
  EXPECT_EQ(g, q);
}

// ================================ E8M0 ================================

TEST(FormatsE8m0, Values) {
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(120), 0.0078125f);              // 2^-7
  EXPECT_EQ(bitsf(e8m0_to_float(0)), 0x00400000u);       // 2^-127: fp32 denormal
  EXPECT_EQ(bitsf(e8m0_to_float(254)), 0x7F000000u);     // 2^127
  EXPECT_TRUE(std::isnan(e8m0_to_float(0xFF)));
  EXPECT_EQ(bitsf(e8m0_inverse(0)), 0x7F000000u);        // 1 / 2^-127 = 2^127
  EXPECT_EQ(bitsf(e8m0_inverse(254)), 0x00400000u);
  EXPECT_TRUE(std::isnan(e8m0_inverse(0xFF)));
}

// ============================ FP8 block scales ============================

TEST(FormatsFp8Block, ScaleRules) {
  // fp32: amax / 448, zero -> 1, non-finite -> NaN, floored at 2^-126.
  EXPECT_EQ(fp8_scale_fp32(bitsf(448.0f)), 1.0f);
  EXPECT_EQ(fp8_scale_fp32(bitsf(3.5f)), 0.0078125f);          // 3.5 / 448 = 2^-7
  EXPECT_EQ(bitsf(fp8_scale_fp32(bitsf(4.0f))), 0x3C124925u);  // 1/112: see the block test
  EXPECT_EQ(fp8_scale_fp32(0), 1.0f);
  EXPECT_TRUE(std::isnan(fp8_scale_fp32(bitsf(kInf))));
  EXPECT_TRUE(std::isnan(fp8_scale_fp32(bitsf(kNaN))));
  EXPECT_EQ(bitsf(fp8_scale_fp32(bitsf(448.0f * 0x1p-126f))), 0x00800000u);  // exactly 2^-126
  EXPECT_EQ(bitsf(fp8_scale_fp32(0x00800000u)), 0x00800000u);  // 2^-126 / 448 -> floor 2^-126
  // UE8M0: smallest 2^e with 448 * 2^e >= amax; amax = 1.f * 2^E -> e = E - 8 if 1.f <= 1.75.
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(448.0f)), 127);        // 1.75 * 2^8: e = 0
  EXPECT_EQ(fp8_scale_ue8m0(0x43E00001u), 128);          // just above 448: e = 1
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(1.0f)), 119);          // 448 * 2^-8 = 1.75 >= 1 > 0.875
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(1.75f)), 119);         // 1.75 <= 1.75
  EXPECT_EQ(fp8_scale_ue8m0(0x3FE00001u), 120);          // 1.75 + ulp > 1.75: e = -7
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(3.5f)), 120);          // 1.75 * 2^1: e = -7
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(4.0f)), 121);          // 2^2: e = -6 (448/64 = 7 >= 4 > 3.5)
  EXPECT_EQ(fp8_scale_ue8m0(0x7F7FFFFFu), 247);          // FLT_MAX: E = 127, 1.f > 1.75: e = 120
  EXPECT_EQ(fp8_scale_ue8m0(0x00800000u), 0);            // 2^-126: e = -134 -> clamp -127
  EXPECT_EQ(fp8_scale_ue8m0(0x00000001u), 0);            // denormal amax -> clamp
  EXPECT_EQ(fp8_scale_ue8m0(0), 127);                    // zero block: scale 1
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(kInf)), 0xFF);
  EXPECT_EQ(fp8_scale_ue8m0(bitsf(kNaN)), 0xFF);
}

// The kernels' division-free encode (fp8_encode_fp32_bounded): whenever its two bounds agree the
// code is fp8_encode_fp32's, on every bf16 x for scales from every 61st positive bf16 amax and
// random fp32 amaxes, on random fp32 x, and on x placed a few ulps around each E4M3 rounding
// midpoint times the scale (where the bounds must disagree and the caller divides). Undecided
// elements stay rare on ordinary data.
TEST(FormatsFp8Block, BoundedEncodeEqualsDivision) {
  std::vector<float> scales = {1.0f, 0x1p-126f, fp8_scale_fp32(0x7F7FFFFFu), kNaN};
  for (uint32_t amax = 0x0001u; amax < 0x7F80u; amax += 61) scales.push_back(fp8_scale_fp32(amax << 16));
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits(0, 0xFFFFFFFFu);
  for (int i = 0; i < 300; ++i) scales.push_back(fp8_scale_fp32(any_bits(rng) % 0x7F800000u));
  int64_t checked = 0, undecided = 0, bad = 0;
  auto check = [&](float x, float scale) {
    uint8_t code = 0;
    ++checked;
    if (!fp8_encode_fp32_bounded(x, fp8_fp32_bounds(scale), code)) {
      ++undecided;
    } else if (code != fp8_encode_fp32(x, scale) && bad++ < 5) {
      ADD_FAILURE() << "x bits 0x" << std::hex << bitsf(x) << " scale bits 0x" << bitsf(scale) << ": bounded "
                    << int{code} << ", divided " << int{fp8_encode_fp32(x, scale)};
    }
  };
  for (const float scale : scales) {
    for (uint32_t b = 0; b <= 0xFFFFu; ++b) check(fbits(b << 16), scale);
  }
  const int64_t bulk_checked = checked, bulk_undecided = undecided;
  for (int i = 0; i < 2000000; ++i) check(fbits(any_bits(rng)), scales[any_bits(rng) % scales.size()]);
  for (const float scale : scales) {
    for (uint32_t code = 0; code < 0x7E; ++code) {  // midpoint between code and code + 1
      const float mid = 0.5f * (e4m3_to_float(static_cast<uint8_t>(code)) +
                                e4m3_to_float(static_cast<uint8_t>(code + 1)));
      const float x = mid * scale;
      for (int d = -6; d <= 6; ++d) {
        if (std::isfinite(x) && x != 0.0f) {
          check(fbits(bitsf(x) + static_cast<uint32_t>(d)), scale);
          check(-fbits(bitsf(x) + static_cast<uint32_t>(d)), scale);
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
  EXPECT_LT(bulk_undecided * 1000, bulk_checked) << bulk_undecided << " undecided of " << bulk_checked;
  EXPECT_GT(undecided, bulk_undecided);  // the midpoint probes reach the fallback
}

// One 1x128 row block: amax 4.0 (a power of two), six hand-chosen values, the rest zeros.
//   fp32 scale s = 4 / 448 = 1/112 rounded: 2^23 / 7 = 1198372.57 -> fraction 1198373 = 0x124925,
//   exponent -7 -> bits 0x3C124925, s = 9586981 * 2^-30 = (1/112)(1 + 4.5e-8).
//   x / s:  4 -> 447.99998 -> 448 (0x7E);  -1 -> -111.999995 -> -112 = -1.75 * 2^6 (0xEE);
//           0.5 -> 56 = 1.75 * 2^5 (0x66);  3 -> 335.99998, just below the 320/352 midpoint
//           -> 320 (0x7A);  2^-10 -> 0.109375 = 1.75 * 2^-4 (0x1E);  1e-5 -> 0.00112 = 0.57 *
//           2^-9 -> 2^-9 (0x01);  -2^-12 -> -0.02734375 = -1.75 * 2^-6 (0x8E).
//   decode: 448 * s = (2^32 + 192) * 2^-30 = 4 + 1.8e-7 -> 4.0f (half ulp 2.4e-7);
//           -112 * s = -(2^30 + 48) * 2^-30 -> -1.0f (48 < 64 = half ulp in 2^-30 units).
//   UE8M0: e = 2 - 8 = -6 (code 121), x * 64: 4 -> 256 (0x78); -1 -> -64 (0xE8); 0.5 -> 32
//           (0x60); 3 -> 192 = 1.5 * 2^7 (0x74); 2^-10 -> 2^-4 (0x18); 1e-5 -> 6.4e-4 = 0.33 *
//           2^-9 -> 0 (0x00); -2^-12 -> -2^-6 (0x88). Decode is exact (power-of-two scale).
const std::vector<float> kFp8Row = {4.0f, -1.0f, 0.5f, 3.0f, 0x1p-10f, 1e-5f, -0x1p-12f};

std::vector<float> padded_row(const std::vector<float>& head, size_t length) {
  std::vector<float> row(length, 0.0f);
  for (size_t i = 0; i < head.size(); ++i) row[i] = head[i];
  return row;
}

TEST(FormatsFp8Block, HandWorkedRowBlockFp32Scale) {
  const std::vector<float> x = padded_row(kFp8Row, 128);
  std::vector<uint8_t> q(128);
  float scale = 0.0f;
  fp8_quantize_rows(x.data(), 1, 128, q.data(), &scale);
  EXPECT_EQ(bitsf(scale), 0x3C124925u);
  const unsigned want[] = {0x7E, 0xEE, 0x66, 0x7A, 0x1E, 0x01, 0x8E};
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(q[i], want[i]) << "element " << i;
  for (size_t i = 7; i < 128; ++i) EXPECT_EQ(q[i], 0x00) << "element " << i;
  std::vector<float> y(128);
  fp8_dequantize_rows(q.data(), &scale, 1, 128, y.data());
  EXPECT_EQ(y[0], 4.0f);
  EXPECT_EQ(y[1], -1.0f);
  for (size_t i = 7; i < 128; ++i) EXPECT_EQ(bitsf(y[i]), 0u) << "zeros decode to +0";
}

TEST(FormatsFp8Block, HandWorkedRowBlockUe8m0Scale) {
  const std::vector<float> x = padded_row(kFp8Row, 128);
  std::vector<uint8_t> q(128);
  uint8_t scale = 0;
  fp8_quantize_rows(x.data(), 1, 128, q.data(), &scale);
  EXPECT_EQ(scale, 121);  // 2^-6
  const unsigned want[] = {0x78, 0xE8, 0x60, 0x74, 0x18, 0x00, 0x88};
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(q[i], want[i]) << "element " << i;
  std::vector<float> y(128);
  fp8_dequantize_rows(q.data(), &scale, 1, 128, y.data());
  const float want_y[] = {4.0f, -1.0f, 0.5f, 3.0f, 0x1p-10f, 0.0f, -0x1p-12f};
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(y[i], want_y[i]) << "element " << i;
}

// Row of L = 300: blocks [0,128) [128,256) [256,300) (partial). Block 0 all zeros (with a -0),
// block 1 holds a NaN, block 2 an Inf: scales 1 / NaN / NaN; NaN blocks encode all-NaN.
TEST(FormatsFp8Block, ZeroAndNonFiniteBlocks) {
  std::vector<float> x(300, 0.25f);
  for (int i = 0; i < 128; ++i) x[static_cast<size_t>(i)] = 0.0f;
  x[5] = -0.0f;
  x[200] = kNaN;
  x[299] = -kInf;
  for (const bool ue8m0 : {false, true}) {
    std::vector<uint8_t> q(300);
    std::vector<float> y(300);
    std::vector<float> s32(3);
    std::vector<uint8_t> s8(3);
    if (ue8m0) {
      fp8_quantize_rows(x.data(), 1, 300, q.data(), s8.data());
      EXPECT_EQ(s8[0], 127);
      EXPECT_EQ(s8[1], 0xFF);
      EXPECT_EQ(s8[2], 0xFF);
      fp8_dequantize_rows(q.data(), s8.data(), 1, 300, y.data());
    } else {
      fp8_quantize_rows(x.data(), 1, 300, q.data(), s32.data());
      EXPECT_EQ(s32[0], 1.0f);
      EXPECT_TRUE(std::isnan(s32[1]));
      EXPECT_TRUE(std::isnan(s32[2]));
      fp8_dequantize_rows(q.data(), s32.data(), 1, 300, y.data());
    }
    for (int i = 0; i < 128; ++i) {
      EXPECT_EQ(q[static_cast<size_t>(i)], i == 5 ? 0x80 : 0x00) << i;
      expect_same_value(i == 5 ? -0.0f : 0.0f, y[static_cast<size_t>(i)], "zero block element");
    }
    for (int i = 128; i < 300; ++i) {
      EXPECT_EQ(q[static_cast<size_t>(i)], 0x7F) << i;
      EXPECT_EQ(bitsf(y[static_cast<size_t>(i)]), 0x7FC00000u) << i << ": decoders return the canonical NaN";
    }
  }
}

// 128x128 weight blocks of one [130, 129] matrix: blocks (0,0) 128x128, (0,1) 128x1, (1,0) 2x128,
// (1,1) 1 element. Each block gets its own amax = a power of two, placed at its last element:
// scales 2^k / 448 (fp32) and 2^(k - 8) (UE8M0).
TEST(FormatsFp8Block, WeightBlocksAndPartialEdges) {
  const int64_t N = 130, L = 129;
  std::vector<float> w(static_cast<size_t>(N * L), 0.0f);
  auto at = [&](int64_t n, int64_t l) -> float& { return w[static_cast<size_t>(n * L + l)]; };
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t l = 0; l < L; ++l) at(n, l) = 0.125f * static_cast<float>((n + l) % 7) / 7.0f;
  }
  at(127, 127) = 1.0f;   // block (0,0): amax 1 -> UE8M0 e = -8 (119)
  at(100, 128) = -8.0f;  // block (0,1): amax 8 = 2^3 -> e = -5 (122)
  at(129, 3) = 0.5f;     // block (1,0): amax 0.5 -> e = -9 (118)
  at(129, 128) = 64.0f;  // block (1,1): amax 64 -> e = -2 (125)
  std::vector<uint8_t> q(w.size());
  std::vector<uint8_t> s8(4);
  fp8_quantize_weights(w.data(), 1, N, L, q.data(), s8.data());
  EXPECT_EQ(s8[0], 119);
  EXPECT_EQ(s8[1], 122);
  EXPECT_EQ(s8[2], 118);
  EXPECT_EQ(s8[3], 125);
  // Each amax element lands on 2^8 = 256 (0x78, negative 0xF8).
  EXPECT_EQ(q[static_cast<size_t>(127 * L + 127)], 0x78);
  EXPECT_EQ(q[static_cast<size_t>(100 * L + 128)], 0xF8);
  EXPECT_EQ(q[static_cast<size_t>(129 * L + 3)], 0x78);
  EXPECT_EQ(q[static_cast<size_t>(129 * L + 128)], 0x78);
  std::vector<float> s32(4);
  fp8_quantize_weights(w.data(), 1, N, L, q.data(), s32.data());
  EXPECT_EQ(s32[0], 1.0f / 448.0f);
  EXPECT_EQ(s32[1], 8.0f / 448.0f);   // = 1/56
  EXPECT_EQ(s32[2], 0.5f / 448.0f);
  EXPECT_EQ(s32[3], 64.0f / 448.0f);  // = 1/7
  // Two groups: the second matrix is the first times 2, so every scale doubles (exactly: a
  // power-of-two factor commutes with the fp32 division) and the codes repeat.
  std::vector<float> w2(w);
  for (float v : w) w2.push_back(2.0f * v);
  std::vector<uint8_t> q2(w2.size());
  std::vector<float> s2(8);
  fp8_quantize_weights(w2.data(), 2, N, L, q2.data(), s2.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s2[static_cast<size_t>(i)], s32[static_cast<size_t>(i)]);
    EXPECT_EQ(s2[static_cast<size_t>(4 + i)], 2.0f * s32[static_cast<size_t>(i)]);
  }
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(q2[i], q[i]) << i;
    ASSERT_EQ(q2[w.size() + i], q[i]) << i;
  }
}

// ================================ MXFP8 ================================

TEST(FormatsMxfp8, ScaleSelection) {
  // shared_exp = floor(log2(amax)) - 8, E8M0 code = shared_exp + 127.
  EXPECT_EQ(mx_scale_e8m0(bitsf(1.0f)), 119);     // 0 - 8
  EXPECT_EQ(mx_scale_e8m0(bitsf(1.99f)), 119);    // floor(log2 1.99) = 0
  EXPECT_EQ(mx_scale_e8m0(bitsf(448.0f)), 127);   // 8 - 8
  EXPECT_EQ(mx_scale_e8m0(bitsf(500.0f)), 127);   // floor(log2 500) = 8
  EXPECT_EQ(mx_scale_e8m0(bitsf(512.0f)), 128);   // 9 - 8
  EXPECT_EQ(mx_scale_e8m0(bitsf(0.1f)), 115);     // 0.1 = 1.6 * 2^-4: -4 - 8 = -12
  EXPECT_EQ(mx_scale_e8m0(0x7F7FFFFFu), 246);     // FLT_MAX: 127 - 8 = 119
  EXPECT_EQ(mx_scale_e8m0(bitsf(0x1p-119f)), 0);  // -119 - 8 = -127: the minimum, no clamp
  EXPECT_EQ(mx_scale_e8m0(bitsf(0x1p-120f)), 0);  // -128 -> clamped to -127
  EXPECT_EQ(mx_scale_e8m0(0x00000001u), 0);       // denormal amax -> clamped
  EXPECT_EQ(mx_scale_e8m0(0), 0);                 // zero block: log2(0) = -inf -> clamped
  EXPECT_EQ(mx_scale_e8m0(bitsf(kInf)), 0xFF);
  EXPECT_EQ(mx_scale_e8m0(bitsf(kNaN)), 0xFF);
}

// Row of L = 200 = 6 full blocks of 32 and a partial block of 8:
//   b0 amax 1.0 (power of two): X = 2^-8, x * 256: 1 -> 256 (0x78), 0.75 -> 192 (0x74),
//      -0.3 -> -76.8: 72 (M=1) / 80 (M=2), nearer 80 -> 0xEA, 2^-12 -> 2^-4 (0x18).
//   b1 amax 500: X = 2^0; 500 saturates to 448 (0x7E, the spec's clamp), 300 -> 288 (M=1, 300
//      is nearer 288 than 320) 0x79, -2.75 -> -2.75 = -1.375 * 2 (0xC3).
//   b2 amax 2^-130 (an fp32 denormal): X = 2^-127 (clamped), 2^-130 * 2^127 = 2^-3 (0x20).
//   b3 all zeros with one -0: X = 2^-127 (0x00), elements 0x00 / 0x80, decode +-0.
//   b4 holds a NaN, b5 an Inf: X = NaN (0xFF), all elements 0x7F.
//   b6 (partial, 8 elements) amax 512: X = 2^1, 512 -> 256 (0x78), 3 -> 1.5 (0x3C).
TEST(FormatsMxfp8, HandWorkedBlocks) {
  const int64_t L = 200;
  std::vector<float> x(L, 0.0f);
  x[0] = 1.0f, x[1] = 0.75f, x[2] = -0.3f, x[3] = 0x1p-12f;
  x[32] = 500.0f, x[33] = 300.0f, x[34] = -2.75f;
  x[64] = 0x1p-130f;
  x[100] = -0.0f;
  x[128] = 1.0f, x[129] = kNaN;
  x[160] = kInf, x[161] = 2.0f;
  x[192] = 512.0f, x[193] = 3.0f;
  std::vector<uint8_t> q(L), s(7);
  mxfp8_quantize_rows(x.data(), 1, L, q.data(), s.data());
  const unsigned want_s[] = {119, 127, 0, 0, 0xFF, 0xFF, 128};
  for (size_t b = 0; b < 7; ++b) EXPECT_EQ(s[b], want_s[b]) << "block " << b;
  const std::pair<int, unsigned> want_q[] = {{0, 0x78},  {1, 0x74},  {2, 0xEA},  {3, 0x18},  {4, 0x00},
                                             {32, 0x7E}, {33, 0x79}, {34, 0xC3}, {64, 0x20}, {65, 0x00},
                                             {100, 0x80}, {192, 0x78}, {193, 0x3C}, {199, 0x00}};
  for (const auto& [i, code] : want_q) EXPECT_EQ(q[static_cast<size_t>(i)], code) << "element " << i;
  for (int i = 128; i < 192; ++i) EXPECT_EQ(q[static_cast<size_t>(i)], 0x7F) << "element " << i;
  std::vector<float> y(L);
  mxfp8_dequantize_rows(q.data(), s.data(), 1, L, y.data());
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[2], -0.3125f);     // -80 * 2^-8
  EXPECT_EQ(y[32], 448.0f);      // 500 clamped
  EXPECT_EQ(y[33], 288.0f);
  EXPECT_EQ(y[64], 0x1p-130f);   // 0.125 * 2^-127: exact fp32 denormal
  expect_same_value(-0.0f, y[100], "-0 in the zero block");
  EXPECT_EQ(bitsf(y[96]), 0u);
  for (int i = 128; i < 192; ++i) EXPECT_EQ(bitsf(y[static_cast<size_t>(i)]), 0x7FC00000u) << i;
  EXPECT_EQ(y[192], 512.0f);
  EXPECT_EQ(y[193], 3.0f);
}

// ================================ NVFP4 ================================

TEST(FormatsNvfp4, ScaleRules) {
  EXPECT_EQ(nvfp4_global_scale(bitsf(2688.0f)), 1.0f);  // 2688 = 448 * 6
  EXPECT_EQ(nvfp4_global_scale(bitsf(5376.0f)), 2.0f);
  EXPECT_EQ(bitsf(nvfp4_global_scale(0)), 0x00800000u);  // zero tensor: floor 2^-126
  EXPECT_EQ(nvfp4_block_scale(bitsf(6.0f), 1.0f), 0x38);     // 6 / 6 / 1 = 1.0
  EXPECT_EQ(nvfp4_block_scale(bitsf(2688.0f), 1.0f), 0x7E);  // 448
  EXPECT_EQ(nvfp4_block_scale(bitsf(7.5f), 1.0f), 0x3A);     // 1.25
  EXPECT_EQ(nvfp4_block_scale(bitsf(6.875f), 1.0f), 0x39);   // 1.1458 -> 1.125 (not 1.25)
  EXPECT_EQ(nvfp4_block_scale(0, 1.0f), 0x01);               // zero block: clamp to 2^-9
  EXPECT_EQ(nvfp4_block_scale(bitsf(0.001f), 1.0f), 0x01);   // 1.7e-4 < 2^-9 -> 2^-9
  EXPECT_EQ(nvfp4_block_scale(bitsf(1.0e4f), 1.0f), 0x7E);   // 1667 saturates at 448
  EXPECT_EQ(nvfp4_block_scale(bitsf(kNaN), 1.0f), 0x7F);
  EXPECT_EQ(nvfp4_block_scale(bitsf(kInf), 1.0f), 0x7F);
}

// Two groups of one row each, L = 96 (6 blocks of 16).
//   row 0: amax 2688 -> global 1.0.
//     b0 amax 6: scale 6/6/1 = 1 (0x38), s = 1: {6, -6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5,
//        -.5, 0, -0, 4, 3, 2, 1} -> {7, F, 0, 2, 2, 4, 4, 6, 6, 9, 0, 8, 6, 5, 4, 2}; packed
//        (first element low): F7 20 42 64 96 80 56 24.
//     b1 amax 2688: scale 448 (0x7E), s = 448: 2688 -> 6 (7), -896 -> -2 (C), 224 -> .5 (1),
//        112 -> .25 tie -> 0 (0), 1000 -> 2.23 -> 2 (4), 1300 -> 2.90 -> 3 (5).
//     b2 amax 7.5: scale 1.25 (0x3A), s = 1.25: 7.5 -> 6 (7), 2.5 -> 2 (4), -1.875 -> -1.5 (B).
//     b3 amax 6.875: 6.875/6 = 1.146 -> 1.125 (0x39), s = 1.125: 6.875 -> 6.11 saturates to 6
//        (7), decode 6.75.
//     b4 zeros: scale 2^-9 (0x01), elements 0, decode 0.
//     b5 amax 0.001: 1.7e-4 < 2^-9 -> 0x01, s = 2^-9: 0.001 / 2^-9 = 0.512 -> 0.5 (1), decode
//        2^-10.
//   row 1: amax 5376 -> global 2.0; b0 amax 5376: 5376/6/2 = 448 (0x7E), s = 896: 5376 -> 6 (7),
//     1344 -> 1.5 (3); other blocks zero.
TEST(FormatsNvfp4, HandWorkedTwoLevelScaling) {
  const int64_t N = 2, L = 96;
  std::vector<float> x(static_cast<size_t>(N * L), 0.0f);
  const float b0[16] = {6, -6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.5f, 0, -0.0f, 4, 3, 2, 1};
  for (int i = 0; i < 16; ++i) x[static_cast<size_t>(i)] = b0[i];
  x[16] = 2688, x[17] = -896, x[18] = 224, x[19] = 112, x[20] = 1000, x[21] = 1300;
  x[32] = 7.5f, x[33] = 2.5f, x[34] = -1.875f;
  x[48] = 6.875f;
  x[80] = 0.001f;
  x[96] = 5376, x[97] = 1344;
  std::vector<float> global(2);
  nvfp4_global_scales(x.data(), 2, N, L, global.data());
  EXPECT_EQ(global[0], 1.0f);
  EXPECT_EQ(global[1], 2.0f);
  std::vector<uint8_t> q(static_cast<size_t>(N * L / 2)), s(static_cast<size_t>(N * 6));
  nvfp4_quantize_rows(x.data(), 2, N, L, global.data(), q.data(), s.data());
  const unsigned want_s[12] = {0x38, 0x7E, 0x3A, 0x39, 0x01, 0x01, 0x7E, 0x01, 0x01, 0x01, 0x01, 0x01};
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(s[i], want_s[i]) << "scale " << i;
  const unsigned want_b0[8] = {0xF7, 0x20, 0x42, 0x64, 0x96, 0x80, 0x56, 0x24};
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(q[i], want_b0[i]) << "byte " << i;
  EXPECT_EQ(q[8], 0xC7);   // 2688 -> 7, -896 -> C
  EXPECT_EQ(q[9], 0x01);   // 224 -> 1, 112 -> 0
  EXPECT_EQ(q[10], 0x54);  // 1000 -> 4, 1300 -> 5
  EXPECT_EQ(q[16], 0x47);  // 7.5 -> 7, 2.5 -> 4
  EXPECT_EQ(q[17], 0x0B);  // -1.875 -> B, 0 -> 0
  EXPECT_EQ(q[24], 0x07);  // 6.875 -> 7
  EXPECT_EQ(q[32], 0x00);  // zero block
  EXPECT_EQ(q[40], 0x01);  // 0.001 -> 0.5
  EXPECT_EQ(q[48], 0x37);  // row 1: 5376 -> 7, 1344 -> 3
  std::vector<float> y(x.size());
  nvfp4_dequantize_rows(q.data(), s.data(), global.data(), 2, N, L, y.data());
  EXPECT_EQ(y[0], 6.0f);
  EXPECT_EQ(y[3], 1.0f);        // 0.75 -> 1.0
  EXPECT_EQ(y[19], 0.0f);       // 112 -> 0
  EXPECT_EQ(y[21], 1344.0f);    // 1300 -> 3 * 448
  EXPECT_EQ(y[34], -1.875f);    // -1.5 * 1.25
  EXPECT_EQ(y[48], 6.75f);      // saturated: 6 * 1.125
  EXPECT_EQ(y[80], 0x1p-10f);   // 0.5 * 2^-9
  EXPECT_EQ(y[96], 5376.0f);
  EXPECT_EQ(y[97], 1344.0f);
  expect_same_value(-0.0f, y[11], "-0");
}

// L = 3 (odd): amax 6 -> global fp32(1/448) = 9586981 * 2^-32; block scale 1 / that =
// 447.99998 -> 448 (0x7E); s = 448 * global = 1 + 192 * 2^-32 -> 1.0f. Elements 0.5 (1), -6 (F),
// 1 (2); bytes F1 (first element low) and 02 (the missing fourth element's nibble is 0).
TEST(FormatsNvfp4, OddLengthPacking) {
  const std::vector<float> x = {0.5f, -6.0f, 1.0f};
  float global = 0.0f;
  nvfp4_global_scales(x.data(), 1, 1, 3, &global);
  EXPECT_EQ(bitsf(global), 0x3B124925u);  // 1/448: the 1/112 fraction, exponent -9
  std::vector<uint8_t> q(2);
  uint8_t s = 0;
  nvfp4_quantize_rows(x.data(), 1, 1, 3, &global, q.data(), &s);
  EXPECT_EQ(s, 0x7E);
  EXPECT_EQ(q[0], 0xF1);
  EXPECT_EQ(q[1], 0x02);
  std::vector<float> y(3);
  nvfp4_dequantize_rows(q.data(), &s, &global, 1, 1, 3, y.data());
  EXPECT_EQ(y[0], 0.5f);
  EXPECT_EQ(y[1], -6.0f);
  EXPECT_EQ(y[2], 1.0f);
}

// Non-finite values are left out of the global amax and poison only their block.
TEST(FormatsNvfp4, NonFiniteBlocksAndZeroTensor) {
  std::vector<float> x(48, 0.0f);
  x[0] = 2688.0f;
  x[20] = kNaN;
  x[40] = -kInf;
  float global = 0.0f;
  nvfp4_global_scales(x.data(), 1, 1, 48, &global);
  EXPECT_EQ(global, 1.0f);
  std::vector<uint8_t> q(24), s(3);
  nvfp4_quantize_rows(x.data(), 1, 1, 48, &global, q.data(), s.data());
  EXPECT_EQ(s[0], 0x7E);
  EXPECT_EQ(s[1], 0x7F);
  EXPECT_EQ(s[2], 0x7F);
  for (size_t i = 8; i < 24; ++i) EXPECT_EQ(q[i], 0x77) << "e2m1(NaN) = +6 in both nibbles";
  std::vector<float> y(48);
  nvfp4_dequantize_rows(q.data(), s.data(), &global, 1, 1, 48, y.data());
  EXPECT_EQ(y[0], 2688.0f);
  for (size_t i = 16; i < 48; ++i) EXPECT_EQ(bitsf(y[i]), 0x7FC00000u) << i;

  const std::vector<float> zeros(32, 0.0f);
  nvfp4_global_scales(zeros.data(), 1, 1, 32, &global);
  EXPECT_EQ(bitsf(global), 0x00800000u);
  nvfp4_quantize_rows(zeros.data(), 1, 1, 32, &global, q.data(), s.data());
  nvfp4_dequantize_rows(q.data(), s.data(), &global, 1, 1, 32, y.data());
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(bitsf(y[i]), 0u) << i;
}

// ================================ argument errors ================================

TEST(FormatsArgs, ErrorsNameTheArgument) {
  std::vector<float> x(8, 1.0f), g(2);
  std::vector<uint8_t> q(8), s(8);
  auto argument_of = [](const auto& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  EXPECT_EQ(argument_of([&] { nvfp4_global_scales(x.data(), 3, 2, 4, g.data()); }), "groups");
  EXPECT_EQ(argument_of([&] { nvfp4_global_scales(x.data(), 0, 2, 4, g.data()); }), "groups");
  EXPECT_EQ(argument_of([&] { fp8_quantize_rows(x.data(), -1, 4, q.data(), g.data()); }), "N");
  EXPECT_EQ(argument_of([&] { mxfp8_quantize_rows(x.data(), 1, 8, q.data(), nullptr); }), "scales_NS");
  EXPECT_EQ(argument_of([&] { fp8_quantize_weights(x.data(), -2, 2, 4, q.data(), g.data()); }), "G");
  // Empty tensors are fine (and null pointers with them).
  EXPECT_EQ(argument_of([&] { mxfp8_quantize_rows(nullptr, 0, 8, nullptr, nullptr); }), "(no error)");
}

}  // namespace
}  // namespace epmoe
