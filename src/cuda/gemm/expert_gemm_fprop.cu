// Forward GEMMs: W13 (+ SwiGLU epilogue) and W2 (+ scatter into the owners' combine slots).
#include "cuda/gemm/expert_gemm.h"
#include "cuda/gemm/expert_gemm_common.h"
#include "cuda/gemm/launch.cuh"

namespace epmoe::cuda {

using namespace gemm;

static_assert(kArrivalGateBlockRows == kArrivalBlockRows, "the gate reads dispatch's counters");

// x_gathered [M, D] (K-major) times w13 [E, 2F, D] (K-major).
template <class S>
void w13_fprop_with(const Step& s, bool swiglu) {
  check_groups(s);
  const int64_t D = s.dims.D, F = s.dims.F;
  const GatheredRows x = x_gathered_rows(s);  // the saved x_gathered, or the Step's buffer
  const Operand a{x.ptr, x.rows, D, D, 1};
  const Operand b{s.w13_EFD, 2 * F, D, D, 1, s.dims.E, 2 * F * D};
  if (swiglu) {
    using T = RowsTraits<S, 128, Major::K, 2>;
    GroupArgs g = step_groups(s, F, D);
    g.a_shift = x.shift;
    g.b_second_offset = F;  // up rows follow the F gate rows
    if (s.arrival_gated_w13) {  // overlapped with dispatch, the launch right before this one
      g.arrival.arrivals_B = arrivals_B(s);
      g.arrival.status = s.status;
      g.arrival.budget_ns = static_cast<uint64_t>(s.barrier_timeout_ms) * 1000000u;
      g.arrival.rank = s.rank;
    }
    const typename SwigluEpilogue<T>::Params epi{placed_h13(s), s.h_MF, F, s.act};
    launch_grouped_gemm<T, Major::K, Major::K, SwigluEpilogue<T>>(a, b, g, epi, stream_of(s),
                                                                  s.arrival_gated_w13);
  } else {
    using T = RowsTraits<S, 256, Major::K, 1>;
    GroupArgs g = step_groups(s, 2 * F, D);
    g.a_shift = x.shift;
    const typename RowsEpilogue<T>::Params epi{placed_h13(s), 2 * F, 2 * F};
    launch_grouped_gemm<T, Major::K, Major::K, RowsEpilogue<T>>(a, b, g, epi, stream_of(s));
  }
}

// h [M, F] (K-major) times w2 [E, D, F] (K-major).
template <class S>
void w2_fprop_with(const Step& s, bool scatter) {
  check_groups(s);
  const int64_t D = s.dims.D, F = s.dims.F, M = s.capacity_rows;
  const Operand a{s.h_MF, M, F, F, 1};
  const Operand b{s.w2_EDF, D, F, F, 1, s.dims.E, D * F};
  using T = RowsTraits<S, S::block_n, Major::K, 1>;
  if (scatter) {
    const typename ScatterEpilogue<T>::Params epi{s.combine_R, s.layout.recv_src_M, s.dims.T,
                                                  s.dims.K, D};
    launch_grouped_gemm<T, Major::K, Major::K, ScatterEpilogue<T>>(a, b, step_groups(s, D, F), epi,
                                                                   stream_of(s));
  } else {
    // Per-rank combine: the rows are h3, kept on this rank (slot or scratch) for the send stage
    // and grad_scores.
    const Placed out = s.combine_per_rank ? placed_h3_rows(s) : plain(s.rows_MD);
    const typename RowsEpilogue<T>::Params epi{out, D, D};
    launch_grouped_gemm<T, Major::K, Major::K, RowsEpilogue<T>>(a, b, step_groups(s, D, F), epi,
                                                                stream_of(s));
  }
}

void w13_fprop(const Step& s, bool swiglu) {
  dispatch_schedule(GemmKind::w13_fprop, s, [&](auto sched) { w13_fprop_with<decltype(sched)>(s, swiglu); });
}

void w2_fprop(const Step& s, bool scatter) {
  dispatch_rows_schedule(GemmKind::w2_fprop, s, [&](auto sched) { w2_fprop_with<decltype(sched)>(s, scatter); });
}

}  // namespace epmoe::cuda
