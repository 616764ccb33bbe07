// Byte terms shared by plan_memory() and by the code that carves the arena, so the plan is what
// is allocated, to the byte. A(n) = align_bytes(n). M = received rows, T = Config T.
#pragma once

#include <cstdint>

#include "core/layout.h"
#include "core/slot_plan.h"
#include "epmoe/memory_plan.h"

namespace epmoe {

struct Dims {
  int64_t T = 0, D = 0, F = 0;
  int K = 0, E = 0, R = 0;  // E = local experts
  bool h3_rows = false;     // per-rank combine: the W2 rows are [rows, D] (the send's input)
};

// Rows per local expert under balanced routing: a rank receives T * K rows (memory_plan's
// balanced_recv_rows) over its E experts. Kernel rules key on it rather than on the capacity,
// which overstates it by the capacity factor.
inline int64_t balanced_rows_per_expert(const Dims& d) {
  return d.T * d.K / (d.E > 0 ? d.E : 1);
}

// Combine buffer (symmetric): [T, K, D] bf16 per route, or with the per-rank combine [T, R, D]
// bf16 partials. (grad_scores return to their owner through the routing buffer's scores.)
inline int64_t combine_buffer_bytes(int64_t T, int K, int R, int64_t D, bool per_rank) {
  return align_bytes(T * (per_rank ? R : K) * D * 2);
}

// One layer's whole state at M rows in one block (stage tests carve their buffers with it):
//   layout(M) | x_gathered [M, D] | h13 [M, 2F] | h3 [T, K, D] or [M, D] (Dims::h3_rows)  (bf16)
struct SavedFullLayout {
  int64_t layout, x_gathered, h13, h3, total;  // offsets from the layer's start; total = bytes
};
inline SavedFullLayout saved_full_layout(const Dims& d, int64_t M) {
  SavedFullLayout l;
  l.layout = 0;
  l.x_gathered = l.layout + layout_bytes(M, d.T, d.K, d.E, d.R).total;
  l.h13 = l.x_gathered + align_bytes(M * d.D * 2);
  l.h3 = l.h13 + align_bytes(M * 2 * d.F * 2);
  l.total = l.h3 + align_bytes((d.h3_rows ? M : d.T * d.K) * d.D * 2);
  return l;
}

// What one layer keeps when it will recompute: its input x [T, D] (packing granule multiple).
inline int64_t saved_input_bytes(const Dims& d) {
  return input_save_bytes(d.T, d.D, packing_granule(d.D));
}
// Full save in the packed region at `rows` received rows (no layout: that sits in the metadata).
inline int64_t saved_full_bytes(const Dims& d, int64_t rows) {
  return full_save_layout(rows, d.D, d.F, packing_granule(d.D)).total;
}

// One slot: metadata of L layers (LayerPlan | layout(M) each), then the packed region.
struct SlotLayout {
  int64_t layer_metadata;  // bytes of one layer's LayerPlan | layout(M)
  int64_t packed;          // offset of the packed region (metadata rounded up to the granule)
};
inline SlotLayout slot_layout(const Dims& d, int64_t M, int64_t L) {
  SlotLayout l;
  l.layer_metadata = align_bytes(static_cast<int64_t>(sizeof(LayerPlan))) +
                     layout_bytes(M, d.T, d.K, d.E, d.R).total;
  l.packed = round_up(L * l.layer_metadata, packing_granule(d.D));
  return l;
}

// Planner state of N slots: SlotState [N] | saved bytes per (slot, rank) int64 [N, R].
struct PlannerStateLayout {
  int64_t states, saved_NR, total;
};
inline PlannerStateLayout planner_state_layout(int64_t N, int R) {
  PlannerStateLayout l;
  l.states = 0;
  l.saved_NR = align_bytes(N * static_cast<int64_t>(sizeof(SlotState)));
  l.total = l.saved_NR + align_bytes(N * R * 8);
  return l;
}

// Route scratch: all ranks' ids gathered [R, T*K] i32, counts [R, E*R] i32, per-chunk histograms
// [R, C, E*R] i32 with C = ceil(T*K / kRouteChunkRoutes); for the pulls (core/layout.h) the pull
// of each (source rank, token) [R, T] i32 and the pulls per token chunk [R, ceil(T /
// kPullChunkTokens)] i32; the dispatch arrival counters [ceil(M / kArrivalBlockRows)] u32 (rows
// of each 128-row block of the received rows that dispatch has stored; route zeroes them).
constexpr int64_t kRouteChunkRoutes = 2048;
constexpr int64_t kPullChunkTokens = 1024;
constexpr int64_t kArrivalBlockRows = 128;
struct RouteScratchLayout {
  int64_t ids_all, counts, chunk_counts, pull_of_token, pull_counts, arrivals, total;
};
inline int64_t arrival_blocks(int64_t M) { return (M + kArrivalBlockRows - 1) / kArrivalBlockRows; }
inline RouteScratchLayout route_scratch_layout(const Dims& d, int64_t M) {
  const int64_t Eg = static_cast<int64_t>(d.E) * d.R;
  const int64_t chunks = (d.T * d.K + kRouteChunkRoutes - 1) / kRouteChunkRoutes;
  const int64_t token_chunks = (d.T + kPullChunkTokens - 1) / kPullChunkTokens;
  RouteScratchLayout l;
  l.ids_all = 0;
  l.counts = l.ids_all + align_bytes(d.R * d.T * d.K * 4);
  l.chunk_counts = l.counts + align_bytes(d.R * Eg * 4);
  l.pull_of_token = l.chunk_counts + align_bytes(d.R * chunks * Eg * 4);
  l.pull_counts = l.pull_of_token + align_bytes(d.R * d.T * 4);
  l.arrivals = l.pull_counts + align_bytes(d.R * token_chunks * 4);
  l.total = l.arrivals + align_bytes(arrival_blocks(M) * 4);
  return l;
}

// grad_scores[t,k] = <dh, h> of the route's row (dh = grad_y[t] @ w2[e], unscaled) is summed per
// 64-column chunk of F (the W2 DGRAD epilogue's chunk), then over the chunks in ascending order.
constexpr int64_t kScoreChunkCols = 64;
inline int64_t score_chunks(int64_t F) { return (F + kScoreChunkCols - 1) / kScoreChunkCols; }

// Call scratch at M rows (after the route scratch and its granule pad). Forward and backward
// share the region; the recompute tensors (layout, x_gathered, h13) come first so backward can
// rebuild them in place, and the layout leads so that the routing part (route scratch, pad,
// layout) is one device-memory prefix of the scratch (Config.scratch_device_bytes).
//   layout(M) | x_gathered [M,D] | h13 [M,2F] | h [M,F] | grad_h3 [M,D] | grad_h13 [M,2F]
//   | unfused or per-rank combine: rows_MD [M,D] (W2 / W13-DGRAD output before its scatter or
//     its per-rank send) | unfused only: grad_h [M,F]
//   | row_scores [M] f32 (each received row's score, stored by gather_grad)
//   | score_parts [M, score_chunks(F)] f32 (per-64-column partials of grad_scores, W2 DGRAD)
struct CallScratchLayout {
  int64_t layout, x_gathered, h13, h, grad_h3, grad_h13, rows_MD, grad_h, row_scores,
      score_parts, total;
};
inline CallScratchLayout call_scratch_layout(const Dims& d, int64_t M, bool unfused,
                                             bool per_rank_combine = false) {
  CallScratchLayout l;
  l.layout = 0;
  l.x_gathered = l.layout + layout_bytes(M, d.T, d.K, d.E, d.R).total;
  l.h13 = l.x_gathered + align_bytes(M * d.D * 2);
  l.h = l.h13 + align_bytes(M * 2 * d.F * 2);
  l.grad_h3 = l.h + align_bytes(M * d.F * 2);
  l.grad_h13 = l.grad_h3 + align_bytes(M * d.D * 2);
  l.rows_MD = l.grad_h13 + align_bytes(M * 2 * d.F * 2);
  l.grad_h = l.rows_MD + (unfused || per_rank_combine ? align_bytes(M * d.D * 2) : 0);
  l.row_scores = l.grad_h + (unfused ? align_bytes(M * d.F * 2) : 0);
  l.score_parts = l.row_scores + align_bytes(M * 4);
  l.total = l.score_parts + align_bytes(M * score_chunks(d.F) * 4);
  return l;
}

// MXFP8 inference on CUDA: each GEMM's activation rows quantized 1x32 by the codec just before
// it (x_gathered for W13, then h for W2: one region serves both), E4M3 codes [M, L] then E8M0
// scales [M, L / 32] with L = max(D, F) (each GEMM uses its own K and S = K / 32 inside). It lies
// in the call scratch's grad_h3 .. rows_MD bytes, which an inference context never touches, so the
// plan adds nothing; mxfp8_scratch_fits says whether it fits there (the context checks it).
struct Mxfp8ScratchLayout {
  int64_t codes = 0, scales = 0, total = 0;
};
inline Mxfp8ScratchLayout mxfp8_scratch_layout(const Dims& d, int64_t M) {
  const int64_t L = d.D > d.F ? d.D : d.F;
  Mxfp8ScratchLayout l;
  l.codes = 0;
  l.scales = align_bytes(M * L);
  l.total = l.scales + align_bytes(M * ((L + 31) / 32));
  return l;
}
inline bool mxfp8_scratch_fits(const CallScratchLayout& cl, const Dims& d, int64_t M) {
  return mxfp8_scratch_layout(d, M).total <= cl.rows_MD - cl.grad_h3;
}

// Zero bytes between the route scratch and the call scratch so that the call scratch's
// x_gathered starts on the packing granule G: the scratch starts at N * slot_bytes (a multiple
// of G), so x_gathered then starts on a whole row of the arena viewed as rows of D bf16, as every
// saved x_gathered does (one TMA descriptor over the arena on CUDA). Multiple of kAlignment, < G.
inline int64_t call_scratch_pad_bytes(int64_t route_scratch_bytes, int64_t call_x_gathered,
                                      int64_t granule) {
  const int64_t r = (route_scratch_bytes + call_x_gathered) % granule;
  return r == 0 ? 0 : granule - r;
}

}  // namespace epmoe
