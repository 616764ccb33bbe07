// Shared by the per-stage GEMM launchers: the group description of a Step and the problem
// descriptor each launcher prints through the config heuristic.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "core/step.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"
#include "cuda/placed.h"
#include "epmoe/error.h"

namespace epmoe::cuda::gemm {

// Throws naming the limit when the launch would not fit the kernel family.
void check_groups(const Step& s);

// The consumer schedule of one GEMM: EPMOE_GEMM_SCHEDULE[_<KIND>|_WGRAD]=cooperative|pingpong
// forces one (for measurements), else the measured table in gemm_config.cpp.
Schedule select_schedule(GemmKind kind, const Step& s);

// CTAs that share each B tile (1, or a pair multicasting it): EPMOE_GEMM_CLUSTER=1|2 forces it,
// else the measured table in gemm_config.cpp.
int select_cluster(GemmKind kind, const Step& s);

// How the bf16 WGRAD writes an overwritten gradient: through one TMA-store buffer per warpgroup
// (3 stages) that drains during the next tile's MMA, its stores issued by the consumers or, up to
// kWgradStoreWarpMaxRows rows per expert, by a producer warp (the rule in gemm_config.cpp); or by
// the threads (staged rows, 16-byte global stores; 4 stages). EPMOE_WGRAD_STORE=tma|tma_warp|direct
// forces one.
WgradStore select_wgrad_store(GemmKind kind, const Step& s);

// The output tile of the TMA-store WGRAD (cooperative, unclustered): EPMOE_WGRAD_TILE=128x256|
// 128x192 forces one (128x192 is built with EPMOE_GEMM_CONFIGS=ALL only), else 128 x 256.
WgradTile select_wgrad_tile(GemmKind kind, const Step& s);

// Whether the bf16 WGRAD (cooperative, unclustered; overwritten output) runs its full k-blocks with
// one wgmma batch in flight and the partial one after them: EPMOE_WGRAD_PEEL=1|0 forces it, else
// the rule in gemm_config.cpp.
bool select_wgrad_peel(GemmKind kind, const Step& s);

// A kernel configuration chosen at run time, as a type: the consumer schedule and the cluster.
template <bool kPingPong, int kCluster>
struct Sched {
  static constexpr bool pingpong = kPingPong;
  static constexpr int cluster = kCluster;
};

// Groups = local experts; sizes from the layout on the device; the step's skip flag (and, in
// backward's replay, the layer plan's replay_skip) empties them.
inline GroupArgs step_groups(const Step& s, int64_t n, int64_t k, int64_t m_out = 0) {
  GroupArgs g;
  g.offsets = s.layout.expert_offsets_E1;
  g.skip = s.layout.header + kLayoutSkip;
  g.replay_skip = replay_skip_flag(s);
  g.groups = s.dims.E;
  g.n = n;
  g.k = k;
  g.m_out = m_out;
  return g;
}

inline cudaStream_t stream_of(const Step& s) { return static_cast<cudaStream_t>(s.stream); }

// x_gathered [rows, D] as a TMA operand. With a layer plan its place is known only on the device:
// the descriptor spans the whole arena as rows of D bf16 and the kernel shifts the row coordinate
// by the plan's x_gathered_offset / 2D (a whole row: every saved region and the call scratch's
// x_gathered start on the packing granule lcm(128, 2D), core/slot_plan.h). Without a plan: the
// Step's [capacity, D] buffer, unshifted.
struct GatheredRows {
  const void* ptr;
  int64_t rows;
  RowShift shift;
};
inline GatheredRows x_gathered_rows(const Step& s) {
  const int64_t pitch = 2 * s.dims.D;
  if (s.layer_plan == nullptr) return {s.x_gathered_MD, s.capacity_rows, RowShift{}};
  const int64_t rows = s.arena_bytes / pitch;
  EPMOE_CHECK_ARG(rows <= INT_MAX, "Config.slots.slot_bytes",
                  "an activation arena of at most " + std::to_string(INT_MAX) +
                      " rows of 2 * hidden_dim bytes (int32 TMA row coordinates)",
                  std::to_string(rows) + " rows");
  return {s.arena, rows,
          RowShift{plan_field<int64_t>(s, offsetof(LayerPlan, x_gathered_offset)), pitch}};
}

// Rows-grouping tile configs: cooperative 128-row tiles (4 stages) or ping-pong 64-row tiles
// (5 stages: a stage holds one 64-row tile's k-block).
template <class S, int kBlockN, Major kMajorB, int kNumB>
using RowsTraits = GemmTraits<S::pingpong ? 64 : 128, kBlockN, S::pingpong ? 5 : 4, Grouping::rows,
                              Major::K, kMajorB, kNumB, S::pingpong, S::cluster>;

// Calls fn(Sched<ping-pong, cluster>{}) with what select_schedule() and select_cluster() pick.
// Builds with EPMOE_GEMM_CONFIGS=CI instantiate the cooperative, unclustered kernel only.
template <class Fn>
void dispatch_schedule([[maybe_unused]] GemmKind kind, [[maybe_unused]] const Step& s, Fn&& fn) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
  const bool pingpong = select_schedule(kind, s) == Schedule::pingpong;
  const bool pair = select_cluster(kind, s) == 2;
  if (pingpong && pair) return fn(Sched<true, 2>{});
  if (pingpong) return fn(Sched<true, 1>{});
  if (pair) return fn(Sched<false, 2>{});
#endif
  fn(Sched<false, 1>{});
}


}  // namespace epmoe::cuda::gemm
