// The owner-side reductions over a token's K route slots. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// y[t] = bf16(sum over active k, ascending, of score[t,k] * combine[t,k]) in fp32; zero rows past
// the live count and for a skipped step; h3 (the layer plan's h3_offset, or Step::h3_TKD without a
// plan; if it exists) receives the active combine slots.
void reduce_forward(const Step& s);
// grad_x[t] = bf16(sum over active k, ascending, of combine[t,k]) in fp32; zeros as above.
void reduce_backward(const Step& s);
// grad_scores[t,k] = sum over d ascending of grad_y[t,d] * h3[t,k,d] in fp32 (h3 placed as above,
// or the own combine buffer when there is none: a replayed layer rebuilt it there); 0 for
// inactive routes, padding rows and a skipped step.
void grad_scores(const Step& s);

}  // namespace epmoe::cuda
