// GPU test support: rel-L2 of one set of layer outputs against another, per output.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "moe_case.h"

namespace epmoe::test {

// rel-L2 of a vs b per output, pooled over ranks (b as the reference).
inline OutputErrors compare(const std::vector<RankOutputs>& a, const std::vector<RankOutputs>& b) {
  double num[kNumOutputs] = {}, den[kNumOutputs] = {};
  auto add = [&](int o, const std::vector<double>& x, const std::vector<double>& y) {
    for (size_t i = 0; i < x.size(); ++i) {
      num[o] += (x[i] - y[i]) * (x[i] - y[i]);
      den[o] += y[i] * y[i];
    }
  };
  for (size_t r = 0; r < a.size(); ++r) {
    add(0, widen(a[r].y_TD), widen(b[r].y_TD));
    add(1, widen(a[r].grad_x_TD), widen(b[r].grad_x_TD));
    add(2, widen(a[r].grad_scores_TK), widen(b[r].grad_scores_TK));
    add(3, widen(a[r].grad_w13_EFD), widen(b[r].grad_w13_EFD));
    add(4, widen(a[r].grad_w2_EDF), widen(b[r].grad_w2_EDF));
  }
  OutputErrors e;
  for (int o = 0; o < kNumOutputs; ++o) e.value[o] = std::sqrt(num[o] / std::max(den[o], 1e-300));
  return e;
}

// One rank's outputs.
inline OutputErrors compare(const RankOutputs& a, const RankOutputs& b) {
  return compare(std::vector<RankOutputs>{a}, std::vector<RankOutputs>{b});
}

}  // namespace epmoe::test
