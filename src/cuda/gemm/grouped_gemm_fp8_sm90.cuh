// FP8 block-scaled grouped GEMM for sm_90a (rows grouping):
//
//   C[m, n] = sum_kb block(m, n, kb) * (sa[m, kb] * sb_e[n / 128, kb]),  block = A_kb . B_e,kb^T
//
// with A [M, K] and B_e [N, K] E4M3 (both K-major, the only form e4m3 wgmma takes), 1x128
// activation scales sa and 128x128 weight scales sb (fp32). Hopper's fp8 wgmma accumulates with
// reduced precision, so each 128-deep k-block goes into a block accumulator (zeroed by the first
// wgmma) that the consumer promotes into an fp32 total in registers with the block's scales:
// total = fma(block, sa * sb, total). CPU twin: cpu/gemm_fp8_reference.h.
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
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

template <int BLOCK_N_, int STAGES_>
struct Fp8GemmTraits {
  static constexpr int BLOCK_M = 128;       // two consumer warpgroups of 64 rows
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
};

template <class Traits, int kEpilogueBytesPerWarpgroup>
struct alignas(1024) Fp8SharedStorage {
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutA>, 1024> a;
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutB>, 1024> b;
  alignas(1024) char epilogue[Traits::kConsumerWarpgroups][kEpilogueBytesPerWarpgroup];
  typename Traits::Pipeline::SharedStorage pipeline;
  int group_offsets[kMaxGroups + 1];  // make_scheduler's names
  int tile_prefix[kMaxGroups + 1];
};

// Activation scales as the consumers read them: [k_blocks, ld] fp32, rows < `rows` valid. With
// rows_1 set, the operand holds a row count known only on the device (received rows,
// core/fp8_terms.h): rows = clamp(*rows_1, 0, rows), and its scales follow its codes, at
// codes + fp8_rows_scales_offset(rows, k) with ld = fp8_rows_ld(rows); scales_SM is then the codes.
struct Fp8ActScales {
  const float* scales_SM;
  int64_t ld;
  int64_t rows;
  const int32_t* rows_1 = nullptr;
  int64_t k = 0;  // the operand's row length (codes bytes per row), with rows_1
};

// Resolved once per consumer thread, before any tile.
__device__ __forceinline__ Fp8ActScales resolve_act_scales(const Fp8ActScales& sa) {
  if (sa.rows_1 == nullptr) return sa;
  const int64_t count = *sa.rows_1;
  Fp8ActScales r = sa;
  r.rows = count < 0 ? 0 : (count < sa.rows ? count : sa.rows);
  r.scales_SM = reinterpret_cast<const float*>(reinterpret_cast<const char*>(sa.scales_SM) +
                                               fp8_rows_scales_offset(r.rows, sa.k));
  r.ld = fp8_rows_ld(r.rows);
  return r;
}

// Weight scales as the consumers read them: [groups, n_blocks, k_blocks] fp32.
struct Fp8WeightScales {
  const float* scales_EBS;
  int64_t n_blocks;  // ceil(N / 128)
  int64_t k_blocks;  // ceil(K / 128)
};

template <class Traits, class Epilogue, bool kOverlap, class TmaA, class TmaB>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    grouped_gemm_fp8_kernel(CUTE_GRID_CONSTANT const TmaA tma_a, CUTE_GRID_CONSTANT const TmaB tma_b,
                            const GroupArgs group_args, const Fp8ActScales sa_args,
                            const Fp8WeightScales sb, CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params,
                            int64_t a_rows, int64_t a_cols, int64_t b_rows, int64_t b_cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = Fp8SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTxBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = warpgroup == 0 && warp_in_group == 0 && lane_predicate;
  pipe_params.num_consumers = 128 * Traits::kWarpgroupsPerTile;
  Pipeline pipeline(smem.pipeline, pipe_params, Shape<_1, _1, _1>{});

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }
  const TileScheduler<Traits> sched = make_scheduler<Traits>(smem, group_args);  // syncs the CTA

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutB{});

  if (warpgroup == 0) {
    // ---------------- producer: one thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0 && lane_predicate) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));                         // (M, K)
      Tensor mB = tma_b.get_tma_tensor(make_shape(b_rows, b_cols, group_args.groups));      // (N, K, G)
      PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
      for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
        const TileCoord t = sched.at(tile);
        Tensor gA = local_tile(domain_offset(make_coord(t.row0, 0), mA), Shape<Int<BM>, Int<BK>>{},
                               make_coord(0, _));  // (BM, BK, k)
        Tensor gB = local_tile(domain_offset(make_coord(static_cast<int64_t>(t.n_tile) * BN, 0, t.group), mB)(_, _, 0),
                               Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));  // (BN, BK, k)
        auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                          group_modes<0, 2>(gA));
        auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                          group_modes<0, 2>(gB));
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          pipeline.producer_acquire(write_state);
          auto* barrier = pipeline.producer_get_barrier(write_state);
          const int stage = write_state.index();
          copy(tma_a.with(*barrier), tAgA(_, kt), tAsA(_, stage));
          copy(tma_b.with(*barrier), tBgB(_, kt), tBsB(_, stage));
          ++write_state;
        }
      }
    }
  } else {
    // ---------------- consumers: wgmma per k-block, promotion, epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<232>();
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
    // Rows past the last one read no scale (their outputs are masked by the epilogue).
    auto act_scale = [&](int64_t row, int kb) {
      return row < sa.rows ? __ldg(sa.scales_SM + kb * sa.ld + row) : 0.0f;
    };

    // The same fma per element and k-block, in k order, in both variants: results are bitwise equal.
    auto promote = [&](const auto& block, float s0, float s1) {
      CUTE_UNROLL
      for (int i = 0; i < size(block); ++i) {
        total(i) = __fmaf_rn(block(i), (i & 2) ? s1 : s0, total(i));
      }
    };
    PipelineState read_state;     // the next stage to wait for
    PipelineState release_state;  // the oldest stage not yet released (trails read_state)
    // Waits for the next stage and issues its k-block's wgmmas into `block` (one commit group).
    auto issue = [&](auto& block) {
      pipeline.consumer_wait(read_state);
      const int stage = read_state.index();
      ++read_state;
      warpgroup_fence_operand(block);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), block);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(block);
    };
    // The oldest k-block in flight has completed (younger_in_flight: wait<1>, else wait<0>):
    // release its stage, then promote it while the younger k-block's MMA runs. The waits are
    // compile-time counts in straight-line code, so ptxas can see which accumulator is complete.
    auto retire = [&](auto& block, auto younger_in_flight, float s0, float s1) {
      warpgroup_wait<decltype(younger_in_flight)::value ? 1 : 0>();
      warpgroup_fence_operand(block);
      pipeline.consumer_release(release_state);  // its wgmmas have read the stage
      ++release_state;
      promote(block, s0, s1);
    };
    // k-blocks alternate between block0 (even kt) and block1 (odd kt), the loop unrolled by two so
    // each is a static register array. A k-block's scales load just before its MMA is issued and
    // are used by its promotion, after the next k-block's issue.
    auto consume_overlapped = [&](int k_tiles, int64_t row0, int64_t row1, const float* sb_S) {
      if (k_tiles <= 0) return;
      float sb_e = __ldg(sb_S), sa0_e = act_scale(row0, 0), sa1_e = act_scale(row1, 0);
      float sb_o = 0.0f, sa0_o = 0.0f, sa1_o = 0.0f;
      issue(block0);
      int kt = 0;
      for (; kt + 2 < k_tiles; kt += 2) {  // block0 holds k-block kt in flight; kt + 2 exists
        sb_o = __ldg(sb_S + kt + 1);
        sa0_o = act_scale(row0, kt + 1);
        sa1_o = act_scale(row1, kt + 1);
        issue(block1);
        retire(block0, cute::true_type{}, sa0_e * sb_e, sa1_e * sb_e);
        sb_e = __ldg(sb_S + kt + 2);
        sa0_e = act_scale(row0, kt + 2);
        sa1_e = act_scale(row1, kt + 2);
        issue(block0);
        retire(block1, cute::true_type{}, sa0_o * sb_o, sa1_o * sb_o);
      }
      if (kt + 1 < k_tiles) {  // two k-blocks left: kt in block0 (in flight), kt + 1
        sb_o = __ldg(sb_S + kt + 1);
        sa0_o = act_scale(row0, kt + 1);
        sa1_o = act_scale(row1, kt + 1);
        issue(block1);
        retire(block0, cute::true_type{}, sa0_e * sb_e, sa1_e * sb_e);
        retire(block1, cute::false_type{}, sa0_o * sb_o, sa1_o * sb_o);
      } else {  // one left
        retire(block0, cute::false_type{}, sa0_e * sb_e, sa1_e * sb_e);
      }
    };

    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, wg, tid);
    for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
      const TileCoord t = sched.at(tile);
      const float* sb_S = sb.scales_EBS + (static_cast<int64_t>(t.group) * sb.n_blocks + t.n_tile) * sb.k_blocks;
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) = 0.0f;
      const int64_t row0 = static_cast<int64_t>(t.row0) + scale_row0, row1 = row0 + 8;
      if constexpr (kOverlap) {
        consume_overlapped(t.k_tiles, row0, row1, sb_S);
      } else {
        float sb_next = __ldg(sb_S);
        float sa0_next = act_scale(row0, 0), sa1_next = act_scale(row1, 0);
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          const float sb_k = sb_next, sa0 = sa0_next, sa1 = sa1_next;
          if (kt + 1 < t.k_tiles) {  // in flight during the MMA
            sb_next = __ldg(sb_S + kt + 1);
            sa0_next = act_scale(row0, kt + 1);
            sa1_next = act_scale(row1, kt + 1);
          }
          pipeline.consumer_wait(read_state);
          const int stage = read_state.index();
          warpgroup_fence_operand(block0);
          warpgroup_arrive();
          tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tCrA); ++kb) {
            cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), block0);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          warpgroup_wait<0>();
          warpgroup_fence_operand(block0);
          pipeline.consumer_release(read_state);  // operands and scales are read
          ++read_state;
          promote(block0, sa0 * sb_k, sa1 * sb_k);
        }
      }
      epilogue.store(t, total, total);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
