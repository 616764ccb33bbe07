// The 128x1 column quantizer of the FP8 WGRAD operands (cuda/formats/fp8_cols.cu) against the
// host codec, bitwise, on the shapes its tiling finds awkward: L not a multiple of the 128-column
// tile (2880, 200, 136) and not of the 8-element vector (75), a misaligned bf16 base (element
// loads), experts of 0, 1, 127, 128, 129 and 300 rows, more than 32 experts (the expert search
// goes 32 at a time), max_blocks past the blocks used, the skip flag, and the E4M3 variant with a
// device row count below M (rows past it quantize as +0, blocks past it get scale 1), and E4M3
// rows holding every code (NaN included) with scales over many binades; columns holding Inf or
// NaN (a NaN scale), whose rows past the block's end stay +0.
// Compared: the whole transposed code buffer (padding +0, untouched k ranges keep 0xA5) and the
// whole scale buffer (blocks past the last expert keep 0xA5).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/formats/fp8_block.h"
#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cpu/fp8_steps.h"
#include "cuda/formats/formats.h"
#include "device_buffer.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

struct Case {
  std::vector<int32_t> rows_E;  // rows per expert
  int64_t spare;                // rows past the experts (M = their sum + spare)
  int64_t L;
};

const std::vector<int32_t> kAwkwardRows = {0, 1, 127, 128, 129, 300};

std::vector<int32_t> many_experts() {  // 70 experts: zeros, partial and whole blocks
  std::vector<int32_t> rows(70);
  for (size_t e = 0; e < rows.size(); ++e) rows[e] = e % 5 == 3 ? 0 : static_cast<int32_t>((e * 37) % 260);
  return rows;
}

std::vector<Case> cases() {
  return {{kAwkwardRows, 5, 2880}, {kAwkwardRows, 0, 200}, {kAwkwardRows, 3, 75},
          {many_experts(), 7, 136}, {{0, 0, 0}, 4, 200}};
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& rows_E) {
  std::vector<int32_t> off(rows_E.size() + 1, 0);
  for (size_t e = 0; e < rows_E.size(); ++e) off[e + 1] = off[e] + rows_E[e];
  return off;
}

// Normal values over several binades, some zeros; with `specials` a few infinities and NaNs.
std::vector<bf16_t> random_bf16(size_t n, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    float x = dist(rng) * std::exp2(static_cast<float>(static_cast<int>(i % 7) - 3));
    if (i % 97 == 0) x = 0.0f;
    if (specials && i % 4099 == 5) x = -std::numeric_limits<float>::infinity();
    if (specials && i % 5003 == 7) x = std::numeric_limits<float>::quiet_NaN();
    v[i] = float_to_bf16(x);
  }
  return v;
}

struct Expected {
  std::vector<uint8_t> qt_LK;
  std::vector<float> scales_BL;
};

// The host codec on x_ML [M, L] (fp32), codes transposed into [L, 128 * max_blocks]; both
// buffers start as 0xA5 bytes, as the device buffers do.
Expected expected(const std::vector<float>& x_ML, int64_t L, const std::vector<int32_t>& off,
                  int64_t max_blocks) {
  const int E = static_cast<int>(off.size()) - 1;
  Expected r;
  r.qt_LK.assign(static_cast<size_t>(L * kFp8RowBlock * max_blocks), 0xA5);
  r.scales_BL.resize(static_cast<size_t>(max_blocks * L));
  std::memset(r.scales_BL.data(), 0xA5, r.scales_BL.size() * sizeof(float));
  std::vector<uint8_t> q_ML(x_ML.size(), 0);
  cpu::fp8_quantize_cols(x_ML.data(), L, off.data(), E, q_ML.data(), r.scales_BL.data());
  cpu::fp8_transpose_cols(q_ML.data(), L, off.data(), E, kFp8RowBlock * max_blocks, r.qt_LK.data());
  return r;
}

void expect_equal(const Expected& want, const Dev<uint8_t>& qt, const Dev<float>& scales,
                  const std::string& what) {
  const std::vector<uint8_t> got_q = qt.get();
  const std::vector<float> got_s = scales.get();
  ASSERT_EQ(got_q.size(), want.qt_LK.size()) << what;
  ASSERT_EQ(got_s.size(), want.scales_BL.size()) << what;
  int64_t bad_q = 0, bad_s = 0, first_q = -1;
  for (size_t i = 0; i < got_q.size(); ++i) {
    if (got_q[i] != want.qt_LK[i]) {
      if (first_q < 0) first_q = static_cast<int64_t>(i);
      ++bad_q;
    }
  }
  for (size_t i = 0; i < got_s.size(); ++i) bad_s += std::memcmp(&got_s[i], &want.scales_BL[i], 4) != 0;
  EXPECT_EQ(bad_q, 0) << what << ": codes differ (of " << got_q.size() << "), first at " << first_q;
  EXPECT_EQ(bad_s, 0) << what << ": scales differ (of " << got_s.size() << ")";
}

std::string describe(const Case& c, int64_t M) {
  return "E " + std::to_string(c.rows_E.size()) + " M " + std::to_string(M) + " L " +
         std::to_string(c.L);
}

TEST(GpuFp8Cols, Bf16MatchesHostCodecOnAwkwardShapes) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 700;
  for (const Case& c : cases()) {
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int E = static_cast<int>(c.rows_E.size());
    const int64_t M = off.back() + c.spare;
    const int64_t max_blocks = fp8_col_blocks(M, E) + 3;  // more room than the blocks need
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * c.L), seed++, true);
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
    const Expected want = expected(xf, c.L, off, max_blocks);
    // x at an aligned base (vector loads where L % 8 == 0) and one element past it (element loads).
    std::vector<bf16_t> shifted(x.size() + 1, 0);
    std::copy(x.begin(), x.end(), shifted.begin() + 1);
    Dev<bf16_t> dx(shifted);
    Dev<int32_t> doff(off);
    for (int shift : {0, 1}) {
      if (shift == 0) {
        EXPECT_EQ(cudaMemcpy(dx.ptr, x.data(), x.size() * sizeof(bf16_t), cudaMemcpyHostToDevice),
                  cudaSuccess);
      } else {
        EXPECT_EQ(cudaMemcpy(dx.ptr, shifted.data(), shifted.size() * sizeof(bf16_t),
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      Dev<uint8_t> dqt(want.qt_LK.size());
      Dev<float> ds(want.scales_BL.size());
      cuda::fp8_quantize_cols_transposed(dx.ptr + shift, M, c.L, doff.ptr, E, nullptr, dqt.ptr,
                                         ds.ptr, max_blocks, nullptr);
      expect_equal(want, dqt, ds, "bf16, " + describe(c, M) + " shift " + std::to_string(shift));
    }
    // A set skip flag: nothing written.
    Dev<int32_t> skip(std::vector<int32_t>{1});
    Dev<uint8_t> dqt(want.qt_LK.size());
    Dev<float> ds(want.scales_BL.size());
    cuda::fp8_quantize_cols_transposed(dx.ptr, M, c.L, doff.ptr, E, skip.ptr, dqt.ptr, ds.ptr,
                                       max_blocks, nullptr);
    EXPECT_TRUE(dqt.get() == std::vector<uint8_t>(dqt.size, 0xA5)) << describe(c, M) << ": skipped";
    const std::vector<float> s = ds.get();
    std::vector<float> untouched(s.size());
    std::memset(untouched.data(), 0xA5, untouched.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(s.data(), untouched.data(), s.size() * sizeof(float)), 0)
        << describe(c, M) << ": skipped, scales";
  }
}

TEST(GpuFp8Cols, E4m3RowsMatchHostCodecBelowTheDeviceRowCount) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 900;
  for (const Case& c : cases()) {
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int E = static_cast<int>(c.rows_E.size());
    const int64_t M = off.back() + c.spare;
    const int64_t max_blocks = fp8_col_blocks(M, E) + 2;
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * c.L), seed++, false);
    // Device counts: all M rows, fewer than the experts hold (cutting a block), none.
    const int64_t total = off.back();
    for (int64_t count : {M, total > 150 ? total - 150 : total / 2, int64_t{0}}) {
      const int64_t pad = 256;  // the rows start at a device-held byte offset
      std::vector<char> buf(static_cast<size_t>(pad + fp8_rows_bytes(M, c.L)), 0);
      uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data() + pad);
      float* row_scales = reinterpret_cast<float*>(buf.data() + pad + fp8_rows_scales_offset(count, c.L));
      const int64_t ld = fp8_rows_ld(count);
      cpu::fp8_quantize_rows_s_major(x.data(), count, c.L, codes, row_scales, ld);
      std::vector<float> decoded(static_cast<size_t>(M * c.L), 0.0f);  // rows past count: +0
      cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, count, c.L, decoded.data());
      const Expected want = expected(decoded, c.L, off, max_blocks);
      Dev<char> dbuf(buf);
      Dev<int64_t> doffset(std::vector<int64_t>{pad});
      Dev<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(count)});
      Dev<int32_t> doff(off);
      Dev<uint8_t> dqt(want.qt_LK.size());
      Dev<float> ds(want.scales_BL.size());
      cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, doffset.ptr, dcount.ptr, M, c.L,
                                                   doff.ptr, E, nullptr, dqt.ptr, ds.ptr,
                                                   max_blocks, nullptr);
      const std::string what = "E4M3, " + describe(c, M) + " count " + std::to_string(count);
      expect_equal(want, dqt, ds, what);
      // A set skip flag: nothing written.
      Dev<int32_t> skip(std::vector<int32_t>{1});
      Dev<uint8_t> dq_skip(want.qt_LK.size());
      cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, doffset.ptr, dcount.ptr, M, c.L,
                                                   doff.ptr, E, skip.ptr, dq_skip.ptr, ds.ptr,
                                                   max_blocks, nullptr);
      EXPECT_TRUE(dq_skip.get() == std::vector<uint8_t>(dq_skip.size, 0xA5)) << what << ": skipped";
    }
  }
}

// Every E4M3 code (the vector path decodes through the hardware's E4M3 -> f16 conversion):
// random codes with row scales over many binades; NaN codes only in column 3 of the experts'
// first rows (their blocks' column 3 is NaN, everything else finite).
TEST(GpuFp8Cols, E4m3RowsOfEveryCodeMatchHostCodec) {
  EPMOE_REQUIRE_GPU();
  for (int64_t L : {int64_t{200}, int64_t{75}}) {
    const std::vector<int32_t> off = offsets_of(kAwkwardRows);
    const int E = static_cast<int>(kAwkwardRows.size());
    const int64_t M = off.back() + 2, ld = fp8_rows_ld(M);
    const int64_t max_blocks = fp8_col_blocks(M, E);
    std::vector<char> buf(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
    uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data());
    float* row_scales = reinterpret_cast<float*>(buf.data() + fp8_rows_scales_offset(M, L));
    std::mt19937_64 rng(static_cast<uint64_t>(L));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t l = 0; l < L; ++l) {
        uint8_t q = static_cast<uint8_t>(rng());
        if ((q & 0x7f) == 0x7f) q = static_cast<uint8_t>(q - 1);  // NaN -> +-448
        codes[m * L + l] = q;
      }
    }
    for (size_t e = 0; e < kAwkwardRows.size(); ++e) {
      if (kAwkwardRows[e] > 0) codes[off[e] * L + 3] = static_cast<uint8_t>(e % 2 == 0 ? 0x7f : 0xff);
    }
    for (int64_t s = 0; s < fp8_blocks(L); ++s) {
      for (int64_t m = 0; m < M; ++m) {
        row_scales[s * ld + m] = std::exp2(static_cast<float>(static_cast<int>(rng() % 40) - 30)) *
                                 (1.0f + static_cast<float>(rng() % 1000) / 1000.0f);
      }
    }
    std::vector<float> decoded(static_cast<size_t>(M * L), 0.0f);
    cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, M, L, decoded.data());
    const Expected want = expected(decoded, L, off, max_blocks);
    Dev<char> dbuf(buf);
    Dev<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(M)});
    Dev<int32_t> doff(off);
    Dev<uint8_t> dqt(want.qt_LK.size());
    Dev<float> ds(want.scales_BL.size());
    cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, nullptr, dcount.ptr, M, L, doff.ptr, E,
                                                 nullptr, dqt.ptr, ds.ptr, max_blocks, nullptr);
    expect_equal(want, dqt, ds, "E4M3 every code, L " + std::to_string(L));
  }
}

// Elements on E4M3 rounding midpoints (and one bf16 ulp off them) under power-of-two column
// scales (an amax of 448 * 2^k every 32 rows): x / scale is a tie or within 2^-8 of one, where the
// kernel's division-free encode leaves the element to the divide (e4m3_bounded.cuh). bf16 rows
// (vector and element loads), and E4M3 rows with power-of-two row scales: decoded x = q * 2^j, and
// where a column's amax is 448 * 2^k (its scale 2^k) x / 2^k may be a midpoint of a coarser binade.
TEST(GpuFp8Cols, RoundingMidpointsMatchHostCodec) {
  EPMOE_REQUIRE_GPU();
  std::vector<float> mids;  // positive E4M3 midpoints, 2^-10 .. 432
  for (int code = 0; code < 0x7e; ++code) {
    const float a = fp8_decode_fp32(static_cast<uint8_t>(code), 1.0f);
    const float b = fp8_decode_fp32(static_cast<uint8_t>(code + 1), 1.0f);
    mids.push_back(0.5f * (a + b));
  }
  const std::vector<int32_t> off = offsets_of(kAwkwardRows);
  const int E = static_cast<int>(kAwkwardRows.size());
  const int64_t M = off.back() + 3, L = 200;
  const int64_t max_blocks = fp8_col_blocks(M, E);
  std::vector<bf16_t> x(static_cast<size_t>(M * L));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t l = 0; l < L; ++l) {
      const float pow2 = std::exp2(static_cast<float>(l % 7 - 3));
      float v = m % 32 == 0 ? 448.0f : mids[static_cast<size_t>((m * 7 + l) % static_cast<int64_t>(mids.size()))];
      bf16_t b = float_to_bf16(v * pow2 * ((m + l) % 2 == 0 ? 1.0f : -1.0f));  // exact: 5 bits
      if (m % 32 != 0 && m % 3 == 1) b = static_cast<bf16_t>(b + 1);          // one ulp further out
      x[static_cast<size_t>(m * L + l)] = b;
    }
  }
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
  const Expected want = expected(xf, L, off, max_blocks);
  std::vector<bf16_t> shifted(x.size() + 1, 0);
  std::copy(x.begin(), x.end(), shifted.begin() + 1);
  Dev<int32_t> doff(off);
  for (int shift : {0, 1}) {
    Dev<bf16_t> dx(shift == 0 ? x : shifted);
    Dev<uint8_t> dqt(want.qt_LK.size());
    Dev<float> ds(want.scales_BL.size());
    cuda::fp8_quantize_cols_transposed(dx.ptr + shift, M, L, doff.ptr, E, nullptr, dqt.ptr, ds.ptr,
                                       max_blocks, nullptr);
    expect_equal(want, dqt, ds, "bf16 midpoints, shift " + std::to_string(shift));
  }
  // E4M3 rows: random codes (no NaN), row scales 2^(m % 5 - 2).
  const int64_t ld = fp8_rows_ld(M);
  std::vector<char> buf(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
  uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data());
  float* row_scales = reinterpret_cast<float*>(buf.data() + fp8_rows_scales_offset(M, L));
  std::mt19937_64 rng(11);
  for (int64_t i = 0; i < M * L; ++i) {
    uint8_t q = static_cast<uint8_t>(rng());
    if ((q & 0x7f) == 0x7f) q = static_cast<uint8_t>(q - 1);
    codes[i] = q;
  }
  for (int64_t s = 0; s < fp8_blocks(L); ++s) {
    for (int64_t m = 0; m < M; ++m) row_scales[s * ld + m] = std::exp2(static_cast<float>(m % 5 - 2));
  }
  std::vector<float> decoded(static_cast<size_t>(M * L), 0.0f);
  cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, M, L, decoded.data());
  const Expected want_e4m3 = expected(decoded, L, off, max_blocks);
  Dev<char> dbuf(buf);
  Dev<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(M)});
  Dev<uint8_t> dqt(want_e4m3.qt_LK.size());
  Dev<float> ds(want_e4m3.scales_BL.size());
  cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, nullptr, dcount.ptr, M, L, doff.ptr, E,
                                               nullptr, dqt.ptr, ds.ptr, max_blocks, nullptr);
  expect_equal(want_e4m3, dqt, ds, "E4M3 rows, power-of-two row scales");
}

// x of random normals with +Inf in the first row of each expert in every third column and NaN in
// its last row in the next column: those columns' scales are NaN in the expert's first and last
// blocks, where the tile's zero rows past the block's end would encode as 0x7F; they are +0.
std::vector<bf16_t> nonfinite_columns(const std::vector<int32_t>& off, int64_t M, int64_t L) {
  std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * L), 77, false);
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    if (off[e + 1] == off[e]) continue;
    for (int64_t l = 0; l < L; ++l) {
      if (l % 3 == 0) x[static_cast<size_t>(off[e] * L + l)] = float_to_bf16(std::numeric_limits<float>::infinity());
      if (l % 3 == 1) x[static_cast<size_t>((off[e + 1] - 1) * L + l)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
    }
  }
  return x;
}

// Rows at or past the device row count in the experts' blocks as +0 codes, the kernel's contract
// (the host codec on the decoded rows encodes their zeros under the column's scale: 0x7F where
// that is NaN).
void zero_rows_past_count(Expected& want, int64_t count, int64_t L, const std::vector<int32_t>& off,
                          int64_t max_blocks) {
  const int E = static_cast<int>(off.size()) - 1;
  const int64_t K = kFp8RowBlock * max_blocks;
  for (int e = 0; e < E; ++e) {
    const int64_t base = cpu::fp8_col_block_base(off.data(), e);
    for (int64_t m = std::max<int64_t>(off[e], count); m < off[e + 1]; ++m) {
      for (int64_t l = 0; l < L; ++l) want.qt_LK[static_cast<size_t>(l * K + kFp8RowBlock * base + (m - off[e]))] = 0;
    }
  }
}

TEST(GpuFp8Cols, NonFiniteColumnsKeepPaddingRowsZero) {
  EPMOE_REQUIRE_GPU();
  const std::vector<int32_t> off = offsets_of(kAwkwardRows);
  const int E = static_cast<int>(kAwkwardRows.size());
  const int64_t M = off.back() + 2;
  const int64_t max_blocks = fp8_col_blocks(M, E);
  Dev<int32_t> doff(off);
  for (int64_t L : {int64_t{200}, int64_t{75}}) {  // vector and element loads
    const std::vector<bf16_t> x = nonfinite_columns(off, M, L);
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
    const Expected want = expected(xf, L, off, max_blocks);
    Dev<bf16_t> dx(x);
    Dev<uint8_t> dqt(want.qt_LK.size());
    Dev<float> ds(want.scales_BL.size());
    cuda::fp8_quantize_cols_transposed(dx.ptr, M, L, doff.ptr, E, nullptr, dqt.ptr, ds.ptr, max_blocks,
                                       nullptr);
    expect_equal(want, dqt, ds, "bf16 non-finite columns, L " + std::to_string(L));
    // The same rows as E4M3 (a row with Inf or NaN gets a NaN scale, its codes 0x7F), all M of
    // them and a device count that cuts the 300-row expert's second block.
    for (int64_t count : {M, int64_t{off.back()} - 150}) {
      std::vector<char> buf(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
      uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data());
      float* row_scales = reinterpret_cast<float*>(buf.data() + fp8_rows_scales_offset(count, L));
      const int64_t ld = fp8_rows_ld(count);
      cpu::fp8_quantize_rows_s_major(x.data(), count, L, codes, row_scales, ld);
      std::vector<float> decoded(static_cast<size_t>(M * L), 0.0f);
      cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, count, L, decoded.data());
      Expected want_e4m3 = expected(decoded, L, off, max_blocks);
      zero_rows_past_count(want_e4m3, count, L, off, max_blocks);
      Dev<char> dbuf(buf);
      Dev<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(count)});
      Dev<uint8_t> dq(want_e4m3.qt_LK.size());
      Dev<float> dsc(want_e4m3.scales_BL.size());
      cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, nullptr, dcount.ptr, M, L, doff.ptr, E,
                                                   nullptr, dq.ptr, dsc.ptr, max_blocks, nullptr);
      expect_equal(want_e4m3, dq, dsc,
                   "E4M3 non-finite columns, L " + std::to_string(L) + " count " + std::to_string(count));
    }
  }
}

}  // namespace
}  // namespace epmoe::test
