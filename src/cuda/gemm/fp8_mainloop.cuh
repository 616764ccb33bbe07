// The pieces the FP8 block-scaled kernels have in common (grouped_gemm_fp8_sm90.cuh, its ping-pong
// tile grouped_gemm_fp8_pingpong_sm90.cuh, grouped_wgrad_fp8_sm90.cuh): operand scales, the
// producer's TMA loops (whole tiles, or A in 64-row boxes), a row-less warpgroup's pass, one
// k-block's wgmmas, the two-accumulator k loop, and the promotion of a block accumulator into the
// fp32 total. Each is force-inlined and takes its sizes at compile time, so a kernel compiles to
// the instructions it would have spelled out itself; the kernels keep their own order of waits,
// releases, scale loads and promotions, which these do not reorder.
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>

#include "core/fp8_terms.h"

namespace epmoe::cuda::gemm {

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

// The scale of (row, k-block kb); a row past the last one reads none (its outputs are masked by
// the epilogue).
__device__ __forceinline__ float fp8_act_scale(const Fp8ActScales& sa, int64_t row, int kb) {
  return row < sa.rows ? __ldg(sa.scales_SM + kb * sa.ld + row) : 0.0f;
}

// Weight scales as the consumers read them: [groups, n_blocks, k_blocks] fp32.
struct Fp8WeightScales {
  const float* scales_EBS;
  int64_t n_blocks;  // ceil(N / 128)
  int64_t k_blocks;  // ceil(K / 128)
};

// The TMA pipeline's roles: warpgroup 0 produces (its elected thread of warp 0 leads), the others
// consume; `consumers` threads release each stage.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params fp8_pipeline_params(int warpgroup, int warp_in_group,
                                                                         int lane_predicate, uint32_t tx_bytes,
                                                                         uint32_t consumers) {
  typename Pipeline::Params p;
  p.transaction_bytes = tx_bytes;
  p.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  p.is_leader = warpgroup == 0 && warp_in_group == 0 && lane_predicate;
  p.num_consumers = consumers;
  return p;
}

template <class TmaA, class TmaB>
__device__ __forceinline__ void fp8_prefetch_descriptors(const TmaA& tma_a, const TmaB& tma_b) {
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }
}

struct NoStageExtras {
  template <class Barrier>
  __device__ __forceinline__ void operator()(Barrier*, int, int) const {}
};

// Producer: k-blocks [0, k_tiles) of the tile's gA (BM, BK, k) and gB (BN, BK, k), one stage each
// (both operands under the stage's transaction barrier), from write_state on. extras(barrier,
// stage, kt) runs first in each stage: more copies under its barrier (they add their bytes to its
// transaction with expect_transaction).
template <class Pipeline, class TmaA, class TmaB, class GA, class GB, class SA, class SB,
          class Extras = NoStageExtras>
__device__ __forceinline__ void fp8_load_k_blocks(Pipeline& pipeline, typename Pipeline::PipelineState& write_state,
                                                  const TmaA& tma_a, const TmaB& tma_b, const GA& gA,
                                                  const GB& gB, SA& sA, SB& sB, int k_tiles,
                                                  const Extras& extras = {}) {
  using namespace cute;
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
  auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.producer_acquire(write_state);
    auto* barrier = pipeline.producer_get_barrier(write_state);
    const int stage = write_state.index();
    extras(barrier, stage, kt);
    copy(tma_a.with(*barrier), tAgA(_, kt), tAsA(_, stage));
    copy(tma_b.with(*barrier), tBgB(_, kt), tBsB(_, stage));
    ++write_state;
  }
}

// Producer with A in 64-row boxes, one per consumer warpgroup: gA (64, BK, boxes, k) and sA
// (64, BK, boxes, PIPE); k-blocks [0, k_tiles) of B and of A's first a_boxes boxes (>= 1). The
// pipeline's transaction counts B and one box; a stage's further boxes add theirs before its
// first copy, so its barrier cannot complete early.
template <uint32_t kBoxBytes, class Pipeline, class TmaA, class TmaB, class GA, class GB, class SA, class SB>
__device__ __forceinline__ void fp8_load_k_blocks_boxed(Pipeline& pipeline,
                                                        typename Pipeline::PipelineState& write_state,
                                                        const TmaA& tma_a, const TmaB& tma_b, const GA& gA,
                                                        const GB& gB, SA& sA, SB& sB, int k_tiles, int a_boxes) {
  using namespace cute;
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
  auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.producer_acquire(write_state);
    if (a_boxes > 1) pipeline.producer_expect_transaction(write_state, static_cast<uint32_t>(a_boxes - 1) * kBoxBytes);
    auto* barrier = pipeline.producer_get_barrier(write_state);
    const int stage = write_state.index();
    for (int box = 0; box < a_boxes; ++box) copy(tma_a.with(*barrier), tAgA(_, box, kt), tAsA(_, box, stage));
    copy(tma_b.with(*barrier), tBgB(_, kt), tBsB(_, stage));
    ++write_state;
  }
}

// A consumer warpgroup with no rows in the tile: each of its k_tiles stages waited for (so that it
// never releases a stage ahead of its fill) and released, no MMA; both read states advance.
template <class Pipeline>
__device__ __forceinline__ void fp8_pass_k_blocks(Pipeline& pipeline, typename Pipeline::PipelineState& read_state,
                                                  typename Pipeline::PipelineState& release_state, int k_tiles) {
  for (int kt = 0; kt < k_tiles; ++kt) {
    pipeline.consumer_wait(read_state);
    pipeline.consumer_release(read_state);
    ++read_state;
    ++release_state;
  }
}

// One k-block's wgmmas into `acc` (the first zeroes it) from stage a_stage of A and b_stage of B,
// as one commit group; the caller waits for it.
template <class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void fp8_mma_k_block(TiledMma& tiled_mma, FragA& tCrA, FragB& tCrB, int a_stage,
                                                int b_stage, Acc& acc) {
  using namespace cute;
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    cute::gemm(tiled_mma, tCrA(_, _, kb, a_stage), tCrB(_, _, kb, b_stage), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Two-accumulator loop, step 1: waits for the next stage and issues its k-block into `acc`.
template <class Pipeline, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void fp8_issue_k_block(Pipeline& pipeline, typename Pipeline::PipelineState& read_state,
                                                  TiledMma& tiled_mma, FragA& tCrA, FragB& tCrB, Acc& acc) {
  pipeline.consumer_wait(read_state);
  const int stage = read_state.index();
  ++read_state;
  fp8_mma_k_block(tiled_mma, tCrA, tCrB, stage, stage, acc);
  cute::warpgroup_fence_operand(acc);
}

// Step 2: the oldest k-block in flight (in `acc`) has completed (kYoungerInFlight: wait<1>, else
// wait<0>); releases its stage (its wgmmas have read it). The caller then promotes `acc`.
template <bool kYoungerInFlight, class Pipeline, class Acc>
__device__ __forceinline__ void fp8_retire_k_block(Pipeline& pipeline,
                                                   typename Pipeline::PipelineState& release_state, Acc& acc) {
  cute::warpgroup_wait<kYoungerInFlight ? 1 : 0>();
  cute::warpgroup_fence_operand(acc);
  pipeline.consumer_release(release_state);
  ++release_state;
}

// The two-accumulator k loop: k-block kt goes into acc0 (even kt) or acc1 (odd), unrolled by two
// so each is a static register array; the wgmmas of kt + 1 are issued before kt is retired and
// promoted, so the tensor cores work during the promotion. scales_of(kt) loads kt's scales just
// before issue(acc) issues it; retire(acc, younger_in_flight, scales) waits (compile-time counts
// in straight-line code, so ptxas can see which accumulator is complete), releases, promotes.
template <class Acc0, class Acc1, class ScalesOf, class Issue, class Retire>
__device__ __forceinline__ void fp8_overlapped_k_blocks(int k_tiles, Acc0& acc0, Acc1& acc1, ScalesOf& scales_of,
                                                        Issue& issue, Retire& retire) {
  if (k_tiles <= 0) return;
  auto e = scales_of(0);
  issue(acc0);
  int kt = 0;
  for (; kt + 2 < k_tiles; kt += 2) {  // acc0 holds k-block kt in flight; kt + 2 exists
    const auto o = scales_of(kt + 1);
    issue(acc1);
    retire(acc0, cute::true_type{}, e);
    e = scales_of(kt + 2);
    issue(acc0);
    retire(acc1, cute::true_type{}, o);
  }
  if (kt + 1 < k_tiles) {  // two k-blocks left: kt in acc0 (in flight), kt + 1
    const auto o = scales_of(kt + 1);
    issue(acc1);
    retire(acc0, cute::true_type{}, e);
    retire(acc1, cute::false_type{}, o);
  } else {  // one left
    retire(acc0, cute::false_type{}, e);
  }
}

// total(offset + i) = fma(block(i), s, total(offset + i)) with s the scale of value i's row: value
// i = j + 2 h + 4 g of a wgmma fragment is in the thread's row h (epilogues.cuh), scaled by s0 or
// s1 (sa * sb of the k-block). One fma per element and k-block: the loops that promote in k order
// agree bitwise.
template <class Total, class Block>
__device__ __forceinline__ void fp8_promote_rows(Total& total, const Block& block, float s0, float s1,
                                                 int offset = 0) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(block); ++i) {
    total(offset + i) = __fmaf_rn(block(i), (i & 2) ? s1 : s0, total(offset + i));
  }
}

// The same with a scale per row and per column: value i = j + 2 h + 4 g is at column
// 8 g + 2 quad + j of the BN-column tile, scaled by sa_h * sb_tile[column].
template <int BN, class Total, class Block>
__device__ __forceinline__ void fp8_promote_rows_cols(Total& total, const Block& block, float sa0, float sa1,
                                                      const float* sb_tile, int quad) {
  CUTE_UNROLL
  for (int g = 0; g < BN / 8; ++g) {
    const float2 sb = *reinterpret_cast<const float2*>(sb_tile + 8 * g + 2 * quad);
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int i = 4 * g + 2 * h;
      const float sa = h == 0 ? sa0 : sa1;
      total(i) = __fmaf_rn(block(i), __fmul_rn(sa, sb.x), total(i));
      total(i + 1) = __fmaf_rn(block(i + 1), __fmul_rn(sa, sb.y), total(i + 1));
    }
  }
}

}  // namespace epmoe::cuda::gemm
