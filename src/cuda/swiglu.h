// Unfused SwiGLU forward and backward over the received rows. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// h[m] = act(h13[m]) for m < M.
void swiglu_forward(const Step& s);
// grad_h13[m] = act'(h13[m]) * grad_h[m] and h[m] = act(h13[m]) for m < M.
void swiglu_backward(const Step& s);

}  // namespace epmoe::cuda
