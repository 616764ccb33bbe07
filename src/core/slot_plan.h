// Activation slots packed by actual rows, and the save-or-recompute rule (DESIGN.md §4). One
// definition for both backends: the CPU calls plan_forward_layer() directly, CUDA from a one-thread
// kernel, so every rank of every backend decides alike.
//
// A slot of the arena:
//   metadata: L x [LayerPlan | layout(M)]      host-known addresses (layer l of the slot)
//   packed:   layers' saved buffers, LIFO      device-decided offsets (this file)
// A layer saves either everything backward needs,  x_gathered [rows,D] | h13 [rows,2F]  at its
// actual rows, or only its input x [T,D] (recompute: backward replays the forward up to W13 and
// SwiGLU). The W2 outputs are never saved: grad_scores come from the W2 DGRAD output and h
// (Step::row_scores_M). Every packed
// allocation is a multiple of the packing granule lcm(128, 2D), so x_gathered always starts on a
// whole row of an arena viewed as rows of D bf16 (one TMA descriptor for the whole arena).
#pragma once

#include <cstdint>

#include "core/hd.h"
#include "core/layout.h"
#include "epmoe/memory_plan.h"

namespace epmoe {

// Written by the forward planner into the layer's metadata, read by the backward. Offsets are
// bytes from the arena base; -1: the buffer does not exist for this decision.
struct LayerPlan {
  int32_t recompute = 0;    // 1: only x was saved; backward replays the forward
  int32_t replay_skip = 1;  // 0: the backward replay stages run (recompute and the step not skipped)
  int32_t slot = -1;
  int32_t layer = -1;
  int64_t begin = 0;        // packed-region byte where this layer's allocation starts
  int64_t x_offset = -1;             // saved x [T, D] (recompute)
  int64_t x_gathered_offset = -1;    // [rows, D]: slot (full save) or call scratch (recompute)
  int64_t h13_offset = -1;           // [rows, 2F]: slot or call scratch
  int64_t h3_offset = -1;            // -1: not kept (the forward's W2 outputs); per-rank
                                     // combine: [rows, D] call scratch rows_MD (the send's rows)
  int64_t reserved[9] = {};
};
static_assert(sizeof(LayerPlan) == kAlignment, "LayerPlan fills one aligned block");

// Planner state of one slot (device memory), followed by saved_R [N, R] int64 in the same block.
struct SlotState {
  int64_t layers = 0;      // layers saved in the slot now (++ forward, -- backward)
  int64_t peak_bytes = 0;  // high-water mark of max over ranks of saved bytes
  int64_t reserved[2] = {};
};

// Static sizes the planner needs (host-computed, the same on every rank).
struct SlotGeometry {
  int64_t T = 0, D = 0, F = 0;
  int K = 0, R = 0;
  int layers_per_slot = 0;        // L
  int64_t granule = kAlignment;   // lcm(128, 2D)
  int64_t packed_bytes = 0;       // bytes of the packed region of one slot
  int64_t packed_base = 0;        // arena offset of this slot's packed region
  int64_t scratch_x_gathered = 0; // arena offsets of the recompute buffers (call scratch)
  int64_t scratch_h13 = 0;
  int64_t scratch_rows = 0;       // per-rank combine: the call scratch's rows_MD (W2 rows)
  int32_t h3_rows = 0;            // 1: per-rank combine, the forward's W2 rows are [rows, D]
  int32_t reserved = 0;
};

EPMOE_HD int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}
EPMOE_HD int64_t gcd64(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}
// lcm(128, 2D): x_gathered offsets are whole rows of D bf16 and 128-byte aligned.
EPMOE_HD int64_t packing_granule(int64_t D) {
  return kAlignment / gcd64(kAlignment, 2 * D) * (2 * D);
}

// Full save of a layer that received `rows` rows: x_gathered | h13 (offsets from its start).
struct FullSaveLayout {
  int64_t x_gathered, h13, total;  // total: rounded up to the granule
};
EPMOE_HD FullSaveLayout full_save_layout(int64_t rows, int64_t D, int64_t F, int64_t granule) {
  FullSaveLayout l;
  l.x_gathered = 0;
  l.h13 = align_bytes(rows * D * 2);
  l.total = round_up(l.h13 + align_bytes(rows * 2 * F * 2), granule);
  return l;
}
// Input-only save: x [T, D].
EPMOE_HD int64_t input_save_bytes(int64_t T, int64_t D, int64_t granule) {
  return round_up(align_bytes(T * D * 2), granule);
}

// Forward planner of one layer (dist_moe §4.3). recv_rows_R: rows every rank receives (all ranks
// know all); saved_R: this slot's bytes saved as if on each rank. Save everything only if, on the
// fullest rank, this layer's full save plus the input of every later layer of the slot still fits;
// the max over ranks makes the decision the same on every rank (a replay re-runs collectives).
// A skipped step (input error, overflow) saves the input: its backward does nothing.
EPMOE_HD void plan_forward_layer(const SlotGeometry& g, const int32_t* recv_rows_R, bool skipped,
                                 int self, int slot, SlotState& state, int64_t* saved_R,
                                 LayerPlan& out) {
  const int64_t x_b = input_save_bytes(g.T, g.D, g.granule);
  const int64_t layers_after = g.layers_per_slot - 1 - state.layers;
  int64_t need = 0;
  for (int r = 0; r < g.R; ++r) {
    const int64_t full_r = full_save_layout(recv_rows_R[r], g.D, g.F, g.granule).total;
    const int64_t v = saved_R[r] + full_r;
    need = v > need ? v : need;
  }
  const bool recompute = skipped || need + layers_after * x_b > g.packed_bytes;
  const int64_t begin = saved_R[self];
  LayerPlan p;
  p.recompute = recompute ? 1 : 0;
  p.replay_skip = recompute && !skipped ? 0 : 1;
  p.slot = slot;
  p.layer = static_cast<int32_t>(state.layers);
  p.begin = begin;
  if (g.h3_rows != 0) p.h3_offset = g.scratch_rows;  // the forward's W2 rows, until the send
  if (recompute) {
    p.x_offset = g.packed_base + begin;
    p.x_gathered_offset = g.scratch_x_gathered;
    p.h13_offset = g.scratch_h13;
  } else {
    const FullSaveLayout l = full_save_layout(recv_rows_R[self], g.D, g.F, g.granule);
    p.x_gathered_offset = g.packed_base + begin + l.x_gathered;
    p.h13_offset = g.packed_base + begin + l.h13;
  }
  int64_t peak = 0;
  for (int r = 0; r < g.R; ++r) {
    saved_R[r] += recompute ? x_b : full_save_layout(recv_rows_R[r], g.D, g.F, g.granule).total;
    peak = saved_R[r] > peak ? saved_R[r] : peak;
  }
  state.layers += 1;
  state.peak_bytes = peak > state.peak_bytes ? peak : state.peak_bytes;
  out = p;
}

// Backward planner: the layer leaves the slot (LIFO); every rank's bytes go back to where they
// were before its forward.
EPMOE_HD void plan_backward_layer(const SlotGeometry& g, const int32_t* recv_rows_R,
                                  const LayerPlan& p, SlotState& state, int64_t* saved_R) {
  const int64_t x_b = input_save_bytes(g.T, g.D, g.granule);
  for (int r = 0; r < g.R; ++r) {
    saved_R[r] -= p.recompute != 0 ? x_b : full_save_layout(recv_rows_R[r], g.D, g.F, g.granule).total;
  }
  state.layers -= 1;
}

}  // namespace epmoe
