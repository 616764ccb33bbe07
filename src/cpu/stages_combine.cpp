// CPU reference of the per-rank combine (Config.combine = per_rank): the send of one summed row
// per pull and the owner's sum over its ranks' partials. Sums run in fp32 with one rounding per
// product and per add (no FMA contraction), ascending k on the sending side and ascending rank
// on the owner, so the CUDA kernels reproduce them bitwise.
#include <cstring>
#include <vector>

#include "core/combine_ranks.h"
#include "cpu/cpu_backend.h"
#include "cpu/gemm_reference.h"

namespace epmoe::cpu {

// Rows of each pull (s, t): sum over its routes k (ascending) of [score[t,k] *] rows_MD[m_k],
// rounded once, into combine_R[s][t * R + rank].
void send_partials(const Step& s, const bf16_t* rows_MD, bool scaled) {
  if (skipped(s)) return;
  const int64_t D = s.dims.D, T = s.dims.T;
  const int K = s.dims.K, R = s.dims.R;
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t p = 0; p < pull_count(s); ++p) {
    const int32_t src = s.layout.pull_src_P[p];
    const int rank = static_cast<int>(src / T);
    const int64_t t = src % T;
    const float* scores_K = routing_view(s, rank).scores_TK + t * K;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int k = 0; k < K; ++k) {
      const int32_t m = s.layout.pull_rows_PK[p * K + k];
      if (m < 0) continue;
      const bf16_t* row_D = rows_MD + m * D;
      if (scaled) {
        const float score = scores_K[k];
        for (int64_t d = 0; d < D; ++d) acc[d] += score * bf16_to_float(row_D[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] += bf16_to_float(row_D[d]);
      }
    }
    store_bf16(acc.data(), D, s.combine_R[rank] + (t * R + s.rank) * D);
  }
}

// out[t] = bf16(sum over the ranks q holding t's routes, ascending, of combine[t, q]); zero rows
// past the live count.
void reduce_partials(const Step& s, bf16_t* out_TD) {
  const int64_t D = s.dims.D, K = s.dims.K;
  const int R = s.dims.R;
  std::memset(out_TD, 0, static_cast<size_t>(s.tokens * D) * 2);
  if (skipped(s)) return;
  const int32_t* ids_TK = routing_view(s, s.rank).ids_TK;
  const bf16_t* combine_TRD = s.combine_R[s.rank];
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t t = 0; t < live_rows(s); ++t) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int q = next_partial_rank(ids_TK + t * K, s.dims.K, s.dims.E, -1); q >= 0;
         q = next_partial_rank(ids_TK + t * K, s.dims.K, s.dims.E, q)) {
      const bf16_t* c = combine_TRD + (t * R + q) * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += bf16_to_float(c[d]);
    }
    store_bf16(acc.data(), D, out_TD + t * D);
  }
}

// grad_scores[t,k] = the expert rank's result for active routes of live rows, else 0: the
// grad_scores stage stored it into this rank's routing buffer in place of the score.
void copy_grad_scores(const Step& s) {
  const int64_t K = s.dims.K;
  for (int64_t i = 0; i < s.tokens * K; ++i) s.grad_scores_TK[i] = 0.0f;
  if (skipped(s)) return;
  const float* scores_TK = routing_view(s, s.rank).scores_TK;
  for (int64_t i = 0; i < live_rows(s) * K; ++i) {
    if (s.layout.route_row_TK[i] >= 0) s.grad_scores_TK[i] = scores_TK[i];
  }
}

// W2 wrote the rows into h3 (placed: the call scratch's rows_MD).
void CpuBackend::combine_send_forward(const Step& step) {
  const Step s = placed(step);
  send_partials(s, s.h3_MD, true);
}
void CpuBackend::combine_send_backward(const Step& s) { send_partials(s, s.rows_MD, false); }

}  // namespace epmoe::cpu
