// GPU test support for the FP8 grouped GEMM (cuda/gemm/fp8_gemm.h): a problem's codes and scales
// on the host (sized from a GroupedShape, filled by the test), its device copies and argument
// block, runs into plain rows and into combine slots, the received-rows operand, the CPU twin's
// output, and the bitwise comparison of two outputs (two kernels, or a kernel and the twin).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cpu/gemm_fp8_reference.h"
#include "cuda/gemm/fp8_gemm.h"
#include "device_buffer.h"
#include "grouped_shape.h"

namespace epmoe::test {

// E4M3 codes of the integers -3 .. 3: every 128-deep block sum is an integer of magnitude
// <= 128 * 9 < 2^11, exact in fp32 and in the tensor core's fp8 accumulation, so a kernel and the
// CPU twin agree bitwise.
inline constexpr uint8_t kE4m3Ints[7] = {0xC8, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x48};

// A [M, K] with S-major scales [S, ld_sa] times each expert's B [N, K] with scales [E, B, S].
struct Fp8GemmProblem {
  GroupedShape shape;
  int E = 0;
  int64_t M = 0, N = 0, K = 0, S = 0, B = 0, ld_sa = 0;
  std::vector<int32_t> offsets;
  std::vector<uint8_t> a, b;
  std::vector<float> sa_SM, sb;

  // Sizes only: fill() or the test sets the data.
  explicit Fp8GemmProblem(const GroupedShape& s)
      : shape(s), E(static_cast<int>(s.rows_E.size())), N(s.N), K(s.K), offsets(group_offsets(s.rows_E)) {
    M = offsets.back() + s.spare_rows;
    S = (K + 127) / 128;
    B = (N + 127) / 128;
    ld_sa = (M + 3) / 4 * 4;
  }

  // The codes of A, then of B, from code(); then the scales of A, then of B, uniform in [0.01, 3)
  // from rng.
  template <class Code>
  void fill(Code&& code, std::mt19937& rng) {
    a.resize(static_cast<size_t>(M * K));
    b.resize(static_cast<size_t>(E * N * K));
    for (uint8_t& v : a) v = code();
    for (uint8_t& v : b) v = code();
    std::uniform_real_distribution<float> scale(0.01f, 3.0f);
    sa_SM.resize(static_cast<size_t>(S * ld_sa));
    for (float& v : sa_SM) v = scale(rng);
    sb.resize(static_cast<size_t>(E * B * S));
    for (float& v : sb) v = scale(rng);
  }

  // The CPU twin's [M, N] output (0xA5A5 outside the groups); magnitude: its abs_MN.
  std::vector<bf16_t> reference(std::vector<float>* magnitude = nullptr) const {
    std::vector<bf16_t> out(static_cast<size_t>(M * N), static_cast<bf16_t>(0xA5A5));
    if (magnitude != nullptr) magnitude->assign(out.size(), 0.0f);
    cpu::fp8_grouped_gemm_reference(a.data(), sa_SM.data(), ld_sa, b.data(), sb.data(), offsets.data(), E, N, K,
                                    out.data(), N, magnitude != nullptr ? magnitude->data() : nullptr);
    return out;
  }

  std::string name() const { return describe(shape); }
};

// Device copies of a problem.
struct Fp8GemmDevice {
  Dev<uint8_t> a, b;
  Dev<float> sa, sb;
  Dev<int32_t> offsets;
  explicit Fp8GemmDevice(const Fp8GemmProblem& p)
      : a(p.a), b(p.b), sa(p.sa_SM), sb(p.sb), offsets(p.offsets) {}

  // The problem's argument block on these copies; the output (and tile, loop) is the caller's.
  cuda::Fp8GroupedGemmArgs args(const Fp8GemmProblem& p) const {
    cuda::Fp8GroupedGemmArgs x;
    x.a_MK = a.ptr;
    x.a_scales_SM = sa.ptr;
    x.ld_a_scales = p.ld_sa;
    x.b_ENK = b.ptr;
    x.b_scales_EBS = sb.ptr;
    x.offsets_E1 = offsets.ptr;
    x.E = p.E;
    x.M = p.M;
    x.N = p.N;
    x.K = p.K;
    return x;
  }
};

// Runs x into plain rows: the [M, N] output, 0xA5A5 where the kernel wrote nothing.
inline std::vector<bf16_t> run_rows(const Fp8GemmProblem& p, cuda::Fp8GroupedGemmArgs x) {
  Dev<bf16_t> out(static_cast<size_t>(p.M * p.N));
  x.out_MN = out.ptr;
  x.ld_out = p.N;
  cuda::fp8_grouped_gemm(x, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return out.get();
}

// Combine slots for the scatter epilogue (R = 1): row m goes to slot recv_src_M[m] of a random
// permutation of T * top_k slots, T = ceil(M / top_k) + 3 (spare slots stay 0xA5A5).
struct ScatterSlots {
  int64_t T = 0;
  int top_k = 0;
  std::vector<int32_t> recv_src_M;  // encode_src of each row's slot
};

inline ScatterSlots scatter_slots(int64_t M, int top_k, std::mt19937& rng) {
  ScatterSlots s;
  s.top_k = top_k;
  s.T = (M + top_k - 1) / top_k + 3;
  std::vector<int32_t> slots(static_cast<size_t>(s.T * top_k));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  s.recv_src_M.assign(slots.begin(), slots.begin() + M);
  for (int32_t& v : s.recv_src_M) v = encode_src(0, v / top_k, v % top_k, s.T, top_k);
  return s;
}

// Runs x into combine slots (recv_src_M: the device copy of s.recv_src_M): the [T * top_k, N]
// combine buffer.
inline std::vector<bf16_t> run_scatter(const Fp8GemmProblem& p, cuda::Fp8GroupedGemmArgs x, const ScatterSlots& s,
                                       const int32_t* recv_src_M) {
  Dev<bf16_t> combine(static_cast<size_t>(s.T * s.top_k * p.N));
  Dev<bf16_t*> table(std::vector<bf16_t*>{combine.ptr});
  x.ld_out = 0;
  x.combine_R = table.ptr;
  x.recv_src_M = recv_src_M;
  x.T = s.T;
  x.top_k = s.top_k;
  cuda::fp8_grouped_gemm(x, nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return combine.get();
}

// The problem's A as a received-rows operand (a_rows_1, core/fp8_terms.h): the codes of the
// grouped rows, then their scales at fp8_rows_scales_offset; the buffer covers all M rows of
// codes (the TMA reads them; rows past the count read what follows, and are masked).
inline std::vector<uint8_t> received_rows(const Fp8GemmProblem& p) {
  const int64_t count = p.offsets.back();
  const int64_t ld = fp8_rows_ld(count), scales_at = fp8_rows_scales_offset(count, p.K);
  std::vector<uint8_t> rows(static_cast<size_t>(std::max(fp8_rows_bytes(count, p.K), p.M * p.K)), 0);
  std::copy(p.a.begin(), p.a.begin() + count * p.K, rows.begin());
  for (int64_t kb = 0; kb < p.S; ++kb) {
    for (int64_t m = 0; m < count; ++m) {
      std::memcpy(&rows[static_cast<size_t>(scales_at + (kb * ld + m) * 4)],
                  &p.sa_SM[static_cast<size_t>(kb * p.ld_sa + m)], 4);
    }
  }
  return rows;
}

// x reading A from a received-rows buffer with its row count on the device.
inline cuda::Fp8GroupedGemmArgs with_received_rows(cuda::Fp8GroupedGemmArgs x, const uint8_t* rows,
                                                   const int32_t* count_1) {
  x.a_MK = rows;
  x.a_scales_SM = nullptr;
  x.ld_a_scales = 0;
  x.a_rows_1 = count_1;
  return x;
}

// Group rows of a plain-rows output that still hold the 0xA5A5 fill: the kernel missed them.
inline size_t untouched(const Fp8GemmProblem& p, const std::vector<bf16_t>& out) {
  size_t n = 0;
  for (int64_t i = 0; i < p.offsets.back() * p.N; ++i) n += out[static_cast<size_t>(i)] == 0xA5A5;
  return n;
}

// Expects got equal to want bit for bit ([rows, N]); names the first 8 elements that differ and
// prints their count.
inline void expect_bitwise(const std::vector<bf16_t>& want, const std::vector<bf16_t>& got, int64_t N,
                           const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const size_t n = static_cast<size_t>(N);
  size_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == got[i]) continue;
    if (differ++ < 8) {
      ADD_FAILURE() << what << ": row " << i / n << " col " << i % n << ": " << bf16_to_float(want[i]) << " (0x"
                    << std::hex << want[i] << ") vs " << bf16_to_float(got[i]) << " (0x" << got[i] << std::dec
                    << ")";
    }
  }
  std::printf("%s: %zu of %zu outputs differ\n", what.c_str(), differ, want.size());
  EXPECT_EQ(differ, 0u) << what;
}

}  // namespace epmoe::test
