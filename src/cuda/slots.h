// Activation-slot stages on CUDA: the forward and backward planners (core/slot_plan.h in a
// one-thread kernel) and the input copies of recompute layers. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// One thread: plan_forward_layer() on the layout's per-rank rows; writes *s.layer_plan.
void plan_forward(const Step& s);
// One thread: plan_backward_layer() (the slot rewinds; the layer plan stays).
void plan_backward(const Step& s);
// layer_plan->replay_skip == 0: x [live, D] into arena + x_offset (else no work).
void save_input(const Step& s);
// layer_plan->replay_skip == 0: arena + x_offset into dispatch_R[rank], and the dispatch arrival
// counters zeroed for the replayed dispatch (else no work).
void restore_input(const Step& s);

}  // namespace epmoe::cuda
