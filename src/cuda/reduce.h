// The owner-side reductions over a token's K route slots. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// y[t] = bf16(sum over active k, ascending, of score[t,k] * combine[t,k]) in fp32; zero rows past
// the live count and for a skipped step; h3 (the layer plan's h3_offset, or Step::h3_TKD without a
// plan; if it exists) receives the active combine slots.
void reduce_forward(const Step& s);
// grad_x[t] = bf16(sum over active k, ascending, of combine[t,k]) in fp32; zeros as above. With
// row scores (Step::row_scores_M) also grad_scores[t,k] = the value the expert rank stored in the
// own routing buffer's score slot (grad_scores below), 0 for inactive routes, padding rows and a
// skipped step.
void reduce_backward(const Step& s);
// With row scores, after the W2 DGRAD: each received row's grad_scores = its score_parts_MC summed
// in ascending chunk order (fp32), stored into the owner's routing buffer in place of the score.
// Without (layered API): grad_scores[t,k] = <grad_y[t], h3[t,k]> in fp32 (lane sums, then an xor
// tree; h3 placed as above, or the own combine buffer when there is none); 0 for inactive routes,
// padding rows and a skipped step.
void grad_scores(const Step& s);

}  // namespace epmoe::cuda
