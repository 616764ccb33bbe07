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

// The consumer schedule of one GEMM: EPMOE_GEMM_SCHEDULE=cooperative|pingpong forces one (for
// measurements), else the measured table in gemm_config.cpp.
Schedule select_schedule(GemmKind kind, const Step& s);

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

// Rows-grouping tile configs: cooperative 128-row tiles (4 stages) or ping-pong 64-row tiles
// (5 stages: a stage holds one 64-row tile's k-block).
template <bool kPingPong, int kBlockN, Major kMajorB, int kNumB>
using RowsTraits = GemmTraits<kPingPong ? 64 : 128, kBlockN, kPingPong ? 5 : 4, Grouping::rows,
                              Major::K, kMajorB, kNumB, kPingPong>;

// Calls fn(std::bool_constant<ping-pong>) with the schedule select_schedule() picks. Builds with
// EPMOE_GEMM_CONFIGS=CI instantiate the cooperative schedule only.
template <class Fn>
void dispatch_schedule([[maybe_unused]] GemmKind kind, [[maybe_unused]] const Step& s, Fn&& fn) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
  if (select_schedule(kind, s) == Schedule::pingpong) {
    fn(std::true_type{});
    return;
  }
#endif
  fn(std::false_type{});
}


}  // namespace epmoe::cuda::gemm
