// Shared by the per-stage GEMM launchers: the group description of a Step and the problem
// descriptor each launcher prints through the config heuristic.
#pragma once

#include <cuda_runtime.h>

#include "core/step.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

// Throws naming the limit when the launch would not fit the kernel family.
void check_groups(const Step& s);

// Groups = local experts; sizes from the layout on the device; the step's skip flag empties them.
inline GroupArgs step_groups(const Step& s, int64_t n, int64_t k, int64_t m_out = 0) {
  GroupArgs g;
  g.offsets = s.layout.expert_offsets_E1;
  g.skip = s.layout.header + kLayoutSkip;
  g.groups = s.dims.E;
  g.n = n;
  g.k = k;
  g.m_out = m_out;
  return g;
}

inline cudaStream_t stream_of(const Step& s) { return static_cast<cudaStream_t>(s.stream); }


}  // namespace epmoe::cuda::gemm
