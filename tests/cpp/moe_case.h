// One routed-experts problem on R thread ranks: random inputs (fixed seeds, never zeros), the
// call through the public Context API (forward + backward), and the float64 reference.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "epmoe/config.h"
#include "epmoe/context.h"
#include "moe_reference.h"
#include "tolerances.h"

namespace epmoe {
// Readable test names for parameters that hold a CombineMode.
inline void PrintTo(CombineMode mode, std::ostream* os) { *os << to_string(mode); }
}  // namespace epmoe

namespace epmoe::test {

struct Problem {
  int ranks = 2;              // R
  int64_t max_tokens = 16;    // Config T
  int64_t hidden = 32;        // D
  int64_t intermediate = 24;  // F
  int top_k = 2;              // K
  int experts = 8;            // global experts (E * R)
  Activation act = Activation::swiglu();
  bool fused = true;
  bool arrival_gated_w13 = false;  // CUDA: W13 overlapped with dispatch (false: staged, the default)
  DType wgrad_dtype = DType::bf16;
  double capacity_factor = 0.0;  // 0: R, every routing fits
  int layers_per_slot = 1;
  OverflowPolicy overflow = OverflowPolicy::report;
  int barrier_timeout_ms = 30000;
  Precision precision = Precision::bf16;
  bool prepared_weights = false;  // fp8_block: RankCall prepares the weights, the calls take them
  std::optional<int64_t> scratch_device_bytes;  // Config.scratch_device_bytes (unset: all device)
  bool inference = false;  // Config.inference: forward only (run_forward), no slots
  CombineMode combine = CombineMode::per_route;  // Config.combine
  // Config.fp8_wgrad with precision fp8_block (other precisions: the default, by_shape). fp8, not
  // the by_shape default, so that the FP8 tests run the FP8 WGRADs whatever their (small) shape.
  Fp8Wgrad fp8_wgrad = Fp8Wgrad::fp8;

  int local_experts() const { return experts / ranks; }
  Config config() const;
  std::string name() const;  // for failure messages
};

// A problem of these sizes; every other field at its default.
Problem make_problem(int ranks, int64_t T, int64_t D, int64_t F, int K, int experts,
                     Activation act = Activation::swiglu());

// Global expert id of route (rank, t, k).
using Router = std::function<int64_t(int rank, int64_t t, int k, std::mt19937_64& rng)>;
// K distinct experts per token, uniform (what a top-k router produces).
Router distinct_router(int experts, int top_k);

// Inputs of one rank for one call.
struct RankInputs {
  int64_t tokens = 0;  // T' of the call
  int64_t live = -1;   // >= 0: passed as num_tokens_1; -1: num_tokens_1 = nullptr
  std::vector<bf16_t> x_TD, w13_EFD, w2_EDF, grad_y_TD;
  std::vector<int64_t> ids_TK;
  bool ids_i64 = false;  // passed as int64 (else int32)
  std::vector<float> scores_TK;
  bool scores_bf16 = false;  // passed as bf16 (rounded; else f32)
};

// Random inputs of every rank: x, grad_y in [-1, 1]; scores in [0.1, 1]; weights scaled so that
// h13 has unit spread (plain) or reaches past the clamp limit 7 (clamped).
std::vector<RankInputs> make_inputs(const Problem& p, uint64_t seed, int64_t tokens,
                                    const Router& router = {});

struct RankOutputs {
  std::vector<bf16_t> y_TD, grad_x_TD;
  std::vector<float> grad_scores_TK;
  std::vector<float> grad_w13_EFD, grad_w2_EDF;  // widened from Config.wgrad_dtype
};

// Owns the typed buffers of one rank's call and builds the argument structs over them.
struct RankCall {
  RankCall(const Problem& p, const RankInputs& in);
  ForwardArgs forward_args(int slot = 0);
  BackwardArgs backward_args(const SavedLayer& saved, bool accumulate = false);
  RankOutputs outputs() const;
  // Sets the weight-gradient buffers (before an accumulating backward).
  void set_wgrads(const std::vector<float>& w13, const std::vector<float>& w2);

  Problem p;
  RankInputs in;
  std::vector<int32_t> ids32;
  std::vector<int64_t> ids64;
  std::vector<float> scores32;
  std::vector<bf16_t> scores16;
  int32_t live = 0;
  std::vector<bf16_t> y, grad_x;
  std::vector<float> grad_scores;
  std::vector<char> grad_w13, grad_w2;  // Config.wgrad_dtype
  // Problem::prepared_weights: fp8_block_fp32 copies of the weights with their transposed
  // copies (prepare_weights; _t: what backward's DGRADs read).
  std::vector<uint8_t> w13_q, w2_q, w13_qt, w2_qt;
  std::vector<float> w13_scales, w2_scales, w13_scales_t, w2_scales_t;
  PreparedWeights w13_prepared, w2_prepared;
};

// fn(rank, context) on every rank with one fresh context each; closes the contexts afterwards.
void with_contexts(const Problem& p, const std::function<void(int rank, Context& ctx)>& fn);

// Forward + backward of one layer on a fresh context group.
std::vector<RankOutputs> run_layer(const Problem& p, const std::vector<RankInputs>& in);
// y of every rank from `calls` forwards (save_for_backward = false) on one fresh context group;
// every call after the first must repeat the first's bits.
std::vector<std::vector<bf16_t>> forward_y(const Problem& p, const std::vector<RankInputs>& in,
                                 int calls = 1);

// Float64 reference of the same inputs (scores as passed: bf16-rounded when scores_bf16).
// The layered API refuses a context of this config (one rank), naming Config.precision.
void expect_layered_refuses_precision(const Config& config);

// The float64 reference's description of the problem (shape of the calls in `in`, activation).
reference::LayerShape reference_shape(const Problem& p, const std::vector<RankInputs>& in);
reference::ActivationSpec reference_activation(const Problem& p);

std::vector<reference::RankOutputs> reference_layer(const Problem& p,
                                                    const std::vector<RankInputs>& in);

// rel-L2 of each output, pooled over ranks. grad_scores[t,k] = <grad_y[t], h3[t,k]> is a dot
// product whose bf16 error scales with sqrt(sum_d (grad_y h3)^2), not with its (possibly
// cancelled) value: each element's squared denominator is max(ref^2, sum_d (grad_y h3)^2).
struct OutputErrors {
  double value[kNumOutputs] = {};   // rel-L2 (grad_scores: floored as above)
  double cosine[kNumOutputs] = {};  // cos(got, ref)
  double max_abs[kNumOutputs] = {}; // max |got - ref|
  double operator[](Output o) const { return value[static_cast<int>(o)]; }
  std::string to_string() const;
};
OutputErrors measure(const std::vector<RankOutputs>& got,
                     const std::vector<reference::RankOutputs>& ref,
                     const std::vector<RankInputs>& in);
// The same with `base` (e.g. the bf16 path's outputs) in place of the reference's values; the
// grad_scores floor still comes from the reference.
OutputErrors measure_against(const std::vector<RankOutputs>& got,
                             const std::vector<RankOutputs>& base,
                             const std::vector<reference::RankOutputs>& ref,
                             const std::vector<RankInputs>& in);

// Prints the measurement when EPMOE_REPORT_ERRORS=1 (evidence for tolerances.h).
void report_errors(const std::string& what, const OutputErrors& errors);

// gtest checks (call from the test thread).
void expect_within_tolerance(const OutputErrors& errors, const std::string& what,
                             Precision precision = Precision::bf16);
// fp8_block (tolerances.h kTrainingTolerances): rel-L2, cosine and atol of every output.
void expect_within_training_tolerance(const OutputErrors& errors, Precision format, bool clamped,
                                      Against against, const std::string& what);
void expect_bitwise_equal(const std::vector<RankOutputs>& a, const std::vector<RankOutputs>& b,
                          const std::string& what);
// Runs the layer and checks it against the reference; returns the outputs.
std::vector<RankOutputs> run_and_check(const Problem& p, const std::vector<RankInputs>& in,
                                       const std::string& what);

std::vector<double> widen(const std::vector<bf16_t>& v);
std::vector<double> widen(const std::vector<float>& v);

}  // namespace epmoe::test
