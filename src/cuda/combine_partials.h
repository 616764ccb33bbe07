// Per-rank combine (Config.combine = per_rank): one summed row per (token, source rank) crosses to
// the owner, which sums its ranks' partials. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// For every pull (s, t) of the layout: bf16(sum over the pull's routes k, ascending, of
// [score[t,k] *] rows_MD[m_k]) in fp32 into combine_R[s][t * R + rank] (scores f32 from the
// owner's routing buffer). scaled: forward (score-weighted); otherwise the backward's plain sum.
// forward: the rows are h3 (placed_h3_rows); backward: rows_MD.
void send_partials(const Step& s, bool scaled);
// out[t] = bf16(sum over the ranks q holding t's active routes, ascending, of combine[t, q]) in
// fp32; zero rows past the live count and for a skipped step. grad_scores_TK (nullable, backward):
// the expert ranks' results from the own routing buffer's score slots (reduce.h, grad_scores) for
// active routes of live rows, 0 elsewhere.
void reduce_partials(const Step& s, bf16_t* out_TD, const char* out_name, float* grad_scores_TK);

}  // namespace epmoe::cuda
