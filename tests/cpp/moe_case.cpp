// Inputs, Context runs and reference comparison of one routed-experts problem (moe_case.h).
#include "moe_case.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "epmoe/error.h"
#include "epmoe/layered.h"
#include "harness.h"

namespace epmoe::test {

Problem make_problem(int ranks, int64_t T, int64_t D, int64_t F, int K, int experts, Activation act) {
  Problem p;
  p.ranks = ranks;
  p.max_tokens = T;
  p.hidden = D;
  p.intermediate = F;
  p.top_k = K;
  p.experts = experts;
  p.act = act;
  return p;
}

Config Problem::config() const {
  ConfigFields f;
  f.max_tokens_per_rank = max_tokens;
  f.hidden_dim = hidden;
  f.intermediate_dim = intermediate;
  f.top_k = top_k;
  f.num_experts = experts;
  f.activation = act;
  f.capacity_factor = capacity_factor > 0.0 ? capacity_factor : static_cast<double>(ranks);
  f.slots.max_layers_per_slot = layers_per_slot;
  f.overflow = overflow;
  f.wgrad_dtype = wgrad_dtype;
  f.barrier_timeout_ms = barrier_timeout_ms;
  f.fuse_epilogues = fused;
  f.arrival_gated_w13 = arrival_gated_w13;
  f.precision = precision;
  f.prepared_weights = prepared_weights;
  f.scratch_device_bytes = scratch_device_bytes;
  f.inference = inference;
  f.combine = combine;
  f.fp8_wgrad = precision == Precision::fp8_block ? fp8_wgrad : kDefaultFp8Wgrad;
  return Config(f);
}

std::string Problem::name() const {
  std::ostringstream os;
  os << "R=" << ranks << " T=" << max_tokens << " D=" << hidden << " F=" << intermediate
     << " K=" << top_k << " experts=" << experts
     << (act.kind == ActivationKind::swiglu_clamped ? " clamped" : " swiglu")
     << (fused ? " fused" : " unfused") << (arrival_gated_w13 ? "" : " staged") << " wgrad=" << epmoe::to_string(wgrad_dtype)
     << " " << epmoe::to_string(precision) << (prepared_weights ? " prepared" : "")
     << (inference ? " inference" : "") << " combine=" << epmoe::to_string(combine)
     << (precision == Precision::fp8_block ? std::string(" fp8_wgrad=") + epmoe::to_string(fp8_wgrad)
                                           : std::string());
  return os.str();
}

Router distinct_router(int experts, int top_k) {
  // Per token: a fresh partial shuffle; route k takes the k-th pick.
  auto picks = std::make_shared<std::vector<int64_t>>();
  return [experts, top_k, picks](int, int64_t, int k, std::mt19937_64& rng) -> int64_t {
    if (k == 0) {
      picks->resize(static_cast<size_t>(experts));
      for (int e = 0; e < experts; ++e) (*picks)[e] = e;
      for (int i = 0; i < std::min(top_k, experts); ++i) {
        std::uniform_int_distribution<int> pick(i, experts - 1);
        std::swap((*picks)[i], (*picks)[pick(rng)]);
      }
    }
    return (*picks)[k % experts];
  };
}

namespace {

std::vector<bf16_t> uniform_bf16(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<bf16_t> v(static_cast<size_t>(n));
  for (auto& e : v) e = float_to_bf16(static_cast<float>(u(rng)));
  return v;
}

// Exact h13 of token x_D through local expert e of w13_EFD is within `margin` of a kink of the
// clamped SwiGLU (gate = limit, up = +-limit).
bool near_clamp_kink(const bf16_t* x_D, const std::vector<bf16_t>& w13_EFD, int64_t e, int64_t D,
                     int64_t F, double limit, double margin) {
  for (int64_t j = 0; j < 2 * F; ++j) {
    const bf16_t* w = w13_EFD.data() + (e * 2 * F + j) * D;
    double h = 0.0;
    for (int64_t d = 0; d < D; ++d)
      h += static_cast<double>(bf16_to_float(w[d])) * bf16_to_float(x_D[d]);
    if (std::fabs(h - limit) < margin) return true;
    if (j >= F && std::fabs(h + limit) < margin) return true;
  }
  return false;
}

}  // namespace

std::vector<RankInputs> make_inputs(const Problem& p, uint64_t seed, int64_t tokens,
                                    const Router& router_in) {
  const Router router = router_in ? router_in : distinct_router(p.experts, p.top_k);
  const int E = p.local_experts();
  const int64_t D = p.hidden, F = p.intermediate, K = p.top_k;
  const bool clamped = p.act.kind == ActivationKind::swiglu_clamped;
  // Uniform(-a, a) weights give h13 a spread of a*sqrt(D)/sqrt(3) * E|x| ~ a*sqrt(D)/3: about 1
  // (plain) or 5 (clamped: a tenth of the values lie past the limit 7).
  const double a13 = (clamped ? 15.0 : 3.0) / std::sqrt(static_cast<double>(D));
  const double a2 = 3.0 / std::sqrt(static_cast<double>(F));
  std::vector<RankInputs> all(p.ranks);
  std::vector<std::mt19937_64> rngs;
  for (int r = 0; r < p.ranks; ++r) {
    rngs.emplace_back(seed * 1000003u + static_cast<uint64_t>(r));
    std::mt19937_64& rng = rngs.back();
    RankInputs& in = all[r];
    in.tokens = tokens;
    in.x_TD = uniform_bf16(rng, tokens * D, -1.0, 1.0);
    in.grad_y_TD = uniform_bf16(rng, tokens * D, -1.0, 1.0);
    in.w13_EFD = uniform_bf16(rng, E * 2 * F * D, -a13, a13);
    in.w2_EDF = uniform_bf16(rng, E * D * F, -a2, a2);
    std::uniform_real_distribution<float> score(0.1f, 1.0f);
    in.scores_TK.resize(static_cast<size_t>(tokens * K));
    for (auto& s : in.scores_TK) s = score(rng);
    in.ids_TK.resize(static_cast<size_t>(tokens * K));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int k = 0; k < p.top_k; ++k) in.ids_TK[t * K + k] = router(r, t, k, rng);
    }
  }
  if (!clamped) return all;
  // The clamped gradient jumps at the kinks: where bf16 rounding of h13 (up to 1/64 near 7) moves
  // a value across one, the pipeline and the exact reference take different branches and that
  // element's gradient differs by its full size. Tokens with a route near a kink are redrawn.
  const double margin = 0.05;
  for (int r = 0; r < p.ranks; ++r) {
    RankInputs& in = all[r];
    for (int64_t t = 0; t < tokens; ++t) {
      bf16_t* x = in.x_TD.data() + t * D;
      for (int attempt = 0;; ++attempt) {
        bool near = false;
        for (int k = 0; k < p.top_k && !near; ++k) {
          const int64_t id = in.ids_TK[t * K + k];
          if (id < 0 || id >= p.experts) continue;
          near = near_clamp_kink(x, all[id / E].w13_EFD, id % E, D, F, p.act.limit, margin);
        }
        if (!near) break;
        if (attempt == 1000) throw std::runtime_error("make_inputs: no token clear of the clamp");
        const std::vector<bf16_t> fresh = uniform_bf16(rngs[r], D, -1.0, 1.0);
        std::copy(fresh.begin(), fresh.end(), x);
      }
    }
  }
  return all;
}

RankCall::RankCall(const Problem& problem, const RankInputs& inputs) : p(problem), in(inputs) {
  const int64_t T = in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
  const int E = p.local_experts();
  for (int64_t id : in.ids_TK) {
    ids32.push_back(static_cast<int32_t>(id));
    ids64.push_back(id);
  }
  scores32 = in.scores_TK;
  for (float s : in.scores_TK) scores16.push_back(float_to_bf16(s));
  live = static_cast<int32_t>(in.live);
  y.assign(static_cast<size_t>(T * D), 0x7fc0);  // NaN: outputs must be written
  grad_x.assign(static_cast<size_t>(T * D), 0x7fc0);
  grad_scores.assign(static_cast<size_t>(T * K), std::nanf(""));
  const size_t wsize = element_size(p.wgrad_dtype);
  grad_w13.assign(static_cast<size_t>(E * 2 * F * D) * wsize, char(0x7f));
  grad_w2.assign(static_cast<size_t>(E * D * F) * wsize, char(0x7f));
  if (!p.prepared_weights) return;
  auto prepare = [&](std::vector<bf16_t>& w, int64_t N, int64_t L, std::vector<uint8_t>& q,
                     std::vector<float>& scales, std::vector<uint8_t>& qt,
                     std::vector<float>& scales_t, PreparedWeights& out) {
    const PreparedWeightShapes shapes =
        prepared_weight_shapes(WeightFormat::fp8_block_fp32, E, N, L);
    q.assign(static_cast<size_t>(shapes.data.numel()), 0);
    scales.assign(static_cast<size_t>(shapes.scales.numel()), 0.0f);
    qt.assign(static_cast<size_t>(shapes.data_t.numel()), 0);
    scales_t.assign(static_cast<size_t>(shapes.scales_t.numel()), 0.0f);
    out = PreparedWeights{WeightFormat::fp8_block_fp32, E, N, L, shapes.data, shapes.scales, {},
                          shapes.data_t, shapes.scales_t};
    out.data.data = q.data();
    out.scales.data = scales.data();
    out.data_t.data = qt.data();
    out.scales_t.data = scales_t.data();
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {E, N, L}), out);
  };
  prepare(in.w13_EFD, 2 * F, D, w13_q, w13_scales, w13_qt, w13_scales_t, w13_prepared);
  prepare(in.w2_EDF, D, F, w2_q, w2_scales, w2_qt, w2_scales_t, w2_prepared);
}

ForwardArgs RankCall::forward_args(int slot) {
  const int64_t T = in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
  const int64_t E = p.local_experts();
  ForwardArgs a;
  a.x_TD = TensorRef::contiguous(in.x_TD.data(), DType::bf16, {T, D});
  if (in.live >= 0) a.num_tokens_1 = TensorRef::contiguous(&live, DType::i32, {1});
  a.topk_ids_TK = in.ids_i64 ? TensorRef::contiguous(ids64.data(), DType::i64, {T, K})
                             : TensorRef::contiguous(ids32.data(), DType::i32, {T, K});
  a.topk_scores_TK = in.scores_bf16 ? TensorRef::contiguous(scores16.data(), DType::bf16, {T, K})
                                    : TensorRef::contiguous(scores32.data(), DType::f32, {T, K});
  a.w13_EFD = TensorRef::contiguous(in.w13_EFD.data(), DType::bf16, {E, 2 * F, D});
  a.w2_EDF = TensorRef::contiguous(in.w2_EDF.data(), DType::bf16, {E, D, F});
  a.y_TD = TensorRef::contiguous(y.data(), DType::bf16, {T, D});
  if (p.prepared_weights) {
    a.w13_prepared = &w13_prepared;
    a.w2_prepared = &w2_prepared;
  }
  a.slot = slot;
  return a;
}

BackwardArgs RankCall::backward_args(const SavedLayer& saved, bool accumulate) {
  const ForwardArgs f = forward_args(saved.slot);
  const int64_t T = in.tokens, D = p.hidden, F = p.intermediate, K = p.top_k;
  const int64_t E = p.local_experts();
  BackwardArgs b;
  b.saved = saved;
  b.grad_y_TD = TensorRef::contiguous(in.grad_y_TD.data(), DType::bf16, {T, D});
  b.num_tokens_1 = f.num_tokens_1;
  b.topk_ids_TK = f.topk_ids_TK;
  b.topk_scores_TK = f.topk_scores_TK;
  b.w13_EFD = f.w13_EFD;
  b.w2_EDF = f.w2_EDF;
  b.grad_x_TD = TensorRef::contiguous(grad_x.data(), DType::bf16, {T, D});
  b.grad_scores_TK = TensorRef::contiguous(grad_scores.data(), DType::f32, {T, K});
  b.grad_w13_EFD = TensorRef::contiguous(grad_w13.data(), p.wgrad_dtype, {E, 2 * F, D});
  b.grad_w2_EDF = TensorRef::contiguous(grad_w2.data(), p.wgrad_dtype, {E, D, F});
  b.accumulate_wgrad = accumulate;
  b.w13_prepared = f.w13_prepared;
  b.w2_prepared = f.w2_prepared;
  return b;
}

namespace {

std::vector<float> widen_wgrad(const std::vector<char>& raw, DType dtype) {
  std::vector<float> v;
  if (dtype == DType::f32) {
    v.resize(raw.size() / 4);
    std::memcpy(v.data(), raw.data(), raw.size());
  } else {
    v.resize(raw.size() / 2);
    for (size_t i = 0; i < v.size(); ++i) {
      bf16_t b;
      std::memcpy(&b, raw.data() + 2 * i, 2);
      v[i] = bf16_to_float(b);
    }
  }
  return v;
}

void narrow_wgrad(const std::vector<float>& v, DType dtype, std::vector<char>& raw) {
  if (dtype == DType::f32) {
    std::memcpy(raw.data(), v.data(), raw.size());
    return;
  }
  for (size_t i = 0; i < v.size(); ++i) {
    const bf16_t b = float_to_bf16(v[i]);
    std::memcpy(raw.data() + 2 * i, &b, 2);
  }
}

}  // namespace

RankOutputs RankCall::outputs() const {
  return {y, grad_x, grad_scores, widen_wgrad(grad_w13, p.wgrad_dtype),
          widen_wgrad(grad_w2, p.wgrad_dtype)};
}

void RankCall::set_wgrads(const std::vector<float>& w13, const std::vector<float>& w2) {
  narrow_wgrad(w13, p.wgrad_dtype, grad_w13);
  narrow_wgrad(w2, p.wgrad_dtype, grad_w2);
}

void with_contexts(const Problem& p, const std::function<void(int rank, Context& ctx)>& fn) {
  const Config config = p.config();
  run_on_ranks(p.ranks, [&](int rank, std::shared_ptr<Transport> transport) {
    std::unique_ptr<Context> ctx = Context::create(config, std::move(transport));
    fn(rank, *ctx);
    ctx->close();
  });
}

std::vector<RankOutputs> run_layer(const Problem& p, const std::vector<RankInputs>& in) {
  std::vector<RankOutputs> out(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    RankCall call(p, in[rank]);
    const SavedLayer saved = ctx.forward(call.forward_args());
    ctx.backward(call.backward_args(saved));
    out[rank] = call.outputs();
  });
  return out;
}

std::vector<std::vector<bf16_t>> forward_y(const Problem& p, const std::vector<RankInputs>& in,
                                 int calls) {
  std::vector<std::vector<bf16_t>> y(p.ranks);
  with_contexts(p, [&](int rank, Context& ctx) {
    for (int c = 0; c < calls; ++c) {
      RankCall call(p, in[rank]);
      ForwardArgs a = call.forward_args();
      a.save_for_backward = false;
      ctx.forward(a);
      if (c == 0) {
        y[rank] = call.y;
      } else {
        EXPECT_TRUE(call.y == y[rank]) << p.name() << ": call " << c << " of rank " << rank;
      }
    }
  });
  return y;
}

std::vector<double> widen(const std::vector<bf16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = bf16_to_float(v[i]);
  return d;
}

std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

void expect_layered_refuses_precision(const Config& config) {
  run_on_ranks(1, [&](int, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(config, transport);
    try {
      Layered::create(*ctx, transport);
      ADD_FAILURE() << "the layered API accepted " << config.to_string();
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "Config.precision") << e.what();
    }
    ctx->close();
  });
}

reference::LayerShape reference_shape(const Problem& p, const std::vector<RankInputs>& in) {
  reference::LayerShape shape;
  shape.ranks = p.ranks;
  shape.local_experts = p.local_experts();
  shape.tokens = in[0].tokens;
  shape.hidden = p.hidden;
  shape.intermediate = p.intermediate;
  shape.top_k = p.top_k;
  return shape;
}

reference::ActivationSpec reference_activation(const Problem& p) {
  reference::ActivationSpec act;
  act.clamped = p.act.kind == ActivationKind::swiglu_clamped;
  act.alpha = p.act.alpha;
  act.limit = p.act.limit;
  return act;
}

std::vector<reference::RankOutputs> reference_layer(const Problem& p,
                                                    const std::vector<RankInputs>& in) {
  const reference::LayerShape shape = reference_shape(p, in);
  const reference::ActivationSpec act = reference_activation(p);
  std::vector<reference::RankInputs> ref(p.ranks);
  for (int r = 0; r < p.ranks; ++r) {
    const RankInputs& i = in[r];
    reference::RankInputs& o = ref[r];
    o.x_TD = widen(i.x_TD);
    o.topk_ids_TK = i.ids_TK;
    for (float s : i.scores_TK) {
      o.topk_scores_TK.push_back(i.scores_bf16 ? bf16_to_float(float_to_bf16(s)) : s);
    }
    o.live = i.live;
    o.w13_EFD = widen(i.w13_EFD);
    o.w2_EDF = widen(i.w2_EDF);
    o.grad_y_TD = widen(i.grad_y_TD);
  }
  return reference::routed_experts(shape, act, ref);
}

std::string OutputErrors::to_string() const {
  std::ostringstream os;
  for (int o = 0; o < kNumOutputs; ++o) {
    os << (o ? ", " : "") << test::to_string(static_cast<Output>(o)) << " " << value[o]
       << " (1-cos " << 1.0 - cosine[o] << ", max " << max_abs[o] << ")";
  }
  return os.str();
}

namespace {

// ||got - ref|| / sqrt(sum_i max(ref_i^2, scale2_i)).
double floored_rel_l2(const std::vector<double>& ref, const std::vector<double>& got,
                      const std::vector<double>& scale2) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += std::max(ref[i] * ref[i], scale2[i]);
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

OutputErrors measure(const std::vector<RankOutputs>& got,
                     const std::vector<reference::RankOutputs>& ref,
                     const std::vector<RankInputs>& in) {
  std::vector<double> g[kNumOutputs], r[kNumOutputs], scores_scale2;
  auto append = [](std::vector<double>& dst, const std::vector<double>& src) {
    dst.insert(dst.end(), src.begin(), src.end());
  };
  for (size_t i = 0; i < got.size(); ++i) {
    append(g[0], widen(got[i].y_TD));
    append(g[1], widen(got[i].grad_x_TD));
    append(g[2], widen(got[i].grad_scores_TK));
    append(g[3], widen(got[i].grad_w13_EFD));
    append(g[4], widen(got[i].grad_w2_EDF));
    append(r[0], ref[i].y_TD);
    append(r[1], ref[i].grad_x_TD);
    append(r[2], ref[i].grad_scores_TK);
    append(r[3], ref[i].grad_w13_EFD);
    append(r[4], ref[i].grad_w2_EDF);
    const int64_t TK = static_cast<int64_t>(ref[i].grad_scores_TK.size());
    const int64_t D = static_cast<int64_t>(in[i].grad_y_TD.size()) / in[i].tokens;
    const int64_t K = TK / in[i].tokens;
    for (int64_t tk = 0; tk < TK; ++tk) {
      double s2 = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double p = static_cast<double>(bf16_to_float(in[i].grad_y_TD[(tk / K) * D + d])) *
                         ref[i].route_out_TKD[tk * D + d];
        s2 += p * p;
      }
      scores_scale2.push_back(s2);
    }
  }
  OutputErrors e;
  for (int o = 0; o < kNumOutputs; ++o) {
    e.value[o] = reference::rel_l2(r[o], g[o]);
    double dot = 0.0, gg = 0.0, rr = 0.0, worst = 0.0;
    for (size_t i = 0; i < r[o].size(); ++i) {
      dot += g[o][i] * r[o][i];
      gg += g[o][i] * g[o][i];
      rr += r[o][i] * r[o][i];
      worst = std::max(worst, std::fabs(g[o][i] - r[o][i]));
    }
    e.cosine[o] = gg > 0.0 && rr > 0.0 ? dot / std::sqrt(gg * rr) : (gg == rr ? 1.0 : 0.0);
    e.max_abs[o] = worst;
  }
  e.value[static_cast<int>(Output::grad_scores)] = floored_rel_l2(r[2], g[2], scores_scale2);
  return e;
}

OutputErrors measure_against(const std::vector<RankOutputs>& got,
                             const std::vector<RankOutputs>& base,
                             const std::vector<reference::RankOutputs>& ref,
                             const std::vector<RankInputs>& in) {
  std::vector<reference::RankOutputs> as_ref = ref;
  for (size_t i = 0; i < ref.size(); ++i) {
    as_ref[i].y_TD = widen(base[i].y_TD);
    as_ref[i].grad_x_TD = widen(base[i].grad_x_TD);
    as_ref[i].grad_scores_TK = widen(base[i].grad_scores_TK);
    as_ref[i].grad_w13_EFD = widen(base[i].grad_w13_EFD);
    as_ref[i].grad_w2_EDF = widen(base[i].grad_w2_EDF);
  }
  return measure(got, as_ref, in);
}

void report_errors(const std::string& what, const OutputErrors& errors) {
  // EPMOE_REPORT_ERRORS=1 prints every measurement (how tolerances.h was filled in).
  const char* flag = std::getenv("EPMOE_REPORT_ERRORS");
  if (flag != nullptr && flag[0] == '1') {
    std::printf("rel_l2 | %s | %s\n", what.c_str(), errors.to_string().c_str());
  }
}

void expect_within_training_tolerance(const OutputErrors& errors, Precision format, bool clamped,
                                      Against against, const std::string& what) {
  report_errors(what, errors);
  for (int o = 0; o < kNumOutputs; ++o) {
    const auto out = static_cast<Output>(o);
    const TrainingTolerance* t = training_tolerance(format, clamped, out, against);
    ASSERT_NE(t, nullptr) << "no tolerance for " << to_string(out);
    EXPECT_LE(errors[out], t->rel_l2) << what << ": rel-L2 of " << to_string(out);
    EXPECT_GE(errors.cosine[o], t->cosine) << what << ": cosine of " << to_string(out);
    EXPECT_LE(errors.max_abs[o], t->atol) << what << ": max abs error of " << to_string(out);
    EXPECT_FALSE(std::isnan(errors[out])) << what << ": " << to_string(out);
  }
}

void expect_within_tolerance(const OutputErrors& errors, const std::string& what,
                             Precision precision) {
  report_errors(what, errors);
  for (int o = 0; o < kNumOutputs; ++o) {
    const auto out = static_cast<Output>(o);
    const double bound = rel_l2_bound(precision, out);
    EXPECT_LE(errors[out], bound) << what << ": rel-L2 of " << to_string(out) << " ("
                                  << errors.to_string() << ")";
    EXPECT_FALSE(std::isnan(errors[out])) << what << ": " << to_string(out);
  }
}

void expect_bitwise_equal(const std::vector<RankOutputs>& a, const std::vector<RankOutputs>& b,
                          const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_TRUE(same(a[r].y_TD, b[r].y_TD)) << what << ": y_TD differs on rank " << r;
    EXPECT_TRUE(same(a[r].grad_x_TD, b[r].grad_x_TD))
        << what << ": grad_x_TD differs on rank " << r;
    EXPECT_TRUE(same(a[r].grad_scores_TK, b[r].grad_scores_TK))
        << what << ": grad_scores_TK differs on rank " << r;
    EXPECT_TRUE(same(a[r].grad_w13_EFD, b[r].grad_w13_EFD))
        << what << ": grad_w13_EFD differs on rank " << r;
    EXPECT_TRUE(same(a[r].grad_w2_EDF, b[r].grad_w2_EDF))
        << what << ": grad_w2_EDF differs on rank " << r;
  }
}

std::vector<RankOutputs> run_and_check(const Problem& p, const std::vector<RankInputs>& in,
                                       const std::string& what) {
  std::vector<RankOutputs> got = run_layer(p, in);
  const OutputErrors errors = measure(got, reference_layer(p, in), in);
  if (p.precision == Precision::bf16) {
    expect_within_tolerance(errors, what + " [" + p.name() + "]");
  } else {
    expect_within_training_tolerance(errors, p.precision,
                                     p.act.kind == ActivationKind::swiglu_clamped, Against::float64,
                                     what + " [" + p.name() + "]");
  }
  return got;
}

}  // namespace epmoe::test
