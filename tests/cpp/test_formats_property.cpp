// Format codecs on random data: every element within half a step of the format's grid at its
// block scale (or saturated), and the round-trip errors of tolerances.h
// (EPMOE_REPORT_ERRORS=1 prints the measurements). Hand-worked values: test_formats.cpp.
#include <gtest/gtest.h>

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
#include "epmoe/error.h"
#include "tolerances.h"

namespace epmoe {
namespace {

// ================================ properties on random data ================================

// Half the spacing of the E4M3 grid around |v| (|v| <= 448), and of E2M1 (|v| <= 6).
double e4m3_half_step(double v) {
  const double a = std::fabs(v);
  if (a < 0x1p-6) return 0x1p-10;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 4);
}
double e2m1_half_step(double v) {
  const double a = std::fabs(v);
  return a < 2.0 ? 0.25 : (a < 4.0 ? 0.5 : 1.0);
}

// |decode - x| <= s * half_step(x / s) + fp32 rounding of x / s and of q * s; an element whose
// x / s lies beyond the format's max decodes to +-max * s (saturation) instead.
void expect_element_within_half_step(float x, float decoded, double s, double max, bool e2m1,
                                     const std::string& what) {
  const double v = static_cast<double>(x) / s;
  const double slop = 0x1p-22 * std::fabs(static_cast<double>(x)) + 0x1p-149;
  if (std::fabs(v) > max * (1.0 + 0x1p-22)) {
    EXPECT_NEAR(decoded, std::copysign(max * s, static_cast<double>(x)), slop + 0x1p-22 * max * s)
        << what << ": x = " << x << " saturates";
    return;
  }
  const double half = e2m1 ? e2m1_half_step(v) : e4m3_half_step(v);
  EXPECT_LE(std::fabs(static_cast<double>(decoded) - static_cast<double>(x)), s * half * (1.0 + 0x1p-20) + slop)
      << what << ": x = " << x << ", s = " << s << ", decoded " << decoded;
}

struct RoundTrip {
  double rel_l2 = 0.0, cosine = 0.0, max_abs = 0.0;
};
RoundTrip measure(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0.0, den = 0.0, xy = 0.0, yy = 0.0, max_abs = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double a = x[i], b = y[i];
    num += (b - a) * (b - a);
    den += a * a;
    xy += a * b;
    yy += b * b;
    max_abs = std::max(max_abs, std::fabs(b - a));
  }
  return {std::sqrt(num / den), xy / std::sqrt(den * yy), max_abs};
}

void report(const std::string& what, const RoundTrip& r) {
  const char* flag = std::getenv("EPMOE_REPORT_ERRORS");
  if (flag != nullptr && flag[0] == '1') {
    std::printf("roundtrip | %s | rel_l2 %.4e cosine %.7f max_abs %.4e\n", what.c_str(), r.rel_l2, r.cosine,
                r.max_abs);
  }
}

void expect_within_format_tolerance(Precision p, test::Direction d, const RoundTrip& r, const std::string& what) {
  report(what, r);
  const test::FormatTolerance* t = test::format_tolerance(p, d);
  ASSERT_NE(t, nullptr) << what << ": no entry in kFormatTolerances";
  EXPECT_LE(r.rel_l2, t->rel_l2) << what;
  EXPECT_GE(r.cosine, t->cosine) << what;
  EXPECT_LE(r.max_abs, t->atol) << what;
}

// Unit-normal data, the distribution the tolerance table is stated for.
std::vector<float> normal_data(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

// Rows scaled by 2^k, k in [-40, 40], with an occasional outlier: every binade of the block
// scales and the element grids, for the half-step property (not for the tolerance table).
std::vector<float> wide_data(int64_t N, int64_t L, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-40, 40), pick(0, 49);
  std::vector<float> x(static_cast<size_t>(N * L));
  for (int64_t n = 0; n < N; ++n) {
    const float row_scale = std::ldexp(1.0f, exp(rng));
    for (int64_t l = 0; l < L; ++l) {
      float v = dist(rng) * row_scale;
      if (pick(rng) == 0) v *= 100.0f;
      x[static_cast<size_t>(n * L + l)] = v;
    }
  }
  return x;
}

constexpr uint32_t kSeeds = 10;

TEST(FormatsProperty, Fp8RowsWithinHalfStep) {
  const int64_t N = 37, L = 300, S = 3;
  for (uint32_t seed = 1; seed <= kSeeds; ++seed) {
    for (const bool wide : {false, true}) {
      const std::vector<float> x = wide ? wide_data(N, L, seed) : normal_data(static_cast<size_t>(N * L), seed);
      std::vector<uint8_t> q(x.size());
      std::vector<float> y(x.size()), s32(static_cast<size_t>(N * S));
      std::vector<uint8_t> s8(s32.size());
      for (const bool ue8m0 : {false, true}) {
        if (ue8m0) {
          fp8_quantize_rows(x.data(), N, L, q.data(), s8.data());
          fp8_dequantize_rows(q.data(), s8.data(), N, L, y.data());
        } else {
          fp8_quantize_rows(x.data(), N, L, q.data(), s32.data());
          fp8_dequantize_rows(q.data(), s32.data(), N, L, y.data());
        }
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t b = 0; b < S; ++b) {
            float amax = 0.0f;
            for (int64_t l = b * 128; l < std::min<int64_t>(L, (b + 1) * 128); ++l) {
              amax = std::max(amax, std::fabs(x[static_cast<size_t>(n * L + l)]));
            }
            const size_t si = static_cast<size_t>(n * S + b);
            double s;
            if (ue8m0) {
              const int e = static_cast<int>(s8[si]) - 127;
              s = std::ldexp(1.0, e);
              EXPECT_GE(448.0 * s, amax) << "UE8M0 scale covers the amax";
              if (e > -127) {
                EXPECT_LT(448.0 * s / 2.0, amax) << "and is the smallest such power";
              }
            } else {
              s = s32[si];
              const float want = std::max(amax / 448.0f, std::numeric_limits<float>::min());
              EXPECT_EQ(s32[si], want) << "fp32 scale = amax / 448 (floored at 2^-126)";
            }
            for (int64_t l = b * 128; l < std::min<int64_t>(L, (b + 1) * 128); ++l) {
              const size_t i = static_cast<size_t>(n * L + l);
              expect_element_within_half_step(x[i], y[i], s, 448.0, false, "fp8 rows");
            }
          }
        }
        const RoundTrip r = measure(x, y);
        if (!wide) {
          expect_within_format_tolerance(Precision::fp8_block, test::Direction::roundtrip_rows, r,
                                         std::string("fp8 rows ") + (ue8m0 ? "ue8m0" : "fp32") + " seed " +
                                             std::to_string(seed));
        }
      }
      if (HasFailure()) return;
    }
  }
}

TEST(FormatsProperty, Fp8WeightsWithinHalfStep) {
  const int64_t G = 2, N = 200, L = 260;  // partial blocks on both axes
  const int64_t B = 2, S = 3;
  for (uint32_t seed = 1; seed <= kSeeds; ++seed) {
    const std::vector<float> x = normal_data(static_cast<size_t>(G * N * L), 100 + seed);
    std::vector<uint8_t> q(x.size());
    std::vector<float> y(x.size()), s32(static_cast<size_t>(G * B * S));
    std::vector<uint8_t> s8(s32.size());
    for (const bool ue8m0 : {false, true}) {
      if (ue8m0) {
        fp8_quantize_weights(x.data(), G, N, L, q.data(), s8.data());
        fp8_dequantize_weights(q.data(), s8.data(), G, N, L, y.data());
      } else {
        fp8_quantize_weights(x.data(), G, N, L, q.data(), s32.data());
        fp8_dequantize_weights(q.data(), s32.data(), G, N, L, y.data());
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t l = 0; l < L; ++l) {
            const size_t i = static_cast<size_t>((g * N + n) * L + l);
            const size_t si = static_cast<size_t>((g * B + n / 128) * S + l / 128);
            const double s = ue8m0 ? std::ldexp(1.0, static_cast<int>(s8[si]) - 127) : s32[si];
            expect_element_within_half_step(x[i], y[i], s, 448.0, false, "fp8 weights");
          }
        }
      }
      expect_within_format_tolerance(Precision::fp8_block, test::Direction::roundtrip_weights, measure(x, y),
                                     std::string("fp8 weights ") + (ue8m0 ? "ue8m0" : "fp32") + " seed " +
                                         std::to_string(seed));
      if (HasFailure()) return;
    }
  }
}

TEST(FormatsProperty, Mxfp8WithinHalfStep) {
  const int64_t N = 37, L = 200, S = 7;
  for (uint32_t seed = 1; seed <= kSeeds; ++seed) {
    for (const bool wide : {false, true}) {
      const std::vector<float> x = wide ? wide_data(N, L, seed) : normal_data(static_cast<size_t>(N * L), 200 + seed);
      std::vector<uint8_t> q(x.size()), s(static_cast<size_t>(N * S));
      std::vector<float> y(x.size());
      mxfp8_quantize_rows(x.data(), N, L, q.data(), s.data());
      mxfp8_dequantize_rows(q.data(), s.data(), N, L, y.data());
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t b = 0; b < S; ++b) {
          float amax = 0.0f;
          for (int64_t l = b * 32; l < std::min<int64_t>(L, (b + 1) * 32); ++l) {
            amax = std::max(amax, std::fabs(x[static_cast<size_t>(n * L + l)]));
          }
          const int e = static_cast<int>(s[static_cast<size_t>(n * S + b)]) - 127;
          if (e > -127) {
            EXPECT_LE(std::ldexp(1.0, e + 8), amax) << "2^(e + emax) <= amax";
            EXPECT_GT(std::ldexp(1.0, e + 9), amax) << "amax < 2^(e + emax + 1)";
          }
          for (int64_t l = b * 32; l < std::min<int64_t>(L, (b + 1) * 32); ++l) {
            const size_t i = static_cast<size_t>(n * L + l);
            expect_element_within_half_step(x[i], y[i], std::ldexp(1.0, e), 448.0, false, "mxfp8");
          }
        }
      }
      if (!wide) {
        expect_within_format_tolerance(Precision::mxfp8, test::Direction::roundtrip_rows, measure(x, y),
                                       "mxfp8 seed " + std::to_string(seed));
      }
      if (HasFailure()) return;
    }
  }
}

TEST(FormatsProperty, Nvfp4WithinHalfStep) {
  const int64_t groups = 3, N = 36, L = 200, S = 13;  // 200 = 12 blocks of 16 + 8
  for (uint32_t seed = 1; seed <= kSeeds; ++seed) {
    for (const bool wide : {false, true}) {
      const std::vector<float> x = wide ? wide_data(N, L, seed) : normal_data(static_cast<size_t>(N * L), 300 + seed);
      std::vector<float> global(groups), y(x.size());
      std::vector<uint8_t> q(static_cast<size_t>(N * L / 2)), s(static_cast<size_t>(N * S));
      nvfp4_global_scales(x.data(), groups, N, L, global.data());
      nvfp4_quantize_rows(x.data(), groups, N, L, global.data(), q.data(), s.data());
      nvfp4_dequantize_rows(q.data(), s.data(), global.data(), groups, N, L, y.data());
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f;
        for (int64_t i = g * (N / groups) * L; i < (g + 1) * (N / groups) * L; ++i) {
          amax = std::max(amax, std::fabs(x[static_cast<size_t>(i)]));
        }
        EXPECT_EQ(global[static_cast<size_t>(g)], amax / 2688.0f) << "global = amax / (448 * 6)";
      }
      for (int64_t n = 0; n < N; ++n) {
        const double gs = global[static_cast<size_t>(n / (N / groups))];
        for (int64_t b = 0; b < S; ++b) {
          const uint8_t code = s[static_cast<size_t>(n * S + b)];
          // The block scale is the E4M3 nearest to amax / 6 / global (or the 2^-9 floor).
          float amax = 0.0f;
          for (int64_t l = b * 16; l < std::min<int64_t>(L, (b + 1) * 16); ++l) {
            amax = std::max(amax, std::fabs(x[static_cast<size_t>(n * L + l)]));
          }
          const double ideal = static_cast<double>(amax) / 6.0 / gs;
          const double bs = e4m3_to_float(code);
          if (ideal >= 0x1p-9) {
            EXPECT_LE(std::fabs(bs - std::min(ideal, 448.0)), e4m3_half_step(ideal) * (1.0 + 0x1p-20) + 1e-6 * ideal)
                << "block scale " << bs << " vs " << ideal;
          }
          const double es = static_cast<double>(nvfp4_element_scale(code, static_cast<float>(gs)));
          for (int64_t l = b * 16; l < std::min<int64_t>(L, (b + 1) * 16); ++l) {
            const size_t i = static_cast<size_t>(n * L + l);
            expect_element_within_half_step(x[i], y[i], es, 6.0, true, "nvfp4");
          }
        }
      }
      if (!wide) {
        expect_within_format_tolerance(Precision::nvfp4, test::Direction::roundtrip_rows, measure(x, y),
                                       "nvfp4 seed " + std::to_string(seed));
      }
      if (HasFailure()) return;
    }
  }
}

}  // namespace
}  // namespace epmoe
