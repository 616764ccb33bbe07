// Input-gradient GEMMs: W2 DGRAD (+ SwiGLU backward epilogue) and W13 DGRAD (+ scatter home).
#include "cuda/gemm/expert_gemm.h"
#include "cuda/gemm/expert_gemm_common.h"
#include "cuda/gemm/launch.cuh"

namespace epmoe::cuda {

using namespace gemm;

// grad_h3 [M, D] (K-major) times w2 [E, D, F] read as (N = F, K = D): MN-major. With row scores
// (Step::row_scores_M) grad_h3 holds grad_y unscaled and the epilogue applies the score.
template <class S>
void w2_dgrad_with(const Step& s, bool swiglu_backward) {
  check_groups(s);
  const int64_t D = s.dims.D, F = s.dims.F, M = s.capacity_rows;
  const Operand a{s.grad_h3_MD, M, D, D, 1};
  const Operand b{s.w2_EDF, F, D, 1, F, s.dims.E, D * F};
  using T = RowsTraits<S, S::block_n, Major::MN, 1>;
  if (swiglu_backward) {
    const typename SwigluBackwardEpilogue<T>::Params epi{
        placed_h13(s), s.grad_h13_M2F, s.h_MF,         F,
        s.act,         s.row_scores_M, s.score_parts_MC, score_chunks(F)};
    launch_grouped_gemm<T, Major::K, Major::MN, SwigluBackwardEpilogue<T>>(a, b, step_groups(s, F, D),
                                                                           epi, stream_of(s));
  } else {
    const typename RowsEpilogue<T>::Params epi{plain(s.grad_h_MF), F, F};
    launch_grouped_gemm<T, Major::K, Major::MN, RowsEpilogue<T>>(a, b, step_groups(s, F, D), epi,
                                                                 stream_of(s));
  }
}

// grad_h13 [M, 2F] (K-major) times w13 [E, 2F, D] read as (N = D, K = 2F): MN-major.
template <class S>
void w13_dgrad_with(const Step& s, bool scatter) {
  check_groups(s);
  const int64_t D = s.dims.D, F = s.dims.F, M = s.capacity_rows;
  const Operand a{s.grad_h13_M2F, M, 2 * F, 2 * F, 1};
  const Operand b{s.w13_EFD, D, 2 * F, 1, D, s.dims.E, 2 * F * D};
  using T = RowsTraits<S, S::block_n, Major::MN, 1>;
  if (scatter) {
    const typename ScatterEpilogue<T>::Params epi{s.combine_R, s.layout.recv_src_M, s.dims.T,
                                                  s.dims.K, D};
    launch_grouped_gemm<T, Major::K, Major::MN, ScatterEpilogue<T>>(a, b, step_groups(s, D, 2 * F),
                                                                    epi, stream_of(s));
  } else {
    const typename RowsEpilogue<T>::Params epi{plain(s.rows_MD), D, D};
    launch_grouped_gemm<T, Major::K, Major::MN, RowsEpilogue<T>>(a, b, step_groups(s, D, 2 * F), epi,
                                                                 stream_of(s));
  }
}

void w2_dgrad(const Step& s, bool swiglu_backward) {
  dispatch_rows_schedule(GemmKind::w2_dgrad, s, [&](auto sched) { w2_dgrad_with<decltype(sched)>(s, swiglu_backward); });
}

void w13_dgrad(const Step& s, bool scatter) {
  dispatch_rows_schedule(GemmKind::w13_dgrad, s, [&](auto sched) { w13_dgrad_with<decltype(sched)>(s, scatter); });
}

}  // namespace epmoe::cuda
