// Weight-gradient GEMMs: a reduction over each expert's rows (variable K, empty experts give 0).
#include <type_traits>

#include "cuda/gemm/expert_gemm.h"
#include "cuda/gemm/expert_gemm_common.h"
#include "cuda/gemm/launch.cuh"

namespace epmoe::cuda {

using namespace gemm;

namespace {

// kPeel: the full k-blocks with one wgmma batch in flight, the partial one after them.
template <class S, bool kPeel = false>
using WgradTraits = GemmTraits<S::pingpong ? 64 : 128, 256, S::pingpong ? 5 : 4, Grouping::reduction,
                               Major::MN, Major::MN, 1, S::pingpong, S::cluster, kPeel>;
// Three stages leave room for the TMA-store staging (2 x 32 KiB); WGRAD's k-loops are short.
template <class S, bool kPeel = false>
using WgradTmaTraits = GemmTraits<S::pingpong ? 64 : 128, 256, 3, Grouping::reduction, Major::MN,
                                  Major::MN, 1, S::pingpong, S::cluster, kPeel>;

// 128 x 192 (EPMOE_WGRAD_TILE, select_wgrad_tile): a fourth stage in the same shared memory.
template <bool kPeel>
using WgradTma192Traits = GemmTraits<128, 192, 4, Grouping::reduction, Major::MN, Major::MN, 1,
                                     false, 1, kPeel>;

// TMA-store descriptor of grad_w [groups, m_out, n_out] bf16 in 64 x 64 boxes.
auto make_wgrad_store(void* out, int64_t m_out, int64_t n_out, int groups) {
  using Box = typename WgradTmaEpilogue<WgradTmaTraits<Sched<false, 1>>, int>::SmemLayoutBox;
  auto tensor = make_tensor(make_gmem_ptr(static_cast<cutlass::bfloat16_t*>(out)),
                            make_layout(make_shape(m_out, n_out, static_cast<int64_t>(groups)),
                                        make_stride(n_out, Int<1>{}, m_out * n_out)));
  return make_tma_atom(SM90_TMA_STORE{}, tensor, Box{}, Shape<_64, _64>{});
}

// grad_w[e] [m_out, n_out] (+)= a[rows of e]^T b[rows of e], a: [M, m_out], b: [b.rows, n_out]
// from row b.shift on (x_gathered placed by the layer plan; else [M, n_out] unshifted).
template <class S>
void wgrad(GemmKind kind, const Step& s, const bf16_t* a_rows, int64_t m_out,
           const GatheredRows& b_rows, int64_t n_out, void* out) {
  check_groups(s);
  const int64_t M = s.capacity_rows;
  const Operand a{a_rows, m_out, M, 1, m_out};
  const Operand b{b_rows.ptr, n_out, b_rows.rows, 1, n_out};
  GroupArgs g = step_groups(s, n_out, 0, m_out);
  g.b_shift = b_rows.shift;
  const int accumulate = s.accumulate_wgrad ? 1 : 0;
  const WgradTile tile = select_wgrad_tile(kind, s);
  const WgradStore how = select_wgrad_store(kind, s);
  if (s.wgrad_dtype == DType::bf16 && !accumulate && how != WgradStore::direct) {
    auto store = make_wgrad_store(out, m_out, n_out, s.dims.E);
    // store_warp: std::true_type where a warp of the producer warpgroup issues the stores.
    auto run = [&](auto traits, auto store_warp) {
      using T = decltype(traits);
      using Epi = WgradTmaEpilogue<T, decltype(store), decltype(store_warp)::value>;
      const typename Epi::Params epi{store, m_out, n_out, s.dims.E};
      launch_grouped_gemm<T, Major::MN, Major::MN, Epi>(a, b, g, epi, stream_of(s));
    };
    // tma_warp: cooperative single CTAs, 128 x 256 (the rule's tile and peel).
    if constexpr (!S::pingpong && S::cluster == 1) {
      if (how == WgradStore::tma_warp && tile == WgradTile::n256) {
        return select_wgrad_peel(kind, s) ? run(WgradTmaTraits<S, true>{}, std::true_type{})
                                          : run(WgradTmaTraits<S>{}, std::true_type{});
      }
    }
    // CTA pairs peel too: measured against single CTAs, both take the same k-tail.
    if constexpr (!S::pingpong) {
      const bool peel = select_wgrad_peel(kind, s);
      if constexpr (S::cluster == 1) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
        if (tile == WgradTile::n192) {
          return peel ? run(WgradTma192Traits<true>{}, std::false_type{})
                      : run(WgradTma192Traits<false>{}, std::false_type{});
        }
#endif
      }
      if (peel) return run(WgradTmaTraits<S, true>{}, std::false_type{});
    }
    EPMOE_CHECK_ARG(tile == WgradTile::n256, "EPMOE_WGRAD_TILE",
                    "128x256 with a ping-pong or clustered WGRAD", "128x192");
    return run(WgradTmaTraits<S>{}, std::false_type{});
  }
  EPMOE_CHECK_ARG(tile == WgradTile::n256, "EPMOE_WGRAD_TILE",
                  "128x256 where the WGRAD does not store through the TMA (f32, accumulated, or "
                  "EPMOE_WGRAD_STORE=direct)",
                  "128x192");
  if constexpr (!S::pingpong && S::cluster == 1) {
    if (s.wgrad_dtype == DType::bf16 && !accumulate && select_wgrad_peel(kind, s)) {
      using T = WgradTraits<S, true>;
      using Epi = WgradEpilogue<T, cutlass::bfloat16_t>;
      const typename Epi::Params epi{static_cast<cutlass::bfloat16_t*>(out), m_out, n_out, 0};
      launch_grouped_gemm<T, Major::MN, Major::MN, Epi>(a, b, g, epi, stream_of(s));
      return;
    }
  }
  using T = WgradTraits<S>;
  if (s.wgrad_dtype == DType::f32) {
    using Epi = WgradEpilogue<T, float>;
    const typename Epi::Params epi{static_cast<float*>(out), m_out, n_out, accumulate};
    launch_grouped_gemm<T, Major::MN, Major::MN, Epi>(a, b, g, epi, stream_of(s));
  } else {
    using Epi = WgradEpilogue<T, cutlass::bfloat16_t>;
    const typename Epi::Params epi{static_cast<cutlass::bfloat16_t*>(out), m_out, n_out, accumulate};
    launch_grouped_gemm<T, Major::MN, Major::MN, Epi>(a, b, g, epi, stream_of(s));
  }
}

}  // namespace

// grad_w2[e] [D, F] = grad_h3[e]^T [D, rows] . h[e] [rows, F]
void w2_wgrad(const Step& s) {
  dispatch_schedule(GemmKind::w2_wgrad, s, [&](auto sched) {
    const GatheredRows h{s.h_MF, s.capacity_rows, RowShift{}};
    wgrad<decltype(sched)>(GemmKind::w2_wgrad, s, s.grad_h3_MD, s.dims.D, h, s.dims.F,
                           s.grad_w2_EDF);
  });
}

// grad_w13[e] [2F, D] = grad_h13[e]^T [2F, rows] . x_gathered[e] [rows, D]
void w13_wgrad(const Step& s) {
  dispatch_schedule(GemmKind::w13_wgrad, s, [&](auto sched) {
    wgrad<decltype(sched)>(GemmKind::w13_wgrad, s, s.grad_h13_M2F, 2 * s.dims.F,
                           x_gathered_rows(s), s.dims.D, s.grad_w13_EFD);
  });
}

}  // namespace epmoe::cuda
