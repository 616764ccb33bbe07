// Config.fp8_wgrad = by_shape resolved to fp8 or bf16 (the precision of fp8_block training's two
// weight gradients). Pure; plan_memory calls it and MemoryPlan::fp8_wgrad holds the result, which
// Context hands to the backends' steps, so both backends and the scratch carve run one choice.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/config.h"

namespace epmoe {

// Thresholds of the rule, from fwd+bwd ms on H200 at EP = 1, balanced routing
// (bench/results/2026-11-30-004ced0-h200.json; rows per expert M_e = T*K*R/E_global):
//   shape          D     F      M_e   D*F/(D+F)  fp8 WGRADs  bf16 WGRADs
//   qwen3-30b-a3b  2048  768    512    559        4.182 ms    3.701 ms (bf16 wins 12 %)
//   deepseek-v3    7168  2048   128   1593       22.014 ms   19.629 ms (bf16 wins 11 %)
//   gpt-oss-120b   2880  2880   256   1440       10.496 ms    9.712 ms (bf16 wins 7 %)
//   mixtral-8x7b   4096  14336  2048  3186       23.113 ms   25.643 ms (fp8 wins 10 %)
// The FP8 WGRAD reduces over each expert's M_e rows in 128-row k-blocks, each promoted with a row
// and a column scale, and both operands need column quantization first. With few k-blocks per
// expert the bf16 WGRAD (which runs only the 16-row k-steps holding rows, 004ced0) is faster:
// gpt-oss at 256 rows moved from fp8 (2 % ahead at 97c789b) to bf16 once the bf16 WGRAD's k-tail
// and TMA boxes were fixed. Between 512 and 2048 rows the rule is unmeasured at EP = 1 (gpt-oss
// at EP = 2 holds 512).
constexpr int64_t kFp8WgradMinRowsPerExpert = 512;
// The operands' column quantization costs per row in proportion to D + F, the GEMM saving in
// proportion to D * F: below this D*F/(D+F) the quantizers cost more than FP8 saves.
constexpr int64_t kFp8WgradMinGemmPerQuantized = 1024;

struct Fp8WgradChoice {
  Fp8Wgrad wgrad = Fp8Wgrad::fp8;  // resolved: fp8 or bf16, never by_shape
  std::string reason;              // one line with the numbers (MemoryPlan::fp8_wgrad_reason)
};

// Explicit fp8 / bf16 pass through ("as configured"). by_shape with fp8_block training applies the
// rule above at M_e = T*K*R/E_global rounded down (T = Config.max_tokens_per_rank, the planner's
// T; the balanced load, no capacity factor); with any other precision, or inference, there are no
// FP8 weight gradients and it resolves to fp8 (unused). Throws like Config::local_experts when
// ep_size does not divide the experts.
Fp8WgradChoice choose_fp8_wgrad(const Config& config, int ep_size);

}  // namespace epmoe
