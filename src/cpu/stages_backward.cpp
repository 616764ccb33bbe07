// CPU reference stages of the backward: publish grad_y, grad_scores, gather grad_h3, W2 DGRAD
// (+SwiGLU backward), W2 WGRAD, W13 DGRAD (+scatter), W13 WGRAD, reduce. The layout is the saved
// forward's; when its step was skipped the stages write zeros to their outputs and nothing else.
#include <cstring>
#include <vector>

#include "core/activation.h"
#include "cpu/cpu_backend.h"
#include "cpu/gemm_reference.h"

namespace epmoe::cpu {

namespace {

// The score after the W2 DGRAD (Step::row_scores_M): dh = the bf16 unscaled DGRAD row;
// grad_h13[m] = bf16(act'(h13[m]) * (score * dh)), h[m] = bf16(score * act(h13[m])) for the W2
// weight gradient, and the partials of <dh, bf16(act(h13[m]))> per 64-column chunk in the CUDA
// epilogue's order: 8 columns per segment summed in ascending order, then the 8 segments by the
// xor tree ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)). Products of two bf16 are exact.
void scored_swiglu_backward_row(const Step& s, int64_t m, const bf16_t* dh_F) {
  const int64_t F = s.dims.F, chunks = score_chunks(F);
  const float score = s.row_scores_M[m];
  const bf16_t* h13 = s.h13_M2F + m * 2 * F;
  bf16_t* grad_h13 = s.grad_h13_M2F + m * 2 * F;
  for (int64_t c = 0; c < chunks; ++c) {
    float seg[8];
    for (int64_t j = 0; j < 8; ++j) {
      seg[j] = 0.0f;
      for (int64_t f = c * kScoreChunkCols + 8 * j; f < c * kScoreChunkCols + 8 * j + 8 && f < F; ++f) {
        const float gate = bf16_to_float(h13[f]);
        const float up = bf16_to_float(h13[F + f]);
        const float dh = bf16_to_float(dh_F[f]);
        float d_gate = 0.0f, d_up = 0.0f;
        epmoe::swiglu_backward(gate, up, score * dh, s.act, d_gate, d_up);
        grad_h13[f] = float_to_bf16(d_gate);
        grad_h13[F + f] = float_to_bf16(d_up);
        const float h = epmoe::swiglu_forward(gate, up, s.act);
        s.h_MF[m * F + f] = float_to_bf16(score * h);
        seg[j] += dh * bf16_to_float(float_to_bf16(h));
      }
    }
    s.score_parts_MC[m * chunks + c] =
        ((seg[0] + seg[4]) + (seg[2] + seg[6])) + ((seg[1] + seg[5]) + (seg[3] + seg[7]));
  }
}

// grad_h13[m] = bf16(act'(h13[m]) * grad_h) and h[m] = bf16(act(h13[m])) for one row, from the
// bf16 grad_h row (the recomputed h feeds the W2 weight gradient); with row scores, the scored
// form above.
void swiglu_backward_row(const Step& s, int64_t m, const bf16_t* grad_h_F) {
  if (s.row_scores_M != nullptr) {
    scored_swiglu_backward_row(s, m, grad_h_F);
    return;
  }
  const int64_t F = s.dims.F;
  const bf16_t* h13 = s.h13_M2F + m * 2 * F;
  bf16_t* grad_h13 = s.grad_h13_M2F + m * 2 * F;
  for (int64_t f = 0; f < F; ++f) {
    const float gate = bf16_to_float(h13[f]);
    const float up = bf16_to_float(h13[F + f]);
    float d_gate = 0.0f, d_up = 0.0f;
    epmoe::swiglu_backward(gate, up, bf16_to_float(grad_h_F[f]), s.act, d_gate, d_up);
    grad_h13[f] = float_to_bf16(d_gate);
    grad_h13[F + f] = float_to_bf16(d_up);
    s.h_MF[m * F + f] = float_to_bf16(epmoe::swiglu_forward(gate, up, s.act));
  }
}

// grad_h[m] = bf16(grad_h3[m] @ w2[e]) for every row; into grad_h_MF (unfused) or straight into
// the SwiGLU backward of the row (fused, same values).
void w2_dgrad_rows(const Step& s, bool fuse_swiglu) {
  const int64_t D = s.dims.D, F = s.dims.F;
  if (s.fp8) {
    // FP8: the DGRAD over all experts into bf16 grad_h, then (fused) the SwiGLU backward of each
    // row and grad_h13 quantized for the W13 DGRAD, as the unfused stages do.
    std::vector<bf16_t> rows;
    if (fuse_swiglu) rows.resize(static_cast<size_t>(received_rows(s) * F));
    bf16_t* grad_h_MF = fuse_swiglu ? rows.data() : s.grad_h_MF;
    fp8_w2_dgrad(s, grad_h_MF);
    if (!fuse_swiglu) return;
    for (int64_t m = 0; m < received_rows(s); ++m) swiglu_backward_row(s, m, grad_h_MF + m * F);
    fp8_quantize_grad_h13(s);
    return;
  }
  std::vector<float> acc(static_cast<size_t>(F));
  std::vector<bf16_t> row(static_cast<size_t>(F));
  for (int e = 0; e < s.dims.E; ++e) {
    for (int64_t m = expert_first_row(s, e); m < expert_last_row(s, e); ++m) {
      row_times_nn(s.grad_h3_MD + m * D, w2_of(s, e), D, F, acc.data());
      bf16_t* grad_h = fuse_swiglu ? row.data() : s.grad_h_MF + m * F;
      store_bf16(acc.data(), F, grad_h);
      if (fuse_swiglu) swiglu_backward_row(s, m, grad_h);
    }
  }
}

// Input-gradient row m = bf16(grad_h13[m] @ w13[e]), into rows_MD[m] or the owner's combine slot.
void w13_dgrad_rows(const Step& s, bool scatter) {
  if (s.fp8) {
    fp8_w13_dgrad(s, scatter);
    return;
  }
  const int64_t D = s.dims.D, F = s.dims.F;
  std::vector<float> acc(static_cast<size_t>(D));
  for (int e = 0; e < s.dims.E; ++e) {
    for (int64_t m = expert_first_row(s, e); m < expert_last_row(s, e); ++m) {
      row_times_nn(s.grad_h13_M2F + m * 2 * F, w13_of(s, e), 2 * F, D, acc.data());
      bf16_t* out = scatter ? combine_slot(s, row_source(s, m)) : s.rows_MD + m * D;
      store_bf16(acc.data(), D, out);
    }
  }
}

// grad_w[e] (+)= a[e]^T @ b[e] over the rows of each expert: [E, P, Q] in wgrad dtype. A skipped
// step writes zeros (keeps the old values when accumulating).
void weight_grad(const Step& s, const bf16_t* a_MP, int64_t P, const bf16_t* b_MQ, int64_t Q,
                 void* grad_EPQ) {
  const int64_t per_expert = P * Q;
  const size_t elem = s.wgrad_dtype == DType::f32 ? 4 : 2;
  std::vector<float> acc(static_cast<size_t>(per_expert));
  for (int e = 0; e < s.dims.E; ++e) {
    void* out = static_cast<char*>(grad_EPQ) + static_cast<size_t>(e * per_expert) * elem;
    if (skipped(s)) {
      if (!s.accumulate_wgrad) std::memset(out, 0, static_cast<size_t>(per_expert) * elem);
      continue;
    }
    rows_outer_sum(a_MP, P, b_MQ, Q, expert_first_row(s, e), expert_last_row(s, e), acc.data());
    store_wgrad(acc.data(), per_expert, out, s.wgrad_dtype, s.accumulate_wgrad);
  }
}

}  // namespace

void CpuBackend::publish_backward(const Step& s) {
  if (skipped(s)) return;
  // The routes are the forward's: its live count (saved in the layout) bounds the rows.
  const int64_t live = live_rows(s);
  const RoutingView v = routing_view(s, s.rank);
  publish_routing(s, live, nullptr);
  if (live > 0) {
    std::memcpy(s.dispatch_R[s.rank], s.grad_y_TD, static_cast<size_t>(live * s.dims.D) * 2);
  }
  RoutingHeader h;
  h.tokens = static_cast<int32_t>(s.tokens);
  h.live = static_cast<int32_t>(live);
  h.sequence = s.sequence;
  *v.header = h;
}

// Score after the W2 DGRAD: each received route's grad_scores = the sum of its row's partials in
// ascending chunk order, stored into the owner's routing buffer in place of the score (only this
// rank reads that score, in gather_grad); the owner's reduce_backward copies it out.
namespace {
void scores_from_parts(const Step& s) {
  if (skipped(s)) return;
  const int64_t chunks = score_chunks(s.dims.F);
  for (int64_t m = 0; m < received_rows(s); ++m) {
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) acc += s.score_parts_MC[m * chunks + c];
    const RowSource src = row_source(s, m);
    routing_view(s, src.rank).scores_TK[src.slot] = acc;
  }
}
}  // namespace

void CpuBackend::grad_scores(const Step& step) {
  if (step.row_scores_M != nullptr) {
    scores_from_parts(step);
    return;
  }
  const Step s = placed(step);
  const int64_t D = s.dims.D, K = s.dims.K;
  for (int64_t i = 0; i < s.tokens * K; ++i) s.grad_scores_TK[i] = 0.0f;
  if (skipped(s)) return;
  // The saved copy: this rank's combine buffer may hold a later layer's rows by now.
  const bf16_t* h3 = s.h3_TKD != nullptr ? s.h3_TKD : s.combine_R[s.rank];
  for (int64_t t = 0; t < live_rows(s); ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = t * K + k;
      if (s.layout.route_row_TK[slot] < 0) continue;
      const bf16_t* g = s.grad_y_TD + t * D;
      const bf16_t* h = h3 + slot * D;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += bf16_to_float(g[d]) * bf16_to_float(h[d]);
      s.grad_scores_TK[slot] = acc;
    }
  }
}

// One read of each pulled grad_y row; every local row it feeds is copied unscaled with its
// route's score stored beside it (score after the W2 DGRAD, Step::row_scores_M), or, without row
// scores (layered API), scaled by its own route's score.
void CpuBackend::gather_grad(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  const int64_t D = s.dims.D, T = s.dims.T;
  const int K = s.dims.K;
  for (int64_t p = 0; p < pull_count(s); ++p) {
    const int32_t src = s.layout.pull_src_P[p];
    const int rank = static_cast<int>(src / T);
    const int64_t t = src % T;
    const bf16_t* g = s.dispatch_R[rank] + t * D;
    const float* scores_TK = routing_view(s, rank).scores_TK;
    for (int k = 0; k < K; ++k) {
      const int32_t m = s.layout.pull_rows_PK[p * K + k];
      if (m < 0) continue;
      const float score = scores_TK[t * K + k];
      bf16_t* out = s.grad_h3_MD + m * D;
      if (s.row_scores_M != nullptr) {
        s.row_scores_M[m] = score;
        std::memcpy(out, g, static_cast<size_t>(D) * 2);
        continue;
      }
      for (int64_t d = 0; d < D; ++d) out[d] = float_to_bf16(score * bf16_to_float(g[d]));
    }
  }
  if (s.fp8) fp8_quantize_grad_h3(s);  // rows along D for the W2 DGRAD
}

void CpuBackend::w2_dgrad(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  w2_dgrad_rows(s, false);
}

void CpuBackend::swiglu_backward(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  for (int64_t m = 0; m < received_rows(s); ++m) {
    swiglu_backward_row(s, m, s.grad_h_MF + m * s.dims.F);
  }
  if (s.fp8) fp8_quantize_grad_h13(s);  // rows along 2F for the W13 DGRAD
}

void CpuBackend::w2_dgrad_swiglu(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  w2_dgrad_rows(s, true);
}

void CpuBackend::w2_wgrad(const Step& s) {
  // Config.fp8_wgrad = bf16: the bf16 WGRAD below on the bf16 grad_h3 and h the FP8 steps keep.
  if (s.fp8 && s.fp8_wgrad == Fp8Wgrad::fp8 && !skipped(s)) {
    fp8_w2_wgrad(s);
    return;
  }
  // grad_w2[e][d, f] = sum_m grad_h3[m, d] * h[m, f]
  weight_grad(s, s.grad_h3_MD, s.dims.D, s.h_MF, s.dims.F, s.grad_w2_EDF);
}

void CpuBackend::w13_dgrad(const Step& s) {
  if (skipped(s)) return;
  w13_dgrad_rows(s, false);
}

void CpuBackend::w13_dgrad_scatter(const Step& s) {
  if (skipped(s)) return;
  w13_dgrad_rows(s, true);
}

void CpuBackend::w13_wgrad(const Step& step) {
  const Step s = placed(step);
  if (s.fp8 && s.fp8_wgrad == Fp8Wgrad::fp8 && !skipped(s)) {
    fp8_w13_wgrad(s);
    return;
  }
  // Config.fp8_wgrad = bf16: x is the received E4M3 rows decoded to bf16.
  const bf16_t* x_MD = s.fp8 && !skipped(s) ? fp8_decode_x_bf16(s) : s.x_gathered_MD;
  // grad_w13[e][j, d] = sum_m grad_h13[m, j] * x_gathered[m, d]
  weight_grad(s, s.grad_h13_M2F, 2 * s.dims.F, x_MD, s.dims.D, s.grad_w13_EFD);
}

void CpuBackend::reduce_backward(const Step& s) {
  if (s.combine_per_rank) {
    reduce_partials(s, s.grad_x_TD);
    copy_grad_scores(s);
    return;
  }
  if (s.row_scores_M != nullptr) copy_grad_scores(s);
  const int64_t D = s.dims.D, K = s.dims.K;
  std::memset(s.grad_x_TD, 0, static_cast<size_t>(s.tokens * D) * 2);
  if (skipped(s)) return;
  const bf16_t* combine = s.combine_R[s.rank];
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t t = 0; t < live_rows(s); ++t) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = t * K + k;
      if (s.layout.route_row_TK[slot] < 0) continue;
      const bf16_t* c = combine + slot * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += bf16_to_float(c[d]);
    }
    store_bf16(acc.data(), D, s.grad_x_TD + t * D);
  }
}

}  // namespace epmoe::cpu
