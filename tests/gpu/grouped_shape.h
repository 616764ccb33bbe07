// GPU test support: the experts' rows of a grouped GEMM test case, their offsets and the line
// that names the case in failure messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace epmoe::test {

// Experts' rows, the output's N and the reduction's K.
struct GroupedShape {
  std::vector<int32_t> rows_E;  // rows per expert
  int64_t spare_rows;           // capacity past the last group
  int64_t N, K;
};

// "E 3 rows {0 1 300 } ": the first 12 experts' rows.
inline std::string describe_rows(const std::vector<int32_t>& rows_E) {
  std::string r = "E " + std::to_string(rows_E.size()) + " rows {";
  for (size_t i = 0; i < rows_E.size() && i < 12; ++i) r += std::to_string(rows_E[i]) + " ";
  if (rows_E.size() > 12) r += "... ";
  return r + "} ";
}

inline std::string describe(const GroupedShape& s) {
  return describe_rows(s.rows_E) + "N " + std::to_string(s.N) + " K " + std::to_string(s.K);
}

// The groups' first rows and the end: [E + 1], offsets[0] = 0.
inline std::vector<int32_t> group_offsets(const std::vector<int32_t>& rows_E) {
  std::vector<int32_t> offsets(1, 0);
  for (int32_t r : rows_E) offsets.push_back(offsets.back() + r);
  return offsets;
}

}  // namespace epmoe::test
