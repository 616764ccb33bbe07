// MXFP8 inference (Config.precision = mxfp8, inference, prepared weights) through Context on CPU
// thread ranks: y against the float64 reference on the dequantized operands (x and the weights as
// the format decodes them) and against the bf16 path on the original inputs (tolerances.h); T = 1
// and 128, live count < T and 0, D not a multiple of 32; fused == unfused; the bf16 weights are
// not read; R = 2 == R = 1 bitwise; the block product's numerics on hand-worked rows; errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "core/formats/codecs.h"
#include "cpu/cpu_backend.h"
#include "epmoe/error.h"
#include "epmoe/layered.h"
#include "harness.h"
#include "moe_case.h"
#include "prepared_inference.h"

namespace epmoe::test {
namespace {

// One MXFP8 prepared weight [E, N, L] in host vectors.
struct Mxfp8Weight {
  Mxfp8Weight(const std::vector<bf16_t>& w_ENL, int64_t E, int64_t N, int64_t L) {
    const PreparedWeightShapes s = prepared_weight_shapes(WeightFormat::mxfp8, E, N, L);
    q.assign(static_cast<size_t>(s.data.numel()), 0);
    scales.assign(static_cast<size_t>(s.scales.numel()), 0);
    view = PreparedWeights{WeightFormat::mxfp8, E, N, L, s.data, s.scales, {}, {}, {}};
    view.data.data = q.data();
    view.scales.data = scales.data();
    std::vector<bf16_t> w = w_ENL;  // prepare_weights takes a mutable view
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {E, N, L}), view);
  }
  // The values the format decodes to (code x 2^scale).
  std::vector<double> decoded() const {
    std::vector<float> x(static_cast<size_t>(view.G * view.N * view.L));
    mxfp8_dequantize_rows(q.data(), scales.data(), view.G * view.N, view.L, x.data());
    return {x.begin(), x.end()};
  }
  std::vector<uint8_t> q, scales;
  PreparedWeights view;
};

// bf16 rows [N, L] through the 1x32 activation quantizer and back: what the W13 GEMM reads.
std::vector<double> mx_roundtrip(const std::vector<bf16_t>& x_NL, int64_t N, int64_t L) {
  std::vector<float> x(x_NL.size()), y(x_NL.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(x_NL[i]);
  std::vector<uint8_t> q(x.size()), s(static_cast<size_t>(N * scale_blocks(L, kMxBlock)));
  mxfp8_quantize_rows(x.data(), N, L, q.data(), s.data());
  mxfp8_dequantize_rows(q.data(), s.data(), N, L, y.data());
  return {y.begin(), y.end()};
}

using prepared_inference::compare;
using prepared_inference::Errors;
using prepared_inference::expect_bitwise;
using prepared_inference::inference_config;
using prepared_inference::problem_of;
using prepared_inference::RunOptions;
using prepared_inference::Shape;
using prepared_inference::shape_name;
using prepared_inference::widen_all;

constexpr Precision kFormat = Precision::mxfp8;

// y of every rank from one forward at mxfp8 (or bf16: RunOptions::bf16) on fresh contexts.
std::vector<std::vector<bf16_t>> run_forward(const Problem& p, const std::vector<RankInputs>& in,
                                             const RunOptions& o = {}) {
  return prepared_inference::run_forward<Mxfp8Weight>(kFormat, p, in, o);
}

void expect_within(const Errors& e, bool clamped, Against against, const std::string& what) {
  prepared_inference::expect_within(kFormat, e, clamped, against, what);
}

int seed_count() { return prepared_inference::seed_count("EPMOE_MXFP8_SEEDS"); }

double activation(double gate, double up, const reference::ActivationSpec& a) {
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  if (!a.clamped) return gate * sigmoid(gate) * up;
  const double g = std::fmin(gate, a.limit), u = std::fmin(std::fmax(up, -a.limit), a.limit);
  return g * sigmoid(a.alpha * g) * (u + 1.0);
}

// Float64 reference of the forward on the dequantized operands, quantized where the pipeline
// quantizes: x through the 1x32 quantizer, each route's h (rounded to fp32, the codec's input)
// through it too, the weights as MXFP8 decodes them; every sum and SwiGLU in double.
std::vector<std::vector<double>> dequantized_reference(const Problem& p,
                                                       const std::vector<RankInputs>& in) {
  const reference::ActivationSpec act = reference_activation(p);
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate, K = p.top_k;
  std::vector<std::vector<double>> w13(p.ranks), w2(p.ranks), y(p.ranks);
  for (int r = 0; r < p.ranks; ++r) {
    w13[r] = Mxfp8Weight(in[r].w13_EFD, E, 2 * F, D).decoded();
    w2[r] = Mxfp8Weight(in[r].w2_EDF, E, D, F).decoded();
  }
  std::vector<float> h_F(static_cast<size_t>(F)), hq_F(static_cast<size_t>(F));
  std::vector<uint8_t> q_F(static_cast<size_t>(F)), s_F(static_cast<size_t>(F));
  for (int r = 0; r < p.ranks; ++r) {
    const int64_t T = in[r].tokens, live = in[r].live < 0 ? T : in[r].live;
    const std::vector<double> x_TD = mx_roundtrip(in[r].x_TD, T, D);
    y[r].assign(static_cast<size_t>(T * D), 0.0);
    for (int64_t t = 0; t < live; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t id = in[r].ids_TK[static_cast<size_t>(t * K + k)];
        if (id < 0) continue;
        const double* w13_FD = w13[static_cast<size_t>(id / E)].data() + (id % E) * 2 * F * D;
        const double* w2_DF = w2[static_cast<size_t>(id / E)].data() + (id % E) * D * F;
        const double* x_D = x_TD.data() + t * D;
        for (int64_t f = 0; f < F; ++f) {
          double gate = 0.0, up = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            gate += x_D[d] * w13_FD[f * D + d];
            up += x_D[d] * w13_FD[(F + f) * D + d];
          }
          h_F[static_cast<size_t>(f)] = static_cast<float>(activation(gate, up, act));
        }
        mxfp8_quantize_rows(h_F.data(), 1, F, q_F.data(), s_F.data());
        mxfp8_dequantize_rows(q_F.data(), s_F.data(), 1, F, hq_F.data());
        const double score = in[r].scores_TK[static_cast<size_t>(t * K + k)];
        for (int64_t d = 0; d < D; ++d) {
          double out = 0.0;
          for (int64_t f = 0; f < F; ++f) out += static_cast<double>(hq_F[f]) * w2_DF[d * F + f];
          y[r][static_cast<size_t>(t * D + d)] += score * out;
        }
      }
    }
  }
  return y;
}


class Mxfp8Inference : public ::testing::TestWithParam<Shape> {};

TEST_P(Mxfp8Inference, MatchesDequantizedReferenceAndBf16Path) {
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
    expect_within(compare(y, dequantized_reference(p, in)), s.clamped, Against::float64_decoded,
                  "mxfp8 vs float64 of the dequantized operands | " + what);
    if (s.statistical) {
      RunOptions bf16;
      bf16.bf16 = true;
      expect_within(compare(y, widen_all(run_forward(p, in, bf16))), s.clamped,
                    Against::bf16_path, "mxfp8 vs bf16 | " + what);
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
    Shapes, Mxfp8Inference,
    ::testing::Values(Shape{1, 1, 64, 48, 2, 4, false, -1, false},   // decode: one token
                      Shape{2, 1, 64, 48, 2, 4, false, -1, false},
                      Shape{2, 1, 64, 48, 2, 4, false, 0, false},    // no live token
                      Shape{1, 128, 64, 48, 2, 4, false, -1},        // decode batch of 128
                      Shape{2, 128, 64, 48, 2, 8, false, 100},       // live count < T
                      Shape{2, 128, 111, 40, 3, 6, true, 77},        // D, F not multiples of 32
                      Shape{2, 64, 256, 200, 2, 4, false, -1},
                      Shape{1, 32, 160, 96, 4, 8, true, -1},
                      Shape{2, 16, 20, 12, 2, 4, false, -1}));       // D, F below one block

// R = 2 and R = 1 on the same global problem: rank r's tokens are rows [r*T, (r+1)*T) of the one
// rank, its experts the one rank's [r*E, (r+1)*E). Quantization is per row (x, h) and per weight
// row, and every expert receives the same rows in the same order: y matches bitwise.
TEST(Mxfp8Inference, TwoRanksEqualOneRank) {
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

// The block product (docs/formats.md "MXFP8 inference") on hand-worked rows of L = 40: block 0
// full, block 1 partial (8 elements). Every value below is an E4M3 value times its block's
// power-of-two scale, so the quantizer keeps it exactly.
TEST(Mxfp8Inference, BlockProductIsExactPerBlockThenScaled) {
  const int64_t L = 40;
  std::vector<float> a(L, 0.0f), w(2 * L, 0.0f);
  // Row 0, block 0: 448 * 448 + 2^-7 + 2^-7 = 200704 + 2^-6, an fp32 value (ulp 2^-6 there). An
  // fp32 running sum would drop each 2^-7 (a tie to even), so the exact block sum shows.
  a[0] = 448.0f;
  a[1] = a[2] = 1.0f;
  w[0] = 448.0f;
  w[1] = w[2] = 0x1p-7f;
  // Block 1: a = 384 x 2^-27 (code 384, scale 2^-27), w = 256 x 2^2: the term 3 * 2^-10, lost
  // in the fp32 total (below half its ulp), which is rounded once per block.
  a[32] = 3.0f * 0x1p-20f;
  w[32] = 0x1p10f;
  // Row 1: block 0 one product 1 * -0.5, block 1 all zero (scale code 0, term 0).
  w[L + 1] = -0.5f;
  std::vector<bf16_t> a_bf16(L);
  for (int64_t k = 0; k < L; ++k) {
    a_bf16[k] = float_to_bf16(a[k]);
    ASSERT_EQ(bf16_to_float(a_bf16[k]), a[k]);
  }
  std::vector<uint8_t> q(2 * L), s(2 * 2);
  mxfp8_quantize_rows(w.data(), 2, L, q.data(), s.data());
  cpu::Mxfp8Expert e;
  e.N = 2;
  e.L = L;
  for (uint8_t c : q) e.v_NL.push_back(e4m3_to_float(c));
  e.scales_NS = s.data();
  float out[2] = {0.0f, 0.0f};
  cpu::row_times_nt(a_bf16.data(), &e, 2, L, out);
  EXPECT_EQ(out[0], 200704.0f + 0x1p-6f + 3.0f * 0x1p-10f);
  EXPECT_EQ(out[1], -0.5f);
}

// Runs fn on a one-rank mxfp8 inference context; fn must throw an Error naming `argument`.
void expect_forward_error(const std::function<void(Context&, RankCall&, const Mxfp8Weight&,
                                                   const Mxfp8Weight&)>& fn,
                          const std::string& argument) {
  const Problem p = problem_of({1, 4, 32, 24, 1, 2, false, -1});
  const std::vector<RankInputs> in = make_inputs(p, 5, p.max_tokens);
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
  run_on_ranks(1, [&](int, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(inference_config(p, Precision::mxfp8), std::move(transport));
    RankCall call(p, in[0]);
    const Mxfp8Weight w13(in[0].w13_EFD, E, 2 * F, D), w2(in[0].w2_EDF, E, D, F);
    try {
      fn(*ctx, call, w13, w2);
      ADD_FAILURE() << "accepted; expected an error naming " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
    ctx->close();
  });
}

ForwardArgs mxfp8_args(RankCall& call, const Mxfp8Weight& w13, const Mxfp8Weight& w2) {
  ForwardArgs a = call.forward_args();
  a.save_for_backward = false;
  a.w13_prepared = &w13.view;
  a.w2_prepared = &w2.view;
  return a;
}

TEST(Mxfp8Inference, MissingOrMismatchedPreparedWeightsAreRefused) {
  using W = const Mxfp8Weight&;
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    a.w13_prepared = nullptr;
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    a.w2_prepared = nullptr;
    ctx.forward(a);
  }, "ForwardArgs.w2_prepared");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    PreparedWeights ue8m0 = w13.view;  // the FP8 128x128 UE8M0 format instead of mxfp8
    ue8m0.format = WeightFormat::fp8_block_ue8m0;
    a.w13_prepared = &ue8m0;
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared.format");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    a.w13_prepared = &w2.view;  // w2's [E, D, F] where w13's [E, 2F, D] belongs
    ctx.forward(a);
  }, "ForwardArgs.w13_prepared.G/N/L");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    PreparedWeights short_scales = w2.view;
    short_scales.scales.shape[2] -= 1;  // one E8M0 scale per 32 along F expected
    a.w2_prepared = &short_scales;
    ctx.forward(a);
  }, "ForwardArgs.w2_prepared.scales");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    a.w2_EDF.shape[1] += 1;  // given bf16 weights are still checked
    ctx.forward(a);
  }, "w2_EDF");
  expect_forward_error([](Context& ctx, RankCall& call, W w13, W w2) {
    ForwardArgs a = mxfp8_args(call, w13, w2);
    a.save_for_backward = true;
    ctx.forward(a);
  }, "ForwardArgs.save_for_backward");
}

TEST(Mxfp8Inference, BackwardIsRefused) {
  expect_forward_error([](Context& ctx, RankCall& call, const Mxfp8Weight&, const Mxfp8Weight&) {
    ctx.backward(call.backward_args(SavedLayer{0, 0, 1, call.in.tokens}));
  }, "Config.precision");
}

TEST(Mxfp8Inference, LayeredApiIsRefused) {
  expect_layered_refuses_precision(
      inference_config(problem_of({1, 4, 32, 24, 1, 2, false, -1}), Precision::mxfp8));
}

// Config refuses mxfp8 for training and without prepared weights, naming the field.
TEST(Mxfp8Inference, TrainingOrUnpreparedWeightsAreRefused) {
  ConfigFields f = problem_of({1, 4, 32, 24, 1, 2, false, -1}).config().fields();
  f.precision = Precision::mxfp8;
  auto field_of = [&] {
    try {
      Config c(f);
    } catch (const Error& e) {
      return e.argument();
    }
    return std::string("(accepted)");
  };
  f.prepared_weights = true;
  f.inference = false;
  EXPECT_EQ(field_of(), "Config.inference");
  f.inference = true;
  f.prepared_weights = false;
  EXPECT_EQ(field_of(), "Config.prepared_weights");
  f.prepared_weights = true;
  EXPECT_EQ(field_of(), "(accepted)");
}

}  // namespace
}  // namespace epmoe::test
