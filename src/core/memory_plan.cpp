// plan_memory(): the byte plan of one context, built only from the terms of core/plan_terms.h and
// core/layout.h, which are also what Context carves the arena with, so plan == allocation.
// docs/memory.md gives the formulas term by term.
#include "epmoe/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "core/fp8_terms.h"
#include "core/fp8_wgrad_choice.h"
#include "core/layout.h"
#include "core/plan_terms.h"
#include "core/slot_plan.h"
#include "epmoe/error.h"
#include "epmoe/status.h"

namespace epmoe {

namespace {

// Every single term stays below 2^56 bytes so that the ~20 terms of a plan sum without overflow;
// the multiplications by L and N are checked separately. Real models are many orders below.
constexpr int64_t kMaxTermBytes = int64_t{1} << 56;

// Factors such as 1.1 are not exact in binary (10 * 1.1 == 11.000000000000002): a product within
// 1e-12 (relative) of an integer is that integer, so the ceil does not add a spurious row.
int64_t ceil_tolerant(double x) {
  const double nearest = std::nearbyint(x);
  if (std::fabs(x - nearest) <= 1e-12 * std::max(1.0, std::fabs(x))) {
    return static_cast<int64_t>(nearest);
  }
  return static_cast<int64_t>(std::ceil(x));
}

int64_t checked_mul(int64_t a, int64_t b, const char* field, const char* what) {
  int64_t r = 0;
  const bool overflow = __builtin_mul_overflow(a, b, &r);
  EPMOE_CHECK_ARG(!overflow && r <= kMaxTermBytes, field,
                  std::string(what) + " below 2^56 bytes",
                  overflow ? std::string("an int64 overflow") : std::to_string(r));
  return r;
}

// A dimension may be at most kMaxTermBytes / per_unit, so that its widest buffer stays below 2^56.
void check_dim(int64_t value, int64_t per_unit, const char* field, const char* why) {
  const int64_t bound = kMaxTermBytes / per_unit;
  EPMOE_CHECK_ARG(value <= bound, field, "<= " + std::to_string(bound) + " (" + why + ")", value);
}

std::string thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out;
  const int lead = static_cast<int>(digits.size() % 3);
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && static_cast<int>(i % 3) == lead) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// "1.094 GiB (1,174,405,120 bytes)"
std::string bytes_text(int64_t n) {
  char gib[32];
  std::snprintf(gib, sizeof(gib), "%.3f", static_cast<double>(n) / (1024.0 * 1024.0 * 1024.0));
  return std::string(gib) + " GiB (" + thousands(n) + " bytes)";
}

std::string factor_text(double f) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", f);
  return buf;
}

}  // namespace

MemoryPlan plan_memory(const Config& config, int ep_size) {
  const ConfigFields& c = config.fields();
  MemoryPlan p;
  const int R = ep_size;
  const int E = config.local_experts(R);  // checks R >= 1 and divisibility
  const int64_t T = config.T(), D = config.D(), F = config.F();
  const int K = config.K();

  // Received rows carry their source as int32 rank*T*K + t*K + k (core/layout.h encode_src).
  const int64_t int32_max = std::numeric_limits<int32_t>::max();
  const int64_t RK = static_cast<int64_t>(R) * K;
  EPMOE_CHECK_ARG(T <= int32_max / RK, "Config.max_tokens_per_rank",
                  "<= " + std::to_string(int32_max / RK) + " so that R*T*K < 2^31 (int32 row ids, R = " +
                      std::to_string(R) + ", K = " + std::to_string(K) + ")",
                  T);
  // Every byte term is at most (R*T*K) rows times 4 * max(D, F, experts) bytes.
  const int64_t routes = RK * T;
  check_dim(D, 4 * routes, "Config.hidden_dim", "byte terms below 2^56 at R*T*K routes");
  check_dim(F, 4 * routes, "Config.intermediate_dim", "byte terms below 2^56 at R*T*K routes");
  check_dim(c.num_experts, 4 * routes, "Config.num_experts",
            "route scratch below 2^56 bytes at R*T*K routes");

  p.ep_size = R;
  p.tokens = T;
  p.hidden = D;
  p.intermediate = F;
  p.top_k = K;
  p.experts_global = c.num_experts;
  p.experts_local = E;
  p.inference = c.inference;

  // ---- rows ----
  // A factor above R buys nothing: R*T*K rows already hold every route that can arrive.
  p.requested_capacity_factor = c.capacity_factor;
  p.capacity_factor = std::min(c.capacity_factor, static_cast<double>(R));
  p.balanced_recv_rows = T * K;
  p.max_recv_rows = T * R * std::min(K, E);
  const int64_t wanted = ceil_tolerant(static_cast<double>(T * K) * p.capacity_factor);
  p.recv_capacity_rows = std::max<int64_t>(1, std::min(wanted, p.max_recv_rows));
  const int64_t M = p.recv_capacity_rows;

  const bool per_rank = c.combine == CombineMode::per_rank;
  const Dims d{T, D, F, K, E, R, per_rank};

  // ---- symmetric buffers ----
  p.routing_buffer_bytes = routing_buffer_layout(T, K).bytes;
  p.precision = c.precision;
  const Fp8WgradChoice wgrad = choose_fp8_wgrad(config, R);
  p.fp8_wgrad = wgrad.wgrad;
  p.fp8_wgrad_requested = c.fp8_wgrad;
  p.fp8_wgrad_reason = wgrad.reason;
  const bool fp8 = c.precision == Precision::fp8_block;
  p.dispatch_buffer_bytes = align_bytes(T * D * 2);
  if (fp8) p.dispatch_buffer_bytes = std::max(p.dispatch_buffer_bytes, fp8_dispatch_layout(T, D).total);
  p.combine = c.combine;
  // One row per (token, route) [T, K, D], or per (token, source rank) [T, R, D] (+ grad_scores
  // [T, K] f32 in training).
  p.combine_buffer_bytes = combine_buffer_bytes(T, K, R, D, per_rank);
  p.symmetric_bytes = p.routing_buffer_bytes + p.dispatch_buffer_bytes + p.combine_buffer_bytes;

  // ---- per-layer saved state ----
  p.packing_granule_bytes = packing_granule(D);
  p.routing_metadata_bytes = layout_bytes(M, T, K, E, R).total;
  p.layer_metadata_bytes = slot_layout(d, M, 1).layer_metadata;
  p.saved_input_bytes_per_layer = saved_input_bytes(d);
  p.saved_full_bytes_balanced = saved_full_bytes(d, T * K);
  p.saved_full_bytes_capacity = saved_full_bytes(d, M);

  // ---- activation slots ----
  if (c.inference) {
    p.slot_sizing = SlotSizing::none;  // every slot term stays 0
  } else {
    const ActivationSlots& s = c.slots;
    p.num_slots = s.num_slots;
    p.layers_per_slot = s.max_layers_per_slot;
    const int64_t L = s.max_layers_per_slot;
    const char* slots_field = "Config.slots.max_layers_per_slot";
    const int64_t G = p.packing_granule_bytes;
    // Metadata of every layer (planner record + layout) first, then the packed region.
    p.slot_metadata_bytes = round_up(
        checked_mul(L, p.layer_metadata_bytes, slots_field, "L * layer metadata"), G);
    p.minimum_slot_bytes = p.slot_metadata_bytes +
                           checked_mul(L, p.saved_input_bytes_per_layer, slots_field, "L * input");
    p.balanced_full_save_slot_bytes =
        p.slot_metadata_bytes +
        checked_mul(L, p.saved_full_bytes_balanced, slots_field, "L * balanced full save");
    p.maximum_useful_slot_bytes =
        p.slot_metadata_bytes +
        checked_mul(L, p.saved_full_bytes_capacity, slots_field, "L * capacity full save");
    if (s.slot_bytes) {
      EPMOE_CHECK_ARG(*s.slot_bytes <= kMaxTermBytes, "Config.slots.slot_bytes",
                      "a slot below 2^56 bytes", *s.slot_bytes);
      p.slot_sizing = SlotSizing::exact;
      p.slot_bytes = round_up(*s.slot_bytes, G);
      // The minimum is what the look-ahead rule needs to always fall back to saving inputs.
      EPMOE_CHECK_ARG(p.slot_bytes >= p.minimum_slot_bytes, "Config.slots.slot_bytes",
                      ">= " + std::to_string(p.minimum_slot_bytes) + " (minimum: metadata " +
                          std::to_string(p.slot_metadata_bytes) + " + " + std::to_string(L) +
                          " layers x input " + std::to_string(p.saved_input_bytes_per_layer) +
                          " bytes)",
                      std::to_string(*s.slot_bytes) + " (rounded to the granule: " +
                          std::to_string(p.slot_bytes) + ")");
    } else if (s.slot_capacity_factor) {
      p.slot_sizing = SlotSizing::factor;
      p.slot_capacity_factor = *s.slot_capacity_factor;
      const double extra = p.slot_capacity_factor *
                           static_cast<double>(p.balanced_full_save_slot_bytes - p.minimum_slot_bytes);
      EPMOE_CHECK_ARG(extra <= static_cast<double>(kMaxTermBytes), "Config.slots.slot_capacity_factor",
                      "a slot below 2^56 bytes", factor_text(p.slot_capacity_factor));
      p.slot_bytes = round_up(p.minimum_slot_bytes + ceil_tolerant(extra), G);
    } else {
      p.slot_sizing = SlotSizing::maximum_useful;
      p.slot_bytes = p.maximum_useful_slot_bytes;
    }
    p.activation_bytes = checked_mul(p.num_slots, p.slot_bytes, "Config.slots.num_slots",
                                     "N * slot bytes");
    p.planner_state_bytes = planner_state_layout(p.num_slots, R).total;
  }

  // ---- scratch (Context: route scratch, pad, call scratch, fp8 operands, fp8 weights) ----
  const bool unfused = !c.fuse_epilogues;
  const CallScratchLayout call = call_scratch_layout(d, M, unfused, per_rank);
  p.route_scratch_bytes = route_scratch_layout(d, M).total;
  // activation_bytes is a multiple of the granule, so the pad puts x_gathered on a whole row.
  p.call_scratch_pad_bytes =
      call_scratch_pad_bytes(p.route_scratch_bytes, call.x_gathered, p.packing_granule_bytes);
  // The forward touches layout..h (recompute mode) and, unfused or per-rank, rows_MD; the
  // backward all of it.
  p.forward_scratch_bytes = call.grad_h3 + (unfused || per_rank ? align_bytes(M * D * 2) : 0);
  p.backward_scratch_bytes = call.total;
  if (fp8) {
    // An inference context runs the forward only: of the FP8 operands it needs the h rows (the
    // first region of fp8_scratch_layout, so the carve is the same).
    p.fp8_scratch_bytes = c.inference ? align_bytes(fp8_rows_bytes(M, F))
                                      : fp8_scratch_layout(d, M, p.fp8_wgrad).total;
    // The h rows are the forward's too.
    p.forward_scratch_bytes += align_bytes(fp8_rows_bytes(M, F));
    // Per-call weights, then, for training, one transposed weight for the DGRADs (the CUDA
    // backend's FP8 grouped GEMM reads B as [E, N, K]); none of either when the caller prepares
    // the weights (with their transposed copies).
    p.fp8_weight_scratch_bytes =
        c.prepared_weights ? 0
                           : fp8_weight_layout(d).total +
                                 (c.inference ? 0 : fp8_transposed_layout(d).total);
  }
  if (c.precision == Precision::mxfp8) {
    p.mxfp8_scratch_bytes = mxfp8_scratch_layout(d, M).total;
    p.forward_scratch_bytes += p.mxfp8_scratch_bytes;
  }
  p.scratch_bytes = p.route_scratch_bytes + p.call_scratch_pad_bytes + p.backward_scratch_bytes +
                    p.fp8_scratch_bytes + p.fp8_weight_scratch_bytes;

  // ---- the rest ----
  p.status_bytes = align_bytes(static_cast<int64_t>(sizeof(Status)));
  p.peer_table_bytes = 3 * align_bytes(static_cast<int64_t>(R) * 8);
  p.arena_bytes = p.activation_bytes + p.scratch_bytes;
  p.total_bytes = p.arena_bytes + p.symmetric_bytes + p.status_bytes + p.peer_table_bytes +
                  p.planner_state_bytes;

  // ---- device / host split of the arena ----
  // Route kernels count with atomics into the route scratch and the layout: they stay on device
  // (with the pad between them, the scratch's first bytes).
  p.scratch_device_minimum_bytes =
      p.route_scratch_bytes + p.call_scratch_pad_bytes + call.x_gathered;
  p.scratch_device_bytes = p.scratch_bytes;
  if (c.scratch_device_bytes) {
    const int64_t cap = *c.scratch_device_bytes / kAlignment * kAlignment;
    EPMOE_CHECK_ARG(cap >= p.scratch_device_minimum_bytes, "Config.scratch_device_bytes",
                    ">= " + std::to_string(p.scratch_device_minimum_bytes) +
                        " (route scratch " + std::to_string(p.route_scratch_bytes) +
                        " + pad " + std::to_string(p.call_scratch_pad_bytes) +
                        " + layout " + std::to_string(call.x_gathered) +
                        " bytes stay in device memory)",
                    *c.scratch_device_bytes);
    p.scratch_device_bytes = std::min(cap, p.scratch_bytes);
  }
  p.arena_device_bytes = p.activation_bytes + p.scratch_device_bytes;
  p.arena_host_bytes = p.scratch_bytes - p.scratch_device_bytes;
  p.host_backed_scratch = p.arena_host_bytes > 0;
  p.device_total_bytes = p.total_bytes - p.arena_host_bytes;
  return p;
}

std::string MemoryPlan::explain() const {
  std::string o;
  auto line = [&o](const std::string& text) { o += text + "\n"; };
  const int min_KE = std::min(top_k, experts_local);

  line("epmoe memory plan: R=" + std::to_string(ep_size) + " ranks, T=" + std::to_string(tokens) +
       ", D=" + std::to_string(hidden) + ", F=" + std::to_string(intermediate) +
       ", K=" + std::to_string(top_k) + ", " + std::to_string(experts_global) + " experts (" +
       std::to_string(experts_local) + " per rank), " + (inference ? "inference" : "training"));
  line("  receive rows per rank: balanced " + thousands(balanced_recv_rows) + " (T*K) / capacity " +
       thousands(recv_capacity_rows) + " / topology max " + thousands(max_recv_rows) +
       " (T*R*min(K,E) = T*R*" + std::to_string(min_KE) + ")");
  if (requested_capacity_factor > capacity_factor) {
    line("  capacity factor: " + factor_text(capacity_factor) + " (requested " +
         factor_text(requested_capacity_factor) + ", clamped to R: a factor of R holds every route)");
  } else {
    line("  capacity factor: " + factor_text(capacity_factor));
  }

  line("  symmetric buffers per rank: " + bytes_text(symmetric_bytes));
  line("    routing (header + ids + scores [T,K]): " + bytes_text(routing_buffer_bytes));
  if (precision == Precision::fp8_block) {
    line("    dispatch x [T,D] E4M3 + scales [T,ceil(D/128)] f32 / grad_y [T,D] bf16: " +
         bytes_text(dispatch_buffer_bytes));
  } else {
    line("    dispatch x / grad_y [T,D] bf16: " + bytes_text(dispatch_buffer_bytes));
  }
  if (combine == CombineMode::per_rank) {
    line("    combine [T,R,D] bf16 (one partial row per source rank): " +
         bytes_text(combine_buffer_bytes));
  } else {
    line("    combine [T,K,D] bf16: " + bytes_text(combine_buffer_bytes));
  }

  line("  saved per layer:");
  line("    metadata (planner record + layout at capacity rows): " +
       bytes_text(layer_metadata_bytes) + "; layout " + bytes_text(routing_metadata_bytes));
  line("    packing granule lcm(128, 2D): " + thousands(packing_granule_bytes) + " bytes");
  {
    const LayoutBytes lb = layout_bytes(recv_capacity_rows, tokens, top_k, experts_local, ep_size);
    line("      of which pulls (one read per source token, " +
         thousands(pull_capacity(recv_capacity_rows, tokens, ep_size)) + " x (source + K rows)): " +
         bytes_text(lb.pull_src + lb.pull_rows));
  }
  line("    input only (recompute) x [T,D]: " + bytes_text(saved_input_bytes_per_layer));
  line("    full save (x_gathered, h13) at balanced rows: " +
       bytes_text(saved_full_bytes_balanced));
  line("    full save at capacity rows: " + bytes_text(saved_full_bytes_capacity));

  if (inference) {
    line("  activation slots: 0 slots (inference)");
  } else {
    std::string how;
    switch (slot_sizing) {
      case SlotSizing::exact: how = "Config.slots.slot_bytes, rounded to the granule"; break;
      case SlotSizing::factor: how = "slot capacity factor " + factor_text(slot_capacity_factor); break;
      case SlotSizing::maximum_useful: how = "maximum useful (default)"; break;
      case SlotSizing::none: how = "none"; break;
    }
    line("  activation slots: " + std::to_string(num_slots) + " x " + bytes_text(slot_bytes) + " = " +
         bytes_text(activation_bytes) + "; " + std::to_string(layers_per_slot) +
         " layer(s) per slot; size from " + how);
    line("  slot metadata (L layers): " + bytes_text(slot_metadata_bytes) +
         "; planner state: " + bytes_text(planner_state_bytes));
    line("  activation slot minimum/balanced full-save/maximum useful: " +
         bytes_text(minimum_slot_bytes) + " / " + bytes_text(balanced_full_save_slot_bytes) + " / " +
         bytes_text(maximum_useful_slot_bytes));
    if (slot_bytes > maximum_useful_slot_bytes) {
      line("  note: the slot is " + thousands(slot_bytes - maximum_useful_slot_bytes) +
           " bytes above the maximum useful size; they are never used");
    }
  }

  if (precision == Precision::fp8_block) {
    line("  scratch: " + bytes_text(scratch_bytes) + " = route " + bytes_text(route_scratch_bytes) +
         " + pad " + bytes_text(call_scratch_pad_bytes) + " + call " +
         bytes_text(backward_scratch_bytes) + " + fp8 operands " +
         bytes_text(fp8_scratch_bytes) + " + fp8 weights " + bytes_text(fp8_weight_scratch_bytes));
    const Dims d{tokens, hidden, intermediate, top_k, experts_local, ep_size};
    const Fp8ScratchLayout l = fp8_scratch_layout(d, recv_capacity_rows, fp8_wgrad);
    if (inference) {
      line("    fp8 operands (E4M3 + fp32 scales): h rows " + bytes_text(fp8_scratch_bytes) +
           " (inference: forward only)");
    } else {
      line("    fp8 operands (E4M3 + fp32 scales): h rows " + bytes_text(l.grad_h3_q - l.h_q) +
           ", grad_h3 rows " + bytes_text(l.grad_h13_q - l.grad_h3_q) + ", grad_h13 rows " +
           bytes_text(l.col_a - l.grad_h13_q) +
           (fp8_wgrad == Fp8Wgrad::bf16
                ? ", x decoded to bf16 for the bf16 WGRADs (no WGRAD columns) "
                : ", WGRAD columns (128 rows per block) ") +
           bytes_text(l.total - l.col_a));
      line("    weight gradients (Config.fp8_wgrad = " +
           std::string(epmoe::to_string(fp8_wgrad_requested)) + "): " + fp8_wgrad_reason);
    }
    // Prepared weights (no per-call weights) bring their transposed copies: no region either.
    const int64_t transposed =
        inference || fp8_weight_scratch_bytes == 0 ? 0 : fp8_transposed_layout(d).total;
    const int64_t per_call = fp8_weight_scratch_bytes - transposed;
    line(per_call > 0 ? "    fp8 weights quantized per call (w13, w2 + 128x128 scales): " +
                            bytes_text(per_call)
                      : "    fp8 weights: prepared by the caller (Config.prepared_weights; "
                        "training: with their transposed copies for the DGRADs)");
    if (transposed > 0) {
      line("    fp8 weight transposed for the DGRADs (w2, then w13, one region): " +
           bytes_text(transposed));
    }
  } else {
    line("  scratch: " + bytes_text(scratch_bytes) + " = route " + bytes_text(route_scratch_bytes) +
         " + pad " + bytes_text(call_scratch_pad_bytes) + " + call " +
         bytes_text(backward_scratch_bytes));
    if (precision == Precision::nvfp4) {
      line("    nvfp4 weights: prepared by the caller (weight-only; activations stay bf16)");
    }
    if (precision == Precision::mxfp8) {
      line("    mxfp8 weights: prepared by the caller (bf16 rows cross ranks; the GEMMs quantize "
           "them 1x32)");
      line("    mxfp8 quantized rows (CUDA): " + bytes_text(mxfp8_scratch_bytes) +
           " in the call scratch's backward rows (no bytes added)");
    }
  }
  {
    const Dims d{tokens, hidden, intermediate, top_k, experts_local, ep_size};
    const RouteScratchLayout rl = route_scratch_layout(d, recv_capacity_rows);
    line("    route: of which pull numbering " + bytes_text(rl.arrivals - rl.pull_of_token) +
         ", dispatch arrival counters (per 128 rows) " + bytes_text(rl.total - rl.arrivals));
    line("    pad: puts the call scratch's x_gathered (after its layout) on the packing granule: " +
         bytes_text(call_scratch_pad_bytes));
  }
  line("    forward (recompute mode): " + bytes_text(forward_scratch_bytes) +
       "; backward: " + bytes_text(backward_scratch_bytes));
  line("  status word: " + bytes_text(status_bytes));
  line("  peer tables (3 x [R] pointers): " + bytes_text(peer_table_bytes));
  line("  arena (slots + scratch): " + bytes_text(arena_bytes));
  line("  total (arena + symmetric + status + peer tables + planner state): " +
       bytes_text(total_bytes));
  if (host_backed_scratch) {
    line("  host-backed scratch (Config.scratch_device_bytes): device " +
         bytes_text(scratch_device_bytes) + " + pinned host " + bytes_text(arena_host_bytes) +
         "; routing part kept on device " + bytes_text(scratch_device_minimum_bytes));
    line("    arena: device " + bytes_text(arena_device_bytes) + " (slots + device scratch), then host " +
         bytes_text(arena_host_bytes) + " in the same virtual range");
    line("    device total: " + bytes_text(device_total_bytes) + " (total minus host scratch)");
  } else {
    line("  all scratch in device memory; device total " + bytes_text(device_total_bytes));
  }

  if (inference) {
    line("  scratch-only inference; no saved activations");
  } else if (slot_bytes >= maximum_useful_slot_bytes) {
    line("  every layer saves everything (no recompute)");
  } else if (slot_bytes >= balanced_full_save_slot_bytes) {
    line("  balanced routing fits without recompute; heavier routing may recompute");
  } else if (slot_bytes > minimum_slot_bytes) {
    line("  some layers recompute at balanced routing");
  } else {
    line("  all layers recompute (minimum budget)");
  }
  return o;
}

}  // namespace epmoe
