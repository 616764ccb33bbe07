// CPU reference of MXFP8 inference (Config.precision = mxfp8; docs/formats.md "MXFP8 inference"):
// each GEMM quantizes its bf16 activation row 1x32 by the codec (core/formats/mxfp8.h) and
// multiplies it with the MXFP8 weight rows block by block: the exact sum of a 32-element k-block's
// code products rounded once to fp32, scaled by 2^(scale_a + scale_w), added to an fp32 total in
// k-block order. The CUDA twin: gemm/mxfp8_gemm.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/formats/codecs.h"
#include "cpu/cpu_backend.h"
#include "epmoe/error.h"

namespace epmoe::cpu {

namespace {

// Expert e of an MXFP8 weight [E, N, L]: its E4M3 codes decoded unscaled, its E8M0 codes.
Mxfp8Expert expert_of(const uint8_t* q_ENL, const uint8_t* scales_ENS, int e, int64_t N,
                      int64_t L) {
  const int64_t S = scale_blocks(L, kMxBlock);
  Mxfp8Expert w;
  w.N = N;
  w.L = L;
  w.v_NL.resize(static_cast<size_t>(N * L));
  const uint8_t* q_NL = q_ENL + e * N * L;
  for (int64_t i = 0; i < N * L; ++i) w.v_NL[static_cast<size_t>(i)] = e4m3_to_float(q_NL[i]);
  w.scales_NS = scales_ENS + e * N * S;
  return w;
}

}  // namespace

Mxfp8Expert mxfp8_w13_of(const Step& s, int e) {
  return expert_of(s.w13_mx_EFD, s.w13_mx_scales_EFS, e, 2 * s.dims.F, s.dims.D);
}

Mxfp8Expert mxfp8_w2_of(const Step& s, int e) {
  return expert_of(s.w2_mx_EDF, s.w2_mx_scales_EDS, e, s.dims.D, s.dims.F);
}

void row_times_nt(const bf16_t* a_L, const Mxfp8Expert* w, int64_t N, int64_t L, float* out_N) {
  EPMOE_ASSERT(w->N == N && w->L == L);
  const int64_t S = scale_blocks(L, kMxBlock);
  std::vector<float> a(static_cast<size_t>(L));
  for (int64_t k = 0; k < L; ++k) a[k] = bf16_to_float(a_L[k]);  // exact widening
  std::vector<uint8_t> q(static_cast<size_t>(L)), scale_a(static_cast<size_t>(S));
  mxfp8_quantize_rows(a.data(), 1, L, q.data(), scale_a.data());
  for (int64_t k = 0; k < L; ++k) a[k] = e4m3_to_float(q[k]);  // the codes' values, unscaled
  for (int64_t n = 0; n < N; ++n) {
    const float* w_L = w->v_NL.data() + n * L;
    const uint8_t* scale_w = w->scales_NS + n * S;
    float total = 0.0f;
    for (int64_t b = 0; b < S; ++b) {
      // Exact in double: an E4M3 product is a multiple of 2^-18 below 2^18 (8 significant bits),
      // so 32 of them sum below 2^23 on the 2^-18 grid, 41 bits. Rounded once to fp32.
      double block = 0.0;
      for (int64_t k = b * kMxBlock; k < std::min(L, (b + 1) * kMxBlock); ++k) {
        block += static_cast<double>(a[k]) * static_cast<double>(w_L[k]);
      }
      total +=
          mx_block_scaled(static_cast<float>(block), scale_a[static_cast<size_t>(b)], scale_w[b]);
    }
    out_N[n] = total;
  }
}

}  // namespace epmoe::cpu
