// route: the global routing layout (core/layout.h) of this rank from every rank's published ids,
// the step's skip flag and the status word. Launcher only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// Largest E*R the route kernels take (per-warp expert histograms live in shared memory).
constexpr int kMaxGlobalExperts = 4096;

// chunked: five launches (chunk histograms, pull counts, one-CTA prefix + checks, pull list,
// stable in-chunk ranking), grids over chunks and source ranks. single: the same block bodies in
// one CTA, one launch, their scratch in shared memory, where T * K <= kRouteChunkRoutes,
// T <= kPullChunkTokens, E * R <= 512 and that scratch fits 200 KiB (decode sizes, where the
// five launches and the phases' round trips are latency). EPMOE_ROUTE_KERNELS=chunked|single
// overrides the choice (read on every call).
enum class RouteKernels { chunked, single };
const char* to_string(RouteKernels k);
RouteKernels select_route_kernels(const Dims& d);

// After the publish barrier. Reproduces build_layout_reference() bitwise either way.
void route(const Step& s);

}  // namespace epmoe::cuda
