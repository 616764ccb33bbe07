// Shared by the per-stage GEMM launchers: the group description of a Step, the kernel choices as
// types (the selectors are gemm_config.h's).
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

// A kernel configuration chosen at run time, as a type: the consumer schedule, the cluster and
// the rows tile's width (the GEMMs with one B operand: dispatch_rows_schedule).
template <bool kPingPong, int kCluster, int kBlockN = 256>
struct Sched {
  static constexpr bool pingpong = kPingPong;
  static constexpr int cluster = kCluster;
  static constexpr int block_n = kBlockN;
};

// Groups = local experts; sizes from the layout on the device; the step's skip flag (and, in
// backward's replay, the layer plan's replay_skip) empties them.
inline GroupArgs step_groups(const Step& s, int64_t n, int64_t k, int64_t m_out = 0) {
  GroupArgs g;
  g.offsets = s.layout.expert_offsets_E1;
  g.skip = s.layout.header + kLayoutSkip;
  g.replay_skip = replay_skip_flag(s);
  g.groups = s.dims.E;
  g.band_rows = m_out == 0 ? select_band_rows(s, k) : 0;  // bands order the rows grouping only
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
// (5 stages: a stage holds one 64-row tile's k-block); 192 columns of one B operand take a stage
// more in about the same shared memory (6 and 5).
constexpr int rows_stages(bool pingpong, int b_cols) {
  return (pingpong ? 5 : 4) + (b_cols == 192 ? 1 : 0);
}
template <class S, int kBlockN, Major kMajorB, int kNumB>
using RowsTraits =
    GemmTraits<S::pingpong ? 64 : 128, kBlockN, rows_stages(S::pingpong, kBlockN * kNumB),
               Grouping::rows, Major::K, kMajorB, kNumB, S::pingpong, S::cluster>;

#if defined(EPMOE_GEMM_ALL_CONFIGS)
// Calls fn(Sched<pingpong, pair ? 2 : 1>{}) (ALL builds: every schedule and cluster instantiated).
template <class Fn>
void dispatch_sched(bool pingpong, bool pair, Fn&& fn) {
  if (pingpong && pair) return fn(Sched<true, 2>{});
  if (pingpong) return fn(Sched<true, 1>{});
  if (pair) return fn(Sched<false, 2>{});
  fn(Sched<false, 1>{});
}
#endif

// Calls fn(Sched<ping-pong, cluster>{}) with what select_schedule() and select_cluster() pick.
// Builds with EPMOE_GEMM_CONFIGS=CI instantiate the cooperative, unclustered kernel only.
template <class Fn>
void dispatch_schedule([[maybe_unused]] GemmKind kind, [[maybe_unused]] const Step& s, Fn&& fn) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
  dispatch_sched(select_schedule(kind, s) == Schedule::pingpong, select_cluster(kind, s) == 2, fn);
#else
  fn(Sched<false, 1>{});
#endif
}

// dispatch_schedule for W2 FPROP, W2 DGRAD and W13 DGRAD, with the tile width select_rows_tile_n()
// picks for the schedule (each selector read once a launch): 192 columns on single CTAs only (ALL
// builds; the selector refuses 192 in CI builds).
template <class Fn>
void dispatch_rows_schedule(GemmKind kind, const Step& s, Fn&& fn) {
  const Schedule schedule = select_schedule(kind, s);
  const RowsTileN width = select_rows_tile_n(kind, s, schedule);
#if defined(EPMOE_GEMM_ALL_CONFIGS)
  const bool pingpong = schedule == Schedule::pingpong;
  const bool pair = select_cluster(kind, s) == 2;
  if (width == RowsTileN::n192) {
    EPMOE_CHECK_ARG(!pair, "EPMOE_GEMM_CLUSTER", "1 with 192-column rows tiles (EPMOE_GEMM_ROWS_TILE_N)", 2);
    if (pingpong) return fn(Sched<true, 1, 192>{});
    return fn(Sched<false, 1, 192>{});
  }
  dispatch_sched(pingpong, pair, fn);
#else
  (void)width;
  fn(Sched<false, 1>{});
#endif
}


}  // namespace epmoe::cuda::gemm
