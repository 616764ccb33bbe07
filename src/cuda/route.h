// route: the global routing layout (core/layout.h) of this rank from every rank's published ids,
// the step's skip flag and the status word. Launcher only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// Largest E*R the route kernels take (per-warp expert histograms live in shared memory).
constexpr int kMaxGlobalExperts = 4096;

// After the publish barrier. Three launches: gather + chunk histograms, one-CTA prefix + checks,
// stable in-chunk ranking. Reproduces build_layout_reference() bitwise.
void route(const Step& s);

}  // namespace epmoe::cuda
