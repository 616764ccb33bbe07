// Shared by the weight-format inference tests (test_nvfp4_inference.cpp, test_mxfp8_inference.cpp):
// the shapes they sweep, a forward on fresh inference contexts with a format's prepared weights,
// and y's errors against a float64 reference checked with the tolerance table (tolerances.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "harness.h"
#include "moe_case.h"

namespace epmoe::test::prepared_inference {

struct Shape {
  int ranks;
  int64_t T, D, F;
  int K, experts;
  bool clamped;
  int64_t live;  // -1: all T rows (num_tokens_1 = nullptr)
  // false: too few elements for the statistical bound against the bf16 path (T = 1: one row).
  bool statistical = true;
};

inline std::string shape_name(const Shape& s) {
  return "R=" + std::to_string(s.ranks) + " T=" + std::to_string(s.T) + " D=" +
         std::to_string(s.D) + " F=" + std::to_string(s.F) + " K=" + std::to_string(s.K) +
         " experts=" + std::to_string(s.experts) + (s.clamped ? " clamped" : " swiglu") +
         " live=" + std::to_string(s.live);
}

// gtest prints parameters in test names: a readable one, without the struct's padding bytes.
inline void PrintTo(const Shape& s, std::ostream* os) { *os << shape_name(s); }

inline Problem problem_of(const Shape& s) {
  return make_problem(s.ranks, s.T, s.D, s.F, s.K, s.experts,
                      s.clamped ? Activation::swiglu_clamped() : Activation::swiglu());
}

// The inference config of `p` at `precision` (bf16, or a format that reads prepared weights).
inline Config inference_config(const Problem& p, Precision precision) {
  ConfigFields f = p.config().fields();
  f.inference = true;
  f.precision = precision;
  f.prepared_weights = precision != Precision::bf16;
  return Config(f);
}

struct RunOptions {
  bool bf16 = false;              // the bf16 path instead of the format's
  bool fused = true;
  bool pass_bf16_weights = true;  // the format's run: also pass w13_EFD / w2_EDF (never read)
};

// y of every rank from one forward on a fresh inference context group at `format`; Weight(w_ENL,
// E, N, L) prepares one weight and holds it in `.view`.
template <class Weight>
std::vector<std::vector<bf16_t>> run_forward(Precision format, const Problem& problem,
                                             const std::vector<RankInputs>& in,
                                             const RunOptions& o = {}) {
  Problem p = problem;
  p.fused = o.fused;
  const Config config = inference_config(p, o.bf16 ? Precision::bf16 : format);
  const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
  std::vector<std::vector<bf16_t>> y(p.ranks);
  run_on_ranks(p.ranks, [&](int rank, std::shared_ptr<Transport> transport) {
    auto ctx = Context::create(config, std::move(transport));
    RankCall call(p, in[rank]);
    const Weight w13(in[rank].w13_EFD, E, 2 * F, D), w2(in[rank].w2_EDF, E, D, F);
    ForwardArgs a = call.forward_args();
    a.save_for_backward = false;
    if (!o.bf16) {
      a.w13_prepared = &w13.view;
      a.w2_prepared = &w2.view;
      if (!o.pass_bf16_weights) a.w13_EFD = a.w2_EDF = TensorRef{};
    }
    ctx->forward(a);
    y[rank] = call.y;
    ctx->close();
  });
  return y;
}

struct Errors {
  double rel_l2 = 0.0, cosine = 1.0, max_abs = 0.0;
};

// Pooled over ranks.
inline Errors compare(const std::vector<std::vector<bf16_t>>& got,
                      const std::vector<std::vector<double>>& ref) {
  std::vector<double> g, r;
  for (size_t i = 0; i < got.size(); ++i) {
    const std::vector<double> w = widen(got[i]);
    g.insert(g.end(), w.begin(), w.end());
    r.insert(r.end(), ref[i].begin(), ref[i].end());
  }
  Errors e;
  e.rel_l2 = reference::rel_l2(r, g);
  double dot = 0.0, gg = 0.0, rr = 0.0;
  for (size_t i = 0; i < r.size(); ++i) {
    dot += g[i] * r[i];
    gg += g[i] * g[i];
    rr += r[i] * r[i];
    e.max_abs = std::max(e.max_abs, std::fabs(g[i] - r[i]));
  }
  e.cosine = gg > 0.0 && rr > 0.0 ? dot / std::sqrt(gg * rr) : (gg == rr ? 1.0 : 0.0);
  return e;
}

inline std::vector<std::vector<double>> widen_all(const std::vector<std::vector<bf16_t>>& y) {
  std::vector<std::vector<double>> out;
  for (const auto& v : y) out.push_back(widen(v));
  return out;
}

// y's errors within the tolerance row of (format, clamped, against); EPMOE_REPORT_ERRORS=1
// prints them (the tolerance measurements).
inline void expect_within(Precision format, const Errors& e, bool clamped, Against against,
                          const std::string& what) {
  const char* flag = std::getenv("EPMOE_REPORT_ERRORS");
  if (flag != nullptr && flag[0] == '1') {
    std::printf("%s y | %s | rel_l2 %.4g 1-cos %.4g max %.4g\n", to_string(format), what.c_str(),
                e.rel_l2, 1.0 - e.cosine, e.max_abs);
  }
  const TrainingTolerance* t = training_tolerance(format, clamped, Output::y, against);
  ASSERT_NE(t, nullptr) << "no tolerance row for " << what;
  EXPECT_LE(e.rel_l2, t->rel_l2) << what << ": rel-L2 of y";
  EXPECT_GE(e.cosine, t->cosine) << what << ": cosine of y";
  EXPECT_LE(e.max_abs, t->atol) << what << ": max abs error of y";
  EXPECT_FALSE(std::isnan(e.rel_l2)) << what;
}

inline void expect_bitwise(const std::vector<std::vector<bf16_t>>& a,
                           const std::vector<std::vector<bf16_t>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t r = 0; r < a.size(); ++r) EXPECT_EQ(a[r], b[r]) << what << ": y differs on rank " << r;
}

// Seeds per shape: the environment variable `name` (default 3; tolerance measurements use 20).
inline int seed_count(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : 3;
}

}  // namespace epmoe::test::prepared_inference
