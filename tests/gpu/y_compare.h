// Comparisons of two bf16 outputs [T, D] for the forward tests: bitwise with the first
// difference described (count, token, column, values), and rel-L2 of a against b.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/numeric.h"

namespace epmoe::test {

inline std::string first_difference(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b,
                                    int64_t D) {
  if (a.size() != b.size()) {
    return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  }
  int64_t count = 0, first = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    if (first < 0) first = static_cast<int64_t>(i);
    ++count;
  }
  if (first < 0) return "equal";
  return std::to_string(count) + " elements differ; first at t " + std::to_string(first / D) +
         " d " + std::to_string(first % D) + ": " + std::to_string(bf16_to_float(a[first])) +
         " vs " + std::to_string(bf16_to_float(b[first]));
}

inline void expect_same_y(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b, int64_t D,
                          const std::string& what) {
  EXPECT_TRUE(a == b) << what << ": " << first_difference(a, b, D);
}

inline double rel_l2(const std::vector<bf16_t>& a, const std::vector<bf16_t>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace epmoe::test
