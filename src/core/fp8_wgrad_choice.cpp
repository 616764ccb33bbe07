#include "core/fp8_wgrad_choice.h"

#include <cstdio>

namespace epmoe {

namespace {

// D*F/(D+F) with one decimal, e.g. "558.5".
std::string ratio_text(int64_t D, int64_t F) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f",
                static_cast<double>(D) * static_cast<double>(F) / static_cast<double>(D + F));
  return buf;
}

}  // namespace

Fp8WgradChoice choose_fp8_wgrad(const Config& config, int ep_size) {
  const ConfigFields& c = config.fields();
  config.local_experts(ep_size);  // checks ep_size >= 1 and divisibility
  Fp8WgradChoice out;
  if (c.fp8_wgrad != Fp8Wgrad::by_shape) {
    out.wgrad = c.fp8_wgrad;
    out.reason = std::string(to_string(c.fp8_wgrad)) + ": as configured";
    return out;
  }
  if (c.precision != Precision::fp8_block || c.inference) {
    out.wgrad = Fp8Wgrad::fp8;
    out.reason = c.inference ? "fp8: unused (inference: no weight gradients)"
                             : std::string("fp8: unused (precision ") + to_string(c.precision) +
                                   " has no FP8 weight gradients)";
    return out;
  }
  const int64_t D = config.D(), F = config.F();
  // T*K*R fits in int32 once the planner has checked it; int64 here needs no such check.
  const int64_t rows = config.T() * config.K() * ep_size / config.num_experts();
  const std::string ratio = "D*F/(D+F) = " + ratio_text(D, F);
  if (rows < kFp8WgradMinRowsPerExpert) {
    out.wgrad = Fp8Wgrad::bf16;
    out.reason = "bf16: " + std::to_string(rows) + " rows per expert < " +
                 std::to_string(kFp8WgradMinRowsPerExpert) +
                 " (short k-loops: the bf16 WGRAD measured faster)";
  } else if (D * F < kFp8WgradMinGemmPerQuantized * (D + F)) {  // D*F/(D+F) < threshold, exact
    out.wgrad = Fp8Wgrad::bf16;
    out.reason = "bf16: " + ratio + " < " + std::to_string(kFp8WgradMinGemmPerQuantized) +
                 " (the column quantization costs more than the FP8 GEMM saves)";
  } else {
    out.wgrad = Fp8Wgrad::fp8;
    out.reason = "fp8: " + std::to_string(rows) + " rows per expert >= " +
                 std::to_string(kFp8WgradMinRowsPerExpert) + " and " + ratio +
                 " >= " + std::to_string(kFp8WgradMinGemmPerQuantized);
  }
  return out;
}

}  // namespace epmoe
