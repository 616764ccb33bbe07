// The steps of the FP8 training path one by one (src/cpu/fp8_steps.h): row quantization with
// S-major scales is the codec's, column blocks start at every expert's first row, DGRAD reads the
// 128x128 weight blocks transposed (bitwise the FPROP twin on the transposed weight), WGRAD sums
// 128-row blocks of each expert; GEMMs on exactly representable data equal the float64 result;
// Config.fp8_wgrad = bf16: the weight gradients are the bf16 path's on the bf16 operands (x its
// E4M3 rows decoded to bf16).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "core/backend.h"
#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "core/step.h"
#include "cpu/fp8_steps.h"
#include "cpu/gemm_fp8_reference.h"
#include "tolerances.h"

namespace epmoe::cpu {
namespace {

std::vector<bf16_t> random_bf16(std::mt19937_64& rng, int64_t n, double sigma) {
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<bf16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = float_to_bf16(static_cast<float>(d(rng)));
  return v;
}

// E4M3 codes of values in {+-0.5, +-1, +-1.5, +-2}: products and 128-term sums stay exact in fp32.
std::vector<uint8_t> small_codes(std::mt19937_64& rng, int64_t n) {
  const float values[] = {0.5f, 1.0f, 1.5f, 2.0f, -0.5f, -1.0f, -1.5f, -2.0f};
  std::uniform_int_distribution<int> pick(0, 7);
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (auto& c : v) c = e4m3_from_float(values[pick(rng)]);
  return v;
}
// Powers of two in [2^-2, 2^2]: scale products are exact, and a total over 3 blocks spans at
// most 2^15 / 2^-6 (21 bits): every fp32 step is exact.
std::vector<float> pow2_scales(std::mt19937_64& rng, int64_t n) {
  std::uniform_int_distribution<int> e(-2, 2);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& s : v) s = std::ldexp(1.0f, e(rng));
  return v;
}

TEST(Fp8Steps, RowsSMajorAreTheCodecsRows) {
  std::mt19937_64 rng(1);
  const int64_t rows = 5, L = 300, S = 3, ld = 7;
  const std::vector<bf16_t> x = random_bf16(rng, rows * L, 3.0);
  std::vector<uint8_t> q(rows * L), q_ref(rows * L);
  std::vector<float> scales(S * ld, -1.0f), scales_ref(rows * S), wide(rows * L), back(rows * L);
  fp8_quantize_rows_s_major(x.data(), rows, L, q.data(), scales.data(), ld);
  for (int64_t i = 0; i < rows * L; ++i) wide[i] = bf16_to_float(x[i]);
  fp8_quantize_rows(wide.data(), rows, L, q_ref.data(), scales_ref.data());
  EXPECT_EQ(q, q_ref);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t s = 0; s < S; ++s) EXPECT_EQ(scales[s * ld + m], scales_ref[m * S + s]) << m << "," << s;
  }
  EXPECT_EQ(scales[5], -1.0f);  // rows [rows, ld) of each block untouched
  fp8_dequantize_rows_s_major(q.data(), scales.data(), ld, rows, L, back.data());
  std::vector<float> back_ref(rows * L);
  fp8_dequantize_rows(q_ref.data(), scales_ref.data(), rows, L, back_ref.data());
  EXPECT_EQ(back, back_ref);
}

TEST(Fp8Steps, ColumnBlocksStartAtEveryExpertsFirstRow) {
  // Experts of 3, 0, 197 and 130 rows: blocks [0,3) | - | [3,131) [131,200) | [200,328) [328,330).
  const int32_t offsets[] = {0, 3, 3, 200, 330};
  const int E = 4;
  const int64_t M = 330, L = 5;
  EXPECT_EQ(fp8_col_block_base(offsets, 0), 0);
  EXPECT_EQ(fp8_col_block_base(offsets, 1), 1);
  EXPECT_EQ(fp8_col_block_base(offsets, 2), 1);
  EXPECT_EQ(fp8_col_block_base(offsets, 3), 3);
  EXPECT_EQ(fp8_col_block_base(offsets, 4), 5);
  // x[m, l] = (m + 1) * (l + 1) / 64: the block amax is its last row's value.
  std::vector<float> x(M * L);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t l = 0; l < L; ++l) x[m * L + l] = static_cast<float>((m + 1) * (l + 1)) / 64.0f;
  }
  std::vector<uint8_t> q(M * L);
  std::vector<float> scales(5 * L);
  fp8_quantize_cols(x.data(), L, offsets, E, q.data(), scales.data());
  const int64_t block_last_row[] = {2, 130, 199, 327, 329};
  const int64_t block_first_row[] = {0, 3, 131, 200, 328};
  for (int b = 0; b < 5; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      const float amax = x[block_last_row[b] * L + l];
      EXPECT_EQ(scales[b * L + l], amax / 448.0f) << "block " << b << " column " << l;
      for (int64_t m = block_first_row[b]; m <= block_last_row[b]; ++m) {
        ASSERT_EQ(q[m * L + l], e4m3_from_float(x[m * L + l] / scales[b * L + l])) << m << "," << l;
      }
      EXPECT_EQ(q[block_last_row[b] * L + l], 0x7E) << "the amax encodes as 448";
    }
  }
}

// The transposed codes the CUDA FP8 WGRAD reads: block b of the rows at k = 128 b, partial blocks
// zero-padded, the k range past the last block untouched.
TEST(Fp8Steps, TransposedColumnCodesPadEveryBlockTo128Rows) {
  const int32_t offsets[] = {0, 3, 3, 200, 330};  // blocks as in the test above: 5
  const int E = 4;
  const int64_t M = 330, L = 5, K = fp8_col_k(M, E);
  EXPECT_EQ(K, 128 * (3 + 4));
  std::vector<uint8_t> q(M * L);
  for (int64_t i = 0; i < M * L; ++i) q[i] = static_cast<uint8_t>(1 + i % 100);  // never 0
  std::vector<uint8_t> qt(L * K, 0xA5);
  fp8_transpose_cols(q.data(), L, offsets, E, K, qt.data());
  const int64_t block_first_row[] = {0, 3, 131, 200, 328}, block_rows[] = {3, 128, 69, 128, 2};
  for (int64_t l = 0; l < L; ++l) {
    for (int b = 0; b < 5; ++b) {
      for (int64_t i = 0; i < 128; ++i) {
        const uint8_t want = i < block_rows[b] ? q[(block_first_row[b] + i) * L + l] : 0;
        ASSERT_EQ(qt[l * K + 128 * b + i], want) << "column " << l << " block " << b << " row " << i;
      }
    }
    for (int64_t k = 5 * 128; k < K; ++k) ASSERT_EQ(qt[l * K + k], 0xA5) << "column " << l << " k " << k;
  }
}

TEST(Fp8Steps, DgradIsTheFpropTwinOnTheTransposedWeight) {
  std::mt19937_64 rng(2);
  const int E = 2;
  const int64_t K = 300, N = 130, SK = 3, SN = 2, M = 9;
  const int32_t offsets[] = {0, 4, 9};
  std::vector<uint8_t> a(M * K), w_EKN(E * K * N), w_ENK(E * N * K);
  std::uniform_int_distribution<int> code(0, 0x7E);
  for (auto& c : a) c = static_cast<uint8_t>(code(rng) | ((rng() & 1) != 0 ? 0x80 : 0));
  for (auto& c : w_EKN) c = static_cast<uint8_t>(code(rng));
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> sa(SK * M), sw_EKN(E * SK * SN), sw_ENK(E * SN * SK);
  for (auto& s : sa) s = std::fabs(n01(rng)) + 0.1f;
  for (auto& s : sw_EKN) s = std::fabs(n01(rng)) + 0.1f;
  for (int e = 0; e < E; ++e) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t n = 0; n < N; ++n) w_ENK[(e * N + n) * K + k] = w_EKN[(e * K + k) * N + n];
    }
    for (int64_t i = 0; i < SK; ++i) {
      for (int64_t j = 0; j < SN; ++j) sw_ENK[(e * SN + j) * SK + i] = sw_EKN[(e * SK + i) * SN + j];
    }
  }
  std::vector<bf16_t> dgrad(M * N), fprop(M * N);
  fp8_grouped_dgrad_reference(a.data(), sa.data(), M, w_EKN.data(), sw_EKN.data(), offsets, E, K, N,
                              dgrad.data(), N);
  fp8_grouped_gemm_reference(a.data(), sa.data(), M, w_ENK.data(), sw_ENK.data(), offsets, E, N, K,
                             fprop.data(), N);
  EXPECT_EQ(dgrad, fprop);
}

TEST(Fp8Steps, DgradAndWgradEqualFloat64OnExactData) {
  std::mt19937_64 rng(3);
  const int E = 3;
  const int32_t offsets[] = {0, 130, 130, 301};  // an empty expert; partial row blocks
  const int64_t M = 301, K = 260, N = 140;
  const std::vector<uint8_t> a = small_codes(rng, M * K), w = small_codes(rng, E * K * N);
  const std::vector<float> sa = pow2_scales(rng, 3 * M), sw = pow2_scales(rng, E * 3 * 2);
  std::vector<bf16_t> out(M * N);
  fp8_grouped_dgrad_reference(a.data(), sa.data(), M, w.data(), sw.data(), offsets, E, K, N,
                              out.data(), N);
  for (int e = 0; e < E; ++e) {
    for (int64_t m = offsets[e]; m < offsets[e + 1]; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          ref += static_cast<double>(e4m3_to_float(a[m * K + k])) * sa[(k / 128) * M + m] *
                 e4m3_to_float(w[(e * K + k) * N + n]) * sw[(e * 3 + k / 128) * 2 + n / 128];
        }
        ASSERT_EQ(out[m * N + n], float_to_bf16(static_cast<float>(ref))) << m << "," << n;
      }
    }
  }
  // WGRAD over the same rows: a [M, P] and b [M, Q] column-quantized, per expert.
  const int64_t P = 7, Q = 5, B = 2 + 0 + 2;
  const std::vector<uint8_t> ca = small_codes(rng, M * P), cb = small_codes(rng, M * Q);
  const std::vector<float> csa = pow2_scales(rng, B * P), csb = pow2_scales(rng, B * Q);
  for (int e = 0; e < E; ++e) {
    std::vector<float> acc(P * Q, -1.0f);
    fp8_wgrad_expert_reference(ca.data(), csa.data(), P, cb.data(), csb.data(), Q, offsets, e,
                               acc.data());
    const int64_t b0 = fp8_col_block_base(offsets, e);
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t q = 0; q < Q; ++q) {
        double ref = 0.0;
        for (int64_t m = offsets[e]; m < offsets[e + 1]; ++m) {
          const int64_t b = b0 + (m - offsets[e]) / 128;
          ref += static_cast<double>(e4m3_to_float(ca[m * P + p])) * csa[b * P + p] *
                 e4m3_to_float(cb[m * Q + q]) * csb[b * Q + q];
        }
        ASSERT_EQ(acc[p * Q + q], static_cast<float>(ref)) << "expert " << e << " " << p << "," << q;
      }
    }
  }
}

// The received E4M3 rows + scales take the place of the bf16 x_gathered rows in the saved state and
// the call scratch: they must fit for every row count once D >= 4 (Config's limit for fp8_block).
TEST(Fp8Steps, ReceivedRowsFitTheBf16RowSpace) {
  for (int64_t D = 4; D <= 1100; ++D) {
    for (int64_t rows = 0; rows <= 700; ++rows) {
      ASSERT_LE(fp8_rows_bytes(rows, D), align_bytes(rows * D * 2)) << "D " << D << " rows " << rows;
    }
  }
  // Why D = 3 is refused: 17 rows need 64 bytes of codes + 80 of scales, more than A(102) = 128.
  EXPECT_GT(fp8_rows_bytes(17, 3), align_bytes(17 * 3 * 2));
}

TEST(Fp8Steps, DecodedBf16RowsAreTheDequantizedRowsRoundedOnce) {
  std::mt19937_64 rng(4);
  const int64_t rows = 37, L = 300;  // a partial last block
  const std::vector<bf16_t> x = random_bf16(rng, rows * L, 3.0);
  const int64_t ld = fp8_rows_ld(rows);
  std::vector<uint8_t> q(static_cast<size_t>(rows * L));
  std::vector<float> scales(static_cast<size_t>(fp8_blocks(L) * ld));
  fp8_quantize_rows_s_major(x.data(), rows, L, q.data(), scales.data(), ld);
  std::vector<float> f(static_cast<size_t>(rows * L));
  fp8_dequantize_rows_s_major(q.data(), scales.data(), ld, rows, L, f.data());
  std::vector<bf16_t> b(static_cast<size_t>(rows * L));
  fp8_decode_rows_bf16(q.data(), scales.data(), ld, rows, L, b.data());
  int64_t inexact = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    ASSERT_EQ(b[i], float_to_bf16(f[i])) << i;
    inexact += bf16_to_float(b[i]) != f[i];
  }
  // code * scale needs up to 4 + 24 significant bits: the bf16 rounding is not a no-op.
  EXPECT_GT(inexact, 0);
}

// One expert-grouped weight-gradient problem through the CPU backend's WGRAD stages: M received
// rows in E experts (one empty, partial 128-row blocks), x as E4M3 rows in the x_gathered space.
struct WgradProblem {
  static constexpr int E = 3;
  static constexpr int64_t M = 301, D = 136, F = 20;
  int32_t offsets[E + 1] = {0, 130, 130, 301};
  std::vector<int32_t> header = std::vector<int32_t>(kLayoutHeaderInts, 0);
  std::vector<bf16_t> x_MD, grad_h13_M2F, grad_h3_MD, h_MF;
  std::vector<char> x_rows;  // E4M3 rows + S-major scales (fp8_rows_bytes)
  std::vector<char> fp8_scratch;
  std::vector<float> grad_w13, grad_w2;

  explicit WgradProblem(Fp8Wgrad wgrad) {
    std::mt19937_64 rng(9);
    x_MD = random_bf16(rng, M * D, 1.0);
    grad_h13_M2F = random_bf16(rng, M * 2 * F, 1.0);
    grad_h3_MD = random_bf16(rng, M * D, 1.0);
    h_MF = random_bf16(rng, M * F, 1.0);
    x_rows.resize(static_cast<size_t>(align_bytes(M * D * 2)));
    auto* q = reinterpret_cast<uint8_t*>(x_rows.data());
    auto* sc = reinterpret_cast<float*>(x_rows.data() + fp8_rows_scales_offset(M, D));
    fp8_quantize_rows_s_major(x_MD.data(), M, D, q, sc, fp8_rows_ld(M));
    fp8_scratch.resize(static_cast<size_t>(fp8_scratch_layout(dims(), M, wgrad).total));
    grad_w13.assign(static_cast<size_t>(E * 2 * F * D), -1.0f);
    grad_w2.assign(static_cast<size_t>(E * D * F), -1.0f);
    header[kLayoutRows] = static_cast<int32_t>(M);
  }
  static Dims dims() { return Dims{8, D, F, 2, E, 1, false}; }
  Step step(bool fp8, Fp8Wgrad wgrad) {
    Step s;
    s.dims = dims();
    s.capacity_rows = M;
    s.layout.header = header.data();
    s.layout.expert_offsets_E1 = offsets;
    s.x_gathered_MD = reinterpret_cast<bf16_t*>(x_rows.data());
    s.grad_h13_M2F = grad_h13_M2F.data();
    s.grad_h3_MD = grad_h3_MD.data();
    s.h_MF = h_MF.data();
    s.grad_w13_EFD = grad_w13.data();
    s.grad_w2_EDF = grad_w2.data();
    s.wgrad_dtype = DType::f32;
    s.fp8 = fp8;
    s.fp8_wgrad = wgrad;
    s.fp8_scratch = fp8_scratch.data();
    return s;
  }
};

// rel-L2 of grad_w13 against the float64 WGRAD of grad_h13 and x_used (what the WGRAD should see).
double w13_rel_l2(const WgradProblem& p, const std::vector<float>& x_used) {
  const int64_t D = WgradProblem::D, F2 = 2 * WgradProblem::F;
  double err = 0.0, norm = 0.0;
  for (int e = 0; e < WgradProblem::E; ++e) {
    for (int64_t j = 0; j < F2; ++j) {
      for (int64_t d = 0; d < D; ++d) {
        double ref = 0.0;
        for (int64_t m = p.offsets[e]; m < p.offsets[e + 1]; ++m) {
          ref += static_cast<double>(bf16_to_float(p.grad_h13_M2F[m * F2 + j])) * x_used[m * D + d];
        }
        const double got = p.grad_w13[(e * F2 + j) * D + d];
        err += (got - ref) * (got - ref);
        norm += ref * ref;
      }
    }
  }
  return std::sqrt(err / norm);
}

// Config.fp8_wgrad = bf16: W2's WGRAD is the bf16 path's on the same bf16 grad_h3 and h, W13's
// the bf16 path's on x decoded to bf16, bitwise; against the float64 WGRAD of those operands it
// is within the bf16 WGRAD bound (fp32 sums of exact products), where the FP8 WGRAD on the same
// data carries its column quantization.
TEST(Fp8Steps, WgradBf16IsTheBf16WgradOnTheDecodedRows) {
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const int64_t M = WgradProblem::M, D = WgradProblem::D;
  WgradProblem p(Fp8Wgrad::bf16);
  cpu->w2_wgrad(p.step(true, Fp8Wgrad::bf16));
  cpu->w13_wgrad(p.step(true, Fp8Wgrad::bf16));
  const std::vector<float> w13 = p.grad_w13, w2 = p.grad_w2;

  // The bf16 path on x decoded to bf16 in a plain bf16 x_gathered.
  WgradProblem b(Fp8Wgrad::bf16);
  std::vector<bf16_t> x_bf16(static_cast<size_t>(M * D));
  fp8_decode_rows_bf16(reinterpret_cast<const uint8_t*>(b.x_rows.data()),
                       reinterpret_cast<const float*>(b.x_rows.data() + fp8_rows_scales_offset(M, D)),
                       fp8_rows_ld(M), M, D, x_bf16.data());
  Step plain = b.step(false, Fp8Wgrad::fp8);
  plain.x_gathered_MD = x_bf16.data();
  cpu->w2_wgrad(plain);
  cpu->w13_wgrad(plain);
  EXPECT_EQ(w13, b.grad_w13);
  EXPECT_EQ(w2, b.grad_w2);

  std::vector<float> x_used(static_cast<size_t>(M * D));
  for (size_t i = 0; i < x_used.size(); ++i) x_used[i] = bf16_to_float(x_bf16[i]);
  const double bf16_err = w13_rel_l2(p, x_used);
  EXPECT_LE(bf16_err, epmoe::test::rel_l2_bound(Precision::bf16, epmoe::test::Output::grad_w13));
  EXPECT_LT(bf16_err, 1e-6);  // fp32 sums of exact bf16 products: far below one bf16 rounding

  WgradProblem f(Fp8Wgrad::fp8);
  cpu->w13_wgrad(f.step(true, Fp8Wgrad::fp8));
  const double fp8_err = w13_rel_l2(f, x_used);
  EXPECT_GT(fp8_err, 1e-2) << "the FP8 WGRAD's column quantization (~2.6e-2 per operand)";

  // A skipped step writes zeros, as the bf16 path does.
  p.header[kLayoutSkip] = 1;
  cpu->w13_wgrad(p.step(true, Fp8Wgrad::bf16));
  for (float v : p.grad_w13) ASSERT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace epmoe::cpu
