// Per-row and per-expert loops of the CPU reference: bf16 operands, fp32 accumulation in
// ascending index order (one product, one add per step: the sources build with -ffp-contract=off),
// results returned in fp32 for the caller to round once.
#pragma once

#include <cstdint>
#include <vector>

#include "core/numeric.h"
#include "epmoe/tensor.h"

namespace epmoe::cpu {

// out_N[n] = sum_{k = 0..K-1} a_K[k] * w_NK[n, k]      (row times the transpose of a weight)
inline void row_times_nt(const bf16_t* a_K, const bf16_t* w_NK, int64_t N, int64_t K,
                         float* out_N) {
  std::vector<float> a(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) a[k] = bf16_to_float(a_K[k]);
  for (int64_t n = 0; n < N; ++n) {
    const bf16_t* w = w_NK + n * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc += a[k] * bf16_to_float(w[k]);
    out_N[n] = acc;
  }
}

// The same with fp32 weights (NVFP4 weights decoded by the codec): the same order and roundings,
// so bf16-valued weights give the bf16 overload's bits.
inline void row_times_nt(const bf16_t* a_K, const float* w_NK, int64_t N, int64_t K,
                         float* out_N) {
  std::vector<float> a(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) a[k] = bf16_to_float(a_K[k]);
  for (int64_t n = 0; n < N; ++n) {
    const float* w = w_NK + n * K;
    float acc = 0.0f;
    for (int64_t k = 0; k < K; ++k) acc += a[k] * w[k];
    out_N[n] = acc;
  }
}

// out_N[n] = sum_{k = 0..K-1} a_K[k] * w_KN[k, n]      (row times a weight; same order per n)
inline void row_times_nn(const bf16_t* a_K, const bf16_t* w_KN, int64_t K, int64_t N,
                         float* out_N) {
  for (int64_t n = 0; n < N; ++n) out_N[n] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = bf16_to_float(a_K[k]);
    const bf16_t* w = w_KN + k * N;
    for (int64_t n = 0; n < N; ++n) out_N[n] += a * bf16_to_float(w[n]);
  }
}

// acc_PQ[p, q] = sum_{m = m0..m1-1} a_MP[m, p] * b_MQ[m, q]   (weight gradient of one expert)
inline void rows_outer_sum(const bf16_t* a_MP, int64_t P, const bf16_t* b_MQ, int64_t Q, int64_t m0,
                           int64_t m1, float* acc_PQ) {
  for (int64_t i = 0; i < P * Q; ++i) acc_PQ[i] = 0.0f;
  std::vector<float> b(static_cast<size_t>(Q));
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t q = 0; q < Q; ++q) b[q] = bf16_to_float(b_MQ[m * Q + q]);
    for (int64_t p = 0; p < P; ++p) {
      const float a = bf16_to_float(a_MP[m * P + p]);
      float* acc = acc_PQ + p * Q;
      for (int64_t q = 0; q < Q; ++q) acc[q] += a * b[q];
    }
  }
}

// Rounds fp32 values once into bf16 storage.
inline void store_bf16(const float* v, int64_t n, bf16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(v[i]);
}

// Weight gradient store in wgrad dtype (bf16 or f32): out[i] = round(v[i]) or, accumulating,
// round(float(out[i]) + v[i]).
inline void store_wgrad(const float* v, int64_t n, void* out, DType dtype, bool accumulate) {
  if (dtype == DType::f32) {
    float* o = static_cast<float*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = accumulate ? o[i] + v[i] : v[i];
    return;
  }
  bf16_t* o = static_cast<bf16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    o[i] = float_to_bf16(accumulate ? bf16_to_float(o[i]) + v[i] : v[i]);
  }
}

}  // namespace epmoe::cpu
