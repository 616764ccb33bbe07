// FP8 block-scaled grouped GEMM, ping-pong tile (rows grouping): the formula, layouts, scale loads
// and promotion of grouped_gemm_fp8_sm90.cuh (fp8_mainloop.cuh), on 64 x 256 tiles instead of
// 128 x 128.
//
// Why: with ~128 rows per expert the GEMM is weight-bound, and a stage of this tile holds a 256 x 128
// weight k-block (32 KiB, plus 8 KiB of A): 5 stages keep 160 KiB of weights in flight against the
// 128 x 128 tile's 6 x 16 KiB. Each consumer warpgroup owns a whole 64-row tile and the two take
// turns (the mainloop-turn barriers of grouped_gemm_sm90.cuh), so one's epilogue overlaps the
// other's mainloop.
//
// Registers: a k-block runs as two 128-column halves, each 4 wgmma m64n128k32 into one 64-register
// block accumulator, then promoted into its half of the 128-register total with the half's weight
// scale (a 256-column tile spans two 128 x 128 weight-scale blocks). Per output element this is the
// 128 x 128 kernel's computation: the same wgmma shape over the same k-block, then
// total = fma(block, sa * sb, total) per k-block in k order, so the outputs agree bitwise.
//
// Order (kPairs, a template argument so that both can be measured):
// - pairs: tiles are scheduled as 128-row units (the 128 x 128 kernel's scheduler on 128 x 256) and
//   a CTA runs both 64-row halves of a unit back to back (the second only when it holds rows), one
//   per warpgroup. The second read of each weight k-block follows the first by one mainloop of
//   the CTA (k_tiles stages; with every CTA streaming, some hundred MB of loads at K = 7168, more
//   than L2 holds), so whether it hits L2 is for the measurement to show.
// - spread: the bf16 ping-pong's order, 64-row tiles m fastest: the two halves of a 128-row block
//   go to neighbouring CTAs and run at the same time, which read each weight k-block together.
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/gemm/fp8_mainloop.cuh"
#include "cuda/gemm/grouped_gemm_fp8_sm90.cuh"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

struct Fp8PingPongTraits {
  static constexpr int BLOCK_M = 64;   // one consumer warpgroup's tile
  static constexpr int BLOCK_N = 256;  // two 128-column weight-scale blocks
  static constexpr int BLOCK_K = 128;  // one scale block; 128 bytes of e4m3
  static constexpr int kHalfN = 128;   // columns per block accumulator
  static constexpr int kStages = 5;    // 40 KiB each
  static constexpr Grouping kGrouping = Grouping::rows;
  static constexpr int kNumB = 1;
  static constexpr bool kPingPong = true;
  static constexpr int kClusterM = 1;
  static constexpr int kWarpgroupsPerTile = 1;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);

  using Element = cutlass::float_e4m3_t;
  using AtomK = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 128 bytes
  using SmemLayoutA = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_M>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BM, BK, PIPE)
  using SmemLayoutB = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_N>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BN, BK, PIPE)
  // The same bytes as 128-row halves: half h of stage s is index 2 s + h (the atom tiles rows first,
  // so a stage's rows [128 h, 128 h + 128) are its h-th contiguous 16 KiB, itself a K-major SW128
  // tile of 128 rows).
  using SmemLayoutBHalves = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<kHalfN>{}, Int<BLOCK_K>{}, Int<2 * kStages>{})));  // (128, BK, 2 PIPE)
  static_assert(cosize_v<SmemLayoutBHalves> == cosize_v<SmemLayoutB>, "halves view the B stages");
  using MmaAtom = decltype(SM90::GMMA::ss_op_selector<Element, Element, float,
                                                       Shape<_64, Int<kHalfN>, Int<BLOCK_K>>,
                                                       GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTxBytes = static_cast<uint32_t>((BLOCK_M + BLOCK_N) * BLOCK_K);
};

// The scheduler's view: units of 256 columns and 128 rows (pairs: the two 64-row tiles one CTA
// runs back to back) or 64 rows (spread: one tile).
template <bool kPairs>
struct Fp8PingPongUnits {
  static constexpr int kTilesPerUnit = kPairs ? 2 : 1;
  static constexpr int BLOCK_M = kTilesPerUnit * Fp8PingPongTraits::BLOCK_M;
  static constexpr int BLOCK_N = Fp8PingPongTraits::BLOCK_N;
  static constexpr int BLOCK_K = Fp8PingPongTraits::BLOCK_K;
  static constexpr Grouping kGrouping = Grouping::rows;
  static constexpr int kClusterM = 1;
};

// The 64-row tile `half` (0, 1) of unit u; rows_valid <= 0: the unit has no rows there (skipped).
__device__ __forceinline__ TileCoord fp8_pingpong_tile(const TileCoord& u, int half) {
  TileCoord t = u;
  t.m_tile = 2 * u.m_tile + half;
  t.row0 = u.row0 + 64 * half;
  t.rows_valid = u.rows_valid - 64 * half;
  return t;
}

template <bool kPairs, class Epilogue, class TmaA, class TmaB>
__global__ void __launch_bounds__(Fp8PingPongTraits::kThreads, 1)
    grouped_gemm_fp8_pingpong_kernel(CUTE_GRID_CONSTANT const TmaA tma_a,
                                     CUTE_GRID_CONSTANT const TmaB tma_b, const GroupArgs group_args,
                                     const Fp8ActScales sa_args, const Fp8WeightScales sb,
                                     CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params,
                                     int64_t a_rows, int64_t a_cols, int64_t b_rows, int64_t b_cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = Fp8PingPongTraits;
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  constexpr int kHalfN = Traits::kHalfN;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = Fp8SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  // One warpgroup works on (and releases) a stage.
  Pipeline pipeline(smem.pipeline,
                    fp8_pipeline_params<Pipeline>(warpgroup, warp_in_group, lane_predicate, Traits::kTxBytes, 128),
                    Shape<_1, _1, _1>{});
  fp8_prefetch_descriptors(tma_a, tma_b);
  using Units = Fp8PingPongUnits<kPairs>;
  const TileScheduler<Units> sched = make_scheduler<Units>(smem, group_args);  // syncs the CTA

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutB{});

  if (warpgroup == 0) {
    // ---------------- producer: one thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0 && lane_predicate) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));                     // (M, K)
      Tensor mB = tma_b.get_tma_tensor(make_shape(b_rows, b_cols, group_args.groups));  // (N, K, G)
      PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
      for (int unit = blockIdx.x; unit < sched.total; unit += gridDim.x) {
        const TileCoord u = sched.at(unit);
        for (int half = 0; half < Units::kTilesPerUnit; ++half) {
          const TileCoord t = kPairs ? fp8_pingpong_tile(u, half) : u;
          if (t.rows_valid <= 0) break;
          Tensor gA = local_tile(domain_offset(make_coord(t.row0, 0), mA), Shape<Int<BM>, Int<BK>>{},
                                 make_coord(0, _));  // (BM, BK, k)
          Tensor gB = local_tile(domain_offset(make_coord(static_cast<int64_t>(t.n_tile) * BN, 0, t.group), mB)(_, _, 0),
                                 Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));  // (BN, BK, k)
          fp8_load_k_blocks(pipeline, write_state, tma_a, tma_b, gA, gB, sA, sB, t.k_tiles);
        }
      }
    }
  } else {
    // ---------------- consumers: alternate 64-row tiles, two N-halves per k-block ----------------
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int wg = warpgroup - 1;
    const int tid = threadIdx.x % 128;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor sBh = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutBHalves{});
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));   // (MMA, 1, MMA_K, PIPE)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sBh));  // (MMA, 1, MMA_K, 2 PIPE)
    Tensor block = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<kHalfN>>{});  // one half k-block
    // The promoted 64 x 256 sum in the wgmma fragment order of a 64 x 256 tile (epilogues.cuh):
    // value i = j + 2 h + 4 g, column 8 g + ...; half n's values are [64 n, 64 n + 64).
    constexpr int kBlockValues = decltype(size(block))::value;
    static_assert(kBlockValues == 64, "a 64 x 128 accumulator is 64 values a thread");
    Tensor total = make_tensor<float>(Int<2 * kBlockValues>{});
    // This thread's two fragment rows within the tile (value i is in row 16 w + l / 4 + 8 h).
    const int scale_row0 = 16 * (tid / 32) + (tid % 32) / 4;
    const Fp8ActScales sa = resolve_act_scales(sa_args);

    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, /*row_block=*/0, tid);
    PipelineState read_state;
    int sequence = 0;  // this CTA's tiles in order; warpgroup (sequence % 2) runs one
    for (int unit = blockIdx.x; unit < sched.total; unit += gridDim.x) {
      const TileCoord u = sched.at(unit);
      for (int half_m = 0; half_m < Units::kTilesPerUnit; ++half_m) {
        const TileCoord t = kPairs ? fp8_pingpong_tile(u, half_m) : u;
        if (t.rows_valid <= 0) break;
        const int seq = sequence++;
        if ((seq & 1) != wg) {  // the other warpgroup's tile: skip its stages
          read_state.advance(static_cast<uint32_t>(t.k_tiles));
          continue;
        }
        // Mainloops take turns (a stage's phase is known by parity only): wait for the other
        // warpgroup to finish the previous tile's mainloop.
        if (seq > 0) {
          barrier_sync(GemmBarrier::mainloop_turn_wg0, wg, 256);
        }
        const bool next_tile = (kPairs && half_m == 0 && u.rows_valid > BM) ||
                               unit + static_cast<int>(gridDim.x) < sched.total;
        // Weight scales of the tile's two 128-column blocks; a block past N reads none (its
        // columns are zero-filled by TMA and masked by the epilogue).
        const int64_t nb0 = 2 * static_cast<int64_t>(t.n_tile);
        const bool has_nb1 = nb0 + 1 < sb.n_blocks;
        const float* sb_S = sb.scales_EBS + (static_cast<int64_t>(t.group) * sb.n_blocks + nb0) * sb.k_blocks;
        CUTE_UNROLL
        for (int i = 0; i < size(total); ++i) total(i) = 0.0f;
        const int64_t row0 = static_cast<int64_t>(t.row0) + scale_row0, row1 = row0 + 8;
        float sb0_next = __ldg(sb_S), sb1_next = has_nb1 ? __ldg(sb_S + sb.k_blocks) : 0.0f;
        float sa0_next = fp8_act_scale(sa, row0, 0), sa1_next = fp8_act_scale(sa, row1, 0);
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          const float sb_k[2] = {sb0_next, sb1_next};
          const float sa0 = sa0_next, sa1 = sa1_next;
          if (kt + 1 < t.k_tiles) {  // in flight during the MMA
            sb0_next = __ldg(sb_S + kt + 1);
            if (has_nb1) sb1_next = __ldg(sb_S + sb.k_blocks + kt + 1);
            sa0_next = fp8_act_scale(sa, row0, kt + 1);
            sa1_next = fp8_act_scale(sa, row1, kt + 1);
          }
          pipeline.consumer_wait(read_state);
          const int stage = read_state.index();
          CUTE_UNROLL
          for (int half_n = 0; half_n < 2; ++half_n) {
            fp8_mma_k_block(tiled_mma, tCrA, tCrB, stage, 2 * stage + half_n, block);
            warpgroup_wait<0>();
            warpgroup_fence_operand(block);
            if (half_n == 1) pipeline.consumer_release(read_state);  // operands are read
            const float s0 = sa0 * sb_k[half_n], s1 = sa1 * sb_k[half_n];
            fp8_promote_rows(total, block, s0, s1, kBlockValues * half_n);  // into half n's values
          }
          ++read_state;
        }
        if (next_tile) {  // the next tile's mainloop may start
          barrier_arrive(GemmBarrier::mainloop_turn_wg0, 1 - wg, 256);
        }
        epilogue.store(t, total, total);
      }
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
