// MXFP8 grouped GEMM on wgmma for sm_90a (rows grouping; prefill-shaped: a weight tile is read
// once per 128 rows):
//
//   C[m, n] = sum over MX blocks b, ascending, of  block(m, n, b) * 2^(sa[m, b] + sw[n, b] - 254)
//   block(m, n, b) = sum_{k in b} e4m3(a[m, k]) * e4m3(w_e[n, k])            (32 products)
//
// Both operands E4M3 (K-major), E8M0 scales per 32 K: activations [M, S], weights [E, N, S].
// Every 32-K slice is one wgmma m64n128k32 per consumer warpgroup into a block accumulator
// (zeroed by that wgmma); the consumer promotes it into the fp32 total with the slice's
// per-row and per-column scales. CPU twin: cpu::row_times_nt (src/cpu/stages_mxfp8.cpp), which
// rounds a block's exact sum once to fp32; the tensor cores sum the 32 products their own way, so
// a block may differ from the CPU's by fp32 ulps of its magnitude (compared within a tolerance).
//
// Structure: the FP8 block-scaled kernel's (grouped_gemm_fp8_sm90.cuh): persistent grid, tile
// scheduler and epilogues of grouped_gemm_sm90.cuh / epilogues.cuh, one producer warpgroup, two
// cooperative consumer warpgroups on a 128 x 128 tile, stages of 128 K (four slices), and its
// two-accumulator loop (fp8_overlapped_k_blocks) run per slice: slice s + 1's wgmma is issued
// before slice s is waited for and promoted.
//
// Scales: E8M0 rows are S bytes, which TMA cannot load (its strides are multiples of 16 bytes),
// so warps 1..3 of the producer warpgroup load them with plain loads, a stage each in turn, into
// the stage's Mxfp8StageScales (as exponent terms: row sa << 23, column (sw - 127) << 23, so
// their integer sum is the bit pattern of 2^(sa + sw - 254)), and arrive on the stage's own
// barrier (scales_full, 32 arrivals); consumers wait on it beside the TMA barrier and release the
// stage after its last slice is promoted. Slices past S, rows past M and columns past N get the
// neutral code 127 (their block sums are 0: TMA fills those codes with zeros), and so do rows past
// the tile's group, whose outputs the epilogue masks (so stale rows cannot force the exact path).
//
// Promotion per accumulator element and slice: 1 IADD (row term + column term = the factor's
// bits) + 1 FFMA (total = fma(block, factor, total)), plus per thread and slice 8 LDS.128 of
// column terms (32 columns), 2 LDS of row terms and 1 of the stage's flag: 2.2 instructions per
// element. The fma is exact to the CPU's fp32(total + ldexp(block, e)) when block * 2^e is a
// normal float: |block| is 0 or in [2^-18, 2^23), so e in [-108, 104] suffices, which the loader
// checks for the whole stage (every pair's sa + sw in [146, 358], no NaN code 0xFF) and records
// as the stage's flag. A stage outside it (NaN scales, extreme exponents) takes the exact path:
// total = fp32(total + mx_block_scaled(block, sa, sw)), the CPU's operations.
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>

#include "core/formats/mxfp8.h"
#include "cuda/gemm/fp8_mainloop.cuh"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

using namespace cute;

struct Mxfp8WgmmaTraits {
  static constexpr int BLOCK_M = 128;  // two consumer warpgroups of 64 rows
  static constexpr int BLOCK_N = 128;  // two 64-row TMA boxes of weight rows
  static constexpr int BLOCK_K = 128;  // a stage: 128 bytes of e4m3, four MX slices
  static constexpr int kSlices = BLOCK_K / kMxBlock;
  static constexpr int kStages = 5;
  static constexpr Grouping kGrouping = Grouping::rows;  // the scheduler's grouping
  static constexpr int kNumB = 1;
  static constexpr bool kPingPong = false;
  static constexpr int kClusterM = 1;
  static constexpr int kWarpgroupsPerTile = BLOCK_M / 64;
  static constexpr int kConsumerWarpgroups = BLOCK_M / 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kScaleLoaders = 3;  // warps 1..3 of the producer warpgroup
  static constexpr int kHalfRows = BLOCK_N / 2;

  using Element = cutlass::float_e4m3_t;
  using AtomK = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 128 bytes
  using SmemLayoutA = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_M>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BM, BK, PIPE)
  using SmemLayoutB = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<BLOCK_N>{}, Int<BLOCK_K>{}, Int<kStages>{})));  // (BN, BK, PIPE)
  // The same bytes as (BN / 2, BK, 2 PIPE): half h of stage p is index 2 p + h (atoms stack along
  // rows, then stages), the TMA boxes' destinations.
  using SmemLayoutBHalves = decltype(tile_to_shape(
      AtomK{}, make_shape(Int<kHalfRows>{}, Int<BLOCK_K>{}, Int<2 * kStages>{})));
  using MmaAtom = decltype(SM90::GMMA::ss_op_selector<Element, Element, float,
                                                      Shape<_64, Int<BLOCK_N>, Int<kMxBlock>>,
                                                      GMMA::Major::K, GMMA::Major::K>());
  using TiledMma =
      decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<Int<kWarpgroupsPerTile>, _1, _1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  static constexpr uint32_t kTxBytes = static_cast<uint32_t>(BLOCK_M * BLOCK_K + BLOCK_N * BLOCK_K);
  static_assert(cosize_v<SmemLayoutBHalves> == cosize_v<SmemLayoutB>, "halves tile B's stages");
};

// Row r of B's stage p is row r % 64 of half 2 p + r / 64 (the TMA boxes' view), swizzle included.
static_assert(Mxfp8WgmmaTraits::SmemLayoutB{}(70, 37, 2) ==
                      Mxfp8WgmmaTraits::SmemLayoutBHalves{}(6, 37, 5) &&
                  Mxfp8WgmmaTraits::SmemLayoutB{}(63, 127, 4) ==
                      Mxfp8WgmmaTraits::SmemLayoutBHalves{}(63, 127, 8) &&
                  Mxfp8WgmmaTraits::SmemLayoutB{}(64, 0, 1) ==
                      Mxfp8WgmmaTraits::SmemLayoutBHalves{}(0, 0, 3),
              "the B halves must alias B's stages");

// One stage's scales as exponent terms. col[slice][quad][2 g + j] is tile column 8 g + 2 quad + j
// (the wgmma fragment's columns of lane quad `quad`: a thread reads its 32 as 8 16-byte loads);
// the pitch of 36 puts the four quads on different banks.
struct alignas(16) Mxfp8StageScales {
  static constexpr int kColPitch = 36;
  int32_t row[Mxfp8WgmmaTraits::kSlices][Mxfp8WgmmaTraits::BLOCK_M];  // sa << 23
  int32_t col[Mxfp8WgmmaTraits::kSlices][4][kColPitch];               // (sw - 127) << 23
  int32_t fast;  // 1: every exponent sum of the stage in the fma band (header comment)
};

template <int kEpilogueBytesPerWarpgroup>
struct alignas(1024) Mxfp8SharedStorage {
  using Traits = Mxfp8WgmmaTraits;
  cute::array_aligned<Traits::Element, cosize_v<Traits::SmemLayoutA>, 1024> a;
  cute::array_aligned<Traits::Element, cosize_v<Traits::SmemLayoutB>, 1024> b;
  alignas(1024) char epilogue[Traits::kConsumerWarpgroups][kEpilogueBytesPerWarpgroup];
  Mxfp8StageScales scales[Traits::kStages];
  uint64_t scales_full[Traits::kStages];  // mbarriers: the loader warp's 32 lanes arrive
  typename Traits::Pipeline::SharedStorage pipeline;
  int group_offsets[kMaxGroups + 1];  // make_scheduler's names
  int tile_prefix[kMaxGroups + 1];
};

// Where the scales are and how the tile's 128 weight rows map to B's rows: half h (tile columns
// [64 h, 64 h + 64)) starts at row n_tile * step + (h ? origin1 : 0) and its rows are valid below
// (h ? N : limit0). Plain: step 128, origin1 64, limit0 N. SwiGLU (W13, gate rows [0, F) then up
// rows [F, 2F)): step 64, origin1 F, limit0 F, so tile column c < 64 is gate f0 + c and c + 64 is
// its up row: the same fragment element index + 32, in the same thread.
struct Mxfp8ScaleArgs {
  const uint8_t* a_scales_MS;   // [M, S]
  const uint8_t* b_scales_ENS;  // [E, N, S]
  int64_t M, N, S;
  int64_t step, origin1, limit0;
  int words;  // 1: S % 4 == 0 and both pointers 4-byte aligned (a stage's 4 codes are one word)
};

// Codes of slices [4 kt, 4 kt + 4) of one scale row (slices past S: 127), little-endian bytes.
__device__ __forceinline__ uint32_t mx_stage_codes(const uint8_t* row_S, int kt, int64_t S,
                                                   int words) {
  if (words) return __ldg(reinterpret_cast<const uint32_t*>(row_S) + kt);
  uint32_t v = 0;
  CUTE_UNROLL
  for (int b = 0; b < 4; ++b) {
    const int64_t slice = 4 * static_cast<int64_t>(kt) + b;
    const uint32_t code = slice < S ? __ldg(row_S + slice) : 127u;
    v |= code << (8 * b);
  }
  return v;
}

// The loader lane's part of one stage: rows and tile columns lane + 32 i, i = 0..3 (each part's
// four loads in flight before its stores).
__device__ __forceinline__ void mx_load_stage_scales(const Mxfp8ScaleArgs& sc, const TileCoord& t,
                                                     int kt, int lane, Mxfp8StageScales& out) {
  constexpr uint32_t kNeutral = 0x7f7f7f7fu;
  uint32_t codes[4];
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int r = lane + 32 * i;  // rows past the tile's group (masked outputs) are neutral too
    const int64_t row = static_cast<int64_t>(t.row0) + r;
    const bool valid = r < t.rows_valid && row < sc.M;
    codes[i] = valid ? mx_stage_codes(sc.a_scales_MS + row * sc.S, kt, sc.S, sc.words) : kNeutral;
  }
  uint32_t a_min = 255, a_max = 0;
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    CUTE_UNROLL
    for (int b = 0; b < 4; ++b) {
      const uint32_t a = (codes[i] >> (8 * b)) & 0xffu;
      a_min = min(a_min, a);
      a_max = max(a_max, a);
      out.row[b][lane + 32 * i] = static_cast<int32_t>(a << 23);
    }
  }
  const uint8_t* w_group = sc.b_scales_ENS + static_cast<int64_t>(t.group) * sc.N * sc.S;
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int c = lane + 32 * i, half = c / 64;
    const int64_t n = static_cast<int64_t>(t.n_tile) * sc.step + (half ? sc.origin1 : 0) + c % 64;
    const bool valid = n < (half ? sc.N : sc.limit0);
    codes[i] = valid ? mx_stage_codes(w_group + n * sc.S, kt, sc.S, sc.words) : kNeutral;
  }
  uint32_t w_min = 255, w_max = 0;
  CUTE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int c = lane + 32 * i, quad = (c % 8) / 2, pos = 2 * (c / 8) + c % 2;
    CUTE_UNROLL
    for (int b = 0; b < 4; ++b) {
      const uint32_t w = (codes[i] >> (8 * b)) & 0xffu;
      w_min = min(w_min, w);
      w_max = max(w_max, w);
      out.col[b][quad][pos] = (static_cast<int32_t>(w) - 127) * (1 << 23);
    }
  }
  a_min = __reduce_min_sync(0xffffffffu, a_min);
  a_max = __reduce_max_sync(0xffffffffu, a_max);
  w_min = __reduce_min_sync(0xffffffffu, w_min);
  w_max = __reduce_max_sync(0xffffffffu, w_max);
  // No NaN code (255 is the largest code: the maxima tell) and every sa + sw - 254 in [-108, 104].
  const bool fast = a_max < 255 && w_max < 255 && a_min + w_min >= 146 && a_max + w_max <= 358;
  if (lane == 0) out.fast = fast ? 1 : 0;
}

// total += block * 2^(sa + sw - 254) for slice b of a stage: value i = j + 2 h + 4 g of the
// fragment is in the thread's row h (row terms ra0, ra1) and tile column 8 g + 2 quad + j.
template <class Total, class Block>
__device__ __forceinline__ void mx_promote(Total& total, const Block& block,
                                           const Mxfp8StageScales& sc, int b, int row0, int quad) {
  const int32_t ra[2] = {sc.row[b][row0], sc.row[b][row0 + 8]};
  const int4* cw = reinterpret_cast<const int4*>(&sc.col[b][quad][0]);
  if (sc.fast) {
    CUTE_UNROLL
    for (int t = 0; t < 8; ++t) {  // columns of g = 2 t, 2 t + 1
      const int4 v = cw[t];
      const int32_t w[4] = {v.x, v.y, v.z, v.w};  // (g 2t, j 0), (2t, 1), (2t + 1, 0), (2t + 1, 1)
      CUTE_UNROLL
      for (int u = 0; u < 4; ++u) {
        const int g = 2 * t + u / 2, j = u % 2;
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int i = j + 2 * h + 4 * g;
          total(i) = __fmaf_rn(block(i), __int_as_float(ra[h] + w[u]), total(i));
        }
      }
    }
  } else {
    CUTE_UNROLL
    for (int t = 0; t < 8; ++t) {
      const int4 v = cw[t];
      const int32_t w[4] = {v.x, v.y, v.z, v.w};
      CUTE_UNROLL
      for (int u = 0; u < 4; ++u) {
        const int g = 2 * t + u / 2, j = u % 2;
        const uint8_t sw = static_cast<uint8_t>((w[u] >> 23) + 127);
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int i = j + 2 * h + 4 * g;
          const uint8_t sa = static_cast<uint8_t>(static_cast<uint32_t>(ra[h]) >> 23);
          total(i) = __fadd_rn(total(i), mx_block_scaled(block(i), sa, sw));
        }
      }
    }
  }
}

template <class Epilogue, class TmaA, class TmaB>
__global__ void __launch_bounds__(Mxfp8WgmmaTraits::kThreads, 1)
    grouped_gemm_mxfp8_wgmma_kernel(CUTE_GRID_CONSTANT const TmaA tma_a,
                                    CUTE_GRID_CONSTANT const TmaB tma_b, const GroupArgs group_args,
                                    const Mxfp8ScaleArgs scale_args,
                                    CUTE_GRID_CONSTANT const typename Epilogue::Params epi_params,
                                    int64_t a_rows, int64_t a_cols, int64_t b_rows,
                                    int64_t b_cols) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Traits = Mxfp8WgmmaTraits;
  constexpr int BM = Traits::BLOCK_M, BK = Traits::BLOCK_K, kHalf = Traits::kHalfRows;
  constexpr int kSlices = Traits::kSlices;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;

  extern __shared__ __align__(1024) char smem_raw[];
  using Smem = Mxfp8SharedStorage<Epilogue::kSmemBytesPerWarpgroup>;
  auto& smem = *reinterpret_cast<Smem*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % 4;
  const int lane_predicate = cute::elect_one_sync();

  Pipeline pipeline(
      smem.pipeline,
      fp8_pipeline_params<Pipeline>(warpgroup, warp_in_group, lane_predicate, Traits::kTxBytes,
                                    128 * Traits::kWarpgroupsPerTile),
      Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    for (int s = 0; s < Traits::kStages; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.scales_full[s], 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  fp8_prefetch_descriptors(tma_a, tma_b);
  const TileScheduler<Traits> sched = make_scheduler<Traits>(smem, group_args);  // syncs the CTA

  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Traits::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutB{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0) {
      // ---------------- producer: one thread issues every TMA load ----------------
      if (lane_predicate) {
        Tensor sBh =
            make_tensor(make_smem_ptr(smem.b.data()), typename Traits::SmemLayoutBHalves{});
        Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));  // (M, K)
        Tensor mB =
            tma_b.get_tma_tensor(make_shape(b_rows, b_cols, group_args.groups));  // (N, K, G)
        PipelineState write_state = cutlass::make_producer_start_state<Pipeline>();
        for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
          const TileCoord t = sched.at(tile);
          Tensor gA = local_tile(domain_offset(make_coord(t.row0, 0), mA),
                                 Shape<Int<BM>, Int<BK>>{}, make_coord(0, _));  // (BM, BK, k)
          auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                            group_modes<0, 2>(gA));
          const int64_t n0 = static_cast<int64_t>(t.n_tile) * scale_args.step;
          // A plain tile's second half may lie wholly past N (N - n0 <= 64): it loads the first
          // half's rows again instead of a box with no row inside the tensor (its columns are
          // masked, their scales neutral). SwiGLU's up half always starts inside (f0 < F).
          const int64_t n1 = n0 + scale_args.origin1 < b_rows ? n0 + scale_args.origin1 : n0;
          Tensor gB0 = local_tile(domain_offset(make_coord(n0, 0, t.group), mB)(_, _, 0),
                                  Shape<Int<kHalf>, Int<BK>>{}, make_coord(0, _));  // (BN/2, BK, k)
          Tensor gB1 = local_tile(domain_offset(make_coord(n1, 0, t.group), mB)(_, _, 0),
                                  Shape<Int<kHalf>, Int<BK>>{}, make_coord(0, _));
          auto [tBgB0, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBh),
                                             group_modes<0, 2>(gB0));
          auto [tBgB1, tBsB1] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBh),
                                              group_modes<0, 2>(gB1));
          (void)tBsB1;
          for (int kt = 0; kt < t.k_tiles; ++kt) {
            pipeline.producer_acquire(write_state);
            auto* barrier = pipeline.producer_get_barrier(write_state);
            const int stage = write_state.index();
            copy(tma_a.with(*barrier), tAgA(_, kt), tAsA(_, stage));
            copy(tma_b.with(*barrier), tBgB0(_, kt), tBsB(_, 2 * stage));
            copy(tma_b.with(*barrier), tBgB1(_, kt), tBsB(_, 2 * stage + 1));
            ++write_state;
          }
        }
      }
    } else {
      // ---------------- scale loaders: warp w loads the stages s with s % 3 == w - 1 -------------
      const int loader = warp_in_group - 1, lane = static_cast<int>(threadIdx.x % 32);
      PipelineState state = cutlass::make_producer_start_state<Pipeline>();  // waits on empty only
      int sequence = 0;
      for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
        const TileCoord t = sched.at(tile);
        for (int kt = 0; kt < t.k_tiles; ++kt, ++sequence, ++state) {
          if (sequence % Traits::kScaleLoaders != loader) continue;
          pipeline.producer_acquire(state);  // not the leader: waits for the stage to be free
          const int stage = state.index();
          mx_load_stage_scales(scale_args, t, kt, lane, smem.scales[stage]);
          // Release: the stores above are seen by the consumers that wait on the barrier.
          cutlass::arch::ClusterBarrier::arrive(&smem.scales_full[stage]);
        }
      }
    }
  } else {
    // ---------------- consumers: a wgmma per slice, promotion, epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<232>();
    const int consumer_tid = threadIdx.x - 128;
    const int wg = warpgroup - 1;  // = its 64-row block of the tile
    const int tid = consumer_tid % 128;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(consumer_tid);
    Tensor tCrA =
        thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K = slices, PIPE)
    Tensor tCrB =
        thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K = slices, PIPE)
    Tensor block0 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<Traits::BLOCK_N>>{});
    Tensor block1 = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<Traits::BLOCK_N>>{});
    Tensor total = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<Traits::BLOCK_N>>{});
    // This thread's first fragment row in the tile (the second is 8 below) and its lane quad.
    const int row0 = 64 * wg + 16 * (tid / 32) + (tid % 32) / 4;
    const int quad = tid % 4;
    PipelineState read_state;     // the next stage to wait for
    PipelineState release_state;  // the stage of the oldest slice not yet retired
    int issued = 0, retired = 0;  // slices of the current tile
    int issue_stage = 0;
    auto slice_of = [&](int) { return 0; };  // the scales come from shared memory at retire
    auto issue = [&](auto& block) {
      const int b = issued % kSlices;
      if (b == 0) {
        pipeline.consumer_wait(read_state);
        cutlass::arch::ClusterBarrier::wait(&smem.scales_full[read_state.index()],
                                            read_state.phase());
        issue_stage = read_state.index();
        ++read_state;
      }
      ++issued;
      warpgroup_fence_operand(block);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      cute::gemm(tiled_mma, tCrA(_, _, b, issue_stage), tCrB(_, _, b, issue_stage), block);
      warpgroup_commit_batch();
      warpgroup_fence_operand(block);
    };
    auto retire = [&](auto& block, auto younger_in_flight, int) {
      warpgroup_wait<decltype(younger_in_flight)::value ? 1 : 0>();
      warpgroup_fence_operand(block);
      const int b = retired % kSlices;
      ++retired;
      mx_promote(total, block, smem.scales[release_state.index()], b, row0, quad);
      if (b == kSlices - 1) {  // the stage's last slice: operands and scales are read
        pipeline.consumer_release(release_state);
        ++release_state;
      }
    };

    Epilogue epilogue(epi_params, smem.epilogue[wg], wg, wg, tid);
    for (int tile = blockIdx.x; tile < sched.total; tile += gridDim.x) {
      const TileCoord t = sched.at(tile);
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) total(i) = 0.0f;
      issued = retired = 0;
      fp8_overlapped_k_blocks(t.k_tiles * kSlices, block0, block1, slice_of, issue, retire);
      epilogue.store(t, total, total);
    }
    epilogue.finish();
  }
#endif
}

}  // namespace epmoe::cuda::gemm
