// The MXFP8 grouped GEMM tests' problem (test_gpu_gemm_mxfp8.cpp: the decode kernel;
// test_gpu_gemm_mxfp8_wgmma.cpp: the wgmma kernel, against the decode kernel too): a grouped
// shape's offsets, bf16 activations quantized 1x32 by the host codec, MXFP8 weights, one run of
// either kernel (cuda::Mxfp8Kernel), the CPU formula (cpu::row_times_nt's: each 32-element
// block's exact code-product sum rounded once to fp32, times 2^(sa + sw), summed in block order)
// with its per-element magnitude for error bounds; NaN-aware bitwise comparison.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/activation.h"
#include "core/formats/codecs.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "cuda/gemm/mxfp8_wgmma_gemm.h"
#include "cuda/mxfp8_forward.h"
#include "device_buffer.h"
#include "grouped_shape.h"

namespace epmoe::test::mxfp8_gemm {

using Shape = GroupedShape;

// Rows outside the groups: set before each run, expected unchanged after it.
inline constexpr bf16_t kUntouched = 0xA5A5;

struct Problem {
  Shape shape;
  int E = 0;
  int64_t M = 0, N = 0, K = 0, S = 0;
  std::vector<int32_t> offsets;
  std::vector<bf16_t> a;                   // [M, K]
  std::vector<uint8_t> a_codes, a_scales;  // the host codec's [M, K], [M, S]
  std::vector<uint8_t> w_codes, w_scales;  // [E, N, K], [E, N, S]

  explicit Problem(const Shape& s) : shape(s) {
    E = static_cast<int>(s.rows_E.size());
    N = s.N;
    K = s.K;
    S = K / kMxBlock;
    offsets = group_offsets(s.rows_E);
    M = offsets.back() + s.spare_rows;
  }

  void quantize_a() {
    std::vector<float> x(a.size());
    for (size_t i = 0; i < a.size(); ++i) x[i] = bf16_to_float(a[i]);
    a_codes.assign(static_cast<size_t>(M * K), 0);
    a_scales.assign(static_cast<size_t>(M * S), 0);
    mxfp8_quantize_rows(x.data(), M, K, a_codes.data(), a_scales.data());
  }

  // Random data through the host codec: activations normal * a_scale, then weights normal, times
  // 2^(expert % 7 - 3) with expert_scaled (so the scales differ per expert), in that draw order.
  void fill_through_codec(std::mt19937& rng, float a_scale, bool expert_scaled) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    a.resize(static_cast<size_t>(M * K));
    for (bf16_t& v : a) v = float_to_bf16(normal(rng) * a_scale);
    quantize_a();
    std::vector<float> w(static_cast<size_t>(E * N * K));
    for (size_t i = 0; i < w.size(); ++i) {
      const int expert = static_cast<int>(i / static_cast<size_t>(N * K));
      w[i] = expert_scaled ? normal(rng) * std::ldexp(1.0f, expert % 7 - 3) : normal(rng);
    }
    w_codes.assign(w.size(), 0);
    w_scales.assign(static_cast<size_t>(E * N * S), 0);
    mxfp8_quantize_rows(w.data(), E * N, K, w_codes.data(), w_scales.data());
  }

  cuda::Mxfp8GroupedGemmArgs args(const Dev<uint8_t>& daq, const Dev<uint8_t>& das,
                                  const Dev<uint8_t>& dwq, const Dev<uint8_t>& dws,
                                  const Dev<int32_t>& doff) const {
    cuda::Mxfp8GroupedGemmArgs x;
    x.a_codes_MK = daq.ptr;
    x.a_scales_MS = das.ptr;
    x.b_codes_ENK = dwq.ptr;
    x.b_scales_ENS = dws.ptr;
    x.offsets_E1 = doff.ptr;
    x.E = E;
    x.M = M;
    x.N = N;
    x.K = K;
    return x;
  }

  static void run(const cuda::Mxfp8GroupedGemmArgs& x, cuda::Mxfp8Kernel kernel,
                  cudaStream_t stream) {
    if (kernel == cuda::Mxfp8Kernel::wgmma) {
      cuda::mxfp8_grouped_gemm_wgmma(x, stream);
    } else {
      cuda::mxfp8_grouped_gemm(x, stream);
    }
  }

  // [M, N] output, with swiglu [M, N / 2]; rows outside the groups keep kUntouched.
  std::vector<bf16_t> run_gpu(cuda::Mxfp8Kernel kernel, const int32_t* skip = nullptr,
                              const ActivationParams* swiglu = nullptr) const {
    const int64_t cols = swiglu != nullptr ? N / 2 : N;
    Dev<uint8_t> daq(a_codes), das(a_scales), dwq(w_codes), dws(w_scales);
    Dev<int32_t> doff(offsets);
    Dev<bf16_t> dout(static_cast<size_t>(M * cols));
    cuda::Mxfp8GroupedGemmArgs x = args(daq, das, dwq, dws, doff);
    x.skip = skip;
    x.out_MN = dout.ptr;
    x.ld_out = cols;
    if (swiglu != nullptr) {
      x.swiglu = true;
      x.act = *swiglu;
    }
    run(x, kernel, nullptr);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return dout.get();
  }

  // The formula in fp32 (before the bf16 rounding), [M, N]; magnitude: sum_b 2^(sa+sw) sum_k
  // |qa qw| per element. Rows outside the groups: 0.
  std::vector<float> formula(std::vector<double>* magnitude = nullptr) const {
    std::vector<float> out(static_cast<size_t>(M * N), 0.0f);
    if (magnitude != nullptr) magnitude->assign(out.size(), 0.0);
    for (int e = 0; e < E; ++e) {
      for (int64_t m = offsets[static_cast<size_t>(e)]; m < offsets[static_cast<size_t>(e) + 1];
           ++m) {
        for (int64_t n = 0; n < N; ++n) {
          const int64_t row = e * N + n;
          float total = 0.0f;
          double mag = 0.0;
          for (int64_t b = 0; b < S; ++b) {
            double block = 0.0, block_mag = 0.0;  // exact: 41 bits at most
            for (int64_t k = b * kMxBlock; k < (b + 1) * kMxBlock; ++k) {
              const double p =
                  static_cast<double>(e4m3_to_float(a_codes[static_cast<size_t>(m * K + k)])) *
                  static_cast<double>(e4m3_to_float(w_codes[static_cast<size_t>(row * K + k)]));
              block += p;
              block_mag += std::fabs(p);
            }
            const uint8_t sa = a_scales[static_cast<size_t>(m * S + b)];
            const uint8_t sw = w_scales[static_cast<size_t>(row * S + b)];
            total += mx_block_scaled(static_cast<float>(block), sa, sw);
            mag += std::ldexp(block_mag, static_cast<int>(sa) + static_cast<int>(sw) - 254);
          }
          out[static_cast<size_t>(m * N + n)] = total;
          if (magnitude != nullptr) (*magnitude)[static_cast<size_t>(m * N + n)] = mag;
        }
      }
    }
    return out;
  }

  // bf16 of the formula, kUntouched outside the groups.
  std::vector<bf16_t> run_cpu(std::vector<double>* magnitude = nullptr) const {
    const std::vector<float> f = formula(magnitude);
    std::vector<bf16_t> out(f.size(), kUntouched);
    for (int64_t m = 0; m < offsets.back(); ++m) {
      for (int64_t n = 0; n < N; ++n) {
        out[static_cast<size_t>(m * N + n)] = float_to_bf16(f[static_cast<size_t>(m * N + n)]);
      }
    }
    return out;
  }
};

inline bool same(bf16_t x, bf16_t y) {
  const bool nan_x = std::isnan(bf16_to_float(x)), nan_y = std::isnan(bf16_to_float(y));
  return nan_x || nan_y ? nan_x && nan_y : x == y;
}

inline void expect_bitwise(const std::vector<bf16_t>& want, const std::vector<bf16_t>& got,
                           int64_t N, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int shown = 0;
  size_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (same(want[i], got[i])) continue;
    ++differ;
    if (shown++ < 8) {
      ADD_FAILURE() << what << ": row " << i / static_cast<size_t>(N) << " col "
                    << i % static_cast<size_t>(N) << ": want " << bf16_to_float(want[i]) << " (0x"
                    << std::hex << want[i] << "), got " << bf16_to_float(got[i]) << " (0x" << got[i]
                    << std::dec << ")";
    }
  }
  EXPECT_EQ(differ, 0u) << what;
}

// Rows stored into combine slots (R = 1): row m of the groups goes to slot recv_src[m] of a
// [T, K, N] buffer (a shuffled slot per row); every stored row equals the plain output's row.
inline void expect_scatter_equals_plain(const Problem& p, cuda::Mxfp8Kernel kernel,
                                        std::mt19937& rng, const std::string& what) {
  const int top_k = 2;
  const int64_t T = (p.M + top_k - 1) / top_k + 3;
  std::vector<int32_t> slots(static_cast<size_t>(T * top_k));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> recv_src(slots.begin(), slots.begin() + p.M);
  for (int32_t& v : recv_src) v = encode_src(0, v / top_k, v % top_k, T, top_k);
  Dev<uint8_t> daq(p.a_codes), das(p.a_scales), dwq(p.w_codes), dws(p.w_scales);
  Dev<int32_t> doff(p.offsets), dsrc(recv_src);
  Dev<bf16_t> combine(static_cast<size_t>(T * top_k * p.N));
  Dev<bf16_t*> table(std::vector<bf16_t*>{combine.ptr});
  cuda::Mxfp8GroupedGemmArgs x = p.args(daq, das, dwq, dws, doff);
  x.combine_R = table.ptr;
  x.recv_src_M = dsrc.ptr;
  x.T = T;
  x.top_k = top_k;
  Problem::run(x, kernel, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<bf16_t> got = combine.get(), plain = p.run_gpu(kernel);
  for (int64_t m = 0; m < p.offsets.back(); ++m) {
    const int64_t slot = src_slot(recv_src[static_cast<size_t>(m)], T, top_k);
    for (int64_t n = 0; n < p.N; ++n) {
      ASSERT_EQ(got[static_cast<size_t>(slot * p.N + n)], plain[static_cast<size_t>(m * p.N + n)])
          << what << " row " << m << " col " << n;
    }
  }
}

}  // namespace epmoe::test::mxfp8_gemm
