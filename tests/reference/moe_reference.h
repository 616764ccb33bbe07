// Float64 reference of one routed-experts layer over all ranks (DESIGN.md §1): a plain loop over
// every rank's tokens and routes, independent of epmoe's code. Used by the CPU tests and the
// main-job program to judge the bf16 pipeline.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace epmoe::reference {

struct LayerShape {
  int ranks = 1;             // R
  int local_experts = 1;     // E (global experts = E * R; rank r owns [r*E, (r+1)*E))
  int64_t tokens = 1;        // T' rows of x per rank
  int64_t hidden = 1;        // D
  int64_t intermediate = 1;  // F
  int top_k = 1;             // K
};

// SwiGLU over [gate | up]; clamped: g = min(gate, limit), u = clamp(up, +-limit),
// h = g * sigmoid(alpha g) * (u + 1). Gradients pass where the input lies in the closed range.
struct ActivationSpec {
  bool clamped = false;
  double alpha = 1.702;
  double limit = 7.0;
};

struct RankInputs {
  std::vector<double> x_TD;            // [T', D]
  std::vector<int64_t> topk_ids_TK;    // [T', K] global expert ids; -1 = inactive
  std::vector<double> topk_scores_TK;  // [T', K]
  int64_t live = -1;                   // live rows (rows past it are padding); -1 = all T'
  std::vector<double> w13_EFD;         // [E, 2F, D] this rank's experts: rows [0, F) gate
  std::vector<double> w2_EDF;          // [E, D, F]
  std::vector<double> grad_y_TD;       // [T', D]; empty = forward only
};

struct RankOutputs {
  std::vector<double> y_TD;            // [T', D]; padding rows 0
  std::vector<double> route_out_TKD;   // [T', K, D] expert output of each route before its score
                                       // (what epmoe keeps as h3); 0 for inactive routes
  std::vector<double> grad_x_TD;       // [T', D]      (backward only)
  std::vector<double> grad_scores_TK;  // [T', K]; 0 for inactive routes and padding rows
  std::vector<double> grad_w13_EFD;    // [E, 2F, D]
  std::vector<double> grad_w2_EDF;     // [E, D, F]
};

// Outputs of every rank. Throws std::invalid_argument on inconsistent sizes or ids out of range.
std::vector<RankOutputs> routed_experts(const LayerShape& shape, const ActivationSpec& act,
                                        const std::vector<RankInputs>& ranks);

// bf16 storage (upper 16 bits of an IEEE float) to double, element-wise.
double bf16_to_double(uint16_t bits);
std::vector<double> widen_bf16(const uint16_t* data, std::size_t n);

// ||got - ref||_2 / ||ref||_2 (absolute ||got|| when ref is all zero).
double rel_l2(const std::vector<double>& ref, const std::vector<double>& got);

}  // namespace epmoe::reference
