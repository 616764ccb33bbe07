// Numerical tolerances of the routed experts vs the float64 reference, as data: one rel-L2 bound
// per (precision, output). Bounds come from measurements (below) with margin; never widen one
// without new evidence.
#pragma once

#include "epmoe/config.h"

namespace epmoe::test {

enum class Output : int { y, grad_x, grad_scores, grad_w13, grad_w2 };
constexpr int kNumOutputs = 5;
inline const char* to_string(Output o) {
  switch (o) {
    case Output::y: return "y";
    case Output::grad_x: return "grad_x";
    case Output::grad_scores: return "grad_scores";
    case Output::grad_w13: return "grad_w13";
    case Output::grad_w2: return "grad_w2";
  }
  return "?";
}

struct Tolerance {
  Precision precision;
  Output output;
  double rel_l2;  // bound on ||got - ref|| / ||ref||, pooled over ranks
};

// BF16 (bf16 operands and stored intermediates, fp32 accumulation), CPU backend, vs float64.
// Measured (rel-L2; grad_scores with the cancellation floor of moe_case.h measure()):
//   output        fixed-seed suite (57 checks)   640 random runs (8 shapes x 2 act. x 40 seeds)
//   y             2.3e-3 .. 4.3e-3               max 6.6e-3
//   grad_x        2.9e-3 .. 5.0e-3               max 6.6e-3
//   grad_scores   0.9e-3 .. 3.8e-3               max 8.2e-3
//   grad_w13      3.2e-3 .. 5.4e-3               max 5.9e-3
//   grad_w2       2.4e-3 .. 4.7e-3               max 8.1e-3
// Suite: R 1-4, T 1-64, D 16-128 incl. 111, F 8-96, K 1-4, plain and clamped SwiGLU, fused and
// unfused, bf16 and f32 weight gradients, edge-case routings. One bf16 rounding is 2^-9 relative
// at most (rel-L2 ~1.1e-3 for uniform data); outputs pass through 2-4 roundings. Bounds are
// ~1.5x the worst random run. Clamped SwiGLU inputs keep h13 0.05 away from the kinks (see
// make_inputs): across a kink the gradient jumps, and bf16 rounding of h13 flips the branch for
// ~0.1% of the values, which alone measured 3e-2 .. 1e-1 on grad_x / grad_w13.
inline constexpr Tolerance kTolerances[] = {
    {Precision::bf16, Output::y, 1.0e-2},
    {Precision::bf16, Output::grad_x, 1.0e-2},
    {Precision::bf16, Output::grad_scores, 1.2e-2},
    {Precision::bf16, Output::grad_w13, 1.0e-2},
    {Precision::bf16, Output::grad_w2, 1.2e-2},
};

// CUDA backend vs CPU backend on identical inputs (same rounding points; they differ only in the
// fp32 accumulation order of the GEMMs and in expf ulps, which flip single bf16 roundings).
// Initial bounds from the forward target (5e-3); adjust only with measured evidence.
inline constexpr Tolerance kBackendTolerances[] = {
    {Precision::bf16, Output::y, 5.0e-3},
    {Precision::bf16, Output::grad_x, 5.0e-3},
    {Precision::bf16, Output::grad_scores, 5.0e-3},
    {Precision::bf16, Output::grad_w13, 5.0e-3},
    {Precision::bf16, Output::grad_w2, 5.0e-3},
};

inline double backend_rel_l2_bound(Precision precision, Output output) {
  for (const Tolerance& t : kBackendTolerances) {
    if (t.precision == precision && t.output == output) return t.rel_l2;
  }
  return -1.0;
}

// The bound for (precision, output); a missing entry is a test bug, reported as -1 (fails).
inline double rel_l2_bound(Precision precision, Output output) {
  for (const Tolerance& t : kTolerances) {
    if (t.precision == precision && t.output == output) return t.rel_l2;
  }
  return -1.0;
}

// ---- Block-scaled formats: bounds keyed by (format, direction) ----
// Directions so far are the codec round trips, dequantize(quantize(x)) vs x; the GEMM directions
// (forward, grad_x, grad_w) join this table when the block-scaled GEMMs land.
enum class Direction : int {
  roundtrip_rows,     // 1 x block along a row (activations; MXFP8 / NVFP4 weights too)
  roundtrip_weights,  // 128 x 128 blocks (FP8 weights)
};

struct FormatTolerance {
  Precision format;
  Direction direction;
  double rel_l2;  // bound on ||got - x|| / ||x||
  double cosine;  // bound below on cos(got, x)
  double atol;    // bound on max |got - x| for the stated data (unit-normal)
};

// Codec round trips, measured by test_formats' property tests (EPMOE_REPORT_ERRORS=1) on
// unit-normal fp32 data, 200 seeds per line (fp8 rows [37, 300]; fp8 weights [2, 200, 260];
// mxfp8 [37, 200]; nvfp4 [36, 200] in 3 global-scale groups; partial last blocks included):
//   format / direction           rel-L2 (min .. max)     cosine (min)   max |err| (max)
//   fp8 rows, fp32 scales        2.51e-2 .. 2.61e-2      0.99966        0.153
//   fp8 rows, UE8M0 scales       2.60e-2 .. 2.72e-2      0.99963        0.2495
//   fp8 weights, fp32 scales     2.62e-2 .. 2.67e-2      0.99964        0.185
//   fp8 weights, UE8M0 scales    2.64e-2 .. 2.67e-2      0.99964        0.2500
//   mxfp8 rows                   2.82e-2 .. 3.18e-2      0.99950        0.498
//   nvfp4 rows                   9.24e-2 .. 9.71e-2      0.99528        0.614
// One fp8_block entry covers both scale formats (the worse of the two). The max errors have
// analytic ceilings for unit-normal blocks (amax < 7): UE8M0 half a step at the top binade is
// 16 * 2^-6 = 0.25 (amax in (3.5, 7]); MXFP8's saturation of (448, 512) * X costs up to 0.5
// (amax just under 4, X = 2^-7); NVFP4 half a step of 4..6 is one element scale, amax / 6 *
// (1 + 1/16). rel-L2 bounds are ~1.1x the worst run (the spread over seeds is under 5%); cosine and
// atol have similar margins.
inline constexpr FormatTolerance kFormatTolerances[] = {
    {Precision::fp8_block, Direction::roundtrip_rows, 3.0e-2, 0.9995, 0.3},
    {Precision::fp8_block, Direction::roundtrip_weights, 3.0e-2, 0.9995, 0.3},
    {Precision::mxfp8, Direction::roundtrip_rows, 3.5e-2, 0.9993, 0.6},
    {Precision::nvfp4, Direction::roundtrip_rows, 0.105, 0.994, 0.8},
};

// The entry for (format, direction); nullptr (a test bug) when there is none.
inline const FormatTolerance* format_tolerance(Precision format, Direction direction) {
  for (const FormatTolerance& t : kFormatTolerances) {
    if (t.format == format && t.direction == direction) return &t;
  }
  return nullptr;
}

}  // namespace epmoe::test
