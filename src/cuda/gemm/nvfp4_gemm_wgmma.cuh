// The NVFP4 grouped GEMM's wgmma consumer (EPMOE_NVFP4_WGMMA=1; gemm/grouped_gemm_nvfp4.cu):
// a chunk's activation rows rearranged in shared memory to the lanes' k order, then per code word
// and m64 tile two wgmma.m64n(8 live)k16 with the decoded weights as the register A operand.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>  // n24, n40, n48, n56

#include <cstddef>
#include <cstdint>
#include <utility>

#include "cuda/gemm/bulk_pipeline.cuh"
#include "cuda/gemm/nvfp4_gemm_decode.cuh"

namespace epmoe::cuda::nvfp4 {

// A barrier of the four consumer warps (named barrier 1; the producer warp is not in it).
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory");
}

// The wgmma consumer (kWgmma; the four consumer warps are one warpgroup). Its A is the same
// decoded fragment, a warp's 16 rows of an m64 tile (code_row<_, true>), so step j of lane t still
// takes the lane's elements 32 t + 4 j + {0, 1} as k pair {2t, 2t + 1} and 32 t + 4 j + {2, 3} as
// {2t + 8, 2t + 9}. wgmma reads B from shared memory in k order, so the stage's activation rows
// are first rearranged in place to that order: per 128-element chunk, position
// 16 j + 8 h + 2 t + e holds element 32 t + 4 j + 2 h + e (pairs of elements move together: target
// 16-byte unit U of a row gathers the 4-byte pairs U, U + 16, U + 32, U + 48). The rows keep the
// stage's layout (halves of 64 elements in 128-byte swizzled rows, 8-row groups at 1 KiB), which
// is K-major SW128 for the descriptor: stride 1 KiB between 8-row groups, k16 step j at
// half j / 4 + 32 bytes x (j % 4).
//
// A row's 16 target units are four quads of 4 (U = 4c + j): quad c reads the 16-byte source units
// holding pairs 16 t + 4c .. 16 t + 4c + 3 (t = 0..3; unit 4 (t % 2) + c of half t / 2) and writes
// their transpose. A row's four quads are adjacent lanes of one warp, so reads and writes of a row
// are ordered by __syncwarp; the consumer barrier then publishes every row to the warpgroup.
template <int kGroups, int kLive>
__device__ __forceinline__ void rearrange_activations(uint8_t* act, int thread) {
  constexpr int kHalf = Ring<kGroups, true>::kActBytes / 2;
  constexpr int kThreads = kConsumerWarps * 32;
  constexpr int kQuads = kLive * 8 * 4;  // (row, quad) of the live groups
  constexpr int kRounds = (kQuads + kThreads - 1) / kThreads;  // rounds of distinct rows
#pragma unroll
  for (int i = 0; i < kRounds; ++i) {
    const int idx = thread + i * kThreads;
    const bool active = kQuads % kThreads == 0 || idx < kQuads;
    const int row = idx / 4, c = idx % 4, r = row % 8;
    uint8_t* rows = act + (row / 8) * 1024 + r * 128;
    uint4 v[4];
    if (active) {
#pragma unroll
      for (int t = 0; t < 4; ++t) v[t] = lds128(rows + (t / 2) * kHalf + (((4 * (t % 2) + c) ^ r) << 4));
    }
    __syncwarp();  // a row's sources read before its quads overwrite them
    if (active) {
      const uint4 unit[4] = {make_uint4(v[0].x, v[1].x, v[2].x, v[3].x),
                             make_uint4(v[0].y, v[1].y, v[2].y, v[3].y),
                             make_uint4(v[0].z, v[1].z, v[2].z, v[3].z),
                             make_uint4(v[0].w, v[1].w, v[2].w, v[3].w)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        *reinterpret_cast<uint4*>(rows + (c / 2) * kHalf + (((4 * (c % 2) + j) ^ r) << 4)) = unit[j];
      }
    }
  }
  // The writes are the generic proxy's; wgmma reads through the async proxy.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  consumer_barrier();
}

// wgmma.m64n(8 kLive)k16 (bf16 in, fp32 accumulate), A from registers, B by descriptor, into the
// first kLive groups of d (group j in d[j][0..3]: the accumulator layout of mma.sync's groups).
template <int kLive>
struct WgmmaRs;
#define EPMOE_NVFP4_WGMMA_OP(live, n)                                                        \
  template <>                                                                                \
  struct WgmmaRs<live> {                                                                     \
    using Op = cute::SM90::GMMA::MMA_64x##n##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, \
                                                                cute::SM90::GMMA::Major::K>; \
  };
EPMOE_NVFP4_WGMMA_OP(1, 8)
EPMOE_NVFP4_WGMMA_OP(2, 16)
EPMOE_NVFP4_WGMMA_OP(3, 24)
EPMOE_NVFP4_WGMMA_OP(4, 32)
EPMOE_NVFP4_WGMMA_OP(5, 40)
EPMOE_NVFP4_WGMMA_OP(6, 48)
EPMOE_NVFP4_WGMMA_OP(7, 56)
EPMOE_NVFP4_WGMMA_OP(8, 64)
#undef EPMOE_NVFP4_WGMMA_OP

template <int kLive, int kGroups, size_t... I>
__device__ __forceinline__ void wgmma_rs(float (&d)[kGroups][4], const uint32_t (&a)[4],
                                         uint64_t desc, std::index_sequence<I...>) {
  WgmmaRs<kLive>::Op::fma(a[0], a[1], a[2], a[3], desc, d[I / 4][I % 4]...);
}

// The descriptor of the stage's activation rows at k16 step 0: K-major, 128-byte swizzle, 1 KiB
// between 8-row groups (the leading offset is unused by swizzled K-major layouts: 1).
__device__ __forceinline__ uint64_t activation_descriptor(const uint8_t* act) {
  return static_cast<uint64_t>((pipe::smem_addr(act) >> 4) & 0x3fffu) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// The descriptor's start-address step (16-byte units) to k16 step j.
template <int kGroups>
__device__ __forceinline__ uint64_t step_offset(int j) {
  return static_cast<uint64_t>(((j / 4) * (Ring<kGroups, true>::kActBytes / 2) + (j % 4) * 32) >> 4);
}

template <int kGroups, int kLive, bool kSwiglu>
__device__ __forceinline__ void consume_chunk_wgmma(uint8_t* stage, int warp, int g, int t,
                                                    float (&acc)[kTiles][kGroups][4]) {
  uint8_t* act = stage + kCodeBytes;
  rearrange_activations<kGroups, kLive>(act, static_cast<int>(threadIdx.x));
  ChunkWeights cw;
  load_chunk_weights<kGroups, kSwiglu, true>(stage, warp, g, t, cw);
  const uint64_t desc = activation_descriptor(act);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t a0[kTiles][4], a1[kTiles][4];
    decode_steps(cw, q, a0, a1);
    cute::warpgroup_arrive();  // the A registers (and, first, the zeroed accumulators) written
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
      wgmma_rs<kLive>(acc[tile], a0[tile], desc + step_offset<kGroups>(2 * q),
                      std::make_index_sequence<4 * kLive>{});
      wgmma_rs<kLive>(acc[tile], a1[tile], desc + step_offset<kGroups>(2 * q + 1),
                      std::make_index_sequence<4 * kLive>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // word q - 1's wgmmas done: its A registers are free
  }
}

// A pass's chunks on wgmma, kLive groups. Each chunk waits for its last wgmmas before releasing
// its stage: keeping them in flight into the next chunk (the stage released one chunk later) made
// ptxas serialize every wgmma for want of registers (C7511) at 168 a thread.
template <int kGroups, int kLive, bool kSwiglu>
__device__ __forceinline__ void consume_pass_wgmma(int chunks,
                                                   RingPos<Ring<kGroups, true>::kStages>& pos,
                                                   uint8_t* smem, uint64_t* full, uint64_t* empty,
                                                   int warp, int g, int t, int lane,
                                                   float (&acc)[kTiles][kGroups][4]) {
  for (int c = 0; c < chunks; ++c, pos.next()) {
    pipe::wait(&full[pos.stage], pos.phase);
    consume_chunk_wgmma<kGroups, kLive, kSwiglu>(smem + pos.stage * Ring<kGroups, true>::kStageBytes,
                                                 warp, g, t, acc);
    cute::warpgroup_wait<0>();
    if (lane == 0) pipe::arrive(&empty[pos.stage]);
  }
}

// consume_pass_wgmma for the run-time live group count (1 .. kGroups; CTA-uniform).
template <int kGroups, bool kSwiglu, int kLive = kGroups>
__device__ __forceinline__ void consume_pass_wgmma_live(int live, int chunks,
                                                        RingPos<Ring<kGroups, true>::kStages>& pos,
                                                        uint8_t* smem, uint64_t* full,
                                                        uint64_t* empty, int warp, int g, int t,
                                                        int lane, float (&acc)[kTiles][kGroups][4]) {
  if (kLive == 1 || live == kLive) {
    consume_pass_wgmma<kGroups, kLive, kSwiglu>(chunks, pos, smem, full, empty, warp, g, t, lane, acc);
  } else if constexpr (kLive > 1) {
    consume_pass_wgmma_live<kGroups, kSwiglu, kLive - 1>(live, chunks, pos, smem, full, empty, warp,
                                                         g, t, lane, acc);
  }
}

// Keeps the compiler from moving accumulator accesses across the wgmma fences and waits.
template <int kGroups>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kTiles][kGroups][4]) {
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
    for (int grp = 0; grp < kGroups; ++grp) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(acc[tile][grp][i]);
    }
  }
}

}  // namespace epmoe::cuda::nvfp4
