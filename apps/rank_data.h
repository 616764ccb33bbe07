// The tensors of one rank in epmoe_run: host vectors (inputs and outputs) and the raw pointers
// the Context reads, which point either at those vectors (CPU) or at device copies (GPU).
#pragma once

#include <cstdint>
#include <vector>

struct RankData {
  std::vector<uint16_t> x_TD, w13_EFD, w2_EDF, grad_y_TD;
  std::vector<int32_t> ids_TK;
  std::vector<float> scores_TK;
  std::vector<uint16_t> y_TD, grad_x_TD, grad_w13_EFD, grad_w2_EDF;
  std::vector<float> grad_scores_TK;
};

struct RankPtrs {
  void *x_TD, *w13_EFD, *w2_EDF, *grad_y_TD, *ids_TK, *scores_TK;
  void *y_TD, *grad_x_TD, *grad_w13_EFD, *grad_w2_EDF, *grad_scores_TK;
};

inline RankPtrs host_ptrs(RankData& d) {
  return {d.x_TD.data(), d.w13_EFD.data(), d.w2_EDF.data(), d.grad_y_TD.data(), d.ids_TK.data(),
          d.scores_TK.data(), d.y_TD.data(), d.grad_x_TD.data(), d.grad_w13_EFD.data(),
          d.grad_w2_EDF.data(), d.grad_scores_TK.data()};
}
