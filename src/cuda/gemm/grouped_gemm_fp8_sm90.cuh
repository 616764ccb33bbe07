// FP8 block-scaled grouped GEMM for sm_90a (rows grouping):
//
//   C[m, n] = sum_kb block(m, n, kb) * (sa[m, kb] * sb_e[n / 128, kb]),  block = A_kb . B_e,kb^T
//
// with A [M, K] and B_e [N, K] E4M3 (both K-major, the only form e4m3 wgmma takes), 1x128
// activation scales sa and 128x128 weight scales sb (fp32). Hopper's fp8 wgmma accumulates with
// reduced precision, so each 128-deep k-block goes into a block accumulator (zeroed by the first
// wgmma) that the consumer promotes into an fp32 total in registers with the block's scales:
// total = fma(block, sa * sb, total). CPU twin: cpu/gemm_fp8_reference.h. The scale loads,
// producer loop, k-block MMA, two-accumulator loop and promotion are fp8_mainloop.cuh's, shared
// with the ping-pong tile and the WGRAD.
//
// Structure as the bf16 kernel (grouped_gemm_sm90.cuh, whose tile scheduler and epilogues this
// reuses): persistent grid, one producer warpgroup (one thread issues TMA), BLOCK_M / 64 consumer
// warpgroups on one 128-row tile (cooperative). A stage holds the A and B k-blocks (128 bytes of
// K: one 128-byte swizzle row). Scales are plain loads issued one k-block ahead, in flight during
// the MMA: each consumer thread's two rows' activation scales from the S-major layout (scale of
// (m, kb) at kb * ld + m) and the tile's weight scale of (expert, n-block, kb). (A TMA box of the
// tile's 128 fp32 activation scales per stage faulted with an illegal instruction on the H200 for
// a tile past the last row; plain loads need no descriptor and cost two L2 hits per k-block.)
//
// Row boxes: A arrives in 64-row boxes, one per consumer warpgroup. With trim_rows a tile loads
// only the boxes that hold rows of its group, and a warpgroup whose 64 rows all lie past them
// passes its stages through without MMAs: an expert's last m-tile is often a few rows (at 128 or
// 256 rows per expert on average, about half the experts of deepseek-v3 and gpt-oss have one), and
// such a tile then costs one warpgroup's MMAs and half of A's bytes. The outputs are the same (the
// epilogue masks those rows either way).
//
// kOverlap: two block accumulators. The wgmmas of k-block kt + 1 are issued into the other one
// before k-block kt is waited for (wgmma.wait_group 1) and promoted, so the tensor cores work
// during the promotion; 3 x 64 accumulator registers per consumer thread. Same promotions in
// the same order: bitwise equal to the one-accumulator loop.
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "core/fp8_terms.h"
#include "cuda/gemm/fp8_mainloop.cuh"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

template <int BLOCK_N_, int STAGES_, int BLOCK_M_ = 128>
struct Fp8GemmTraits {
  static constexpr int BLOCK_M = BLOCK_M_;  // two or three consumer warpgroups of 64 rows
  static constexpr int BLOCK_N = BLOCK_N_;  // 128: one weight scale block per tile
  static constexpr int BLOCK_K = 128;       // one scale block; 128 bytes of e4m3
  static constexpr int kStages = STAGES_;
  static constexpr Grouping kGrouping = Grouping::rows;  // the scheduler's grouping
  static constexpr int kNumB = 1;
  static constexpr bool kPingPong = false;
  static constexpr int kClusterM = 1;       // the scheduler's tiles: one CTA each
  static constexpr int kWarpgroupsPerTile = BLOCK_M / 64;
  static constexpr int kConsumerWarpgroups = BLOCK_M / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static_assert(BLOCK_N == 128, "one 128-row weight scale block per tile");
  static_assert(BLOCK_M == 128 || BLOCK_M == 192, "two or three consumer warpgroups");
  // Registers (64 K in all): 40 / 232 with two consumer warpgroups; with three, 24 / 160, which
  // holds one block accumulator and the total (2 x 64 a thread), not a second block.
  static constexpr int kProducerRegs = kConsumerWarpgroups == 2 ? 40 : 24;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 2 ? 232 : 160;

  using Element = cutlass::float_e4m3_t;
  using AtomK = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 128 bytes
  using SmemLayoutA = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_M>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BM, BK, PIPE)
  using SmemLayoutB = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_N>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BN, BK, PIPE)
  using MmaAtom = decltype(SM90::GMMA::ss_op_selector<Element, Element, float,
                                                       Shape<_64, Int<BLOCK_N>, Int<BLOCK_K>>,
                                                       GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kWarpgroupsPerTile>, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTxBytes = static_cast<uint32_t>(BLOCK_M * BLOCK_K + BLOCK_N * BLOCK_K);
  // A in 64-row boxes (this file's kernel): a stage's transaction starts at B and one box.
  static constexpr uint32_t kBoxBytes = static_cast<uint32_t>(64 * BLOCK_K);
  static constexpr uint32_t kBoxedTxBytes = kBoxBytes + static_cast<uint32_t>(BLOCK_N * BLOCK_K);
};

// The 64-row boxes of A a tile loads: those holding its rows (trim_rows), else all of them.
template <class Traits>
__device__ __forceinline__ int fp8_row_boxes(int rows_valid, bool trim_rows) {
  if (!trim_rows) return Traits::kConsumerWarpgroups;
  const int boxes = (rows_valid + 63) / 64;
  return boxes < 1 ? 1 : (boxes > Traits::kConsumerWarpgroups ? Traits::kConsumerWarpgroups : boxes);
}

template <class Traits, int kEpilogueBytesPerWarpgroup>
struct alignas(1024) Fp8SharedStorage {
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutA>, 1024> a;
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutB>, 1024> b;
  alignas(1024) char epilogue[Traits::kConsumerWarpgroups][kEpilogueBytesPerWarpgroup];
  typename Traits::Pipeline::SharedStorage pipeline;
  int group_offsets[kMaxGroups + 1];  // make_scheduler's names
  int tile_prefix[kMaxGroups + 1];
};

// One k-block's scales for a consumer thread: the tile's weight scale and its two rows' activation
// scales.
struct Fp8RowScales {
  float sb, sa0, sa1;
};

template <class Traits, class Epilogue, bool kOverlap, class TmaA, class TmaB>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    grouped_gemm_fp8_kernel(CUTE_GRID_CONSTANT const TmaA tma_a, CUTE_GRID_CONSTANT const TmaB tma_b,
                            const GroupArgs group_args, const Fp8ActScales sa_args,
                            const Fp8WeightScales sb, CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params,
                            int64_t a_rows, int64_t a_cols, int64_t b_rows, int64_t b_cols, int trim_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  static_assert(!kOverlap || Traits::kConsumerWarpgroups == 2, "three warpgroups: one block accumulator");
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = Fp8SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  Pipeline pipeline(smem.pipeline,
                    fp8_pipeline_params<Pipeline>(warpgroup, warp_in_group, lane_predicate, Traits::kBoxedTxBytes,
                                                  128 * Traits::kWarpgroupsPerTile),
                    Shape<_1, _1, _1>{});
  fp8_prefetch_descriptors(tma_a, tma_b);
  const TileScheduler<Traits> sched = make_scheduler<Traits>(smem, group_args);  // syncs the CTA

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutB{});
  // (64, BK, boxes, PIPE): the stage's 64-row boxes of A (the swizzle atom's rows run along M first,
  // so a box is 8 KiB of contiguous, whole atoms)
  Tensor sA_boxes = flat_divide(sA, Shape<_64, Int<BK>>{})(_, _, _, 0, _);

  if (warpgroup == 0) {
    // ---------------- producer: one thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_in_group == 0 && lane_predicate) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));                         // (M, K)
      Tensor mB = tma_b.get_tma_tensor(make_shape(b_rows, b_cols, group_args.groups));      // (N, K, G)
      PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
      for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
        const TileCoord t = sched.at(tile);
        Tensor gA = local_tile(domain_offset(make_coord(t.row0, 0), mA), Shape<_64, Int<BK>>{},
                               make_coord(_, _));  // (64, BK, boxes, k)
        Tensor gB = local_tile(domain_offset(make_coord(static_cast<int64_t>(t.n_tile) * BN, 0, t.group), mB)(_, _, 0),
                               Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));  // (BN, BK, k)
        fp8_load_k_blocks_boxed<Traits::kBoxBytes>(pipeline, write_state, tma_a, tma_b, gA, gB, sA_boxes, sB,
                                                   t.k_tiles, fp8_row_boxes<Traits>(t.rows_valid, trim_rows != 0));
      }
    }
  } else {
    // ---------------- consumers: wgmma per k-block, promotion, epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int consumer_tid = threadIdx.x - 128;
    const int wg = warpgroup - 1;  // = its 64-row block of the tile
    const int tid = consumer_tid % 128;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    // One k-block each; block1 only with kOverlap (the MMA of k-block kt + 1 runs in it while
    // k-block kt in block0 is promoted, and the other way round).
    Tensor block0 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    Tensor block1 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    Tensor total = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});  // promoted sum
    // This thread's two fragment rows within the tile (value i = j + 2 h + 4 g is in row
    // 16 w + l / 4 + 8 h of the warpgroup's 64; epilogues.cuh).
    const int scale_row0 = 64 * wg + 16 * (tid / 32) + (tid % 32) / 4;
    const Fp8ActScales sa = resolve_act_scales(sa_args);
    auto promote = [&](const auto& block, float s0, float s1) { fp8_promote_rows(total, block, s0, s1); };
    PipelineState read_state;     // the next stage to wait for
    PipelineState release_state;  // the oldest stage not yet released (trails read_state)
    // kOverlap (fp8_overlapped_k_blocks): k-blocks alternate between block0 and block1; a k-block's
    // scales load just before its MMA is issued and are used by its promotion, after the next
    // k-block's issue.
    auto issue = [&](auto& block) { fp8_issue_k_block(pipeline, read_state, tiled_mma, tCrA, tCrB, block); };
    auto retire = [&](auto& block, auto younger_in_flight, const Fp8RowScales& k) {
      const float s0 = k.sa0 * k.sb, s1 = k.sa1 * k.sb;
      fp8_retire_k_block<decltype(younger_in_flight)::value>(pipeline, release_state, block);
      promote(block, s0, s1);  // while the younger k-block's MMA runs
    };

    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, wg, tid);
    for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
      const TileCoord t = sched.at(tile);
      if constexpr (requires { epilogue.prefetch(t); }) epilogue.prefetch(t);  // its global inputs
      const float* sb_S = sb.scales_EBS + (static_cast<int64_t>(t.group) * sb.n_blocks + t.n_tile) * sb.k_blocks;
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) = 0.0f;
      const int64_t row0 = static_cast<int64_t>(t.row0) + scale_row0, row1 = row0 + 8;
      // Rows past the last one read no scale (their outputs are masked by the epilogue).
      auto scales_of = [&](int kb) {
        return Fp8RowScales{__ldg(sb_S + kb), fp8_act_scale(sa, row0, kb), fp8_act_scale(sa, row1, kb)};
      };
      if (wg >= fp8_row_boxes<Traits>(t.rows_valid, trim_rows != 0)) {
        fp8_pass_k_blocks(pipeline, read_state, release_state, t.k_tiles);  // no rows: total stays 0
      } else if constexpr (kOverlap) {
        fp8_overlapped_k_blocks(t.k_tiles, block0, block1, scales_of, issue, retire);
      } else {
        Fp8RowScales next = scales_of(0);
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          const Fp8RowScales k = next;
          if (kt + 1 < t.k_tiles) next = scales_of(kt + 1);  // in flight during the MMA
          pipeline.consumer_wait(read_state);
          const int stage = read_state.index();
          fp8_mma_k_block(tiled_mma, tCrA, tCrB, stage, stage, block0);
          warpgroup_wait<0>();
          warpgroup_fence_operand(block0);
          pipeline.consumer_release(read_state);  // operands and scales are read
          ++read_state;
          promote(block0, k.sa0 * k.sb, k.sa1 * k.sb);
        }
      }
      epilogue.store(t, total, total);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
