// The FP8 backward's own kernels against their CPU twins, bitwise (cpu/fp8_steps.h):
// - the 128x128-block weight transpose (the DGRAD operand): codes and scales; and the DGRAD as the
//   backward runs it (transpose, then the FP8 grouped GEMM) against cpu::fp8_grouped_dgrad_reference
//   on exact blocks (every 128-deep block sum a small integer);
// - the 128x1 column quantization of the WGRAD operands (blocks from each expert's first row;
//   empty experts, partial blocks, rows outside every expert) with the codes transposed for the
//   FP8 WGRAD ([L, 128 blocks], partial blocks zero-padded: cpu::fp8_transpose_cols of the CPU's
//   codes), from bf16 rows and from E4M3 rows at a device-held offset; and the skip flag;
// - the E4M3 rows decoded to bf16 (Config.fp8_wgrad = bf16: the W13 WGRAD's x) against
//   cpu::fp8_decode_rows_bf16: rows at a device-held offset (8-byte aligned or not), device counts
//   M, below M and 0 (rows past the count untouched), the skip flag.
// Argument checks run without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/formats/fp8_block.h"
#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cpu/fp8_steps.h"
#include "cuda/formats/formats.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

std::vector<bf16_t> random_bf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bf16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    // Magnitudes over several binades, a few zeros: amaxes and scales vary per block.
    const float x = dist(rng) * std::exp2(static_cast<float>(static_cast<int>(i % 7) - 3));
    v[i] = float_to_bf16(i % 97 == 0 ? 0.0f : x);
  }
  return v;
}

TEST(GpuFp8Steps, TransposeWeightsMatchesCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  struct Shape {
    int64_t G, N, L;
  };
  for (const Shape& s : {Shape{1, 16, 16}, Shape{3, 48, 32}, Shape{2, 272, 144}, Shape{4, 256, 384},
                         Shape{2, 130, 260}}) {
    const int64_t B = fp8_blocks(s.N), S = fp8_blocks(s.L);
    std::mt19937_64 rng(static_cast<uint64_t>(s.G * 1000 + s.N + s.L));
    std::vector<uint8_t> q(static_cast<size_t>(s.G * s.N * s.L));
    for (auto& b : q) b = static_cast<uint8_t>(rng());
    std::vector<float> scales(static_cast<size_t>(s.G * B * S));
    for (auto& x : scales) x = static_cast<float>(rng() % 1000) / 7.0f;
    std::vector<uint8_t> qt(q.size());
    std::vector<float> st(scales.size());
    cpu::fp8_transpose_weights(q.data(), scales.data(), s.G, s.N, s.L, qt.data(), st.data());
    Dev<uint8_t> dq(q), dqt(q.size());
    Dev<float> ds(scales), dst(scales.size());
    cuda::fp8_transpose_weights(dq.ptr, ds.ptr, s.G, s.N, s.L, dqt.ptr, dst.ptr, nullptr);
    const std::string what = std::to_string(s.G) + "x" + std::to_string(s.N) + "x" + std::to_string(s.L);
    EXPECT_TRUE(dqt.get() == qt) << what << ": codes";
    EXPECT_TRUE(dst.get() == st) << what << ": scales";
  }
}

TEST(GpuFp8Steps, DgradOnTheTransposeMatchesCpuBitwiseOnExactBlocks) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    std::vector<int32_t> rows_E;
    int64_t K, N;  // the weight [E, K, N]: K contracted (W2: D), N out (W2: F)
  };
  const uint8_t kInts[7] = {0xC8, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x48};  // e4m3 -3 -2 -1 0 1 2 3
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> pick(0, 6);
  std::uniform_real_distribution<float> scale(0.01f, 3.0f);
  for (const Case& c : {Case{{300}, 256, 128}, Case{{0, 200, 1, 130}, 384, 272},
                        Case{{40, 90, 0}, 144, 528}}) {
    const int E = static_cast<int>(c.rows_E.size());
    std::vector<int32_t> off(1, 0);
    for (int32_t r : c.rows_E) off.push_back(off.back() + r);
    const int64_t M = off.back() + 3, ld = fp8_rows_ld(M);
    const int64_t SK = fp8_blocks(c.K), SN = fp8_blocks(c.N);
    std::vector<uint8_t> a(static_cast<size_t>(M * c.K)), w(static_cast<size_t>(E * c.K * c.N));
    for (auto& v : a) v = kInts[pick(rng)];
    for (auto& v : w) v = kInts[pick(rng)];
    std::vector<float> sa(static_cast<size_t>(SK * ld)), sw(static_cast<size_t>(E * SK * SN));
    for (auto& v : sa) v = scale(rng);
    for (auto& v : sw) v = scale(rng);
    std::vector<bf16_t> cpu(static_cast<size_t>(M * c.N), static_cast<bf16_t>(0xA5A5));
    cpu::fp8_grouped_dgrad_reference(a.data(), sa.data(), ld, w.data(), sw.data(), off.data(), E,
                                     c.K, c.N, cpu.data(), c.N);
    Dev<uint8_t> da(a), dw(w), dwt(w.size());
    Dev<float> dsa(sa), dsw(sw), dswt(sw.size());
    Dev<int32_t> doff(off);
    Dev<bf16_t> dout(cpu.size());
    cuda::fp8_transpose_weights(dw.ptr, dsw.ptr, E, c.K, c.N, dwt.ptr, dswt.ptr, nullptr);
    cuda::Fp8GroupedGemmArgs args;
    args.a_MK = da.ptr;
    args.a_scales_SM = dsa.ptr;
    args.ld_a_scales = ld;
    args.b_ENK = dwt.ptr;  // [E, N, K]
    args.b_scales_EBS = dswt.ptr;
    args.offsets_E1 = doff.ptr;
    args.E = E;
    args.M = M;
    args.N = c.N;
    args.K = c.K;
    args.out_MN = dout.ptr;
    args.ld_out = c.N;
    cuda::fp8_grouped_gemm(args, nullptr);
    const std::vector<bf16_t> gpu = dout.get();
    int64_t differ = 0;
    for (int64_t m = 0; m < off.back(); ++m) {
      for (int64_t n = 0; n < c.N; ++n) differ += gpu[static_cast<size_t>(m * c.N + n)] != cpu[static_cast<size_t>(m * c.N + n)];
    }
    EXPECT_EQ(differ, 0) << "K " << c.K << " N " << c.N << ": DGRAD outputs differ";
  }
}

struct ColsCase {
  std::vector<int32_t> rows_E;  // rows per expert
  int64_t M;                    // capacity (>= total rows: rows past them belong to no expert)
  int64_t L;
};

std::vector<int32_t> offsets_of(const std::vector<int32_t>& rows_E) {
  std::vector<int32_t> off(rows_E.size() + 1, 0);
  for (size_t e = 0; e < rows_E.size(); ++e) off[e + 1] = off[e] + rows_E[e];
  return off;
}

const std::vector<ColsCase>& cols_cases() {
  static const std::vector<ColsCase> cases = {
      {{5}, 8, 16},
      {{0, 130, 0, 1, 256, 127}, 600, 48},  // empty experts, partial and whole blocks, spare rows
      {{300, 17}, 320, 272},
      {{0, 0, 0, 0}, 16, 32},               // no rows at all
  };
  return cases;
}

// Transposed codes: [L, K] compared over every used block (padding included), the k range past
// them untouched (0xA5); scales over the used blocks.
void expect_cols_transposed_equal(const ColsCase& c, const std::vector<int32_t>& off,
                                  const std::vector<uint8_t>& q_ML, const std::vector<float>& s_cpu,
                                  const std::vector<uint8_t>& qt_gpu,
                                  const std::vector<float>& s_gpu, const std::string& what) {
  const int E = static_cast<int>(c.rows_E.size());
  const int64_t K = fp8_col_k(c.M, E), blocks = cpu::fp8_col_block_base(off.data(), E);
  std::vector<uint8_t> qt_cpu(static_cast<size_t>(c.L * K), 0xA5);
  cpu::fp8_transpose_cols(q_ML.data(), c.L, off.data(), E, K, qt_cpu.data());
  ASSERT_EQ(qt_gpu.size(), qt_cpu.size()) << what;
  int64_t bad_q = 0, bad_s = 0;
  for (size_t i = 0; i < qt_cpu.size(); ++i) bad_q += qt_gpu[i] != qt_cpu[i];
  for (int64_t i = 0; i < blocks * c.L; ++i) {
    bad_s += std::memcmp(&s_gpu[static_cast<size_t>(i)], &s_cpu[static_cast<size_t>(i)], 4) != 0;
  }
  EXPECT_EQ(bad_q, 0) << what << ": transposed codes differ (of " << qt_cpu.size() << ")";
  EXPECT_EQ(bad_s, 0) << what << ": scales differ";
}

TEST(GpuFp8Steps, ColumnQuantizationOfBf16RowsMatchesCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 120;
  for (const ColsCase& c : cols_cases()) {
    const int E = static_cast<int>(c.rows_E.size());
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(c.M * c.L), seed++);
    std::vector<float> xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_to_float(x[i]);
    const int64_t max_blocks = fp8_col_blocks(c.M, E), K = fp8_col_k(c.M, E);
    std::vector<uint8_t> q(x.size(), 0);
    std::vector<float> s(static_cast<size_t>(max_blocks * c.L), 0.0f);
    cpu::fp8_quantize_cols(xf.data(), c.L, off.data(), E, q.data(), s.data());
    const std::string what = "E " + std::to_string(E) + " M " + std::to_string(c.M) + " L " +
                             std::to_string(c.L);
    Dev<bf16_t> dx(x);
    Dev<int32_t> doff(off);
    Dev<uint8_t> dqt(static_cast<size_t>(c.L * K));
    Dev<float> ds(s.size());
    cuda::fp8_quantize_cols_transposed(dx.ptr, c.M, c.L, doff.ptr, E, nullptr, dqt.ptr, ds.ptr,
                                       max_blocks, nullptr);
    expect_cols_transposed_equal(c, off, q, s, dqt.get(), ds.get(), what);
    // A set skip flag: nothing written.
    Dev<int32_t> skip(std::vector<int32_t>{1});
    Dev<uint8_t> dq_skip(static_cast<size_t>(c.L * K));
    cuda::fp8_quantize_cols_transposed(dx.ptr, c.M, c.L, doff.ptr, E, skip.ptr, dq_skip.ptr,
                                       ds.ptr, max_blocks, nullptr);
    EXPECT_TRUE(dq_skip.get() == std::vector<uint8_t>(dq_skip.size, 0xA5)) << what << ": skipped";
  }
}

TEST(GpuFp8Steps, ColumnQuantizationOfE4m3RowsMatchesCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  uint64_t seed = 160;
  for (const ColsCase& c : cols_cases()) {
    if (c.L % 16 != 0) continue;
    const int E = static_cast<int>(c.rows_E.size());
    const std::vector<int32_t> off = offsets_of(c.rows_E);
    const int64_t rows = off[static_cast<size_t>(E)];
    const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(c.M * c.L), seed++);
    const int64_t pad = 256;  // the rows start at a device-held byte offset
    std::vector<char> buf(static_cast<size_t>(pad + fp8_rows_bytes(c.M, c.L)), 0);
    uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data() + pad);
    float* scales = reinterpret_cast<float*>(buf.data() + pad + fp8_rows_scales_offset(rows, c.L));
    cpu::fp8_quantize_rows_s_major(x.data(), rows, c.L, codes, scales, fp8_rows_ld(rows));
    std::vector<float> decoded(static_cast<size_t>(c.M * c.L), 0.0f);
    cpu::fp8_dequantize_rows_s_major(codes, scales, fp8_rows_ld(rows), rows, c.L, decoded.data());
    const int64_t max_blocks = fp8_col_blocks(c.M, E), K = fp8_col_k(c.M, E);
    std::vector<uint8_t> q(decoded.size(), 0);
    std::vector<float> s(static_cast<size_t>(max_blocks * c.L), 0.0f);
    cpu::fp8_quantize_cols(decoded.data(), c.L, off.data(), E, q.data(), s.data());
    Dev<char> dbuf(buf);
    Dev<int64_t> doffset(std::vector<int64_t>{pad});
    Dev<int32_t> drows(std::vector<int32_t>{static_cast<int32_t>(rows)});
    Dev<int32_t> doff(off);
    Dev<uint8_t> dqt(static_cast<size_t>(c.L * K));
    Dev<float> ds(s.size());
    cuda::fp8_quantize_cols_transposed_from_rows(dbuf.ptr, doffset.ptr, drows.ptr, c.M, c.L,
                                                 doff.ptr, E, nullptr, dqt.ptr, ds.ptr, max_blocks,
                                                 nullptr);
    expect_cols_transposed_equal(c, off, q, s, dqt.get(), ds.get(),
                                 "E4M3 rows, E " + std::to_string(E) + " L " + std::to_string(c.L));
  }
}

TEST(GpuFp8Steps, RowsDecodedToBf16MatchCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    int64_t M, L, rows;
  };
  uint64_t seed = 190;
  for (const Case& c : {Case{1, 16, 1}, Case{37, 144, 37}, Case{37, 144, 30}, Case{300, 272, 300},
                        Case{300, 272, 0}, Case{129, 2880, 129}, Case{64, 7168, 61}}) {
    for (int64_t pad : {int64_t{256}, int64_t{260}}) {  // 260: codes not 8-byte aligned
      const std::vector<bf16_t> x = random_bf16(static_cast<size_t>(c.rows * c.L), seed++);
      std::vector<char> buf(static_cast<size_t>(pad + fp8_rows_bytes(c.M, c.L)), 0);
      uint8_t* codes = reinterpret_cast<uint8_t*>(buf.data() + pad);
      float* scales =
          reinterpret_cast<float*>(buf.data() + pad + fp8_rows_scales_offset(c.rows, c.L));
      const int64_t ld = fp8_rows_ld(c.rows);
      cpu::fp8_quantize_rows_s_major(x.data(), c.rows, c.L, codes, scales, ld);
      std::vector<bf16_t> want(static_cast<size_t>(c.M * c.L), 0xA5A5);
      cpu::fp8_decode_rows_bf16(codes, scales, ld, c.rows, c.L, want.data());
      Dev<char> dbuf(buf);
      Dev<int64_t> doffset(std::vector<int64_t>{pad});
      Dev<int32_t> drows(std::vector<int32_t>{static_cast<int32_t>(c.rows)});
      Dev<bf16_t> dx(static_cast<size_t>(c.M * c.L));
      cuda::fp8_decode_rows_bf16_counted(dbuf.ptr, doffset.ptr, drows.ptr, c.M, c.L, nullptr,
                                         dx.ptr, nullptr);
      const std::vector<bf16_t> got = dx.get();
      int64_t bad = 0;
      for (size_t i = 0; i < want.size(); ++i) bad += got[i] != want[i];
      EXPECT_EQ(bad, 0) << "M " << c.M << " L " << c.L << " rows " << c.rows << " pad " << pad
                        << ": decoded values differ (rows past the count must stay 0xA5A5)";
      // A set skip flag: nothing written.
      Dev<int32_t> skip(std::vector<int32_t>{1});
      Dev<bf16_t> dskip(static_cast<size_t>(c.M * c.L));
      cuda::fp8_decode_rows_bf16_counted(dbuf.ptr, doffset.ptr, drows.ptr, c.M, c.L, skip.ptr,
                                         dskip.ptr, nullptr);
      EXPECT_TRUE(dskip.get() == std::vector<bf16_t>(dskip.size, 0xA5A5)) << "skipped";
    }
  }
}

TEST(GpuFp8Steps, ArgumentErrorsNameTheArgument) {
  try {
    cuda::fp8_quantize_cols_transposed(nullptr, 4, 16, nullptr, 1, nullptr, nullptr, nullptr, 5,
                                       nullptr);
    ADD_FAILURE() << "accepted a null x_ML";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "x_ML") << e.what();
  }
  try {
    cuda::fp8_transpose_weights(nullptr, nullptr, 1, 16, 16, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "accepted a null q_GNL";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "q_GNL") << e.what();
  }
  try {
    std::vector<bf16_t> host(64);  // a host pointer is enough: the checks run before any launch
    cuda::fp8_quantize_cols_transposed(host.data(), 4, 16, nullptr, 1, nullptr, nullptr, nullptr,
                                       5, nullptr);
    ADD_FAILURE() << "accepted a null qt_LK";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "qt_LK") << e.what();
  }
  try {
    cuda::fp8_decode_rows_bf16_counted(nullptr, nullptr, nullptr, 4, 16, nullptr, nullptr, nullptr);
    ADD_FAILURE() << "accepted a null rows";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "rows") << e.what();
  }
  try {
    std::vector<char> host(64);
    cuda::fp8_decode_rows_bf16_counted(host.data(), nullptr, nullptr, 4, 12, nullptr, nullptr,
                                       nullptr);
    ADD_FAILURE() << "accepted L = 12";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "L") << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
