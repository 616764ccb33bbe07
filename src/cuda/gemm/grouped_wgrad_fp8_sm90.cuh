// FP8 block-scaled weight gradient for sm_90a (reduction over each expert's rows):
//
//   C_e[n, l] = sum_kb block(n, l, kb) * (sa[kb, n] * sb[kb, l]),  block = A_kb . B_kb^T
//
// over the column blocks kb of expert e (128 of its rows each, core/fp8_terms.h), with A [N, K]
// and B [L, K] E4M3 codes transposed by the column quantizer (K-major, K = the rows: the only form
// e4m3 wgmma takes; an expert's partial last block is zero-padded, so no k-tail handling) and
// fp32 scales of 128x1 blocks, [blocks, N] and [blocks, L]. Each k-block goes into a block
// accumulator that the consumer promotes into an fp32 total in registers, as the FP8 grouped GEMM
// does (grouped_gemm_fp8_sm90.cuh, whose traits this shares, and the main loop pieces of
// fp8_mainloop.cuh), but with a scale per output row and one per output column. CPU twin:
// cpu::fp8_wgrad_expert_reference (fp8_steps.h).
//
// Tiles: one per (expert, n-tile, l-tile), looping over the expert's k-blocks; an expert without
// rows (or every expert, when the step is skipped) has no k-block and its epilogue writes zeros or
// adds nothing, as the bf16 WGRAD (grouped_gemm_sm90.cuh, reduction grouping). No atomics: each
// output element is written by one thread, in one fixed order of k-blocks.
//
// Column scales: each consumer thread needs its two rows' A scales (plain loads, issued one
// k-block ahead) and 32 columns' B scales, which each consumer warpgroup stages in its own shared
// buffer, 128 per k-block (one per thread), double-buffered behind a barrier of that warpgroup
// only: the buffer of k-block s is written after the barrier of k-block s - 1, which every thread
// of the warpgroup passes only once it has promoted k-block s - 2 (the last reader of that
// buffer). Per warpgroup, so the two warpgroups' k-blocks are tied only by the pipeline stages
// they share: one shared buffer behind a 256-thread barrier per k-block made both promote at once
// and cost 5-9 % of the WGRAD stages (bench/RESULTS.md "cdf2a3d"). Taking the tensor cores in
// strict turns, k-block by k-block (one warpgroup promotes while the other's MMA runs), measured
// slower than letting them run free, whether the turn passed after issue or after completion.
//
// kStageScales (one block accumulator; single CTAs or pairs): the producer copies each k-block's
// 128 A and 128 B scales of the tile (512 contiguous bytes each, cp.async.bulk; each CTA of a pair
// its own) into the k-block's stage, under the stage's transaction barrier; the consumers read
// theirs from the stage after its wait and release it after the promotion. No global loads, no
// shared buffers and no barriers of their own in the k loop (the per-warpgroup barrier above was ~a
// third of the FP8 WGRAD's stall samples when it was one barrier; bench/RESULTS.md 52ac101). Needs
// N % 4 == 0 (16-byte aligned scale rows); the same fmas in the same order: bitwise equal.
//
// kOverlap: two block accumulators, as the FP8 grouped GEMM's (the wgmmas of k-block s + 1 are
// issued before k-block s is retired with wait<1> and promoted). k-block s is then promoted after
// the barrier of k-block s + 1, so its B scales need a third buffer: buffer s % 3 is rewritten
// at k-block s + 3, after the barrier of s + 2, which every consumer passes only once it has
// promoted k-block s. Same fmas in the same order: bitwise equal.
//
// kCluster == 2: CTAs run in pairs (2 x 1 x 1 clusters) on the two n-tiles 2 p and 2 p + 1 of one
// (expert, l-tile), which read the same B k-blocks: each CTA loads half of every B k-block and
// multicasts it to both, which halves B's L2 -> shared-memory traffic (a k-block is 32 KiB for
// 4.2 MFLOP, so a single CTA's tile needs more L2 bandwidth per FLOP than the forward GEMM's). The
// pair walks the same tiles, so the same stages; a stage is free once the consumers of both CTAs
// have released it (the pipeline's cluster arrivals). An odd n-tile count leaves the last pair's
// second tile past N: it is loaded (out-of-bounds rows read as zeros, their scales as 0) and
// computed like any tile, and its epilogue writes nothing (rows past N are clipped). Each output
// element still sees the same k-blocks, fmas and order as with single CTAs: bitwise equal. Pairs
// run one block accumulator (with two, the consumers spill).
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/gemm/fp8_mainloop.cuh"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_fp8_sm90.cuh"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

// 192 x 128 tiles on three consumer warpgroups (Fp8WgradArgs::tile): per 128-deep k-block 40 KiB of
// operands from L2 for 6.3 MFLOP where 128 x 128 loads 32 KiB for 4.2 (x0.82 the bytes per FLOP),
// and a third warpgroup's MMA to run while the others promote. Four stages (40 KiB each) beside
// three 16 KiB TMA-store stagings. The scales ride in the stages (kStageScales). The third
// warpgroup's epilogue barrier takes GemmBarrier id 5, which this kernel uses for nothing else.
struct Fp8Wgrad192Traits {
  static constexpr int BLOCK_M = 192;  // three consumer warpgroups of 64 rows
  static constexpr int BLOCK_N = 128;
  static constexpr int BLOCK_K = 128;
  static constexpr int kStages = 4;
  static constexpr bool kPingPong = false;
  static constexpr int kWarpgroupsPerTile = 3;
  static constexpr int kConsumerWarpgroups = 3;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  using Element = cutlass::float_e4m3_t;
  using AtomK = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutA = decltype(tile_to_shape(AtomK{}, make_shape(Int<BLOCK_M>{}, Int<BLOCK_K>{}, Int<kStages>{})));
  using SmemLayoutB = decltype(tile_to_shape(AtomK{}, make_shape(Int<BLOCK_N>{}, Int<BLOCK_K>{}, Int<kStages>{})));
  using MmaAtom = decltype(SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BLOCK_N>, Int<BLOCK_K>>,
                                                       GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kWarpgroupsPerTile>, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTxBytes = static_cast<uint32_t>((BLOCK_M + BLOCK_N) * BLOCK_K);
};

template <class Traits, int kEpilogueBytesPerWarpgroup>
struct alignas(1024) Fp8WgradSharedStorage {
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutA>, 1024> a;
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutB>, 1024> b;
  alignas(1024) char epilogue[Traits::kConsumerWarpgroups][kEpilogueBytesPerWarpgroup];
  typename Traits::Pipeline::SharedStorage pipeline;
  alignas(16) float b_scales[Traits::kConsumerWarpgroups][3][Traits::BLOCK_N];  // per warpgroup
  alignas(16) float stage_a_scales[Traits::kStages][Traits::BLOCK_M];  // kStageScales: A, B per stage
  alignas(16) float stage_b_scales[Traits::kStages][Traits::BLOCK_N];
  int group_rows[kMaxGroups];        // rows of each expert (0 when the step is skipped)
  int group_block[kMaxGroups + 1];   // its first column block
};

// The problem as the kernel reads it (sizes in elements; K = 128 * column blocks).
struct Fp8WgradGroups {
  const int32_t* offsets = nullptr;      // device [groups + 1]
  const int32_t* skip = nullptr;         // non-zero: every expert is empty
  const int32_t* replay_skip = nullptr;  // the same (backward's replay)
  int groups = 0;
  int64_t n = 0, l = 0, k = 0;           // output rows, output columns, K of A and B
};

struct Fp8ColScales {
  const float* a_BN;  // [blocks, N]
  const float* b_BL;  // [blocks, L]
};

// Tiles (expert, n-tile, l-tile), l fastest; TileCoord's row0 is the expert's first column block,
// rows_valid its rows (the epilogues read group, m_tile = n-tile, n_tile = l-tile and k_tiles).
// With kCluster == 2 the schedule's tiles are pairs of n-tiles (2 p + rank) of one (expert,
// l-tile), the CTA's rank in its cluster picks one; 2 p + 1 may be past the last n-tile. The rank,
// the first tile and the stride are read where used (special registers), as the single-CTA loops
// always read blockIdx / gridDim: held in registers, they made its two-accumulator consumers
// spill (-Xptxas -v).
template <int kCluster>
__device__ __forceinline__ int cluster_rank() {
  return kCluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
}
template <int kCluster>
__device__ __forceinline__ int first_cluster_tile() {
  return static_cast<int>(blockIdx.x) / kCluster;  // tiles are per cluster
}
template <int kCluster>
__device__ __forceinline__ int cluster_tile_stride() {
  return static_cast<int>(gridDim.x) / kCluster;
}

template <class Traits, int kCluster>
struct Fp8WgradScheduler {
  const int* rows;   // shared memory
  const int* block;  // shared memory
  int m_pairs, n_tiles, total;  // m_pairs: ceil(n-tiles / kCluster)

  __device__ TileCoord at(int tile) const {
    const int per_group = m_pairs * n_tiles;
    TileCoord t;
    t.group = tile / per_group;
    const int local = tile % per_group;
    t.m_tile = (local / n_tiles) * kCluster + cluster_rank<kCluster>();
    t.n_tile = local % n_tiles;
    t.row0 = block[t.group];
    t.rows_valid = rows[t.group];
    t.k_tiles = (t.rows_valid + Traits::BLOCK_K - 1) / Traits::BLOCK_K;
    return t;
  }
};

template <class Traits, int kCluster, class Smem>
__device__ Fp8WgradScheduler<Traits, kCluster> make_wgrad_scheduler(Smem& smem, const Fp8WgradGroups& g) {
  const bool skip = (g.skip != nullptr && *g.skip != 0) ||
                    (g.replay_skip != nullptr && *g.replay_skip != 0);
  for (int i = threadIdx.x; i < g.groups; i += blockDim.x) {
    smem.group_rows[i] = skip ? 0 : g.offsets[i + 1] - g.offsets[i];
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // one warp: exclusive prefix of the blocks, in chunks of 32 experts
    const int lane = threadIdx.x;
    int carry = 0;
    for (int base = 0; base < g.groups; base += 32) {
      const int grp = base + lane;
      const int blocks = grp < g.groups ? (smem.group_rows[grp] + Traits::BLOCK_K - 1) / Traits::BLOCK_K : 0;
      int incl = blocks;
      for (int d = 1; d < 32; d *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
      }
      if (grp < g.groups) smem.group_block[grp] = carry + incl - blocks;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) smem.group_block[g.groups] = carry;
  }
  __syncthreads();
  Fp8WgradScheduler<Traits, kCluster> s;
  s.rows = smem.group_rows;
  s.block = smem.group_block;
  const int m_tiles = static_cast<int>((g.n + Traits::BLOCK_M - 1) / Traits::BLOCK_M);
  s.m_pairs = (m_tiles + kCluster - 1) / kCluster;
  s.n_tiles = static_cast<int>((g.l + Traits::BLOCK_N - 1) / Traits::BLOCK_N);
  s.total = g.groups * s.m_pairs * s.n_tiles;
  return s;
}

// Producer, kCluster == 2: k-blocks [0, k_tiles) of the tile's gA (this CTA's, whole) and gB (the
// pair's), one stage each: B in two halves, this CTA's half (`rank`) multicast into both CTAs'
// stage, each half signalling the receiving CTA's barrier (so every stage still receives
// Traits::kTxBytes). As fp8_load_k_blocks otherwise (extras too).
template <class Pipeline, class TmaA, class TmaB, class GA, class GB, class SA, class SB,
          class Extras = NoStageExtras>
__device__ __forceinline__ void fp8_load_k_blocks_b_multicast(Pipeline& pipeline,
                                                              typename Pipeline::PipelineState& write_state,
                                                              const TmaA& tma_a, const TmaB& tma_b, const GA& gA,
                                                              const GB& gB, SA& sA, SB& sB, int k_tiles, int rank,
                                                              const Extras& extras = {}) {
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
  auto [tBgB, tBsB] = tma_partition(tma_b, rank, Layout<_2>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
  constexpr uint16_t kBothCtas = 0b11;
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.producer_acquire(write_state);
    auto* barrier = pipeline.producer_get_barrier(write_state);
    const int stage = write_state.index();
    extras(barrier, stage, kt);  // this CTA's own copies into its own stage
    copy(tma_a.with(*barrier), tAgA(_, kt), tAsA(_, stage));
    copy(tma_b.with(*barrier, kBothCtas), tBgB(_, kt), tBsB(_, stage));
    ++write_state;
  }
}

template <class Traits, class Epilogue, bool kOverlap, int kCluster, bool kStageScales, class TmaA, class TmaB>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    grouped_wgrad_fp8_kernel(CUTE_GRID_CONSTANT const TmaA tma_a, CUTE_GRID_CONSTANT const TmaB tma_b,
                             const Fp8WgradGroups groups, const Fp8ColScales scales,
                             CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  static_assert(BN == 128 && (Traits::kConsumerWarpgroups == 2 || (Traits::kConsumerWarpgroups == 3 && kStageScales)),
                "two consumer warpgroups on one tile (three with the scales in the stage: the consumers' "
                "scale barriers exist for two); one B scale per thread of each");
  // Registers: 40 / 232 with two consumer warpgroups; with three, 24 / 160 (64 K in all).
  constexpr int kProducerRegs = Traits::kConsumerWarpgroups == 2 ? 40 : 24;
  constexpr int kConsumerRegs = Traits::kConsumerWarpgroups == 2 ? 232 : 160;
  static_assert(kCluster == 1 || kCluster == 2, "single CTAs or pairs sharing B");
  static_assert(kCluster == 1 || !kOverlap, "pairs run one block accumulator: with two they spill");
  static_assert(!kStageScales || !kOverlap, "stage scales: one block accumulator");
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = Fp8WgradSharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  Pipeline pipeline(smem.pipeline,
                    fp8_pipeline_params<Pipeline>(warpgroup, warp_in_group, lane_predicate, Traits::kTxBytes,
                                                  128 * Traits::kWarpgroupsPerTile),
                    Shape<Int<kCluster>, _1, _1>{});
  if constexpr (kCluster > 1) {  // the peer's barriers are initialised before any multicast
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
  fp8_prefetch_descriptors(tma_a, tma_b);
  const Fp8WgradScheduler<Traits, kCluster> sched = make_wgrad_scheduler<Traits, kCluster>(smem, groups);  // syncs

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutB{});

  if (warpgroup == 0) {
    // ---------------- producer: one thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_group == 0 && lane_predicate) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(groups.n, groups.k));  // (N, K)
      Tensor mB = tma_b.get_tma_tensor(make_shape(groups.l, groups.k));  // (L, K)
      PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
      for (int tile = first_cluster_tile<kCluster>(); tile < sched.total; tile += cluster_tile_stride<kCluster>()) {
        const TileCoord t = sched.at(tile);
        if (t.k_tiles == 0) continue;
        const int64_t k0 = static_cast<int64_t>(t.row0) * BK;  // the expert's first k-block
        Tensor gA = local_tile(domain_offset(make_coord(static_cast<int64_t>(t.m_tile) * BM, k0), mA),
                               Shape<Int<BM>, Int<BK>>{}, make_coord(0, _));  // (BM, BK, k)
        Tensor gB = local_tile(domain_offset(make_coord(static_cast<int64_t>(t.n_tile) * BN, k0), mB),
                               Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));  // (BN, BK, k)
        // kStageScales: each k-block's A and B scales into stage_a_scales / stage_b_scales[stage], under its
        // barrier. A pair's second tile past N copies no A scales (its rows are clipped).
        const int64_t n0 = static_cast<int64_t>(t.m_tile) * BM, l0 = static_cast<int64_t>(t.n_tile) * BN;
        const int64_t kb0 = t.row0;
        const auto a_bytes = static_cast<uint32_t>(n0 < groups.n ? 4 * cute::min(int64_t{BM}, groups.n - n0) : 0);
        const auto b_bytes = static_cast<uint32_t>(4 * cute::min(int64_t{BN}, groups.l - l0));
        const float* a_scales = scales.a_BN + kb0 * groups.n + n0;  // row kt at kt * N
        const float* b_scales = scales.b_BL + kb0 * groups.l + l0;
        auto copy_scales = [&](auto* barrier, int stage, int kt) {
          cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, a_bytes + b_bytes);
          if (a_bytes != 0) {
            SM90_BULK_COPY_G2S::copy(a_scales + kt * groups.n, barrier, smem.stage_a_scales[stage],
                                     static_cast<int32_t>(a_bytes));
          }
          SM90_BULK_COPY_G2S::copy(b_scales + kt * groups.l, barrier, smem.stage_b_scales[stage],
                                   static_cast<int32_t>(b_bytes));
        };
        if constexpr (kCluster == 1 && kStageScales) {
          fp8_load_k_blocks(pipeline, write_state, tma_a, tma_b, gA, gB, sA, sB, t.k_tiles, copy_scales);
        } else if constexpr (kCluster == 1) {
          fp8_load_k_blocks(pipeline, write_state, tma_a, tma_b, gA, gB, sA, sB, t.k_tiles);
        } else if constexpr (kStageScales) {
          fp8_load_k_blocks_b_multicast(pipeline, write_state, tma_a, tma_b, gA, gB, sA, sB, t.k_tiles,
                                        cluster_rank<kCluster>(), copy_scales);
        } else {
          fp8_load_k_blocks_b_multicast(pipeline, write_state, tma_a, tma_b, gA, gB, sA, sB, t.k_tiles,
                                        cluster_rank<kCluster>());
        }
      }
      // A CTA of a pair stays until the peer's consumers have released every stage this CTA's
      // barriers track (their arrivals target this CTA's shared memory).
      if constexpr (kCluster > 1) pipeline.producer_tail(write_state);
    }
  } else {
    // ---------------- consumers: wgmma per k-block, promotion, epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int consumer_tid = threadIdx.x - 128;
    const int wg = warpgroup - 1;  // = its 64-row block of the tile
    const int tid = consumer_tid % 128;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    // One k-block each; block1 only with kOverlap.
    Tensor block = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    Tensor block1 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
    Tensor total = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});  // promoted sum
    // Fragment value i = j + 2 h + 4 g is at row 16 w + l / 4 + 8 h of the warpgroup's 64 and
    // column 8 g + 2 (l % 4) + j of the tile (epilogues.cuh).
    const int scale_row0 = 64 * wg + 16 * (tid / 32) + (tid % 32) / 4;
    const int quad = tid % 4;
    const int64_t N = groups.n, L = groups.l;
    // Rows and columns past the output read no scale (their outputs are clipped by the epilogue).
    auto a_scale = [&](int64_t n, int kb) {
      return n < N ? __ldg(scales.a_BN + kb * N + n) : 0.0f;
    };
    auto b_scale = [&](int64_t l, int kb) {
      return l < L ? __ldg(scales.b_BL + kb * L + l) : 0.0f;
    };

    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, wg, tid);
    PipelineState read_state;
    int step = 0;  // k-blocks this CTA has consumed: picks the B-scale buffer
    // The scales of the next k-block to consume, loaded one k-block ahead, across tiles too (a
    // tile often has one or two k-blocks): this thread's two A rows and the B column it stages.
    float sa0_next = 0.0f, sa1_next = 0.0f, sb_next = 0.0f;
    bool next_loaded = false;  // they hold the current tile's first k-block
    auto load_next = [&](const TileCoord& c, int kb) {
      const int64_t n = static_cast<int64_t>(c.m_tile) * BM + scale_row0;
      sa0_next = a_scale(n, kb);
      sa1_next = a_scale(n + 8, kb);
      sb_next = b_scale(static_cast<int64_t>(c.n_tile) * BN + tid, kb);
    };
    // The same fmas in both loops, per element in k order.
    auto promote = [&](const auto& acc, float sa0, float sa1, const float* sb_tile) {
      fp8_promote_rows_cols<BN>(total, acc, sa0, sa1, sb_tile, quad);
    };
    struct KScales {
      float sa0, sa1;
      const float* sb_tile;
    };
    // k-block kt of tile t: its B scales staged into buffer step % 3 (kOverlap) or step % 2, the
    // next k-block's scales loaded (in flight during the MMA; across tiles too), the barrier that
    // publishes the buffer.
    auto stage_scales = [&](const TileCoord& t, int kt, const TileCoord& t_next, bool prefetch_next) {
      float* sb_tile = smem.b_scales[wg][kOverlap ? step % 3 : step & 1];
      const KScales k{sa0_next, sa1_next, sb_tile};
      sb_tile[tid] = sb_next;
      if (kt + 1 < t.k_tiles) {
        load_next(t, t.row0 + kt + 1);
      } else if (prefetch_next) {
        load_next(t_next, t_next.row0);
        next_loaded = true;
      }
      barrier_sync(GemmBarrier::fp8_wgrad_scales_wg0, wg, 128);
      ++step;
      return k;
    };
    // ---- kOverlap (fp8_overlapped_k_blocks: k-blocks alternate between block and block1) ----
    PipelineState release_state;  // the oldest stage not yet released (trails read_state)
    auto issue = [&](auto& acc) { fp8_issue_k_block(pipeline, read_state, tiled_mma, tCrA, tCrB, acc); };
    // Promotes the retired k-block while the younger one's MMA runs.
    auto retire = [&](auto& acc, auto younger_in_flight, const KScales& k) {
      fp8_retire_k_block<decltype(younger_in_flight)::value>(pipeline, release_state, acc);
      promote(acc, k.sa0, k.sa1, k.sb_tile);
    };

    for (int tile = first_cluster_tile<kCluster>(); tile < sched.total; tile += cluster_tile_stride<kCluster>()) {
      const TileCoord t = sched.at(tile);
      const int following = tile + cluster_tile_stride<kCluster>();
      const TileCoord t_next = sched.at(following < sched.total ? following : tile);
      const bool prefetch_next = following < sched.total && t_next.k_tiles > 0;
      if (!kStageScales && !next_loaded && t.k_tiles > 0) load_next(t, t.row0);
      next_loaded = false;
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) = 0.0f;
      if constexpr (kStageScales) {
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          pipeline.consumer_wait(read_state);
          const int stage = read_state.index();
          fp8_mma_k_block(tiled_mma, tCrA, tCrB, stage, stage, block);
          const float* ss = smem.stage_a_scales[stage];  // read during the MMA
          const float sa0 = ss[scale_row0], sa1 = ss[scale_row0 + 8];
          warpgroup_wait<0>();
          warpgroup_fence_operand(block);
          promote(block, sa0, sa1, smem.stage_b_scales[stage]);
          pipeline.consumer_release(read_state);  // after the promotion has read the B scales
          ++read_state;
        }
      } else if constexpr (kOverlap) {
        auto scales_of = [&](int kt) { return stage_scales(t, kt, t_next, prefetch_next); };
        fp8_overlapped_k_blocks(t.k_tiles, block, block1, scales_of, issue, retire);
      } else {
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          const KScales k = stage_scales(t, kt, t_next, prefetch_next);
          pipeline.consumer_wait(read_state);
          const int stage = read_state.index();
          fp8_mma_k_block(tiled_mma, tCrA, tCrB, stage, stage, block);
          warpgroup_wait<0>();
          warpgroup_fence_operand(block);
          pipeline.consumer_release(read_state);
          ++read_state;
          promote(block, k.sa0, k.sa1, k.sb_tile);
        }
      }
      epilogue.store(t, total, total);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
