// NVFP4 weight-only inference (Config.precision = nvfp4, inference, prepared weights) through
// Context on CPU thread ranks: y against the float64 reference on the decoded NVFP4 weights (the
// same math) and against the bf16 path on the original weights (tolerances.h); T = 1 and 128, live
// count < T; fused == unfused; the bf16 weights are not read; R = 2 == R = 1 bitwise; errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "epmoe/error.h"
#include "epmoe/layered.h"
#include "harness.h"
#include "moe_case.h"
#include "prepared_inference.h"

namespace epmoe::test {
namespace {

// One NVFP4 prepared weight [E, N, L] in host vectors.
struct Nvfp4Weight {
  Nvfp4Weight(const std::vector<bf16_t>& w_ENL, int64_t E, int64_t N, int64_t L) {
    const PreparedWeightShapes s = prepared_weight_shapes(WeightFormat::nvfp4, E, N, L);
    q.assign(static_cast<size_t>(s.data.numel()), 0);
    scales.assign(static_cast<size_t>(s.scales.numel()), 0);
    global.assign(static_cast<size_t>(E), 0.0f);
    view = PreparedWeights{WeightFormat::nvfp4, E, N, L, s.data, s.scales, s.global_scale, {}, {}};
    view.data.data = q.data();
    view.scales.data = scales.data();
    view.global_scale.data = global.data();
    std::vector<bf16_t> w = w_ENL;  // prepare_weights takes a mutable view
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {E, N, L}), view);
  }
  // The values the format decodes to (codec: element x (block scale x global)), from the codes
  // and scales in the codec's order.
  std::vector<double> decoded() const {
    std::vector<uint8_t> codec = q;
    nvfp4_codes_to_codec_order(codec.data(), view.G * view.N, nvfp4_packed_bytes(view.L));
    std::vector<uint8_t> codec_scales(
        static_cast<size_t>(view.G * view.N * scale_blocks(view.L, kNvfp4Block)));
    nvfp4_scales_to_codec_order(scales.data(), view.G, view.N, view.L, codec_scales.data());
    std::vector<float> x(static_cast<size_t>(view.G * view.N * view.L));
    nvfp4_dequantize_rows(codec.data(), codec_scales.data(), global.data(), view.G, view.G * view.N,
                          view.L, x.data());
    return {x.begin(), x.end()};
  }
  std::vector<uint8_t> q, scales;
  std::vector<float> global;
  PreparedWeights view;
};

using prepared_inference::compare;
using prepared_inference::Errors;
using prepared_inference::expect_bitwise;
using prepared_inference::inference_config;
using prepared_inference::problem_of;
using prepared_inference::RunOptions;
using prepared_inference::Shape;
using prepared_inference::shape_name;
using prepared_inference::widen_all;

constexpr Precision kFormat = Precision::nvfp4;

// y of every rank from one forward at nvfp4 (or bf16: RunOptions::bf16) on fresh contexts.
std::vector<std::vector<bf16_t>> run_forward(const Problem& p, const std::vector<RankInputs>& in,
                                             const RunOptions& o = {}) {
  return prepared_inference::run_forward<Nvfp4Weight>(kFormat, p, in, o);
}

void expect_within(const Errors& e, bool clamped, Against against, const std::string& what) {
  prepared_inference::expect_within(kFormat, e, clamped, against, what);
}

int seed_count() { return prepared_inference::seed_count("EPMOE_NVFP4_SEEDS"); }

// Float64 reference of the forward with every rank's weights replaced by their NVFP4 decoding.
std::vector<std::vector<double>> decoded_reference(const Problem& p,
                                                   const std::vector<RankInputs>& in) {
  const reference::LayerShape shape = reference_shape(p, in);
  const reference::ActivationSpec act = reference_activation(p);
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
  std::vector<reference::RankInputs> ref(p.ranks);
  for (int r = 0; r < p.ranks; ++r) {
    ref[r].x_TD = widen(in[r].x_TD);
    ref[r].topk_ids_TK = in[r].ids_TK;
    ref[r].topk_scores_TK = widen(in[r].scores_TK);
    ref[r].live = in[r].live;
    ref[r].w13_EFD = Nvfp4Weight(in[r].w13_EFD, E, 2 * F, D).decoded();
    ref[r].w2_EDF = Nvfp4Weight(in[r].w2_EDF, E, D, F).decoded();
  }
  std::vector<std::vector<double>> y;
  for (const reference::RankOutputs& o : reference::routed_experts(shape, act, ref)) {
    y.push_back(o.y_TD);
  }
  return y;
}


class Nvfp4Inference : public ::testing::TestWithParam<Shape> {};

TEST_P(Nvfp4Inference, MatchesDecodedReferenceAndBf16Path) {
  const Shape& s = GetParam();
  const Problem p = problem_of(s);
  for (uint64_t seed = 31; seed < 31u + static_cast<uint64_t>(seed_count()); ++seed) {
    std::vector<RankInputs> in = make_inputs(p, seed, p.max_tokens);
    for (RankInputs& r : in) r.live = s.live;
    const std::string what = shape_name(s) + " seed " + std::to_string(seed);
    const std::vector<std::vector<bf16_t>> y = run_forward(p, in);
    for (size_t r = 0; r < y.size(); ++r) {  // rows past the live count are zero
      const int64_t live = s.live < 0 ? p.max_tokens : s.live;
      for (int64_t i = live * p.hidden; i < p.max_tokens * p.hidden; ++i) {
        ASSERT_EQ(y[r][static_cast<size_t>(i)], 0) << what << ": padding row on rank " << r;
      }
    }
    expect_within(compare(y, decoded_reference(p, in)), s.clamped, Against::float64_decoded,
                  "nvfp4 vs float64 of the decoded weights | " + what);
    if (s.statistical) {
      RunOptions bf16;
      bf16.bf16 = true;
      expect_within(compare(y, widen_all(run_forward(p, in, bf16))), s.clamped,
                    Against::bf16_path, "nvfp4 vs bf16 | " + what);
    }
    if (seed != 31u) continue;  // the bitwise checks once per shape
    RunOptions unfused;
    unfused.fused = false;
    expect_bitwise(run_forward(p, in, unfused), y, what + ": unfused vs fused");
    RunOptions without_bf16;
    without_bf16.pass_bf16_weights = false;
    expect_bitwise(run_forward(p, in, without_bf16), y, what + ": without the bf16 weights");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Nvfp4Inference,
    ::testing::Values(Shape{1, 1, 64, 48, 2, 4, false, -1, false},   // decode: one token
                      Shape{2, 1, 64, 48, 2, 4, false, -1, false},
                      Shape{2, 1, 64, 48, 2, 4, false, 0, false},    // no live token
                      Shape{1, 128, 64, 48, 2, 4, false, -1},        // decode batch of 128
                      Shape{2, 128, 64, 48, 2, 8, false, 100},       // live count < T
                      Shape{2, 128, 111, 40, 3, 6, true, 77},        // odd D, partial blocks
                      Shape{2, 64, 256, 200, 2, 4, false, -1},
                      Shape{1, 32, 160, 96, 4, 8, true, -1}));

// R = 2 and R = 1 on the same global problem: rank r's tokens are rows [r*T, (r+1)*T) of the one
// rank, its experts the one rank's [r*E, (r+1)*E). The global scale is per expert, so the decoded
// weights coincide, and every expert receives the same rows in the same order: y matches bitwise.
TEST(Nvfp4Inference, TwoRanksEqualOneRank) {
  const Problem p2 = problem_of({2, 128, 136, 72, 2, 4, false, -1});
  Problem p1 = p2;
  p1.ranks = 1;
  p1.max_tokens = 2 * p2.max_tokens;
  const std::vector<RankInputs> in2 = make_inputs(p2, 41, p2.max_tokens);
  std::vector<RankInputs> in1(1);
  RankInputs& one = in1[0];
  one.tokens = p1.max_tokens;
  auto append = [](auto& dst, const auto& src) { dst.insert(dst.end(), src.begin(), src.end()); };
  for (const RankInputs& r : in2) {
    append(one.x_TD, r.x_TD);
    append(one.ids_TK, r.ids_TK);
    append(one.scores_TK, r.scores_TK);
    append(one.w13_EFD, r.w13_EFD);
    append(one.w2_EDF, r.w2_EDF);
  }
  const std::vector<std::vector<bf16_t>> two = run_forward(p2, in2);
  std::vector<std::vector<bf16_t>> joined(1);
  for (const auto& y : two) append(joined[0], y);
  expect_bitwise(run_forward(p1, in1), joined, "R = 1 vs R = 2 joined");
}

// Weights whose NVFP4 decoding is exact in bf16 (each expert's amax 2688 * 2^-12, so its global
// scale is 2^-12 and every decoded value has at most 5 significant bits): the NVFP4 path on them
// equals the bf16 path on their decoded values bitwise, the same fp32 accumulation as its twin.
TEST(Nvfp4Inference, EqualsBf16PathOnBf16ExactDecodedWeights) {
  const Problem p = problem_of({2, 64, 64, 48, 2, 8, false, 50});
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
  std::vector<RankInputs> in = make_inputs(p, 51, p.max_tokens);
  std::vector<RankInputs> decoded = in;
  const float amax = 2688.0f * 0x1p-12f;  // above every weight of make_inputs here (< 0.44)
  for (size_t r = 0; r < in.size(); ++r) {
    in[r].live = decoded[r].live = 50;
    for (int64_t e = 0; e < E; ++e) {
      in[r].w13_EFD[static_cast<size_t>(e * 2 * F * D + 5)] = float_to_bf16(-amax);
      in[r].w2_EDF[static_cast<size_t>(e * D * F + 7)] = float_to_bf16(amax);
    }
    auto to_bf16 = [](const std::vector<double>& v) {
      std::vector<bf16_t> out;
      for (double x : v) {
        out.push_back(float_to_bf16(static_cast<float>(x)));
        EXPECT_EQ(bf16_to_float(out.back()), x) << "decoded value not exact in bf16";
      }
      return out;
    };
    decoded[r].w13_EFD = to_bf16(Nvfp4Weight(in[r].w13_EFD, E, 2 * F, D).decoded());
    decoded[r].w2_EDF = to_bf16(Nvfp4Weight(in[r].w2_EDF, E, D, F).decoded());
  }
  RunOptions bf16;
  bf16.bf16 = true;
  expect_bitwise(run_forward(p, in), run_forward(p, decoded, bf16),
                 "nvfp4 vs bf16 on the decoded weights");
}

// Runs fn on a one-rank nvfp4 inference context; fn must throw an Error naming `argument`.
void expect_forward_error(const std::function<void(Context&, RankCall&, const Nvfp4Weight&,
                                                   const Nvfp4Weight&)>& fn,
                          const std::string& argument) {
  const Problem p = problem_of({1, 4, 32, 24, 1, 2, false, -1});
  const std::vector<RankInputs> in = make_inputs(p, 5, p.max_tokens);
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
  run_on_ranks(1, [&](int, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(inference_config(p, Precision::nvfp4), std::move(transport));
    RankCall call(p, in[0]);
    const Nvfp4Weight w13(in[0].w13_EFD, E, 2 * F, D), w2(in[0].w2_EDF, E, D, F);
    try {
      fn(*ctx, call, w13, w2);
      ADD_FAILURE() << "accepted; expected an error naming " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    ctx->close();
  });
}

ForwardArgs nvfp4_args(RankCall& call, const Nvfp4Weight& w13, const Nvfp4Weight& w2) {
  ForwardArgs a = call.forward_args();
  a.save_for_backward = false;
  a.w13_prepared = &w13.view;
  a.w2_prepared = &w2.view;
  return a;
}

TEST(Nvfp4Inference, MissingOrMismatchedPreparedWeightsAreRefused) {
  using W = const Nvfp4Weight&;
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    a.w13_prepared = nullptr;
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    a.w2_prepared = nullptr;
    ctx.forward(a);
  }, "ForwardArgs.w2_prepared");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    PreparedWeights fp8 = w13.view;  // an FP8 training format instead of nvfp4
    fp8.format = WeightFormat::fp8_block_fp32;
    a.w13_prepared = &fp8;
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared.format");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    a.w13_prepared = &w2.view;  // w2's [E, D, F] where w13's [E, 2F, D] belongs
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared.G/N/L");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    PreparedWeights no_global = w2.view;
    no_global.global_scale = TensorRef{};
    a.w2_prepared = &no_global;
    ctx.forward(a);
  }, "ForwardArgs.w2_prepared.global_scale");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    a.w2_EDF.shape[1] += 1;  // given bf16 weights are still checked
    ctx.forward(a);
  }, "w2_EDF");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = nvfp4_args(call, w13, w2);
    a.save_for_backward = true;
    ctx.forward(a);
  }, "ForwardArgs.save_for_backward");
}

TEST(Nvfp4Inference, BackwardIsRefused) {
  expect_forward_error([](Context& ctx, RankCall& call, const Nvfp4Weight&, const Nvfp4Weight&) {
    ctx.backward(call.backward_args(SavedLayer{0, 0, 1, call.in.tokens}));
  }, "Config.precision");
}

TEST(Nvfp4Inference, LayeredApiIsRefused) {
  expect_layered_refuses_precision(
      inference_config(problem_of({1, 4, 32, 24, 1, 2, false, -1}), Precision::nvfp4));
}

}  // namespace
}  // namespace epmoe::test
