// Config: the static description of one EP group's MoE layers. Validated at construction; every
// error names the field and gives the expected and the actual value.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "epmoe/tensor.h"

namespace epmoe {

enum class ActivationKind : int { swiglu, swiglu_clamped };

// SwiGLU over h13 = [gate | up]:
//   swiglu:          h = silu(gate) * up
//   swiglu_clamped:  g = min(gate, limit); u = clamp(up, -limit, limit);
//                    h = g * sigmoid(alpha * g) * (u + 1)            (GPT-OSS: alpha 1.702, limit 7)
struct Activation {
  ActivationKind kind = ActivationKind::swiglu;
  float alpha = 1.702f;
  float limit = 7.0f;
  static Activation swiglu() { return {}; }
  static Activation swiglu_clamped(float alpha = 1.702f, float limit = 7.0f) {
    return {ActivationKind::swiglu_clamped, alpha, limit};
  }
};

// Operand precision of the expert GEMMs. bf16 runs everywhere; fp8_block (E4M3, 1x128 activation
// and 128x128 weight blocks, fp32 scales; docs/formats.md "FP8 training") on the CPU backend;
// nvfp4 is weight-only inference (NVFP4 prepared weights, bf16 activations; needs inference and
// prepared_weights; docs/formats.md "NVFP4 weight-only inference") on both backends; mxfp8 is
// inference with MXFP8 weights and activations quantized 1x32 (needs inference and
// prepared_weights; docs/formats.md "MXFP8 inference") on both backends (CUDA: D, F multiples of
// 32).
enum class Precision : int { bf16, fp8_block, mxfp8, nvfp4 };
const char* to_string(Precision precision);

// How expert outputs return to their token's rank (docs/cuda_backend.md "Combine").
//   per_route: every route's row is stored into the owner's combine slot [T, K, D]; the owner
//              sums the K slots (score-weighted in forward) in fp32 and rounds once.
//   per_rank:  the expert side sums the routes of each (token, source rank) pull in fp32, rounds
//              once, and stores one row per (token, rank) into the owner's [T, R, D] buffer; the
//              owner sums its R partials in rank order. Sends (ranks holding >= 1 route) rows per
//              token instead of K. Backward: grad_x the same way; grad_scores computed on the
//              expert side (which keeps h3 [rows, D]). Needs precision bf16.
enum class CombineMode : int { per_route, per_rank };
const char* to_string(CombineMode mode);

// Precision of the two weight gradients of FP8 training (precision fp8_block; docs/formats.md
// "FP8 training", "The weight gradients in bf16").
//   fp8:  both operands quantized 128x1 along each expert's rows, then the FP8 WGRAD.
//   bf16: the bf16 path's WGRAD (bf16 operands, fp32 accumulation) on the bf16 grad_h3 / h and
//         grad_h13 the step holds, and x as its received E4M3 rows decoded, each value
//         bf16(fp32 code * scale). No column quantization.
//   by_shape: the planner picks fp8 or bf16 from the shape (MemoryPlan::fp8_wgrad holds the
//         choice, explain() its reason; rule in src/core/fp8_wgrad_choice.h): fp8 iff the balanced
//         rows per local expert T*K*R/E_global >= 512 and D*F/(D+F) >= 1024.
enum class Fp8Wgrad : int { fp8, bf16, by_shape };
const char* to_string(Fp8Wgrad wgrad);
// The default of ConfigFields::fp8_wgrad (one place to change it).
constexpr Fp8Wgrad kDefaultFp8Wgrad = Fp8Wgrad::by_shape;

// What happens when a rank receives more rows than its planned capacity.
//   report: no out-of-bounds access; the status word records (rank, required, available), every
//           rank skips the step consistently, Context::check() throws; the context stays usable.
//   trap:   additionally trap on the device (CUDA) / abort the step with an exception (CPU).
enum class OverflowPolicy : int { report, trap };

// Activation slots hold what forward saves for backward (DESIGN.md §4). A slot is LIFO over the
// layers that share it; N slots serve N pipeline micro-batches in flight.
struct ActivationSlots {
  int num_slots = 1;                           // N
  int max_layers_per_slot = 1;                 // L
  std::optional<int64_t> slot_bytes;           // exact budget per slot
  std::optional<double> slot_capacity_factor;  // minimum + f * (balanced full save - minimum)
  // Neither set: the maximum useful size (every layer saves everything, no recompute).
};

struct ConfigFields {
  int64_t max_tokens_per_rank = 0;  // T: physical rows of x_TD per call (a call may pass fewer)
  int64_t hidden_dim = 0;           // D
  int64_t intermediate_dim = 0;     // F
  int top_k = 0;                    // K
  int num_experts = 0;              // global experts = E * R (rank r owns [r*E, (r+1)*E))
  Activation activation = Activation::swiglu();
  Precision precision = Precision::bf16;
  // Receive-row capacity per rank in units of the balanced load T*K; clamped to the topology
  // bound T*R*min(K, E) (a factor of R always suffices).
  double capacity_factor = 1.0;
  ActivationSlots slots{};
  OverflowPolicy overflow = OverflowPolicy::report;
  DType wgrad_dtype = DType::bf16;  // dtype of grad_w13 / grad_w2: bf16 or f32
  bool inference = false;           // no slots, no backward
  bool check_inputs = true;         // expert ids in range and finite x / scores, checked on device
  int barrier_timeout_ms = 30000;   // budget of every cross-rank wait
  bool fuse_epilogues = true;       // false: run the unfused chain (GEMM, then SwiGLU / scatter)
  // CUDA: the W13 GEMM is launched while dispatch runs (programmatic dependent launch) and its TMA
  // producer waits on per-128-row arrival counters that dispatch releases; false: staged (W13
  // starts after dispatch has finished). Results are bitwise equal; the CPU backend ignores it.
  // Off by default: measured slower on 2 x H200 (deepseek-v3 EP = 2 forward 9.95 ms gated vs
  // 5.51 ms staged; bench/results/2026-11-29-*-ep2-gated.json): W13 CTAs take SMs that dispatch
  // still needs and spin, and dispatch fills rows in (source, token) order, not expert order.
  bool arrival_gated_w13 = false;
  // fp8_block: true: forward/backward take the caller's PreparedWeights (w13_prepared,
  // w2_prepared; made once per optimizer step with prepare_weights). false: the context quantizes
  // the bf16 weights in every call into its own scratch (bitwise the same as prepared ones).
  // nvfp4 / mxfp8: must be true (forward takes NVFP4 / MXFP8 w13_prepared / w2_prepared).
  bool prepared_weights = false;
  // The most bytes of the scratch kept in device memory (rounded down to 128); the rest of the
  // scratch is pinned host memory mapped right behind it in the arena's one virtual range (CUDA:
  // VMM; docs/memory.md "Host-backed scratch"). At least the routing part (route scratch + one
  // layout), which stays in device memory. Unset: everything in device memory (plain cudaMalloc).
  std::optional<int64_t> scratch_device_bytes{};
  CombineMode combine = CombineMode::per_route;
  // fp8_block training: the weight gradients' precision (Fp8Wgrad above); other precisions
  // must leave it at the default.
  Fp8Wgrad fp8_wgrad = kDefaultFp8Wgrad;
};

class Config {
 public:
  explicit Config(const ConfigFields& fields);

  const ConfigFields& fields() const { return f_; }
  int64_t T() const { return f_.max_tokens_per_rank; }
  int64_t D() const { return f_.hidden_dim; }
  int64_t F() const { return f_.intermediate_dim; }
  int K() const { return f_.top_k; }
  int num_experts() const { return f_.num_experts; }
  // Local experts per rank; throws naming Config.num_experts when E*R does not divide.
  int local_experts(int ep_size) const;

  std::string to_string() const;

 private:
  ConfigFields f_;
};

}  // namespace epmoe
