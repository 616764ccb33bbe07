// dispatch / gather_grad: pull the rows of received routes from their owners' dispatch buffers
// into this rank's expert-grouped [M, D] buffer, one read per (source rank, token) fanned out to
// the token's local rows (the layout's pulls). Launchers only (no CUDA types).
#pragma once

#include <cstdint>

#include "core/step.h"

namespace epmoe::cuda {

// x_gathered[m] = dispatch_R[src rank][t] for m < M and lets a programmatically dependent launch
// (W13) start at once; with Step::arrival_gated_w13 it also counts the stored rows per 128-row
// block in arrivals_B(s) (release), which that W13 waits on.
void dispatch(const Step& s);
// grad_h3[m] = grad_y[t] and row_scores_M[m] = score[t,k] for m < M (with row scores,
// Step::row_scores_M), else grad_h3[m] = bf16(score[t,k] * grad_y[t]); score from the owner's
// routing buffer (f32) and grad_y from its dispatch buffer.
void gather_grad(const Step& s);
// gather_grad that also writes every stored grad_h3 row quantized 1x128 along D (FP8 training):
// codes q_MD [capacity, D] (16-byte aligned) and fp32 scales S-major, (row m, block b) at
// scales_SM[b * ld + m], ld >= capacity; bitwise what fp8_quantize_rows_counted writes from the
// stored rows (rows [0, M), nothing past them or when the step is skipped). D % 16 == 0.
void gather_grad_fp8_rows(const Step& s, uint8_t* q_MD, float* scales_SM, int64_t ld);

}  // namespace epmoe::cuda
