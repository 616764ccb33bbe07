// CPU reference stages of the FP8 training path (Config.precision = fp8_block): the bf16 stages
// call these where the precision changes what they do; every quantization and GEMM is one step of
// fp8_steps.h. Callers have checked skipped() and placed the step where the stage reads saved state.
#include <cstring>
#include <vector>

#include "core/formats/codecs.h"
#include "core/fp8_terms.h"
#include "cpu/cpu_backend.h"
#include "cpu/fp8_steps.h"
#include "cpu/gemm_fp8_reference.h"
#include "cpu/gemm_reference.h"

namespace epmoe::cpu {

namespace {

// E4M3 rows with S-major scales (fp8_rows_bytes): room for `rows` rows.
struct Fp8Rows {
  uint8_t* q;
  float* scales;
  int64_t ld;
};
Fp8Rows rows_at(void* base, int64_t rows, int64_t L) {
  char* b = static_cast<char*>(base);
  return {reinterpret_cast<uint8_t*>(b),
          reinterpret_cast<float*>(b + fp8_rows_scales_offset(rows, L)), fp8_rows_ld(rows)};
}

// The received x rows: in the x_gathered space, at the rows this rank received.
Fp8Rows x_rows(const Step& s) { return rows_at(s.x_gathered_MD, received_rows(s), s.dims.D); }
// Scratch operands: at capacity rows.
Fp8Rows scratch_rows(const Step& s, int64_t offset, int64_t L) {
  return rows_at(s.fp8_scratch + offset, s.capacity_rows, L);
}
Fp8Rows h_rows(const Step& s) {
  return scratch_rows(s, fp8_scratch_layout(s).h_q, s.dims.F);
}
Fp8Rows grad_h3_rows(const Step& s) {
  return scratch_rows(s, fp8_scratch_layout(s).grad_h3_q, s.dims.D);
}
Fp8Rows grad_h13_rows(const Step& s) {
  return scratch_rows(s, fp8_scratch_layout(s).grad_h13_q, 2 * s.dims.F);
}

std::vector<float> widen_rows(const bf16_t* x, int64_t rows, int64_t L) {
  std::vector<float> out(static_cast<size_t>(rows * L));
  for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(x[i]);
  return out;
}

// Each received row of out_MD to its owner's combine slot.
void scatter_to_owners(const Step& s, const bf16_t* out_MD) {
  const int64_t D = s.dims.D;
  for (int64_t m = 0; m < received_rows(s); ++m) {
    std::memcpy(combine_slot(s, row_source(s, m)), out_MD + m * D, static_cast<size_t>(D) * 2);
  }
}

// grad_w[e] (+)= a[e]^T @ b[e] from the column-quantized a_MP and b_MQ (fp32 inputs: bf16
// tensors widened, or the decoded E4M3 x rows).
void weight_grad(const Step& s, const std::vector<float>& a_MP, int64_t P,
                 const std::vector<float>& b_MQ, int64_t Q, void* grad_EPQ) {
  const int64_t per_expert = P * Q;
  const size_t elem = s.wgrad_dtype == DType::f32 ? 4 : 2;
  const Fp8ScratchLayout l = fp8_scratch_layout(s);
  uint8_t* qa = reinterpret_cast<uint8_t*>(s.fp8_scratch + l.col_a);
  float* sa = reinterpret_cast<float*>(s.fp8_scratch + l.col_a_scales);
  uint8_t* qb = reinterpret_cast<uint8_t*>(s.fp8_scratch + l.col_b);
  float* sb = reinterpret_cast<float*>(s.fp8_scratch + l.col_b_scales);
  const int32_t* offsets = s.layout.expert_offsets_E1;
  fp8_quantize_cols(a_MP.data(), P, offsets, s.dims.E, qa, sa);
  fp8_quantize_cols(b_MQ.data(), Q, offsets, s.dims.E, qb, sb);
  std::vector<float> acc(static_cast<size_t>(per_expert));
  for (int e = 0; e < s.dims.E; ++e) {
    void* out = static_cast<char*>(grad_EPQ) + static_cast<size_t>(e * per_expert) * elem;
    fp8_wgrad_expert_reference(qa, sa, P, qb, sb, Q, offsets, e, acc.data());
    store_wgrad(acc.data(), per_expert, out, s.wgrad_dtype, s.accumulate_wgrad);
  }
}

}  // namespace

void fp8_publish_rows(const Step& s, const bf16_t* x_TD, int64_t live) {
  const int64_t D = s.dims.D;
  const Fp8DispatchLayout l = fp8_dispatch_layout(s.dims.T, D);
  char* base = reinterpret_cast<char*>(s.dispatch_R[s.rank]);
  const std::vector<float> x = widen_rows(x_TD, live, D);
  fp8_quantize_rows(x.data(), live, D, reinterpret_cast<uint8_t*>(base + l.codes),
                    reinterpret_cast<float*>(base + l.scales));
}

// One read of each pulled source row (codes and scales), copied to every local row it feeds.
void fp8_dispatch(const Step& s) {
  const int64_t D = s.dims.D, T = s.dims.T, S = fp8_blocks(D);
  const int K = s.dims.K;
  const Fp8DispatchLayout l = fp8_dispatch_layout(T, D);
  const Fp8Rows x = x_rows(s);
  uint32_t* arrived_B = arrivals_B(s);
  for (int64_t p = 0; p < pull_count(s); ++p) {
    const int32_t src = s.layout.pull_src_P[p];
    const char* base = reinterpret_cast<const char*>(s.dispatch_R[src / T]);
    const uint8_t* codes_D = reinterpret_cast<const uint8_t*>(base + l.codes) + (src % T) * D;
    const float* scales_S = reinterpret_cast<const float*>(base + l.scales) + (src % T) * S;
    for (int k = 0; k < K; ++k) {
      const int32_t m = s.layout.pull_rows_PK[p * K + k];
      if (m < 0) continue;
      std::memcpy(x.q + m * D, codes_D, static_cast<size_t>(D));
      for (int64_t b = 0; b < S; ++b) x.scales[b * x.ld + m] = scales_S[b];
      ++arrived_B[m / kArrivalBlockRows];
    }
  }
}

void fp8_w13(const Step& s) {
  const Fp8Rows x = x_rows(s);
  fp8_grouped_gemm_reference(x.q, x.scales, x.ld, s.w13_q_EFD, s.w13_scales_EBS,
                             s.layout.expert_offsets_E1, s.dims.E, 2 * s.dims.F, s.dims.D,
                             s.h13_M2F, 2 * s.dims.F);
}

void fp8_quantize_h(const Step& s) {
  const Fp8Rows h = h_rows(s);
  fp8_quantize_rows_s_major(s.h_MF, received_rows(s), s.dims.F, h.q, h.scales, h.ld);
}

void fp8_w2(const Step& s, bool scatter) {
  const int64_t D = s.dims.D;
  const Fp8Rows h = h_rows(s);
  std::vector<bf16_t> rows;
  if (scatter) rows.resize(static_cast<size_t>(received_rows(s) * D));
  bf16_t* out = scatter ? rows.data() : s.rows_MD;
  fp8_grouped_gemm_reference(h.q, h.scales, h.ld, s.w2_q_EDF, s.w2_scales_EBS,
                             s.layout.expert_offsets_E1, s.dims.E, D, s.dims.F, out, D);
  if (scatter) scatter_to_owners(s, out);
}

void fp8_quantize_grad_h3(const Step& s) {
  const Fp8Rows g = grad_h3_rows(s);
  fp8_quantize_rows_s_major(s.grad_h3_MD, received_rows(s), s.dims.D, g.q, g.scales, g.ld);
}

void fp8_w2_dgrad(const Step& s, bf16_t* grad_h_MF) {
  const Fp8Rows g = grad_h3_rows(s);
  fp8_grouped_dgrad_reference(g.q, g.scales, g.ld, s.w2_q_EDF, s.w2_scales_EBS,
                              s.layout.expert_offsets_E1, s.dims.E, s.dims.D, s.dims.F, grad_h_MF,
                              s.dims.F);
}

void fp8_quantize_grad_h13(const Step& s) {
  const Fp8Rows g = grad_h13_rows(s);
  fp8_quantize_rows_s_major(s.grad_h13_M2F, received_rows(s), 2 * s.dims.F, g.q, g.scales, g.ld);
}

void fp8_w13_dgrad(const Step& s, bool scatter) {
  const int64_t D = s.dims.D;
  const Fp8Rows g = grad_h13_rows(s);
  std::vector<bf16_t> rows;
  if (scatter) rows.resize(static_cast<size_t>(received_rows(s) * D));
  bf16_t* out = scatter ? rows.data() : s.rows_MD;
  fp8_grouped_dgrad_reference(g.q, g.scales, g.ld, s.w13_q_EFD, s.w13_scales_EBS,
                              s.layout.expert_offsets_E1, s.dims.E, 2 * s.dims.F, D, out, D);
  if (scatter) scatter_to_owners(s, out);
}

void fp8_w2_wgrad(const Step& s) {
  // grad_w2[e][d, f] = sum_m grad_h3[m, d] * h[m, f]
  const int64_t rows = received_rows(s), D = s.dims.D, F = s.dims.F;
  weight_grad(s, widen_rows(s.grad_h3_MD, rows, D), D, widen_rows(s.h_MF, rows, F), F,
              s.grad_w2_EDF);
}

void fp8_w13_wgrad(const Step& s) {
  // grad_w13[e][j, d] = sum_m grad_h13[m, j] * x[m, d], x the decoded received E4M3 rows
  const int64_t rows = received_rows(s), D = s.dims.D, F = s.dims.F;
  const Fp8Rows x = x_rows(s);
  std::vector<float> x_MD(static_cast<size_t>(rows * D));
  fp8_dequantize_rows_s_major(x.q, x.scales, x.ld, rows, D, x_MD.data());
  weight_grad(s, widen_rows(s.grad_h13_M2F, rows, 2 * F), 2 * F, x_MD, D, s.grad_w13_EFD);
}

const bf16_t* fp8_decode_x_bf16(const Step& s) {
  const Fp8Rows x = x_rows(s);
  bf16_t* x_MD = reinterpret_cast<bf16_t*>(s.fp8_scratch + fp8_scratch_layout(s).x_bf16);
  fp8_decode_rows_bf16(x.q, x.scales, x.ld, received_rows(s), s.dims.D, x_MD);
  return x_MD;
}

}  // namespace epmoe::cpu
