// CPU steps of the FP8 training path (fp8_steps.h). Built with -ffp-contract=off: the only fused
// multiply-adds are the explicit std::fma promotions.
#include "cpu/fp8_steps.h"

#include <cmath>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/fp8_block.h"

namespace epmoe::cpu {

namespace {
constexpr int64_t kBlock = kFp8RowBlock;
int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }
}  // namespace

void fp8_quantize_rows_s_major(const bf16_t* x_ML, int64_t rows, int64_t L, uint8_t* q_ML,
                               float* scales_SM, int64_t ld) {
  const int64_t S = blocks(L);
  std::vector<float> x(static_cast<size_t>(L));
  std::vector<float> s(static_cast<size_t>(S));
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t l = 0; l < L; ++l) x[l] = bf16_to_float(x_ML[m * L + l]);
    fp8_quantize_rows(x.data(), 1, L, q_ML + m * L, s.data());  // the codec, one row
    for (int64_t b = 0; b < S; ++b) scales_SM[b * ld + m] = s[b];
  }
}

void fp8_dequantize_rows_s_major(const uint8_t* q_ML, const float* scales_SM, int64_t ld,
                                 int64_t rows, int64_t L, float* x_ML) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t l = 0; l < L; ++l) {
      x_ML[m * L + l] = fp8_decode_fp32(q_ML[m * L + l], scales_SM[(l / kBlock) * ld + m]);
    }
  }
}

void fp8_decode_rows_bf16(const uint8_t* q_ML, const float* scales_SM, int64_t ld, int64_t rows,
                          int64_t L, bf16_t* x_ML) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t l = 0; l < L; ++l) {
      x_ML[m * L + l] =
          float_to_bf16(fp8_decode_fp32(q_ML[m * L + l], scales_SM[(l / kBlock) * ld + m]));
    }
  }
}

int64_t fp8_col_block_base(const int32_t* offsets_E1, int e) {
  int64_t base = 0;
  for (int i = 0; i < e; ++i) base += blocks(offsets_E1[i + 1] - offsets_E1[i]);
  return base;
}

void fp8_transpose_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                           int64_t L, uint8_t* qt_GLN, float* scales_t_GSB) {
  const int64_t B = blocks(N), S = blocks(L);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t l = 0; l < L; ++l) qt_GLN[(g * L + l) * N + n] = q_GNL[(g * N + n) * L + l];
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s < S; ++s) scales_t_GSB[(g * S + s) * B + b] = scales_GBS[(g * B + b) * S + s];
    }
  }
}

void fp8_quantize_cols(const float* x_ML, int64_t L, const int32_t* offsets_E1, int E,
                       uint8_t* q_ML, float* scales_BL) {
  int64_t b = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t m0 = offsets_E1[e]; m0 < offsets_E1[e + 1]; m0 += kBlock, ++b) {
      const int64_t m1 = m0 + kBlock < offsets_E1[e + 1] ? m0 + kBlock : offsets_E1[e + 1];
      for (int64_t l = 0; l < L; ++l) {
        uint32_t amax = 0;
        for (int64_t m = m0; m < m1; ++m) amax = amax_bits_add(amax, x_ML[m * L + l]);
        const float scale = fp8_scale_fp32(amax);
        scales_BL[b * L + l] = scale;
        for (int64_t m = m0; m < m1; ++m) q_ML[m * L + l] = fp8_encode_fp32(x_ML[m * L + l], scale);
      }
    }
  }
}

void fp8_transpose_cols(const uint8_t* q_ML, int64_t L, const int32_t* offsets_E1, int E,
                        int64_t K, uint8_t* qt_LK) {
  int64_t b = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t m0 = offsets_E1[e]; m0 < offsets_E1[e + 1]; m0 += kBlock, ++b) {
      const int64_t valid = offsets_E1[e + 1] - m0 < kBlock ? offsets_E1[e + 1] - m0 : kBlock;
      for (int64_t l = 0; l < L; ++l) {
        uint8_t* block_K = qt_LK + l * K + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) block_K[i] = i < valid ? q_ML[(m0 + i) * L + l] : 0;
      }
    }
  }
}

void fp8_grouped_dgrad_reference(const uint8_t* a_MK, const float* a_scales_SM, int64_t ld_sa,
                                 const uint8_t* w_EKN, const float* w_scales_EBS,
                                 const int32_t* offsets_E1, int E, int64_t K, int64_t N,
                                 bf16_t* out_MN, int64_t ld_out) {
  const int64_t SK = blocks(K), SN = blocks(N);
  std::vector<float> a(static_cast<size_t>(K));
  for (int e = 0; e < E; ++e) {
    const uint8_t* w_KN = w_EKN + static_cast<int64_t>(e) * K * N;
    const float* sw = w_scales_EBS + static_cast<int64_t>(e) * SK * SN;
    for (int64_t m = offsets_E1[e]; m < offsets_E1[e + 1]; ++m) {
      for (int64_t k = 0; k < K; ++k) a[k] = e4m3_to_float(a_MK[m * K + k]);
      for (int64_t n = 0; n < N; ++n) {
        float total = 0.0f;
        for (int64_t s = 0; s < SK; ++s) {
          const int64_t k1 = (s + 1) * kBlock < K ? (s + 1) * kBlock : K;
          float block = 0.0f;
          for (int64_t k = s * kBlock; k < k1; ++k) block += a[k] * e4m3_to_float(w_KN[k * N + n]);
          total = std::fma(block, a_scales_SM[s * ld_sa + m] * sw[s * SN + n / kBlock], total);
        }
        out_MN[m * ld_out + n] = float_to_bf16(total);
      }
    }
  }
}

void fp8_wgrad_expert_reference(const uint8_t* a_MP, const float* a_scales_BP, int64_t P,
                                const uint8_t* b_MQ, const float* b_scales_BQ, int64_t Q,
                                const int32_t* offsets_E1, int e, float* acc_PQ) {
  const int64_t m_begin = offsets_E1[e], m_end = offsets_E1[e + 1];
  const int64_t b0 = fp8_col_block_base(offsets_E1, e);
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t q = 0; q < Q; ++q) {
      float total = 0.0f;
      int64_t b = b0;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlock, ++b) {
        const int64_t m1 = m0 + kBlock < m_end ? m0 + kBlock : m_end;
        float block = 0.0f;
        for (int64_t m = m0; m < m1; ++m) {
          block += e4m3_to_float(a_MP[m * P + p]) * e4m3_to_float(b_MQ[m * Q + q]);
        }
        total = std::fma(block, a_scales_BP[b * P + p] * b_scales_BQ[b * Q + q], total);
      }
      acc_PQ[p * Q + q] = total;
    }
  }
}

}  // namespace epmoe::cpu
