// Numerical tolerances of the routed experts vs the float64 reference, as data: one rel-L2 bound
// per (precision, output). Bounds come from measurements (below) with margin; never widen one
// without new evidence.
#pragma once

#include <string_view>

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
    // fp8_block forward (measured on inference contexts; training runs the same stages). The FP8 steps
    // are the same functions on both backends; the tensor core sums each 128-deep block with
    // reduced precision and expf differs by ulps, which flip single bf16 roundings of h13 / h and,
    // through h's 1x128 scale (when the block amax flips), re-round a whole block of h codes.
    // Measured on the H200 (test_gpu_fp8_forward, EPMOE_REPORT_ERRORS=1, 2026-11-30, 5 shapes):
    // rel-L2 3.0e-4 .. 7.0e-3; the bound is about twice the worst.
    {Precision::fp8_block, Output::y, 1.5e-2},
    // fp8_block backward (training contexts): the same steps, and the WGRADs run the bf16 kernel on
    // the FP8 column-quantized operands dequantized to bf16 (code * scale rounded to bf16; the CPU
    // sums E4M3 products per block with fp32 scale promotion), so grad_w13 / grad_w2 differ by
    // those roundings and the tensor core's sums too. Measured on the H200 (test_gpu_fp8_training,
    // EPMOE_REPORT_ERRORS=1, 2026-11-30 at 5f29166, 9 cases: 6 shapes, f32 WGRAD, live counts
    // 77 / 0 / none): y 3.3e-4 .. 5.6e-3, grad_x 1.9e-3 .. 5.4e-3, grad_scores 2.3e-4 .. 5.1e-3,
    // grad_w13 3.0e-3 .. 5.3e-3, grad_w2 2.6e-4 .. 5.1e-3; the bounds are about 2.8x the worst.
    {Precision::fp8_block, Output::grad_x, 1.5e-2},
    {Precision::fp8_block, Output::grad_scores, 1.5e-2},
    {Precision::fp8_block, Output::grad_w13, 1.5e-2},
    {Precision::fp8_block, Output::grad_w2, 1.5e-2},
    // nvfp4 weight-only forward (inference). The CPU decodes w = e2m1 * (e4m3 * global) in fp32 and
    // sums a * w in order; CUDA decodes e2m1 * e4m3 exactly into bf16, sums on the tensor cores and
    // multiplies the fp32 sum by global once, so sums differ by fp32 ulps that flip single bf16
    // roundings of h13 / h / y (the bf16 path's size). A conservative first bound, to be tightened
    // from the H200 measurement (test_gpu_nvfp4_forward with EPMOE_REPORT_ERRORS=1).
    {Precision::nvfp4, Output::y, 1.0e-2},
    // mxfp8 forward (inference). Both backends quantize x and h 1x32 with the same codec and scale
    // each block's code-product sum by 2^(sa + sw) into an fp32 total in block order; the CPU
    // rounds a block's exact sum once to fp32, the tensor cores sum its 32 products in fp32 in
    // their own order (equal unless the exact sum needs more than 24 bits). The differences that
    // remain are the bf16 path's: expf ulps and those block sums flip single bf16 roundings of
    // h13 / h / y, and a flipped h element can re-round its 32-element block's codes when it moves
    // the block amax across a power of two. A conservative first bound (nvfp4's), to be tightened
    // from the H200 measurement (test_gpu_mxfp8_forward with EPMOE_REPORT_ERRORS=1).
    {Precision::mxfp8, Output::y, 1.0e-2},
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

// ---- Grouped GEMMs against their format's CPU formula (bf16 outputs), keyed by (format, kernel) ----
// A kernel whose tensor cores sum a block's products their own way (not exactly, as the CPU does)
// agrees with the formula up to flipped bf16 roundings: per element
//   |gpu - cpu| <= rel_bf16 |cpu| + block_fraction * sum_b 2^(sa+sw) sum_k |qa qw|
// and over all outputs rel-L2 <= rel_l2, on codec-prepared normal data.
struct GemmTolerance {
  Precision format;
  const char* kernel;
  double rel_bf16;        // one bf16 rounding step of the output: 2^-7 relative
  double block_fraction;  // of each block's sum of |products|, scaled
  double rel_l2;
};

// mxfp8 wgmma (cuda/gemm/mxfp8_wgmma_gemm.h): block_fraction 2^-8 is what an fp8 accumulation that
// keeps 14 bits below a block's largest product can lose over 32 products (analytical, not yet
// measured); rel_l2 a first bound below the bf16 path's 5e-3. Both to be tightened from the H200
// measurement (test_gpu_gemm_mxfp8_wgmma, CodecPreparedRandomDataWithinBound with
// EPMOE_REPORT_ERRORS=1 prints bitwise count, max relative error and rel-L2).
inline constexpr GemmTolerance kGemmTolerances[] = {
    {Precision::mxfp8, "wgmma", 0x1p-7, 0x1p-8, 4.0e-3},
};

// The entry for (format, kernel); nullptr (a test bug) when there is none.
inline const GemmTolerance* gemm_tolerance(Precision format, std::string_view kernel) {
  for (const GemmTolerance& t : kGemmTolerances) {
    if (t.format == format && kernel == t.kernel) return &t;
  }
  return nullptr;
}

// ---- Block-scaled formats: bounds keyed by (format, direction) ----
// Directions here are the codec round trips, dequantize(quantize(x)) vs x; the training directions
// (forward, grad_x, grad_scores, grad_w13, grad_w2) are kTrainingTolerances below.
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

// ---- Training and inference through Context: bounds keyed by (format, direction = output,
// reference) ----
enum class Against : int {
  float64,          // the float64 reference (no fake quantization)
  bf16_path,        // the bf16 pipeline on the same inputs
  float64_decoded,  // the float64 reference on the weights the format decodes to (same math;
                    // mxfp8: also on the activations as the 1x32 quantizer leaves them)
};

struct TrainingTolerance {
  Precision format;
  bool clamped;   // SwiGLU clamped (GPT-OSS) inputs: h13 reaches the kinks (see below)
  Output output;  // the direction: forward (y), grad_x, grad_scores, grad_w13, grad_w2
  Against against;
  double rel_l2;  // bound on ||got - ref|| / ||ref|| (grad_scores floored as in moe_case.h)
  double cosine;  // bound below on cos(got, ref)
  double atol;    // bound on max |got - ref| for make_inputs' data (x, grad_y in [-1, 1])
};

// FP8 block-scaled training (Config.precision = fp8_block), CPU backend, through Context.
// Measured by test_fp8_training (EPMOE_FP8_SEEDS=20 EPMOE_REPORT_ERRORS=1): plain SwiGLU over 4
// shapes x 20 seeds (R 1-2, T 16-100, D 32-136, F 24-72, 2-8 experts, up to 200 rows per expert)
// + D = 256, F = 200 x 6 seeds (66 runs); clamped SwiGLU (D = 111, F = 40, K = 3) x 20 seeds:
//   output        plain: rel-L2 (min..max)  1-cos max  max|err|   clamped: rel-L2   1-cos   max|err|
//   y             5.2e-2 .. 7.2e-2          2.6e-3     0.40       6.1e-2 .. 6.8e-2  2.3e-3  8.5
//   grad_x        5.4e-2 .. 7.8e-2          3.0e-3     0.59       8.8e-2 .. 0.172   1.5e-2  45
//   grad_scores   3.7e-2 .. 7.0e-2          4.1e-3     2.1        4.7e-2 .. 5.9e-2  2.9e-3  33
//   grad_w13      5.5e-2 .. 7.1e-2          2.5e-3     1.6        8.9e-2 .. 0.170   1.4e-2  21
//   grad_w2       4.7e-2 .. 6.6e-2          2.2e-3     1.05       6.0e-2 .. 6.5e-2  2.1e-3  10.6
// Against the bf16 path the numbers agree to the second digit (the FP8 error dominates the bf16
// one, ~5e-3). Each quantization of a unit-spread operand costs ~2.6e-2 (kFormatTolerances); an
// output passes through 2-4 of them. Clamped SwiGLU has its own rows: its inputs keep h13 0.05 away
// from the kinks (make_inputs), enough for bf16 but not for the E4M3 error of x (~1/16 relative),
// so some elements take the other branch and their gradient jumps (grad_x, grad_w13); its data is
// larger (h13 spread ~5), hence the atol. Bounds: ~1.25x the worst rel-L2, 1.5x the worst
// (1 - cos) and max |err|. Never widen one without new measurements.
inline constexpr TrainingTolerance kTrainingTolerances[] = {
    {Precision::fp8_block, false, Output::y, Against::float64, 0.090, 0.996, 0.6},
    {Precision::fp8_block, false, Output::grad_x, Against::float64, 0.095, 0.9955, 0.9},
    {Precision::fp8_block, false, Output::grad_scores, Against::float64, 0.090, 0.994, 3.2},
    {Precision::fp8_block, false, Output::grad_w13, Against::float64, 0.090, 0.996, 2.4},
    {Precision::fp8_block, false, Output::grad_w2, Against::float64, 0.085, 0.9965, 1.6},
    {Precision::fp8_block, false, Output::y, Against::bf16_path, 0.090, 0.996, 0.6},
    {Precision::fp8_block, false, Output::grad_x, Against::bf16_path, 0.095, 0.9955, 0.9},
    {Precision::fp8_block, false, Output::grad_scores, Against::bf16_path, 0.090, 0.994, 3.2},
    {Precision::fp8_block, false, Output::grad_w13, Against::bf16_path, 0.090, 0.996, 2.4},
    {Precision::fp8_block, false, Output::grad_w2, Against::bf16_path, 0.085, 0.9965, 1.6},
    {Precision::fp8_block, true, Output::y, Against::float64, 0.085, 0.9965, 13.0},
    {Precision::fp8_block, true, Output::grad_x, Against::float64, 0.21, 0.978, 68.0},
    {Precision::fp8_block, true, Output::grad_scores, Against::float64, 0.075, 0.9955, 50.0},
    {Precision::fp8_block, true, Output::grad_w13, Against::float64, 0.21, 0.978, 32.0},
    {Precision::fp8_block, true, Output::grad_w2, Against::float64, 0.082, 0.9965, 16.0},
    {Precision::fp8_block, true, Output::y, Against::bf16_path, 0.085, 0.9965, 13.0},
    {Precision::fp8_block, true, Output::grad_x, Against::bf16_path, 0.21, 0.978, 68.0},
    {Precision::fp8_block, true, Output::grad_scores, Against::bf16_path, 0.075, 0.9955, 50.0},
    {Precision::fp8_block, true, Output::grad_w13, Against::bf16_path, 0.21, 0.978, 32.0},
    {Precision::fp8_block, true, Output::grad_w2, Against::bf16_path, 0.082, 0.9965, 16.0},
    // NVFP4 weight-only inference: forward only (y); see the measurements below.
    {Precision::nvfp4, false, Output::y, Against::float64_decoded, 7.5e-3, 0.99997, 0.06},
    {Precision::nvfp4, true, Output::y, Against::float64_decoded, 5.0e-3, 0.99999, 1.0},
    {Precision::nvfp4, false, Output::y, Against::bf16_path, 0.235, 0.975, 1.9},
    {Precision::nvfp4, true, Output::y, Against::bf16_path, 0.24, 0.973, 43.0},
    // MXFP8 inference: forward only (y); see the measurements below.
    {Precision::mxfp8, false, Output::y, Against::float64_decoded, 0.052, 0.9987, 0.58},
    {Precision::mxfp8, true, Output::y, Against::float64_decoded, 0.025, 0.9997, 5.3},
    {Precision::mxfp8, false, Output::y, Against::bf16_path, 0.15, 0.992, 1.2},
    {Precision::mxfp8, true, Output::y, Against::bf16_path, 0.122, 0.9935, 23.0},
};

// NVFP4 weight-only inference (Config.precision = nvfp4), CPU backend, y only. Measured by
// test_nvfp4_inference (EPMOE_NVFP4_SEEDS=20 EPMOE_REPORT_ERRORS=1): 8 shapes x 20 seeds (R 1-2,
// T 1-128, live count < T, D 64-256 incl. 111, F 40-200, K 2-4; plain and clamped SwiGLU):
//   against                           rel-L2 (min..max)     1-cos max   max|err|
//   float64 on the decoded weights    plain 2.9e-3 .. 5.9e-3  1.6e-5      0.037
//                                     clamped 3.2e-3 .. 3.3e-3 5.5e-6     0.66
//   bf16 path on the original weights plain 0.174 .. 0.188    1.7e-2      1.23
//                                     clamped 0.177 .. 0.191  1.8e-2      28.8
// Against the decoded weights only the pipeline's bf16 roundings (h13, h, the combine rows, y)
// remain: the same size as the bf16 path's own error (kTolerances y). Against the bf16 path the
// NVFP4 error of both weights dominates: make_inputs' uniform weights lose ~9.5% each to the
// format (kFormatTolerances nvfp4), and the two GEMMs and SwiGLU compound it. The upper T = 1
// decoded numbers come from single rows (64 values), hence the plain bound. Bounds: ~1.25x the
// worst rel-L2, ~1.5-2x the worst (1 - cos) and max |err|. Never widen one without new
// measurements.

// MXFP8 inference (Config.precision = mxfp8), CPU backend, y only. Measured by
// test_mxfp8_inference (EPMOE_MXFP8_SEEDS=20 EPMOE_REPORT_ERRORS=1): 9 shapes x 20 seeds (R 1-2,
// T 1-128, live count < T, D 20-256 incl. 20 and 111, F 12-200, K 2-4; plain and clamped SwiGLU):
//   against                             rel-L2 (min..max)       1-cos max   max|err|
//   float64 on the dequantized operands plain 2.3e-3 .. 4.1e-2    8.4e-4      0.39
//   (x, h quantized 1x32, w decoded)    clamped 1.3e-2 .. 2.0e-2  1.9e-4      3.49
//   bf16 path on the original inputs    plain 7.8e-2 .. 0.119     5.3e-3      0.78
//                                       clamped 8.7e-2 .. 9.7e-2  4.4e-3      15.5
// Against the dequantized operands the pipeline's bf16 roundings of h13 and h move some h
// elements across an E4M3 rounding boundary before the h quantizer (a 1/16-relative step each),
// ~1.5-2% on the larger shapes; the upper plain numbers are the T = 1 rows and D = 20, F = 12
// (few elements). Against the bf16 path the format's error of x, h and both weights (~3% each,
// kFormatTolerances mxfp8) compounds. Bounds: ~1.25x the worst rel-L2, ~1.5x the worst
// (1 - cos) and max |err|. Never widen one without new measurements.

// The entry for (format, output, against); nullptr (a test bug) when there is none.
inline const TrainingTolerance* training_tolerance(Precision format, bool clamped, Output output,
                                                  Against against) {
  for (const TrainingTolerance& t : kTrainingTolerances) {
    if (t.format == format && t.clamped == clamped && t.output == output && t.against == against) {
      return &t;
    }
  }
  return nullptr;
}

}  // namespace epmoe::test
