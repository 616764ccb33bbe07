// plan_memory: pure (no device, no communication) byte plan of one context. Every number here is
// what Context::create allocates, to the byte; explain() prints each term.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/config.h"

namespace epmoe {

// A(n) = ceil(n / 128) * 128: every sub-allocation is 128-byte aligned.
constexpr int64_t kAlignment = 128;
constexpr int64_t align_bytes(int64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// How the slot size was chosen (Config.slots).
enum class SlotSizing : int {
  none,            // inference: no slots
  maximum_useful,  // neither control set: every layer saves everything
  exact,           // slot_bytes, rounded up to the packing granule
  factor,          // slot_capacity_factor between the minimum and the balanced full save
};

struct MemoryPlan {
  // Problem (echoed).
  int ep_size = 0;                  // R
  int64_t tokens = 0;               // T
  int64_t hidden = 0;               // D
  int64_t intermediate = 0;         // F
  int top_k = 0;                    // K
  int experts_global = 0;           // E * R
  int experts_local = 0;            // E

  // Receive rows per rank.
  int64_t balanced_recv_rows = 0;   // T*K
  int64_t max_recv_rows = 0;        // topology bound T*R*min(K, E)
  double requested_capacity_factor = 0;  // Config.capacity_factor as given
  double capacity_factor = 0;       // effective: min(requested, R)
  int64_t recv_capacity_rows = 0;   // min(ceil(T*K*f), max_recv_rows): sizes every [M, *] buffer

  // Symmetric buffers (one per rank, peers address each other's; allocated through the Transport).
  int64_t routing_buffer_bytes = 0;   // header + ids [T,K] i32 + scores [T,K] f32
  int64_t dispatch_buffer_bytes = 0;  // [T, D] bf16: x (forward), grad_y (backward); fp8_block:
                                      // the larger of that and x as E4M3 rows + scales
  int64_t combine_buffer_bytes = 0;   // [T, K, D] bf16: route outputs (fwd), route input grads (bwd);
                                      // combine per_rank: [T, R, D], one partial per source rank
                                      // (+ grad_scores [T, K] f32 in training)
  int64_t symmetric_bytes = 0;

  // Per-layer saved state.
  int64_t packing_granule_bytes = 0;        // lcm(128, 2D): every packed allocation's multiple
  int64_t routing_metadata_bytes = 0;       // layout of one layer at capacity rows
  int64_t layer_metadata_bytes = 0;         // planner record (128) + layout, fixed per layer
  int64_t saved_input_bytes_per_layer = 0;  // recompute mode: x [T, D]
  int64_t saved_full_bytes_balanced = 0;    // x_gathered + h13 at T*K rows
  int64_t saved_full_bytes_capacity = 0;    // same at recv_capacity_rows

  // Activation slots.
  int num_slots = 0;                        // N (0 for inference)
  int layers_per_slot = 0;                  // L
  int64_t slot_metadata_bytes = 0;          // L * layer metadata, rounded to the granule
  int64_t minimum_slot_bytes = 0;           // metadata + L * saved input: every layer recomputes
  int64_t balanced_full_save_slot_bytes = 0;
  int64_t maximum_useful_slot_bytes = 0;    // metadata + L * full save at capacity rows
  SlotSizing slot_sizing = SlotSizing::none;
  double slot_capacity_factor = 0;          // the factor when slot_sizing == factor
  int64_t slot_bytes = 0;                   // chosen (a multiple of the packing granule)
  int64_t activation_bytes = 0;             // N * slot_bytes
  int64_t planner_state_bytes = 0;          // per-slot planner state (separate allocation)

  // Scratch (reused within one call), sized at capacity rows.
  // Scratch order (Context): route | pad | call (layout, x_gathered, ...) | fp8 ops | fp8 weights
  int64_t route_scratch_bytes = 0;     // global routing layout computation
  int64_t call_scratch_pad_bytes = 0;  // puts the call scratch's x_gathered on the granule (< G)
  int64_t forward_scratch_bytes = 0;   // worst forward (recompute mode)
  int64_t backward_scratch_bytes = 0;  // worst backward (recompute mode)
  // fp8_block only (0 otherwise), after the call scratch (core/fp8_terms.h):
  // E4M3 operands: h, grad_h3, grad_h13 rows, then the WGRAD columns (fp8_wgrad fp8) or x decoded
  // to bf16 (fp8_wgrad bf16)
  int64_t fp8_scratch_bytes = 0;
  // Config.prepared_weights off: weights quantized per call, then (training) one weight
  // transposed for the DGRADs (core/fp8_terms.h fp8_transposed_layout). On: 0 (the caller's
  // prepared weights carry their transposed copies).
  int64_t fp8_weight_scratch_bytes = 0;
  // mxfp8 only (0 otherwise): the CUDA GEMMs' activation rows quantized 1x32 (codes + E8M0
  // scales, core/plan_terms.h mxfp8_scratch_layout), inside the call scratch's backward rows that
  // an inference context leaves unused: counted in forward_scratch_bytes, not added to scratch.
  int64_t mxfp8_scratch_bytes = 0;
  int64_t scratch_bytes = 0;           // route + pad + backward (+ fp8); backward's holds forward's

  int64_t status_bytes = 0;            // device status word
  int64_t peer_table_bytes = 0;        // 3 peer-pointer tables [R] (routing, dispatch, combine)
  int64_t arena_bytes = 0;             // activation_bytes + scratch_bytes
  int64_t total_bytes = 0;             // arena + symmetric + status + peer tables + planner

  // Where the arena lives (Config.scratch_device_bytes): slots and the first scratch_device_bytes
  // of the scratch in device memory, the rest of the scratch in pinned host memory mapped right
  // behind it (one virtual range). Without the field everything is device memory.
  bool host_backed_scratch = false;          // arena_host_bytes > 0
  int64_t scratch_device_minimum_bytes = 0;  // route scratch + pad + layout(M): always device
  int64_t scratch_device_bytes = 0;          // min(floor128(Config.scratch_device_bytes), scratch)
  int64_t arena_device_bytes = 0;            // activation_bytes + scratch_device_bytes
  int64_t arena_host_bytes = 0;              // scratch_bytes - scratch_device_bytes
  int64_t device_total_bytes = 0;            // total_bytes - arena_host_bytes

  bool inference = false;
  Precision precision = Precision::bf16;
  CombineMode combine = CombineMode::per_route;
  // Config.fp8_wgrad resolved (fp8 or bf16, never by_shape; core/fp8_wgrad_choice.h): what the
  // fp8 scratch is sized for and what both backends run. Precisions other than fp8_block, and
  // inference, resolve by_shape to fp8 (unused).
  Fp8Wgrad fp8_wgrad = Fp8Wgrad::fp8;
  Fp8Wgrad fp8_wgrad_requested = kDefaultFp8Wgrad;  // Config.fp8_wgrad as given
  std::string fp8_wgrad_reason = {};  // one line: the choice and why ("bf16: 128 rows per ...")

  // Multi-line, human-readable account of every term above.
  std::string explain() const;
};

// Pure. Throws Error naming the Config field for impossible configurations (E*R not divisible by
// ep_size, slot budget below the minimum, scratch_device_bytes below the routing part, ...).
MemoryPlan plan_memory(const Config& config, int ep_size);

}  // namespace epmoe
