// CPU reference stages of the forward: publish, route, dispatch, W13 (+SwiGLU), W2 (+scatter),
// reduce. Each stage after route does nothing (reduce: writes zeros) when the step is skipped.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/activation.h"
#include "cpu/cpu_backend.h"
#include "cpu/gemm_reference.h"

namespace epmoe::cpu {

namespace {

int64_t read_id(const Step& s, int64_t i) {
  return s.ids_dtype == DType::i64 ? static_cast<const int64_t*>(s.ids_TK)[i]
                                   : static_cast<const int32_t*>(s.ids_TK)[i];
}

float read_score(const Step& s, int64_t i) {
  return s.scores_dtype == DType::bf16 ? bf16_to_float(static_cast<const bf16_t*>(s.scores_TK)[i])
                                       : static_cast<const float*>(s.scores_TK)[i];
}

}  // namespace

void record_input_error(RoutingHeader& h, StatusCode code, StatusArg arg, int64_t value,
                        int64_t bound, int64_t index) {
  if (h.error_code != 0) return;  // the first error in check order wins
  h.error_code = static_cast<int32_t>(code);
  h.error_arg = static_cast<int32_t>(arg);
  h.error_value = value;
  h.error_bound = bound;
  h.error_index = index;
}

void publish_routing(const Step& s, int64_t live, RoutingHeader* errors) {
  const int64_t T = s.dims.T, K = s.dims.K;
  const int64_t experts = static_cast<int64_t>(s.dims.E) * s.dims.R;
  const RoutingView v = routing_view(s, s.rank);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      int32_t id = -1;
      float score = 0.0f;
      if (t < live) {
        const int64_t raw = read_id(s, i);
        if (raw >= 0 && raw < experts) {
          id = static_cast<int32_t>(raw);
        } else if (raw != -1 && errors != nullptr) {
          // Published as -1: a bad id is never used as an index, even though the step is skipped.
          record_input_error(*errors, StatusCode::expert_id_out_of_range, StatusArg::topk_ids_TK,
                             raw, experts, i);
        }
        score = read_score(s, i);
      }
      v.ids_TK[i] = id;
      v.scores_TK[i] = score;
    }
  }
}

void CpuBackend::publish_forward(const Step& s) {
  const int64_t D = s.dims.D, K = s.dims.K;
  const RoutingView v = routing_view(s, s.rank);
  RoutingHeader h;
  h.tokens = static_cast<int32_t>(s.tokens);
  h.sequence = s.sequence;
  // Checks run in the order live count, ids, x, scores; the first error is published.
  // The live count bounds every read of x, so it is checked whether or not check_inputs is set.
  int64_t live = s.num_tokens_1 != nullptr ? *s.num_tokens_1 : s.tokens;
  if (live < 0 || live > s.tokens) {
    record_input_error(h, StatusCode::token_count_mismatch, StatusArg::num_tokens_1, live, s.tokens,
                       0);
    live = live < 0 ? 0 : s.tokens;
  }
  h.live = static_cast<int32_t>(live);

  publish_routing(s, live, s.check_inputs ? &h : nullptr);
  if (s.check_inputs) {
    for (int64_t i = 0; i < live * D; ++i) {
      if (!is_finite_bf16(s.x_TD[i])) {
        record_input_error(h, StatusCode::non_finite_input, StatusArg::x_TD, 0, 0, i);
        break;
      }
    }
    // Scores of inactive routes are never read, so only active ones must be finite.
    for (int64_t i = 0; i < live * K; ++i) {
      if (v.ids_TK[i] >= 0 && !std::isfinite(v.scores_TK[i])) {
        record_input_error(h, StatusCode::non_finite_input, StatusArg::topk_scores_TK, 0, 0, i);
        break;
      }
    }
  }
  if (s.fp8) {
    fp8_publish_rows(s, s.x_TD, live);  // x crosses ranks as E4M3 rows + scales
  } else if (live > 0) {
    std::memcpy(s.dispatch_R[s.rank], s.x_TD, static_cast<size_t>(live * D) * 2);
  }
  *v.header = h;
}

void CpuBackend::route(const Step& s) {
  const int R = s.dims.R;
  const LayoutView& L = s.layout;
  for (int i = 0; i < kLayoutHeaderInts; ++i) L.header[i] = 0;
  std::fill_n(arrivals_B(s), arrival_blocks(s.capacity_rows), 0u);
  L.header[kLayoutTokens] = static_cast<int32_t>(s.tokens);
  L.header[kLayoutLive] = routing_view(s, s.rank).header->live;

  // Every rank walks the same headers in the same order, so all report the same first error.
  Status err;
  const RoutingHeader& h0 = *routing_view(s, 0).header;
  for (int q = 0; q < R && err.ok(); ++q) {
    const RoutingHeader& hq = *routing_view(s, q).header;
    if (hq.tokens != h0.tokens) {
      // Rank 0's T' is the reference (not this rank's), so every rank reports the same error.
      err.code = static_cast<int32_t>(StatusCode::token_count_mismatch);
      err.arg = static_cast<int32_t>(StatusArg::x_TD);
      err.rank = q;
      err.required = hq.tokens;
      err.available = h0.tokens;
    } else if (hq.error_code != 0) {
      err.code = hq.error_code;
      err.arg = hq.error_arg;
      err.rank = q;
      err.required = hq.error_value;
      err.available = hq.error_bound;
      err.index = hq.error_index;
    }
  }
  if (err.ok()) {
    std::vector<const int32_t*> ids_R(R);
    for (int q = 0; q < R; ++q) ids_R[q] = routing_view(s, q).ids_TK;
    build_layout_reference(ids_R.data(), s.dims.T, s.dims.K, s.dims.E, R, s.rank, s.capacity_rows,
                           L);
    for (int q = 0; q < R && err.ok(); ++q) {
      if (L.recv_rows_R[q] > s.capacity_rows) {
        err.code = static_cast<int32_t>(StatusCode::capacity_overflow);
        err.arg = static_cast<int32_t>(StatusArg::topk_ids_TK);
        err.rank = q;
        err.required = L.recv_rows_R[q];
        err.available = s.capacity_rows;
      }
    }
  }
  if (!err.ok()) {
    // OverflowPolicy::trap behaves the same on the CPU: the Context throws after the step.
    L.header[kLayoutSkip] = 1;
    report(s, err);
  }
}

// One read of each pulled source row, copied to every local row it feeds; with an arrival-gated
// W13 the arrival counters count the rows stored per 128-row block (the CUDA dispatch releases the
// same counts), otherwise they stay as route left them (zero).
void CpuBackend::dispatch(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  if (s.fp8) {
    fp8_dispatch(s);
    return;
  }
  const int64_t D = s.dims.D, T = s.dims.T;
  const int K = s.dims.K;
  uint32_t* arrived_B = s.arrival_gated_w13 ? arrivals_B(s) : nullptr;
  for (int64_t p = 0; p < pull_count(s); ++p) {
    const int32_t src = s.layout.pull_src_P[p];
    const bf16_t* row_D = s.dispatch_R[src / T] + (src % T) * D;
    for (int k = 0; k < K; ++k) {
      const int32_t m = s.layout.pull_rows_PK[p * K + k];
      if (m < 0) continue;
      std::memcpy(s.x_gathered_MD + m * D, row_D, static_cast<size_t>(D) * 2);
      if (arrived_B != nullptr) ++arrived_B[m / kArrivalBlockRows];
    }
  }
}

namespace {

// h[m] = bf16(act(h13[m])) for every received row.
void swiglu_rows(const Step& s) {
  const int64_t F = s.dims.F;
  for (int64_t m = 0; m < received_rows(s); ++m) {
    const bf16_t* h13 = s.h13_M2F + m * 2 * F;
    for (int64_t f = 0; f < F; ++f) {
      s.h_MF[m * F + f] = float_to_bf16(
          epmoe::swiglu_forward(bf16_to_float(h13[f]), bf16_to_float(h13[F + f]), s.act));
    }
  }
}

// Rows of expert e through W13 (w_NK: bf16 as given, fp32 decoded NVFP4, or an Mxfp8Expert whose
// row_times_nt quantizes the row 1x32): h13[m] =
// bf16(x_gathered[m] @ w13[e]^T); with h_MF also h[m] = bf16(act(h13[m])) from the rounded h13
// (the fused stage, same values as unfused).
template <class W>
void w13_expert_rows(const Step& s, int e, const W* w_NK, bf16_t* h_MF, float* acc_2F) {
  const int64_t D = s.dims.D, F = s.dims.F;
  for (int64_t m = expert_first_row(s, e); m < expert_last_row(s, e); ++m) {
    row_times_nt(s.x_gathered_MD + m * D, w_NK, 2 * F, D, acc_2F);
    bf16_t* h13 = s.h13_M2F + m * 2 * F;
    store_bf16(acc_2F, 2 * F, h13);
    if (h_MF == nullptr) continue;
    for (int64_t f = 0; f < F; ++f) {
      h_MF[m * F + f] = float_to_bf16(
          epmoe::swiglu_forward(bf16_to_float(h13[f]), bf16_to_float(h13[F + f]), s.act));
    }
  }
}

void w13_rows(const Step& s, bf16_t* h_MF) {
  if (s.fp8) {
    // FP8: the GEMM over all experts, then SwiGLU of the rounded h13 and h quantized for W2.
    fp8_w13(s);
    if (h_MF == nullptr) return;
    swiglu_rows(s);
    fp8_quantize_h(s);
    return;
  }
  std::vector<float> acc(static_cast<size_t>(2 * s.dims.F));
  for (int e = 0; e < s.dims.E; ++e) {
    if (s.nvfp4) {
      if (expert_first_row(s, e) == expert_last_row(s, e)) continue;
      const std::vector<float> w = nvfp4_w13_of(s, e);
      w13_expert_rows(s, e, w.data(), h_MF, acc.data());
    } else if (s.mxfp8) {
      if (expert_first_row(s, e) == expert_last_row(s, e)) continue;
      const Mxfp8Expert w = mxfp8_w13_of(s, e);
      w13_expert_rows(s, e, &w, h_MF, acc.data());
    } else {
      w13_expert_rows(s, e, w13_of(s, e), h_MF, acc.data());
    }
  }
}

// Row m of W2 (w_NK as in W13): bf16(h[m] @ w2[e]^T), into rows_MD[m] or, with scatter, the
// owner's combine slot.
template <class W>
void w2_expert_rows(const Step& s, int e, const W* w_NK, bool scatter, float* acc_D) {
  const int64_t D = s.dims.D, F = s.dims.F;
  for (int64_t m = expert_first_row(s, e); m < expert_last_row(s, e); ++m) {
    row_times_nt(s.h_MF + m * F, w_NK, D, F, acc_D);
    bf16_t* out = scatter ? combine_slot(s, row_source(s, m)) : s.rows_MD + m * D;
    store_bf16(acc_D, D, out);
  }
}

void w2_rows(const Step& s, bool scatter) {
  if (s.fp8) {
    fp8_w2(s, scatter);
    return;
  }
  std::vector<float> acc(static_cast<size_t>(s.dims.D));
  for (int e = 0; e < s.dims.E; ++e) {
    if (s.nvfp4) {
      if (expert_first_row(s, e) == expert_last_row(s, e)) continue;
      const std::vector<float> w = nvfp4_w2_of(s, e);
      w2_expert_rows(s, e, w.data(), scatter, acc.data());
    } else if (s.mxfp8) {
      if (expert_first_row(s, e) == expert_last_row(s, e)) continue;
      const Mxfp8Expert w = mxfp8_w2_of(s, e);
      w2_expert_rows(s, e, &w, scatter, acc.data());
    } else {
      w2_expert_rows(s, e, w2_of(s, e), scatter, acc.data());
    }
  }
}

}  // namespace

void CpuBackend::w13_gemm(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  w13_rows(s, nullptr);
}

void CpuBackend::swiglu_forward(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  swiglu_rows(s);
  if (s.fp8) fp8_quantize_h(s);
}

void CpuBackend::w13_swiglu(const Step& step) {
  const Step s = placed(step);
  if (skipped(s)) return;
  w13_rows(s, s.h_MF);
}

void CpuBackend::w2_gemm(const Step& step) {
  Step s = placed(step);
  if (skipped(s)) return;
  if (s.combine_per_rank) s.rows_MD = s.h3_MD;  // per-rank combine: the rows are h3, kept here
  w2_rows(s, false);
}

void CpuBackend::scatter_rows(const Step& s) {
  if (skipped(s)) return;
  const int64_t D = s.dims.D;
  for (int64_t m = 0; m < received_rows(s); ++m) {
    std::memcpy(combine_slot(s, row_source(s, m)), s.rows_MD + m * D, static_cast<size_t>(D) * 2);
  }
}

void CpuBackend::w2_scatter(const Step& s) {
  if (skipped(s)) return;
  w2_rows(s, true);
}

void CpuBackend::reduce_forward(const Step& step) {
  const Step s = placed(step);
  if (s.combine_per_rank) {
    reduce_partials(s, s.y_TD);
    return;
  }
  const int64_t D = s.dims.D, K = s.dims.K;
  std::memset(s.y_TD, 0, static_cast<size_t>(s.tokens * D) * 2);
  if (skipped(s)) return;
  const float* scores = routing_view(s, s.rank).scores_TK;
  const bf16_t* combine = s.combine_R[s.rank];
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t t = 0; t < live_rows(s); ++t) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t slot = t * K + k;
      if (s.layout.route_row_TK[slot] < 0) continue;  // inactive: the slot holds stale data
      const float score = scores[slot];
      const bf16_t* c = combine + slot * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += score * bf16_to_float(c[d]);
      if (s.h3_TKD != nullptr) {
        std::memcpy(s.h3_TKD + slot * D, c, static_cast<size_t>(D) * 2);
      }
    }
    store_bf16(acc.data(), D, s.y_TD + t * D);
  }
}

}  // namespace epmoe::cpu
