// publish_forward / publish_backward: this rank's ids, scores and header into its routing buffer,
// and x (forward) or grad_y (backward) into its dispatch buffer. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// Own ids (int32; -1 for inactive routes, invalid ids and rows past the live count, over all
// Config T rows), scores (f32; 0 past the live count), header (T', live, input-check result,
// sequence) into routing_R[rank]; x rows [0, live) into dispatch_R[rank]. Two launches.
void publish_forward(const Step& s);
// The same with grad_y rows, the forward's live count (saved layout) and no input checks;
// nothing when the saved layout says the step was skipped.
void publish_backward(const Step& s);

}  // namespace epmoe::cuda
