// Launcher and the instantiations of the FP8 weight gradient (three epilogues; the two through
// the stage with one or two block accumulators, Fp8WgradArgs::overlap; bf16 overwritten through
// TMA stores with one, its scales loaded by the consumers or copied into the stages by the
// producer, Fp8WgradArgs::stage_scales; in builds with
// EPMOE_GEMM_CONFIGS=ALL each also on CTA pairs multicasting B with one, Fp8WgradArgs::multicast):
// 128 x 128 tiles, 128-deep k-blocks, 5 stages (32 KiB each), cooperative consumers; the bf16
// WGRAD's epilogues: bf16 overwritten through TMA stores, bf16 or f32 overwritten or accumulated
// through the stage.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/check.h"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/fp8_wgrad.h"
#include "cuda/gemm/grouped_wgrad_fp8_sm90.cuh"
#include "cuda/gemm/launch.cuh"
#include "cuda/gemm/launch_checks.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

using namespace gemm;

namespace {

// Five stages leave room for the TMA-store staging (2 x 16 KiB) under 227 KiB.
using Traits = Fp8GemmTraits<128, 5>;

void check_args(const Fp8WgradArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= kMaxGroups, "E", "1 .. " + std::to_string(kMaxGroups), a.E);
  EPMOE_CHECK_ARG(a.N > 0, "N", "> 0", a.N);
  EPMOE_CHECK_ARG(a.overlap >= -1 && a.overlap <= 1, "overlap", "-1, 0 or 1", a.overlap);
  EPMOE_CHECK_ARG(a.multicast >= -1 && a.multicast <= 1, "multicast", "-1, 0 or 1", a.multicast);
  EPMOE_CHECK_ARG(a.stage_scales >= -1 && a.stage_scales <= 1, "stage_scales", "-1, 0 or 1", a.stage_scales);
  EPMOE_CHECK_ARG(a.tile >= -1 && a.tile <= 1, "tile", "-1, 0 or 1", a.tile);
  EPMOE_CHECK_ARG(a.L > 0 && a.L % 8 == 0, "L", "> 0 and a multiple of 8", a.L);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % 128 == 0, "K", "> 0 and a multiple of 128 (whole column blocks)",
                  a.K);
  EPMOE_CHECK_ARG(a.out_dtype == DType::bf16 || a.out_dtype == DType::f32, "out_dtype",
                  "bf16 or f32", to_string(a.out_dtype));
  check_device_pointer(a.a_NK, "a_NK", 16);
  check_device_pointer(a.a_scales_BN, "a_scales_BN", 16);
  check_device_pointer(a.b_LK, "b_LK", 16);
  check_device_pointer(a.b_scales_BL, "b_scales_BL", 16);
  check_device_pointer(a.offsets_E1, "offsets_E1", 16);
  check_device_pointer(a.out_ENL, "out_ENL", 16);
}

// CTAs per cluster: 2 (pairs multicasting B) or 1, from Fp8WgradArgs::multicast or, at -1, from
// EPMOE_FP8_WGRAD_MULTICAST read per launch (benches flip it; unset: single CTAs until pairs are
// measured faster). Pairs exist only in builds with EPMOE_GEMM_CONFIGS=ALL.
int cluster_size(int multicast) {
  bool pairs = multicast == 1;
  if (multicast < 0) {
    const char* env = std::getenv("EPMOE_FP8_WGRAD_MULTICAST");
    EPMOE_CHECK_ARG(env == nullptr || std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0,
                    "EPMOE_FP8_WGRAD_MULTICAST", "0 or 1", env);
    pairs = env != nullptr && env[0] == '1';
  }
#if !defined(EPMOE_GEMM_ALL_CONFIGS)
  EPMOE_CHECK_ARG(!pairs, multicast < 0 ? "EPMOE_FP8_WGRAD_MULTICAST" : "multicast",
                  "0 in a build with EPMOE_GEMM_CONFIGS=CI (CTA pairs not instantiated)", 1);
#endif
  return pairs ? 2 : 1;
}

// Fp8WgradArgs::stage_scales, or at -1 EPMOE_FP8_WGRAD_SCALES=stage|threads read per launch
// (unset: stage); never where N % 4 != 0 (the scale rows' 16-byte alignment).
bool stage_scales_selected(const Fp8WgradArgs& a) {
  bool stage = a.stage_scales == 1;
  if (a.stage_scales < 0) {
    const char* env = std::getenv("EPMOE_FP8_WGRAD_SCALES");
    EPMOE_CHECK_ARG(env == nullptr || std::strcmp(env, "stage") == 0 || std::strcmp(env, "threads") == 0,
                    "EPMOE_FP8_WGRAD_SCALES", "stage or threads", env);
    stage = env == nullptr || std::strcmp(env, "stage") == 0;
  }
  return stage && a.N % 4 == 0;
}

// Fp8WgradArgs::tile, or at -1 EPMOE_FP8_WGRAD_TILE=128x128|192x128 read per launch (unset:
// 192x128). Measured on mixtral-8x7b, the shape whose WGRADs run in FP8 (EP = 1, fp8-train,
// alternating, bench/RESULTS.md "2026-12-01 · 7d26173"): W13 / W2 WGRAD x0.94-0.97 / x0.95-0.98
// against 128 x 128 in three A / B pairs.
bool tile192_selected(int tile) {
  if (tile >= 0) return tile == 1;
  const char* env = std::getenv("EPMOE_FP8_WGRAD_TILE");
  EPMOE_CHECK_ARG(env == nullptr || std::strcmp(env, "128x128") == 0 || std::strcmp(env, "192x128") == 0,
                  "EPMOE_FP8_WGRAD_TILE", "128x128 or 192x128", env);
  return env == nullptr || std::strcmp(env, "192x128") == 0;
}

template <class Epilogue, bool kOverlap, int kCluster, bool kStageScales = false, class T = Traits>
void launch(const Fp8WgradArgs& args, const typename Epilogue::Params& epi, void* stream) {
  const Operand a{args.a_NK, args.N, args.K, args.K, 1};
  const Operand b{args.b_LK, args.L, args.K, args.K, 1};
  auto tma_a = make_tma<T, Major::K, T::BLOCK_M, 2>(a);
  auto tma_b = make_tma<T, Major::K, T::BLOCK_N, 2, kCluster>(b);
  Fp8WgradGroups groups;
  groups.offsets = args.offsets_E1;
  groups.skip = args.skip;
  groups.replay_skip = args.replay_skip;
  groups.groups = args.E;
  groups.n = args.N;
  groups.l = args.L;
  groups.k = args.K;
  const Fp8ColScales scales{args.a_scales_BN, args.b_scales_BL};

  constexpr auto kernel =
      &grouped_wgrad_fp8_kernel<T, Epilogue, kOverlap, kCluster, kStageScales, decltype(tma_a),
                                decltype(tma_b)>;
  constexpr int kSmem = static_cast<int>(sizeof(Fp8WgradSharedStorage<T, Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  if constexpr (kCluster == 1) {
    kernel<<<device_sm_count(), T::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
        tma_a, tma_b, groups, scales, epi);
    EPMOE_CUDA_LAUNCH_CHECK();
  } else {
    cudaLaunchAttribute attribute = cluster_attribute(kCluster);
    cudaLaunchConfig_t config{};
    // As many pairs as can be resident at once (two free SMs of one GPC each).
    config.gridDim = dim3(static_cast<unsigned>(resident_cluster_grid<kernel, kCluster>(T::kThreads, kSmem)));
    config.blockDim = dim3(T::kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = static_cast<cudaStream_t>(stream);
    config.attrs = &attribute;
    config.numAttrs = 1;
    EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tma_a, tma_b, groups, scales, epi));
  }
}

// Pairs run one block accumulator whatever `overlap` says (bitwise the same): with two, the
// pair's consumers spill 226 bytes (-Xptxas -v), single CTAs none.
template <class Epilogue, bool kOverlap>
void launch(const Fp8WgradArgs& args, const typename Epilogue::Params& epi, int cluster, void* stream) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
  if (cluster == 2) {
    launch<Epilogue, false, 2>(args, epi, stream);
    return;
  }
#endif
  (void)cluster;  // 1 (cluster_size refuses 2 in a CI build)
  launch<Epilogue, kOverlap, 1>(args, epi, stream);
}

template <class Epilogue>
void launch(const Fp8WgradArgs& args, const typename Epilogue::Params& epi, const Fp8WgradKernel& k,
            void* stream) {
  if (k.overlap) {
    launch<Epilogue, true>(args, epi, k.cluster, stream);
  } else {
    launch<Epilogue, false>(args, epi, k.cluster, stream);
  }
}

}  // namespace

Fp8WgradKernel fp8_wgrad_kernel(const Fp8WgradArgs& args) {
  Fp8WgradKernel k;
  k.cluster = cluster_size(args.multicast);
  if (args.out_dtype == DType::bf16 && !args.accumulate) {
    // One block accumulator only: with two, the TMA-store epilogue's kernel spills (-Xptxas -v).
    k.stage_scales = stage_scales_selected(args);
    k.tile192 = k.stage_scales && k.cluster == 1 && tile192_selected(args.tile);
  } else {
    k.overlap = k.cluster == 1 && fp8_overlap_selected(args.overlap);
  }
  return k;
}

std::string to_string(const Fp8WgradKernel& k) {
  std::string s = k.tile192 ? "192 x 128" : "128 x 128";
  s += k.stage_scales ? ", scales in the stage" : ", scales loaded by the consumers";
  if (k.overlap) s += ", two block accumulators";
  s += k.cluster == 2 ? ", CTA pairs multicasting B" : ", single CTAs";
  return s;
}

void fp8_grouped_wgrad(const Fp8WgradArgs& args, void* stream) {
  check_args(args);
  const Fp8WgradKernel k = fp8_wgrad_kernel(args);
  if (args.out_dtype == DType::bf16 && !args.accumulate) {
    using Box = typename WgradTmaEpilogue<Traits, int>::SmemLayoutBox;
    auto tensor = make_tensor(make_gmem_ptr(static_cast<cutlass::bfloat16_t*>(args.out_ENL)),
                              make_layout(make_shape(args.N, args.L, static_cast<int64_t>(args.E)),
                                          make_stride(args.L, Int<1>{}, args.N * args.L)));
    auto store = make_tma_atom(SM90_TMA_STORE{}, tensor, Box{}, Shape<_64, _64>{});
    using Epi = WgradTmaEpilogue<Traits, decltype(store)>;
    const typename Epi::Params epi{store, args.N, args.L, args.E};
    if (k.stage_scales) {
#if defined(EPMOE_GEMM_ALL_CONFIGS)
      if (k.cluster == 2) {
        launch<Epi, false, 2, true>(args, epi, stream);
        return;
      }
#endif
      if (k.tile192) {
        using Epi192 = WgradTmaEpilogue<Fp8Wgrad192Traits, decltype(store)>;
        const typename Epi192::Params epi192{store, args.N, args.L, args.E};
        launch<Epi192, false, 1, true, Fp8Wgrad192Traits>(args, epi192, stream);
        return;
      }
      launch<Epi, false, 1, true>(args, epi, stream);
    } else {
      launch<Epi, false>(args, epi, k.cluster, stream);
    }
    return;
  }
  const int accumulate = args.accumulate ? 1 : 0;
  if (args.out_dtype == DType::f32) {
    using Epi = WgradEpilogue<Traits, float>;
    const typename Epi::Params epi{static_cast<float*>(args.out_ENL), args.N, args.L, accumulate};
    launch<Epi>(args, epi, k, stream);
  } else {
    using Epi = WgradEpilogue<Traits, cutlass::bfloat16_t>;
    const typename Epi::Params epi{static_cast<cutlass::bfloat16_t*>(args.out_ENL), args.N, args.L,
                                   accumulate};
    launch<Epi>(args, epi, k, stream);
  }
}

}  // namespace epmoe::cuda
