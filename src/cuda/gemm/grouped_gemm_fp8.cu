// Launcher and the instantiations of the FP8 block-scaled grouped GEMM: 128 x 128 tiles,
// 128-deep k-blocks, 6 stages (32.5 KiB each), cooperative consumers; plain bf16 rows, rows
// stored into their owners' combine slots (the W2 forward), or the W2 DGRAD's SwiGLU backward
// (fp8_swiglu_epilogue.cuh); each with one block accumulator or
// two (kOverlap: MMA of the next k-block during the promotion; Fp8GroupedGemmArgs::overlap).
// Plain and combine-slot rows also on 192 x 128 tiles (three consumer warpgroups, one block
// accumulator). A in 64-row boxes, trimmed to a tile's rows (Fp8GroupedGemmArgs::trim_rows).
// The argument checks and the tile choice (Fp8Tile; the 64 x 256 ping-pong tile is launched by
// grouped_gemm_fp8_pingpong.cu).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/fp8_gemm_launch.h"
#include "cuda/gemm/fp8_swiglu_epilogue.cuh"
#include "cuda/gemm/grouped_gemm_fp8_sm90.cuh"
#include "cuda/gemm/launch.cuh"
#include "cuda/gemm/launch_checks.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

using namespace gemm;

namespace {

using Traits = Fp8GemmTraits<128, 6>;
// 192 x 128: three consumer warpgroups, 4 stages of 40 KiB (five do not fit beside the epilogue's
// staging); 1.2x the FLOPs per operand byte of 128 x 128, one block accumulator.
using Traits192 = Fp8GemmTraits<128, 4, 192>;

// fp8_trim_rows_rule's and fp8_tile_for_d_rows' bounds (fp8_gemm.h says what was measured).
constexpr int64_t kFp8TrimRowsMinRows = 256;
constexpr int64_t kFp8TallTileMaxRows = 192;

void check_args(const Fp8GroupedGemmArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= kMaxGroups, "E", "1 .. " + std::to_string(kMaxGroups), a.E);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.overlap >= -1 && a.overlap <= 1, "overlap", "-1, 0 or 1", a.overlap);
  EPMOE_CHECK_ARG(a.trim_rows >= -1 && a.trim_rows <= 1, "trim_rows", "-1, 0 or 1", a.trim_rows);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % 16 == 0, "K", "> 0 and a multiple of 16", a.K);
  EPMOE_CHECK_ARG(a.N > 0 && a.N % 8 == 0, "N", "> 0 and a multiple of 8", a.N);
  const bool scatter = a.combine_R != nullptr;
  const Fp8SwigluBackwardOut& sw = a.swiglu_backward;
  const bool swiglu = sw.grad_h13_M2F != nullptr;
  if (swiglu) {
    EPMOE_CHECK_ARG(a.out_MN == nullptr && !scatter, "out_MN, combine_R",
                    "nullptr with swiglu_backward (one destination)", "a pointer");
    EPMOE_CHECK_ARG(a.N % 128 == 0, "N", "a multiple of 128 with swiglu_backward (F)", a.N);
    EPMOE_CHECK_ARG(sw.q_ld >= a.M, "swiglu_backward.q_ld", ">= M", sw.q_ld);
    EPMOE_CHECK_ARG(sw.q_scales_SM != nullptr, "swiglu_backward.q_scales_SM", "a device pointer",
                    "nullptr");
    EPMOE_CHECK_ARG(sw.row_scores_M == nullptr || sw.score_parts_MC != nullptr,
                    "swiglu_backward.score_parts_MC", "a device pointer with row_scores_M", "nullptr");
  } else if (scatter) {
    EPMOE_CHECK_ARG(a.out_MN == nullptr, "out_MN", "nullptr with combine_R (one destination)",
                    "a pointer");
    EPMOE_CHECK_ARG(a.T >= 1 && a.top_k >= 1, "T, top_k", ">= 1 with combine_R",
                    std::to_string(a.T) + ", " + std::to_string(a.top_k));
  } else {
    EPMOE_CHECK_ARG(a.ld_out >= a.N && a.ld_out % 8 == 0, "ld_out", ">= N and a multiple of 8",
                    a.ld_out);
  }
  // With a_rows_1 the scales follow the codes at fp8_rows_scales_offset (16-byte aligned).
  if (a.a_rows_1 == nullptr) {
    EPMOE_CHECK_ARG(a.ld_a_scales >= a.M && a.ld_a_scales % 4 == 0, "ld_a_scales",
                    ">= M and a multiple of 4", a.ld_a_scales);
  }
  check_device_pointer(a.b_ENK, "b_ENK", 16);
  check_device_pointer(a.b_scales_EBS, "b_scales_EBS", 16);
  check_device_pointer(a.offsets_E1, "offsets_E1", 16);
  if (a.M == 0) return;
  check_device_pointer(a.a_MK, "a_MK", 16);
  if (a.a_rows_1 == nullptr) check_device_pointer(a.a_scales_SM, "a_scales_SM", 16);
  if (swiglu) {
    check_device_pointer(sw.h13.base, "swiglu_backward.h13", 16);
    check_device_pointer(sw.grad_h13_M2F, "swiglu_backward.grad_h13_M2F", 16);
    check_device_pointer(sw.h_MF, "swiglu_backward.h_MF", 16);
    check_device_pointer(sw.q_M2F, "swiglu_backward.q_M2F", 16);
  } else if (scatter) {
    check_device_pointer(a.combine_R, "combine_R", 16);
    check_device_pointer(a.recv_src_M, "recv_src_M", 16);
  } else {
    check_device_pointer(a.out_MN, "out_MN", 16);
  }
}

template <class T, class Epilogue, bool kOverlap>
void launch(const Fp8GroupedGemmArgs& args, const typename Epilogue::Params& epi, void* stream) {
  const Operand a{args.a_MK, args.M, args.K, args.K, 1};
  const Operand b{args.b_ENK, args.N, args.K, args.K, 1, args.E, args.N * args.K};
  auto tma_a = make_tma<T, Major::K, 64, 2>(a);  // 64-row boxes (grouped_gemm_fp8_sm90.cuh)
  auto tma_b = make_tma<T, Major::K, T::BLOCK_N, 3>(b);
  const GroupArgs groups = fp8_group_args(args);
  const Fp8ActScales sa = fp8_act_scales(args);
  const Fp8WeightScales sb = fp8_weight_scales(args);

  constexpr auto kernel = &grouped_gemm_fp8_kernel<T, Epilogue, kOverlap, decltype(tma_a), decltype(tma_b)>;
  constexpr int kSmem = static_cast<int>(sizeof(Fp8SharedStorage<T, Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  kernel<<<device_sm_count(), T::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      tma_a, tma_b, groups, sa, sb, epi, a.rows, a.cols, b.rows, b.cols,
      fp8_trim_rows_selected(args.trim_rows) ? 1 : 0);
  EPMOE_CUDA_LAUNCH_CHECK();
}

// Calls fn(type_identity<traits>, bool_constant<two block accumulators>) for the tile: 128 x 128 with
// one block accumulator or two (Fp8GroupedGemmArgs::overlap), or (kTall) 192 x 128 with one.
template <bool kTall, class Fn>
void with_tile(const Fp8GroupedGemmArgs& args, Fp8Tile tile, Fn&& fn) {
  if constexpr (kTall) {
    if (tile == Fp8Tile::m192_n128) return fn(std::type_identity<Traits192>{}, std::false_type{});
  }
  if (fp8_overlap_selected(args.overlap)) return fn(std::type_identity<Traits>{}, std::true_type{});
  fn(std::type_identity<Traits>{}, std::false_type{});
}

}  // namespace

Fp8Tile fp8_tile_from_env() {
  const char* env = std::getenv("EPMOE_FP8_TILE");  // per call (~100 ns), for measurements
  if (env == nullptr || std::strcmp(env, "128x128") == 0) return Fp8Tile::m128_n128;
  if (std::strcmp(env, "192x128") == 0) return Fp8Tile::m192_n128;
  if (std::strcmp(env, "64x256") == 0) return Fp8Tile::m64_n256;
  EPMOE_CHECK_ARG(std::strcmp(env, "64x256-spread") == 0, "EPMOE_FP8_TILE",
                  "128x128, 192x128, 64x256 or 64x256-spread", env);
  return Fp8Tile::m64_n256_spread;
}

Fp8Tile fp8_tile_for_d_rows(int64_t N, int64_t K, int64_t rows_per_expert, std::string* why) {
  if (const char* env = std::getenv("EPMOE_FP8_TILE"); env != nullptr) {
    if (why != nullptr) *why += std::string("EPMOE_FP8_TILE=") + env + " (override)";
    return fp8_tile_from_env();
  }
  if (why != nullptr) *why += "K " + std::to_string(K) + (K < N ? " < N " : " >= N ") + std::to_string(N);
  if (K >= N) return Fp8Tile::m128_n128;
  const bool tall = rows_per_expert <= kFp8TallTileMaxRows;
  if (why != nullptr) {
    *why += ", T*K/E " + std::to_string(rows_per_expert) + (tall ? " <= " : " > ") +
            std::to_string(kFp8TallTileMaxRows);
  }
  return tall ? Fp8Tile::m192_n128 : Fp8Tile::m64_n256_spread;
}

bool fp8_overlap_selected(int overlap) {
  if (overlap >= 0) return overlap != 0;
  // Read per launch: benches flip it. Unset: two accumulators (faster end to end on all four
  // bench shapes, bench/RESULTS.md "e86d331").
  const char* env = std::getenv("EPMOE_FP8_OVERLAP");
  if (env == nullptr) return true;
  EPMOE_CHECK_ARG(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, "EPMOE_FP8_OVERLAP", "0 or 1", env);
  return env[0] == '1';
}

bool fp8_trim_rows_selected(int trim_rows) {
  if (trim_rows >= 0) return trim_rows != 0;
  const char* env = std::getenv("EPMOE_FP8_TRIM_ROWS");  // per launch: benches flip it
  if (env == nullptr) return true;
  EPMOE_CHECK_ARG(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, "EPMOE_FP8_TRIM_ROWS", "0 or 1", env);
  return env[0] == '1';
}

int fp8_trim_rows_rule(int64_t rows_per_expert, Fp8Tile tile, std::string* why) {
  if (const char* env = std::getenv("EPMOE_FP8_TRIM_ROWS"); env != nullptr) {
    if (why != nullptr) *why += std::string("EPMOE_FP8_TRIM_ROWS=") + env + " (override)";
    return fp8_trim_rows_selected(-1) ? 1 : 0;
  }
  if (tile == Fp8Tile::m192_n128) {
    if (why != nullptr) *why += "192 x 128";
    return 1;
  }
  const bool trim = rows_per_expert >= kFp8TrimRowsMinRows;
  if (why != nullptr) {
    *why += "T*K/E " + std::to_string(rows_per_expert) + (trim ? " >= " : " < ") +
            std::to_string(kFp8TrimRowsMinRows);
  }
  return trim ? 1 : 0;
}

void fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, void* stream) {
  check_args(args);
  const Fp8Tile tile = args.tile == Fp8Tile::from_env ? fp8_tile_from_env() : args.tile;
  EPMOE_CHECK_ARG(tile == Fp8Tile::m128_n128 || tile == Fp8Tile::m192_n128 || tile == Fp8Tile::m64_n256 ||
                      tile == Fp8Tile::m64_n256_spread,
                  "tile", "from_env, m128_n128, m192_n128, m64_n256 or m64_n256_spread", static_cast<int>(tile));
  const Fp8SwigluBackwardOut& sw = args.swiglu_backward;
  if (sw.grad_h13_M2F != nullptr) {
    EPMOE_CHECK_ARG(tile == Fp8Tile::m128_n128, "tile",
                    "m128_n128 with swiglu_backward (from_env: EPMOE_FP8_TILE unset or 128x128)",
                    static_cast<int>(tile));
  }
  if (args.M == 0) return;  // no rows: every group is empty
  if (tile == Fp8Tile::m64_n256 || tile == Fp8Tile::m64_n256_spread) {
    return fp8_grouped_gemm_pingpong(args, tile == Fp8Tile::m64_n256, stream);
  }
  if (sw.grad_h13_M2F != nullptr) {
    with_tile<false>(args, tile, [&](auto t, auto overlap) {
      using T = typename decltype(t)::type;
      const typename SwigluBackwardFp8Epilogue<T>::Params epi{
          sw.h13, sw.grad_h13_M2F, sw.h_MF, Fp8RowsOut{sw.q_M2F, sw.q_scales_SM, sw.q_ld}, args.N, sw.act,
          sw.row_scores_M, sw.score_parts_MC, score_chunks(args.N)};
      launch<T, SwigluBackwardFp8Epilogue<T>, decltype(overlap)::value>(args, epi, stream);
    });
  } else if (args.combine_R != nullptr) {
    with_tile<true>(args, tile, [&](auto t, auto overlap) {
      using T = typename decltype(t)::type;
      const typename ScatterEpilogue<T>::Params epi{args.combine_R, args.recv_src_M, args.T, args.top_k, args.N};
      launch<T, ScatterEpilogue<T>, decltype(overlap)::value>(args, epi, stream);
    });
  } else {
    with_tile<true>(args, tile, [&](auto t, auto overlap) {
      using T = typename decltype(t)::type;
      const typename RowsEpilogue<T>::Params epi{fp8_rows_out(args), args.ld_out, args.N};
      launch<T, RowsEpilogue<T>, decltype(overlap)::value>(args, epi, stream);
    });
  }
}

}  // namespace epmoe::cuda
