// The host model of the CUDA column quantizer (fp8_cols_model.h) against the host codec
// (cpu::fp8_quantize_cols + cpu::fp8_transpose_cols), bitwise, on the data of
// tests/gpu/test_gpu_fp8_cols.cpp and on random shapes, with no shared-memory race and no output
// written twice. Without the padding mask (rows past a block's end encoded from the tile's zeros
// under the column's scale) the model gives the mismatches the kernel gave on an H200: a column
// holding Inf or NaN has a NaN scale, so its padding rows became 0x7F instead of +0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cpu/fp8_steps.h"
#include "fp8_cols_model.h"

namespace epmoe::test {
namespace {

// The GPU test's shapes and data (same seeds, same generators).
struct Case {
  std::vector<int32_t> rows_E;
  int64_t spare;
  int64_t L;
};

const std::vector<int32_t> kAwkwardRows = {0, 1, 127, 128, 129, 300};

std::vector<int32_t> many_experts() {
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

struct Diff {
  int64_t codes = 0, first = -1, scales = 0;
};

Diff compare(const Expected& want, const ColsModelOutput& got) {
  Diff d;
  EXPECT_EQ(got.qt_LK.size(), want.qt_LK.size());
  EXPECT_EQ(got.scales_BL.size(), want.scales_BL.size());
  for (size_t i = 0; i < got.qt_LK.size() && i < want.qt_LK.size(); ++i) {
    if (got.qt_LK[i] != want.qt_LK[i]) {
      if (d.first < 0) d.first = static_cast<int64_t>(i);
      ++d.codes;
    }
  }
  for (size_t i = 0; i < got.scales_BL.size() && i < want.scales_BL.size(); ++i) {
    d.scales += std::memcmp(&got.scales_BL[i], &want.scales_BL[i], 4) != 0;
  }
  return d;
}

// The model's result equals the host codec's; no race.
void expect_model_matches(const Expected& want, const ColsModelInput& in, const std::string& what) {
  const ColsModelOutput got = run_cols_model(in);
  const Diff d = compare(want, got);
  EXPECT_EQ(d.codes, 0) << what << ": codes differ (of " << want.qt_LK.size() << "), first at " << d.first;
  EXPECT_EQ(d.scales, 0) << what << ": scales differ";
  EXPECT_EQ(got.shared_races, 0) << what << ": " << got.first_race;
  EXPECT_EQ(got.global_races, 0) << what << ": " << got.first_race;
}

std::vector<float> to_float(const std::vector<bf16_t>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_to_float(x[i]);
  return f;
}

// Inputs of the bf16 variant: x at x_buf[shift ..] (shift 1: element loads).
struct Bf16Input {
  std::vector<bf16_t> buf;
  ColsModelInput in;
};
Bf16Input bf16_input(const std::vector<bf16_t>& x, int shift, int64_t M, int64_t L,
                     const std::vector<int32_t>& off, int64_t max_blocks) {
  Bf16Input r;
  r.buf.assign(x.size() + static_cast<size_t>(shift), 0);
  std::copy(x.begin(), x.end(), r.buf.begin() + shift);
  r.in.x_offset = shift;
  r.in.M = M;
  r.in.L = L;
  r.in.offsets_E1 = off;
  r.in.max_blocks = max_blocks;
  return r;
}

TEST(Fp8ColsModel, Bf16MatchesHostCodecOnAwkwardShapes) {
  uint64_t seed = 700;
  for (const Case& c : cases()) {
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int E = static_cast<int>(c.rows_E.size());
    const int64_t M = off.back() + c.spare;
    const int64_t max_blocks = fp8_col_blocks(M, E) + 3;
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * c.L), seed++, true);
    const Expected want = expected(to_float(x), c.L, off, max_blocks);
    for (int shift : {0, 1}) {
      Bf16Input b = bf16_input(x, shift, M, c.L, off, max_blocks);
      b.in.x_buf = &b.buf;
      expect_model_matches(want, b.in, "bf16, L " + std::to_string(c.L) + " M " + std::to_string(M) +
                                           " shift " + std::to_string(shift));
    }
    Bf16Input b = bf16_input(x, 0, M, c.L, off, max_blocks);
    b.in.x_buf = &b.buf;
    b.in.skip = 1;
    const ColsModelOutput skipped = run_cols_model(b.in);
    EXPECT_TRUE(skipped.qt_LK == std::vector<uint8_t>(skipped.qt_LK.size(), 0xA5)) << "skipped";
  }
}

// The kernel as first written (padding rows encoded under the column's scale) gives the H200's
// mismatches: bf16 awkward shapes, "5328 of 5529600, first at 9601" at L = 2880 (both loads),
// "601, first at 2175" at L = 200 and "425, first at 9601" at L = 75. 9601 = 5 K + 1 (K = 1920):
// column 5, block 0 (expert 1's single row), row 1, padding; x[0][5] is the test's -Inf.
TEST(Fp8ColsModel, PaddingRowsUnderTheColumnScaleGiveTheH200Mismatches) {
  const int64_t want_codes[] = {5328, 601, 425};
  const int64_t want_first[] = {9601, 2175, 9601};
  uint64_t seed = 700;
  const std::vector<Case> all = cases();
  for (size_t k = 0; k < 3; ++k) {
    const Case& c = all[k];
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int E = static_cast<int>(c.rows_E.size());
    const int64_t M = off.back() + c.spare;
    const int64_t max_blocks = fp8_col_blocks(M, E) + 3;
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * c.L), seed++, true);
    const Expected want = expected(to_float(x), c.L, off, max_blocks);
    for (int shift : {0, 1}) {
      Bf16Input b = bf16_input(x, shift, M, c.L, off, max_blocks);
      b.in.x_buf = &b.buf;
      b.in.mask_padding_rows = false;
      const ColsModelOutput got = run_cols_model(b.in);
      const Diff d = compare(want, got);
      EXPECT_EQ(d.codes, want_codes[k]) << "L " << c.L << " shift " << shift;
      EXPECT_EQ(d.first, want_first[k]) << "L " << c.L << " shift " << shift;
      EXPECT_EQ(d.scales, 0);
      EXPECT_EQ(got.shared_races, 0) << got.first_race;
      // Every differing code is a padding row's 0x7F where the host has +0.
      for (size_t i = 0; i < got.qt_LK.size(); ++i) {
        if (got.qt_LK[i] != want.qt_LK[i]) {
          ASSERT_EQ(got.qt_LK[i], 0x7F) << i;
          ASSERT_EQ(want.qt_LK[i], 0x00) << i;
        }
      }
    }
  }
}

// E4M3 rows (fp8_rows_bytes layout at a byte offset) with a device row count.
struct E4m3Input {
  std::vector<char> buf;
  ColsModelInput in;
};

TEST(Fp8ColsModel, E4m3RowsMatchHostCodecBelowTheDeviceRowCount) {
  uint64_t seed = 900;
  for (const Case& c : cases()) {
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int E = static_cast<int>(c.rows_E.size());
    const int64_t M = off.back() + c.spare;
    const int64_t max_blocks = fp8_col_blocks(M, E) + 2;
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * c.L), seed++, false);
    const int64_t total = off.back();
    for (int64_t count : {M, total > 150 ? total - 150 : total / 2, int64_t{0}}) {
      const int64_t pad = 256;
      E4m3Input r;
      r.buf.assign(static_cast<size_t>(pad + fp8_rows_bytes(M, c.L)), 0);
      uint8_t* codes = reinterpret_cast<uint8_t*>(r.buf.data() + pad);
      float* row_scales = reinterpret_cast<float*>(r.buf.data() + pad + fp8_rows_scales_offset(count, c.L));
      const int64_t ld = fp8_rows_ld(count);
      cpu::fp8_quantize_rows_s_major(x.data(), count, c.L, codes, row_scales, ld);
      std::vector<float> decoded(static_cast<size_t>(M * c.L), 0.0f);
      cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, count, c.L, decoded.data());
      const Expected want = expected(decoded, c.L, off, max_blocks);
      r.in = {.rows_buf = &r.buf, .rows_offset = pad, .rows_count = static_cast<int32_t>(count),
              .M = M, .L = c.L, .offsets_E1 = off, .max_blocks = max_blocks};
      expect_model_matches(want, r.in, "E4M3, L " + std::to_string(c.L) + " count " + std::to_string(count));
    }
  }
}

// The GPU test's every-code rows (NaN codes in column 3 of the experts' first rows): without the
// padding mask the NaN columns' padding rows differ, as on the H200; with it, none.
TEST(Fp8ColsModel, E4m3RowsOfEveryCodeMatchHostCodec) {
  for (int64_t L : {int64_t{200}, int64_t{75}}) {
    const std::vector<int32_t> off = offsets_of(kAwkwardRows);
    const int E = static_cast<int>(kAwkwardRows.size());
    const int64_t M = off.back() + 2, ld = fp8_rows_ld(M);
    const int64_t max_blocks = fp8_col_blocks(M, E);
    E4m3Input r;
    r.buf.assign(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
    uint8_t* codes = reinterpret_cast<uint8_t*>(r.buf.data());
    float* row_scales = reinterpret_cast<float*>(r.buf.data() + fp8_rows_scales_offset(M, L));
    std::mt19937_64 rng(static_cast<uint64_t>(L));
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t l = 0; l < L; ++l) {
        uint8_t q = static_cast<uint8_t>(rng());
        if ((q & 0x7f) == 0x7f) q = static_cast<uint8_t>(q - 1);
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
    r.in = {.rows_buf = &r.buf, .rows_count = static_cast<int32_t>(M), .M = M, .L = L,
            .offsets_E1 = off, .max_blocks = max_blocks};
    expect_model_matches(want, r.in, "E4M3 every code, L " + std::to_string(L));
    r.in.mask_padding_rows = false;
    const Diff d = compare(want, run_cols_model(r.in));
    EXPECT_GT(d.codes, 0) << "L " << L << ": padding rows of the NaN column 3";
    EXPECT_EQ(d.first % (kFp8RowBlock * max_blocks) / kFp8RowBlock, 0) << "first in block 0";
    EXPECT_EQ(d.first / (kFp8RowBlock * max_blocks), 3) << "first in column 3";
  }
}

// The GPU test's midpoint data: the division pass (bounds that disagree) on bf16 and E4M3 rows.
TEST(Fp8ColsModel, RoundingMidpointsMatchHostCodec) {
  std::vector<float> mids;
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
      bf16_t b = float_to_bf16(v * pow2 * ((m + l) % 2 == 0 ? 1.0f : -1.0f));
      if (m % 32 != 0 && m % 3 == 1) b = static_cast<bf16_t>(b + 1);
      x[static_cast<size_t>(m * L + l)] = b;
    }
  }
  const Expected want = expected(to_float(x), L, off, max_blocks);
  for (int shift : {0, 1}) {
    Bf16Input b = bf16_input(x, shift, M, L, off, max_blocks);
    b.in.x_buf = &b.buf;
    expect_model_matches(want, b.in, "bf16 midpoints, shift " + std::to_string(shift));
  }
  const int64_t ld = fp8_rows_ld(M);
  E4m3Input r;
  r.buf.assign(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
  uint8_t* codes = reinterpret_cast<uint8_t*>(r.buf.data());
  float* row_scales = reinterpret_cast<float*>(r.buf.data() + fp8_rows_scales_offset(M, L));
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
  r.in = {.rows_buf = &r.buf, .rows_count = static_cast<int32_t>(M), .M = M, .L = L,
          .offsets_E1 = off, .max_blocks = max_blocks};
  expect_model_matches(want_e4m3, r.in, "E4M3 rows, power-of-two row scales");
}

// Rows at or past the device row count in the experts' blocks as +0 codes (the kernel's contract,
// as the padding rows': the host codec on the decoded rows encodes their zeros under the column's
// scale, 0x7F where it is NaN).
void zero_rows_past_count(Expected& want, int64_t count, int64_t L, const std::vector<int32_t>& off,
                          int64_t max_blocks) {
  const int E = static_cast<int>(off.size()) - 1;
  const int64_t K = kFp8RowBlock * max_blocks;
  for (int e = 0; e < E; ++e) {
    const int64_t base = cpu::fp8_col_block_base(off.data(), e);
    for (int64_t m = std::max<int64_t>(off[e], count); m < off[e + 1]; ++m) {
      const int64_t k = kFp8RowBlock * base + (m - off[e]);  // 128 b + i
      for (int64_t l = 0; l < L; ++l) want.qt_LK[static_cast<size_t>(l * K + k)] = 0;
    }
  }
}

// Random shapes: 1-40 experts of 0-300 rows, spare rows, L of 1-600 (vector and element loads),
// Inf / NaN in some columns, bf16 at offset 0 or 1..7 and E4M3 rows with a random device count.
TEST(Fp8ColsModel, RandomShapesMatchHostCodec) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 24; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 40);
    std::vector<int32_t> rows_E(static_cast<size_t>(E));
    for (auto& r : rows_E) r = rng() % 4 == 0 ? 0 : static_cast<int32_t>(rng() % 301);
    const std::vector<int32_t> off = offsets_of(rows_E);
    const int64_t M = off.back() + static_cast<int64_t>(rng() % 9);
    const int64_t L = trial % 3 == 0 ? 8 * (1 + static_cast<int64_t>(rng() % 75)) : 1 + static_cast<int64_t>(rng() % 600);
    const int64_t max_blocks = fp8_col_blocks(M, E) + static_cast<int64_t>(rng() % 3);
    const std::string what = "trial " + std::to_string(trial) + ": E " + std::to_string(E) + " M " +
                             std::to_string(M) + " L " + std::to_string(L);
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * L), rng(), trial % 2 == 0);
    const Expected want = expected(to_float(x), L, off, max_blocks);
    const int shift = trial % 4 == 0 ? 0 : static_cast<int>(rng() % 8);
    Bf16Input b = bf16_input(x, shift, M, L, off, max_blocks);
    b.in.x_buf = &b.buf;
    expect_model_matches(want, b.in, what + " bf16 shift " + std::to_string(shift));

    const int64_t count = static_cast<int64_t>(rng() % static_cast<uint64_t>(M + 1));
    const int64_t pad = 4 * static_cast<int64_t>(rng() % 64);  // the row scales stay 4-byte aligned
    E4m3Input r;
    r.buf.assign(static_cast<size_t>(pad + fp8_rows_bytes(M, L)), 0);
    uint8_t* codes = reinterpret_cast<uint8_t*>(r.buf.data() + pad);
    const int64_t ld = fp8_rows_ld(count);
    std::vector<float> row_scales(static_cast<size_t>(fp8_blocks(L) * ld), 0.0f);
    cpu::fp8_quantize_rows_s_major(x.data(), count, L, codes, row_scales.data(), ld);
    std::memcpy(r.buf.data() + pad + fp8_rows_scales_offset(count, L), row_scales.data(),
                row_scales.size() * sizeof(float));
    std::vector<float> decoded(static_cast<size_t>(M * L), 0.0f);
    cpu::fp8_dequantize_rows_s_major(codes, row_scales.data(), ld, count, L, decoded.data());
    Expected want_e4m3 = expected(decoded, L, off, max_blocks);
    zero_rows_past_count(want_e4m3, count, L, off, max_blocks);
    r.in = {.rows_buf = &r.buf, .rows_offset = pad, .rows_count = static_cast<int32_t>(count),
            .M = M, .L = L, .offsets_E1 = off, .max_blocks = max_blocks};
    expect_model_matches(want_e4m3, r.in, what + " E4M3 count " + std::to_string(count));
  }
}

// The data of the GPU test NonFiniteColumnsKeepPaddingRowsZero: +Inf in every third column of
// each expert's first row, NaN in the next column of its last row (NaN column scales in blocks with
// padding rows), as bf16 and as E4M3 rows with a device count cutting a block.
TEST(Fp8ColsModel, NonFiniteColumnsKeepPaddingRowsZero) {
  const std::vector<int32_t> off = offsets_of(kAwkwardRows);
  const int E = static_cast<int>(kAwkwardRows.size());
  const int64_t M = off.back() + 2;
  const int64_t max_blocks = fp8_col_blocks(M, E);
  for (int64_t L : {int64_t{200}, int64_t{75}}) {
    std::vector<bf16_t> x = random_bf16(static_cast<size_t>(M * L), 77, false);
    for (size_t e = 0; e + 1 < off.size(); ++e) {
      if (off[e + 1] == off[e]) continue;
      for (int64_t l = 0; l < L; ++l) {
        if (l % 3 == 0) x[static_cast<size_t>(off[e] * L + l)] = float_to_bf16(std::numeric_limits<float>::infinity());
        if (l % 3 == 1) x[static_cast<size_t>((off[e + 1] - 1) * L + l)] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
      }
    }
    const Expected want = expected(to_float(x), L, off, max_blocks);
    Bf16Input b = bf16_input(x, 0, M, L, off, max_blocks);
    b.in.x_buf = &b.buf;
    expect_model_matches(want, b.in, "bf16 non-finite columns, L " + std::to_string(L));
    b.in.mask_padding_rows = false;
    EXPECT_GT(compare(want, run_cols_model(b.in)).codes, 0) << "L " << L << ": unmasked padding rows";
    for (int64_t count : {M, int64_t{off.back()} - 150}) {
      E4m3Input r;
      r.buf.assign(static_cast<size_t>(fp8_rows_bytes(M, L)), 0);
      uint8_t* codes = reinterpret_cast<uint8_t*>(r.buf.data());
      float* row_scales = reinterpret_cast<float*>(r.buf.data() + fp8_rows_scales_offset(count, L));
      const int64_t ld = fp8_rows_ld(count);
      cpu::fp8_quantize_rows_s_major(x.data(), count, L, codes, row_scales, ld);
      std::vector<float> decoded(static_cast<size_t>(M * L), 0.0f);
      cpu::fp8_dequantize_rows_s_major(codes, row_scales, ld, count, L, decoded.data());
      Expected want_e4m3 = expected(decoded, L, off, max_blocks);
      zero_rows_past_count(want_e4m3, count, L, off, max_blocks);
      r.in = {.rows_buf = &r.buf, .rows_count = static_cast<int32_t>(count), .M = M, .L = L,
              .offsets_E1 = off, .max_blocks = max_blocks};
      expect_model_matches(want_e4m3, r.in, "E4M3 non-finite columns, L " + std::to_string(L) + " count " +
                                                std::to_string(count));
    }
  }
}

}  // namespace
}  // namespace epmoe::test
