// Persistent, warp-specialized grouped GEMM for sm_90a: TMA loads into a multi-stage shared-memory
// pipeline, wgmma (bf16 in, fp32 accumulators), one producer warpgroup and BLOCK_M/64 consumer
// warpgroups working on one BLOCK_M x BLOCK_N tile. Group sizes are read from device memory at
// kernel start (no host copy of counts): the grid is sized by the SM count, never by row counts.
//
//   Grouping::rows       C[m, :] = A[m, :] . B_e^T for the rows m of expert e; rows of A past the
//                        group end are loaded but their outputs are masked in the epilogue.
//   Grouping::reduction  C_e = A_e^T . B_e over the rows of expert e (WGRAD); the k-block that
//                        crosses the group end is zeroed in shared memory before the MMA.
//
// With NumB == 2 the tile has two B operands (W13's gate and up rows) and two accumulators that
// hold the same (row, column) in the same thread, so SwiGLU is thread-local in the epilogue.
//
// CLUSTER_M == 2: CTAs run in pairs (a 2 x 1 x 1 cluster) on the two m-tiles of one (group,
// n-tile) and share its B tile: each CTA loads half of every B k-block and multicasts it to both,
// which halves B's L2 -> shared-memory traffic (the weights in forward and DGRAD, the x / h rows
// in WGRAD). A pair's second m-tile may lie past the group's rows (odd m-tile counts): it is
// loaded and computed like any tile and its epilogue masks every row (TMA stores clip it).
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/gemm/arrival_gate.cuh"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/tile_timeline.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

// The order in which tile_to_shape repeats a 128B-swizzle atom over (MN, K[, PIPE]). An MN-major
// atom is 64 (MN) x 8 (K); repeated k-first, a 64 x BLOCK_K slab is one contiguous 8 KiB block,
// which one TMA box fills (6 boxes per WGRAD k-block). Repeated MN-first, every 64 x 8 atom is a
// box of its own: 1 KiB per TMA instruction, 8x the producer's instructions for the same bytes.
template <Major kMajor>
using AtomOrder =
    std::conditional_t<kMajor == Major::K, cute::Step<_1, _2, _3>, cute::Step<_2, _1, _3>>;

// PINGPONG: each of the two consumer warpgroups owns alternate 64-row tiles, so one warpgroup's
// epilogue overlaps the other's MMA. Otherwise (cooperative) BLOCK_M / 64 warpgroups share a tile.
// PEEL_TAIL (reduction grouping): the k-blocks a group fills run with one wgmma batch in flight;
// the partial last one, whose rows past the group are zeroed, runs after them.
template <int BLOCK_M_, int BLOCK_N_, int STAGES_, Grouping GROUPING_, Major A_MAJOR_,
          Major B_MAJOR_, int NUM_B_, bool PINGPONG_ = false, int CLUSTER_M_ = 1,
          bool PEEL_TAIL_ = false>
struct GemmTraits {
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;  // per B operand
  static constexpr int BLOCK_K = 64;        // 128 bytes of bf16: one 128B-swizzle row
  static constexpr int kStages = STAGES_;
  static constexpr Grouping kGrouping = GROUPING_;
  static constexpr int kNumB = NUM_B_;
  static constexpr bool kPingPong = PINGPONG_;
  static constexpr int kClusterM = CLUSTER_M_;  // CTAs sharing each B tile (multicast)
  static constexpr bool kPeelTail = PEEL_TAIL_;
  static constexpr int kWarpgroupsPerTile = kPingPong ? 1 : BLOCK_M / 64;
  static constexpr int kConsumerWarpgroups = kPingPong ? 2 : BLOCK_M / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two consumer warpgroups of 64 rows");
  static_assert(!kPingPong || BLOCK_M == 64, "ping-pong: one warpgroup per 64-row tile");
  static_assert(kNumB == 1 || kNumB == 2, "one B operand, or W13's gate and up halves");
  static_assert(kClusterM == 1 || kClusterM == 2, "B shared by one or two CTAs");
  static_assert(!kPeelTail || kGrouping == Grouping::reduction, "only reduction has a k-tail");
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;

  using Element = cutlass::bfloat16_t;
  static constexpr GMMA::Major kMajorA = A_MAJOR_ == Major::K ? GMMA::Major::K : GMMA::Major::MN;
  static constexpr GMMA::Major kMajorB = B_MAJOR_ == Major::K ? GMMA::Major::K : GMMA::Major::MN;
  using AtomA = std::conditional_t<A_MAJOR_ == Major::K, GMMA::Layout_K_SW128_Atom<Element>,
                                   GMMA::Layout_MN_SW128_Atom<Element>>;
  using AtomB = std::conditional_t<B_MAJOR_ == Major::K, GMMA::Layout_K_SW128_Atom<Element>,
                                   GMMA::Layout_MN_SW128_Atom<Element>>;
  using SmemLayoutA = decltype(tile_to_shape(
      AtomA{}, make_shape(Int<BLOCK_M>{}, Int<BLOCK_K>{}, Int<kStages>{}),
      AtomOrder<A_MAJOR_>{}));  // (BM, BK, PIPE)
  using SmemLayoutB = decltype(tile_to_shape(
      AtomB{}, make_shape(Int<BLOCK_N>{}, Int<BLOCK_K>{}, Int<kStages>{}),
      AtomOrder<B_MAJOR_>{}));  // (BN, BK, PIPE)
  using MmaAtom = decltype(SM90::GMMA::ss_op_selector<Element, Element, float,
                                                       Shape<_64, Int<BLOCK_N>, Int<BLOCK_K>>,
                                                       kMajorA, kMajorB>());
  using TiledMma = decltype(make_tiled_mma(
      MmaAtom{}, Layout<Shape<Int<kWarpgroupsPerTile>, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTxBytes =
      static_cast<uint32_t>((BLOCK_M * BLOCK_K + kNumB * BLOCK_N * BLOCK_K) * sizeof(Element));
};

// Epilogues declare their shared memory per consumer warpgroup as kSmemBytesPerWarpgroup
// (1024-byte aligned: TMA-store staging uses the 128-byte swizzle).
template <class Traits, int kEpilogueBytesPerWarpgroup>
struct alignas(1024) SharedStorage {
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutA>, 1024> a;
  cute::array_aligned<typename Traits::Element, cosize_v<typename Traits::SmemLayoutB>, 1024>
      b[Traits::kNumB];
  alignas(1024) char epilogue[Traits::kConsumerWarpgroups][kEpilogueBytesPerWarpgroup];
  typename Traits::Pipeline::SharedStorage pipeline;
  int group_offsets[kMaxGroups + 1];  // row offset of each group
  int tile_prefix[kMaxGroups + 1];    // rows grouping: first tile of each group
};

// A saved-state operand in the activation arena (x_gathered, core/slot_plan.h): its descriptor
// spans the whole arena as rows of pitch_bytes, and the operand's row 0 is arena row
// *offset / pitch_bytes (the planner's byte offset, always a whole row; device memory, read once
// per CTA by the producer). offset == nullptr: no shift (the descriptor is the operand itself).
struct RowShift {
  const int64_t* offset = nullptr;
  int64_t pitch_bytes = 1;
  __device__ int rows() const { return offset == nullptr ? 0 : static_cast<int>(*offset / pitch_bytes); }
};

// Device view of the groups: row offsets [groups + 1] on the device, and optional skip flags.
struct GroupArgs {
  const int32_t* offsets = nullptr;
  const int32_t* skip = nullptr;         // non-zero: the step is skipped, every group is empty
  const int32_t* replay_skip = nullptr;  // the same, for backward's replay (LayerPlan::replay_skip)
  RowShift a_shift;               // rows grouping: A's rows (W13 forward reads x_gathered)
  RowShift b_shift;               // reduction grouping: B's rows, the k axis (W13 WGRAD)
  int groups = 0;
  int band_rows = 0;              // rows grouping: m-tile bands of about this many rows (0: none)
  int64_t n = 0;                  // output columns (per B operand)
  int64_t m_out = 0;              // reduction: output rows
  int64_t k = 0;                  // rows: reduction length
  int64_t b_second_offset = 0;    // NumB == 2: first N row of the second B operand (F)
  ArrivalGate arrival;            // NumB == 2 (W13): wait for dispatched rows (arrival_gate.cuh)
};

// The tile a CTA works on.
struct TileCoord {
  int group;
  int m_tile;
  int n_tile;
  int row0;        // rows: first row of the tile; reduction: first row of the group
  int rows_valid;  // rows: rows of the group inside the tile; reduction: rows of the group
  int k_tiles;
};

// Tiles are numbered per cluster: with kClusterM == 2, tile i of the schedule is a pair of m-tiles
// (2 m + rank) of one (group, n-tile), and `rank` (the CTA's rank in its cluster) picks one.
// Rows grouping: a group's m-tiles run m fastest, so the m-tiles that share a weight slice run side
// by side and read it once from HBM. A group of more than `band` m-tiles (skewed routing: one
// expert with most rows) runs as ceil(m-tiles / band) bands of (nearly) equal width, each band
// over every n-tile, so that a band's rows stay in L2 while the weights stream past them; without
// bands a wave spans few n-tiles of every m-tile and re-reads the group's rows from HBM each wave.
template <class Traits>
struct TileScheduler {
  static constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  static constexpr int CM = Traits::kClusterM;
  const int* offsets;  // shared memory
  const int* prefix;   // shared memory
  int groups, n_tiles, m_tiles_out, total;
  int k_tiles_rows;
  int band;            // rows grouping: m-tiles (of clusters) per band; 0: the whole group
  int rank;            // this CTA's rank in its cluster

  __device__ TileCoord at(int tile) const {
    TileCoord t;
    if constexpr (Traits::kGrouping == Grouping::rows) {
      int lo = 0, hi = groups;  // largest g with prefix[g] <= tile
      while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (prefix[mid] <= tile) lo = mid; else hi = mid;
      }
      // Skip empty groups that share the same prefix.
      while (lo + 1 < groups && prefix[lo + 1] <= tile) ++lo;
      // m fastest within a band (expert groups are often just over a tile: a second, sparse
      // m-tile, which shares its band).
      const int local = tile - prefix[lo];
      const int m_tiles = ((offsets[lo + 1] - offsets[lo] + BM - 1) / BM + CM - 1) / CM;
      const int bands = band > 0 ? (m_tiles + band - 1) / band : 1;
      const int bm = (m_tiles + bands - 1) / bands;  // bands of equal width, the last <= 1 short
      const int per_band = bm * n_tiles;
      const int b = local / per_band;
      const int in_band = local - b * per_band;
      const int width = min(bm, m_tiles - b * bm);
      t.group = lo;
      t.m_tile = (b * bm + in_band % width) * CM + rank;
      t.n_tile = in_band / width;
      t.row0 = offsets[lo] + t.m_tile * BM;
      t.rows_valid = min(BM, offsets[lo + 1] - t.row0);  // <= 0: a pair's tile past the group
      t.k_tiles = k_tiles_rows;
    } else {
      const int m_tiles = (m_tiles_out + CM - 1) / CM;
      const int per_group = m_tiles * n_tiles;
      t.group = tile / per_group;
      const int local = tile % per_group;
      t.m_tile = (local / n_tiles) * CM + rank;  // >= m_tiles_out: outside, stores clipped
      t.n_tile = local % n_tiles;
      t.row0 = offsets[t.group];
      t.rows_valid = offsets[t.group + 1] - t.row0;
      t.k_tiles = (t.rows_valid + BK - 1) / BK;
    }
    return t;
  }
};

// Loads the group offsets (zero-sized groups when skipped) and the per-group tile prefix.
template <class Traits, class Smem>
__device__ TileScheduler<Traits> make_scheduler(Smem& smem, const GroupArgs& g) {
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  const bool skip = (g.skip != nullptr && *g.skip != 0) ||
                    (g.replay_skip != nullptr && *g.replay_skip != 0);
  for (int i = threadIdx.x; i <= g.groups; i += blockDim.x) {
    smem.group_offsets[i] = skip ? 0 : g.offsets[i];
  }
  __syncthreads();
  const int n_tiles = static_cast<int>((g.n + BN - 1) / BN);
  if constexpr (Traits::kGrouping == Grouping::rows) {
    if (threadIdx.x < 32) {  // one warp scans the groups in chunks of 32
      const int lane = threadIdx.x;
      int carry = 0;
      for (int base = 0; base < g.groups; base += 32) {
        const int grp = base + lane;
        int tiles = 0;
        if (grp < g.groups) {
          const int rows = smem.group_offsets[grp + 1] - smem.group_offsets[grp];
          tiles = ((rows + BM - 1) / BM + Traits::kClusterM - 1) / Traits::kClusterM * n_tiles;
        }
        int incl = tiles;
        for (int d = 1; d < 32; d *= 2) {
          int v = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += v;
        }
        if (grp < g.groups) smem.tile_prefix[grp] = carry + incl - tiles;
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) smem.tile_prefix[g.groups] = carry;
    }
    __syncthreads();
  }
  TileScheduler<Traits> s;
  s.offsets = smem.group_offsets;
  s.prefix = smem.tile_prefix;
  s.groups = g.groups;
  s.n_tiles = n_tiles;
  s.m_tiles_out = static_cast<int>((g.m_out + BM - 1) / BM);
  s.k_tiles_rows = static_cast<int>((g.k + BK - 1) / BK);
  s.band = g.band_rows <= 0 ? 0 : max(1, g.band_rows / (BM * Traits::kClusterM));
  s.rank = Traits::kClusterM == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
  constexpr int CM = Traits::kClusterM;
  s.total = Traits::kGrouping == Grouping::rows
                ? smem.tile_prefix[g.groups]
                : g.groups * ((s.m_tiles_out + CM - 1) / CM) * n_tiles;
  return s;
}

// Named barriers by hardware id (1-15; 0 is __syncthreads), one per kind and consumer warpgroup:
// two, three for the epilogue's (the FP8 kernels' 192-row tiles). Raw ids through barrier_sync /
// barrier_arrive: cutlass::arch::NamedBarrier adds 8 to a user id, which leaves 8 user barriers
// and put fp8_wgrad_scales of warpgroup 1 at id 16, past the last.
enum class GemmBarrier : uint32_t {
  k_tail_wg0 = 1,
  epilogue_wg0 = 3,
  mainloop_turn_wg0 = 6,
  fp8_wgrad_scales_wg0 = 8,  // the FP8 WGRAD's staged column scales
  wgrad_staged_wg0 = 10,     // the WGRAD store warp's barriers (WgradTmaEpilogue::kStoreWarp)
  wgrad_free_wg0 = 12,
};

// Waits at barrier `b` of warpgroup `w` until `threads` threads have arrived.
__device__ __forceinline__ void barrier_sync(GemmBarrier b, int w, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" : : "r"(static_cast<uint32_t>(b) + static_cast<uint32_t>(w)), "r"(threads)
               : "memory");
}
// Arrives at it without waiting.
__device__ __forceinline__ void barrier_arrive(GemmBarrier b, int w, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" : : "r"(static_cast<uint32_t>(b) + static_cast<uint32_t>(w)), "r"(threads)
               : "memory");
}

// Epilogues whose stores a warp of the producer warpgroup issues (Epilogue::store_warp).
template <class Epilogue>
constexpr bool epilogue_has_store_warp = false;
template <class Epilogue>
  requires requires { Epilogue::kStoreWarp; }
constexpr bool epilogue_has_store_warp<Epilogue> = Epilogue::kStoreWarp;

template <class Traits, class Epilogue, class TmaA, class TmaB>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    grouped_gemm_kernel(CUTE_GRID_CONSTANT const TmaA tma_a, CUTE_GRID_CONSTANT const TmaB tma_b,
                        const GroupArgs group_args,
                        CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params,
                        int64_t a_rows, int64_t a_cols, int64_t b_rows, int64_t b_cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = Traits::BLOCK_M, BN = Traits::BLOCK_N, BK = Traits::BLOCK_K;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTxBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer
                                    : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = warpgroup == 0 && warp_in_group == 0 && lane_predicate;
  pipe_params.num_consumers = 128 * Traits::kWarpgroupsPerTile;  // who releases a stage
  Pipeline pipeline(smem.pipeline, pipe_params, typename Traits::ClusterShape{});
  if constexpr (Traits::kClusterM > 1) {  // the peer's barriers are initialised before any multicast
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
  constexpr int kCluster = Traits::kClusterM;
  const int first_tile = static_cast<int>(blockIdx.x) / kCluster;  // tiles are per cluster
  const int tile_stride = static_cast<int>(gridDim.x) / kCluster;

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }
  const TileScheduler<Traits> sched = make_scheduler<Traits>(smem, group_args);  // syncs the CTA

  // Coordinate tensors of the whole operands (TMA coordinates, absolute).
  Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));  // rows: (M, K); reduction: (M_out, rows)
  Tensor mB = [&] {
    if constexpr (Traits::kGrouping == Grouping::rows) {
      return tma_b.get_tma_tensor(make_shape(b_rows, b_cols, group_args.groups));  // (N, K, G)
    } else {
      return tma_b.get_tma_tensor(make_shape(b_rows, b_cols));  // (N_out, rows)
    }
  }();
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});

  if (warpgroup == 0) {
    // ---------------- producer: one thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0 && lane_predicate) {
      TileTimeline timeline;
      timeline.on = blockIdx.x == 0;
      int sequence = 0;
      PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
      [[maybe_unused]] bool arrival_gave_up = false;
      const int a_shift = group_args.a_shift.rows();  // saved-state operands: arena rows
      [[maybe_unused]] const int b_shift = group_args.b_shift.rows();
      for (int tile = first_tile; tile < sched.total; tile += tile_stride, ++sequence) {
        const TileCoord t = sched.at(tile);
        if (t.k_tiles == 0) continue;
        if constexpr (Traits::kNumB == 2 && Traits::kGrouping == Grouping::rows) {  // W13 only
          wait_for_rows(group_args.arrival, t.row0, t.rows_valid, sched.offsets[sched.groups],
                        arrival_gave_up);
        }
        // (BM, BK, k) views of A and (BN, BK, k) views of each B operand for this tile.
        Tensor gA = [&] {
          if constexpr (Traits::kGrouping == Grouping::rows) {
            return local_tile(domain_offset(make_coord(t.row0 + a_shift, 0), mA),
                              Shape<Int<BM>, Int<BK>>{}, make_coord(0, _));
          } else {  // A is (M_out, rows): output rows along mode 0, group rows along K
            return local_tile(domain_offset(make_coord(t.m_tile * BM, t.row0 + a_shift), mA),
                              Shape<Int<BM>, Int<BK>>{}, make_coord(0, _));
          }
        }();
        auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                          group_modes<0, 2>(gA));
        for (int kt = 0; kt < t.k_tiles; ++kt) {
          pipeline.producer_acquire(write_state);
          if (kt == 0) timeline.stamp(sequence, Stamp::acquire_first);
          if (kt == t.k_tiles - 1) timeline.stamp(sequence, Stamp::acquire_last);
          auto* barrier = pipeline.producer_get_barrier(write_state);
          const int stage = write_state.index();
          copy(tma_a.with(*barrier), tAgA(_, kt), tAsA(_, stage));
          CUTE_UNROLL
          for (int b = 0; b < Traits::kNumB; ++b) {
            Tensor sB = make_tensor(make_smem_ptr(smem.b[b].data()), typename Traits::SmemLayoutB{});
            Tensor gB = [&] {
              if constexpr (Traits::kGrouping == Grouping::rows) {
                const int64_t n0 = (b == 0 ? 0 : group_args.b_second_offset) +
                                   static_cast<int64_t>(t.n_tile) * BN;
                return local_tile(domain_offset(make_coord(n0, 0, t.group), mB)(_, _, 0),
                                  Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));
              } else {  // B is (N_out, rows)
                return local_tile(domain_offset(make_coord(t.n_tile * BN, t.row0 + b_shift), mB),
                                  Shape<Int<BN>, Int<BK>>{}, make_coord(0, _));
              }
            }();
            if constexpr (kCluster == 1) {
              auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{},
                                                group_modes<0, 2>(sB), group_modes<0, 2>(gB));
              copy(tma_b.with(*barrier), tBgB(_, kt), tBsB(_, stage));
            } else {  // this CTA's half of the B tile, written into both CTAs' stage
              auto [tBgB, tBsB] = tma_partition(tma_b, sched.rank, Layout<Int<kCluster>>{},
                                                group_modes<0, 2>(sB), group_modes<0, 2>(gB));
              constexpr uint16_t kAllCtas = (1u << kCluster) - 1;
              copy(tma_b.with(*barrier, kAllCtas), tBgB(_, kt), tBsB(_, stage));
            }
          }
          ++write_state;
        }
      }
      // A CTA of a pair stays until the peer's consumers have released every stage this CTA's
      // barriers track (their arrivals target this CTA's shared memory).
      if constexpr (kCluster > 1) pipeline.producer_tail(write_state);
    }
    if constexpr (epilogue_has_store_warp<Epilogue>) {  // warp 1 issues the epilogue's stores
      if (warp_in_group == 1) Epilogue::store_warp(epi_params, smem.epilogue, sched, first_tile, tile_stride);
    }
  } else {
    // ---------------- consumers: wgmma on the tile, then the epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<232>();
    constexpr int kTileThreads = 128 * Traits::kWarpgroupsPerTile;  // threads working on one tile
    const int consumer_tid = threadIdx.x - 128;
    const int wg = warpgroup - 1;
    const int tile_tid = consumer_tid % kTileThreads;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tile_tid);
    Tensor tCsA = thr_mma.partition_A(sA);                    // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrA = thr_mma.make_fragment_A(tCsA);
    Tensor sB0 = make_tensor(make_smem_ptr(smem.b[0].data()), typename Traits::SmemLayoutB{});
    Tensor tCrB0 = thr_mma.make_fragment_B(thr_mma.partition_B(sB0));  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sB1 = make_tensor(make_smem_ptr(smem.b[Traits::kNumB - 1].data()),
                             typename Traits::SmemLayoutB{});
    Tensor tCrB1 = thr_mma.make_fragment_B(thr_mma.partition_B(sB1));
    Tensor acc0 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});  // (MMA, MMA_M, MMA_N)
    Tensor acc1 = partition_fragment_C(tiled_mma, Shape<Int<Traits::kNumB == 2 ? BM : 64>,
                                                        Int<Traits::kNumB == 2 ? BN : 8>>{});

    // The warpgroup's rows within a tile: 64 * row_block (always 0 in ping-pong).
    const int row_block = Traits::kPingPong ? 0 : wg;
    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, row_block, consumer_tid % 128);
    PipelineState read_state;
    TileTimeline timeline;
    timeline.on = blockIdx.x == 0 && consumer_tid == 0;
    int sequence = 0;  // this CTA's tiles in order; ping-pong: warpgroup (sequence % 2) owns one
    for (int tile = first_tile; tile < sched.total; tile += tile_stride, ++sequence) {
      const TileCoord t = sched.at(tile);
      timeline.stamp(sequence, Stamp::tile_start);
      timeline.tile(sequence, t.k_tiles, t.rows_valid);
      if constexpr (Traits::kPingPong) {
        if ((sequence & 1) != wg) {  // the other warpgroup's tile: skip its stages
          read_state.advance(static_cast<uint32_t>(t.k_tiles));
          continue;
        }
        // Mainloops take turns: a stage's barrier phase is only known by parity, so this
        // warpgroup may wait on its stages only once the other has consumed the earlier tile's.
        if (sequence > 0) {
          barrier_sync(GemmBarrier::mainloop_turn_wg0, wg, 256);
        }
      }
      // A group with no rows (WGRAD only) skips the MMA; its epilogue writes zeros without
      // reading the accumulators, which keeps them out of any branch merge (a merge makes ptxas
      // copy and spill them inside the mainloop).
      if (t.k_tiles > 0) {
        PipelineState release_state = read_state;
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        // Reduction grouping: a k-block that crosses the group end has its rows [valid, end) past
        // the end zeroed in shared memory. Those rows belong to the next expert (or are stale):
        // zero them in both operands so they add nothing, whatever they hold (NaN included).
        // Operands are MN-major, so a k-row is whole 128-byte swizzle rows (64 elements each),
        // which the swizzle only permutes internally: zero each row from the address of its first
        // element rounded down to 128 bytes.
        [[maybe_unused]] auto zero_k_tail = [&](int stage, int valid, int end) {
          static_assert(Traits::kGrouping != Grouping::reduction ||
                            (Traits::kMajorA == GMMA::Major::MN &&
                             Traits::kMajorB == GMMA::Major::MN),
                        "k-tail zeroing assumes MN-major operands");
          constexpr int kRowsPerK = (BM + BN) / 64;
          const int tail_rows = (end - valid) * kRowsPerK;
          for (int i = tile_tid; i < tail_rows * 8; i += kTileThreads) {
            const int row = i / 8, chunk = i % 8;
            const int k = valid + row / kRowsPerK, r = row % kRowsPerK;
            const auto* first =
                r < BM / 64 ? &sA(64 * r, k, stage) : &sB0(64 * (r - BM / 64), k, stage);
            const uintptr_t base =
                reinterpret_cast<uintptr_t>(raw_pointer_cast(first)) & ~uintptr_t(127);
            reinterpret_cast<uint4*>(base)[chunk] = make_uint4(0, 0, 0, 0);
          }
          cutlass::arch::fence_view_async_shared();
          barrier_sync(GemmBarrier::k_tail_wg0, Traits::kPingPong ? wg : 0, kTileThreads);
        };
        // With kPeelTail the loop runs the full k-blocks only (no zeroing in it, so one batch can
        // stay in flight) and the partial one follows it.
        constexpr bool kRetireEach = Traits::kGrouping == Grouping::reduction && !Traits::kPeelTail;
        const int loop_tiles =
            Traits::kPeelTail && t.rows_valid % BK != 0 ? t.k_tiles - 1 : t.k_tiles;
        for (int kt = 0; kt < loop_tiles; ++kt) {
          pipeline.consumer_wait(read_state);
          if (kt == 0) timeline.stamp(sequence, Stamp::operands_ready);
          const int stage = read_state.index();
          if constexpr (kRetireEach) {
            const int valid = t.rows_valid - kt * BK;  // group rows in this k-block
            if (valid < BK) zero_k_tail(stage, valid, BK);
          }
          warpgroup_fence_operand(acc0);
          if constexpr (Traits::kNumB == 2) warpgroup_fence_operand(acc1);
          warpgroup_arrive();
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tCrA); ++kb) {
            cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB0(_, _, kb, stage), acc0);
            if constexpr (Traits::kNumB == 2) {
              cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB1(_, _, kb, stage), acc1);
            }
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          // Rows grouping keeps one batch in flight (the previous k-block's stage is free once it
          // retires). WGRAD without kPeelTail retires each batch: with its k-tail zeroing in the
          // loop, a batch left in flight makes ptxas serialize every wgmma of the kernel (C7514).
          if constexpr (kRetireEach) {
            warpgroup_wait<0>();
          } else {
            warpgroup_wait<1>();
          }
          warpgroup_fence_operand(acc0);
          if constexpr (Traits::kNumB == 2) warpgroup_fence_operand(acc1);
          if (kt > 0) {
            pipeline.consumer_release(release_state);
            ++release_state;
          }
          ++read_state;
        }
        timeline.stamp(sequence, Stamp::loop_done);
        if constexpr (Traits::kPeelTail) {
          // The partial k-block runs only the MMA k-steps (16 rows each) that hold group rows,
          // and zeroes only the rows past the group inside the last of them. The previous
          // k-block's batch stays in flight meanwhile: it reads another stage.
          if (loop_tiles < t.k_tiles) {
            constexpr int kStepRows = BK / size<2>(tCrA);  // rows of one wgmma k-step
            const int valid = t.rows_valid - loop_tiles * BK;
            const int steps = (valid + kStepRows - 1) / kStepRows;
            pipeline.consumer_wait(read_state);
            timeline.stamp(sequence, Stamp::tail_ready);
            const int stage = read_state.index();
            if (valid % kStepRows != 0) zero_k_tail(stage, valid, steps * kStepRows);
            warpgroup_fence_operand(acc0);
            warpgroup_arrive();
            CUTE_UNROLL
            for (int kb = 0; kb < size<2>(tCrA); ++kb) {
              if (kb < steps) {
                cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB0(_, _, kb, stage), acc0);
                tiled_mma.accumulate_ = GMMA::ScaleOut::One;
              }
            }
            warpgroup_commit_batch();
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc0);
            if (loop_tiles > 0) {
              pipeline.consumer_release(release_state);
              ++release_state;
            }
            ++read_state;
          }
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc0);
        if constexpr (Traits::kNumB == 2) warpgroup_fence_operand(acc1);
        pipeline.consumer_release(release_state);
        timeline.stamp(sequence, Stamp::mma_done);
      }
      if constexpr (Traits::kPingPong) {  // the next tile's mainloop may start
        if (tile + tile_stride < sched.total) {
          barrier_arrive(GemmBarrier::mainloop_turn_wg0, 1 - wg, 256);
        }
      }
      epilogue.store(t, acc0, acc1);
      timeline.stamp(sequence, Stamp::epilogue_done);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
