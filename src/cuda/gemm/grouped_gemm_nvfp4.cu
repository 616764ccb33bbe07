// NVFP4 weight-only grouped GEMM for few rows per expert (decode), swap-AB on mma.sync: the
// weights are the 16-row A operand of mma.m16n8k16, decoded from E2M1 x E4M3 into bf16 in
// registers; 8-row groups of activation rows are the B operand. The weight stream sets the time.
//
// Work item (slab of 128 weight rows, expert e, K split z) of a persistent grid: one producer
// warp keeps a ring of stages full by TMA, each stage one 128-element chunk of K: the slab's code
// bytes (128 rows x 64 B), its block scales (128 rows x 8 B: the prepared scales keep a chunk's
// rows together), and the pass's live 8-row groups of activation rows (256 B a row in two
// 128-byte swizzled halves, the second 256 bytes off the swizzle atom where the stage has room so
// the lanes' loads take no bank conflicts, Ring::kHalfShiftRows; the narrow launch loads a half's
// groups in boxes of up to four, nvfp4_act_boxes). Four consumer warps own 32 weight rows each (two m16 tiles). A pass
// covers up to 8 * kGroups rows of the expert; experts with more rows take more passes over the
// weights. Each CTA first lists the experts of its launch from the offsets (rows in a range:
// nvfp4_grouped_gemm sends experts with many rows to a second, 8-group launch), so experts
// without rows make no items.
//
// Per chunk a lane (group g, quad position t) owns elements [32 t, 32 t + 32) of its four rows
// (tile rows g and g + 8): one 16-byte shared-memory load a row, NVFP4 blocks 2t and 2t + 1, so a
// lane converts two block scales a row a chunk. An mma's 16 k are any 16 of K as long as A and B agree: step j
// (0..7) takes the lane's elements 4j + {0, 1} as k pair {2t, 2t + 1} and 4j + {2, 3} as
// {2t + 8, 2t + 9}; its activation words are the same elements (the B registers come from the
// lane's own loads). Code word q (elements 8q .. 8q + 7) decodes (core/formats/nvfp4_gemm_order.h:
// the prepared order) into the pairs of steps 2q and 2q + 1, times the block scale in bf16
// (mul.rn.bf16x2, exact: e2m1 x e4m3 has <= 6 significant bits).
//
// EPMOE_NVFP4_WGMMA=1 (off by default, measured slower): passes of 8 groups issue the same MMAs as
// wgmma.m64n(8 live)k16 with the decoded fragments as the register A operand and the activation
// rows, rearranged in shared memory to the lanes' k order, as B (consume_chunk_wgmma).
//
// Numbers: the decoded pair is e2m1 * 2^-126, the scale operand e4m3 * 2^118 (bf16, exact), so
// the MMA sees the weight e2m1 * e4m3 * 2^-8 (normal bf16; every product exact in fp32) and the
// epilogue multiplies the fp32 sum by 2^8 (exact) and then the fp32 global: the bits of
// bf16(global * sum) for the tensor cores' summation order.
#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "core/activation.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "core/layout.h"
#include "cuda/check.h"
#include "cuda/gemm/bulk_pipeline.cuh"
#include "cuda/gemm/launch_checks.h"
#include "cuda/gemm/nvfp4_gemm.h"
#include "cuda/gemm/nvfp4_gemm_decode.cuh"
#include "cuda/gemm/nvfp4_gemm_wgmma.cuh"
#include "cuda/gemm/tensor_map.h"
#include "cuda/kernel_common.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

using namespace nvfp4;  // the ring, decode and wgmma consumer (nvfp4_gemm_decode.cuh, _wgmma.cuh)

// The decode launches (2 groups: qwen3; 8: mixtral and every wide launch) have room for the
// conflict-free halves; 1 and 4 groups' stages do not.
static_assert(Ring<2>::kHalfShiftRows == 2 && Ring<kNvfp4MaxRowGroups>::kHalfShiftRows == 2 &&
                  Ring<kNvfp4MaxRowGroups, true>::kHalfShiftRows == 0,
              "the shifted activation halves of nvfp4_gemm_decode.cuh's Ring");

struct Params {
  CUtensorMap codes;  // [E * N rows, K / 2 bytes] u8; box 64 bytes x 128 rows (SwiGLU: 64 rows)
  CUtensorMap act;    // [M rows, K] bf16; box 64 x 8 rows, 128-byte swizzle
  CUtensorMap act16;  // the same with boxes of 16 and 32 rows (act_boxes)
  CUtensorMap act32;
  CUtensorMap scales; // [E * ceil(K / 128) rows, N] of 8-byte scale groups; box 128 (SwiGLU: 64) x 1
  Nvfp4GroupedGemmArgs a;
  int64_t C = 0;                   // scale chunks per weight row, ceil(K / 128)
  // 32-bit: the work-item arithmetic runs per item on every warp (items = slabs * E * splits <
  // 2^31 by check_args' E * N < 2^31 and at most 16 splits).
  int32_t chunks = 0;              // ceil(K / kChunk)
  int32_t slabs = 0;               // slabs per expert
  int32_t splits = 1;
  int32_t rows_above = 0;          // the launch takes the experts with rows in (rows_above,
  int32_t rows_upto = 0;           // rows_upto]
  int32_t act_boxes = 1;           // activation boxes of up to 32 rows (nvfp4_act_boxes), else 8
  float* partials_SMN = nullptr;   // split-K: [splits, M, N] fp32 (the caller's scratch)
};

// The pass's rows' sources (the combine slots' epilogue reads them) into L1 while its chunks run:
// lane l takes the l-th 128-byte line of recv_src_M[m0, min(m0 + rows, end)).
__device__ __forceinline__ void prefetch_sources(const Nvfp4GroupedGemmArgs& a, int m0, int end,
                                                 int rows, int lane) {
  const int line = (m0 & ~31) + 32 * lane;  // 32 sources a line
  const int last = m0 + rows < end ? m0 + rows : end;
  if (lane * 32 < rows + 32 && line < last) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(a.recv_src_M + line));
  }
}

__device__ __forceinline__ bf16_t* out_row(const Nvfp4GroupedGemmArgs& a, int64_t m) {
  if (a.combine_R == nullptr) return a.out_MN + m * a.ld_out;
  const int32_t src = a.recv_src_M[m];
  return a.combine_R[src_rank(src, a.T, a.top_k)] + src_slot(src, a.T, a.top_k) * a.N;
}

// The experts of this launch (rows in (rows_above, rows_upto]), ascending, into ids; returns their
// count. Every thread of the CTA calls it (two CTA barriers); each warp ballots 32 experts at a
// time, one load round of the offsets.
__device__ __forceinline__ int select_experts(const Params& p, uint16_t* ids, int* chunk_n) {
  constexpr int kWarps = kConsumerWarps + 1;
  constexpr int kRounds = (kExpertChunks + kWarps - 1) / kWarps;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int E = p.a.E;
  const int chunks = (E + 31) / 32;
  uint32_t picked[kRounds];
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    const int c = warp + j * kWarps;
    const int e = c * 32 + lane;
    bool take = false;
    if (e < E) {
      const int begin = p.a.offsets_E1[e];
      const int end_raw = p.a.offsets_E1[e + 1];
      const int end = end_raw < p.a.M ? end_raw : static_cast<int>(p.a.M);
      take = end - begin > p.rows_above && end - begin <= p.rows_upto;
    }
    picked[j] = __ballot_sync(0xffffffffu, take);
    if (lane == 0 && c < chunks) chunk_n[c] = __popc(picked[j]);
  }
  __syncthreads();
  int total = 0;
  for (int c = 0; c < chunks; ++c) total += chunk_n[c];
#pragma unroll
  for (int j = 0; j < kRounds; ++j) {
    const int c = warp + j * kWarps;
    if (c >= chunks || ((picked[j] >> lane) & 1u) == 0) continue;
    int base = 0;
    for (int k = 0; k < c; ++k) base += chunk_n[k];
    ids[base + __popc(picked[j] & ((1u << lane) - 1u))] = static_cast<uint16_t>(c * 32 + lane);
  }
  __syncthreads();
  return total;
}

// One work item of the persistent grid: (slab, listed expert, split) of item i, slab fastest
// (CTAs running side by side share an expert's activation rows), and its rows, chunks and global
// scale. Loaded one item ahead, so the offsets' latency hides under the item before.
struct Work {
  int e = 0;
  int n0 = 0, f0 = 0;        // the slab's first weight row (plain) / column f (SwiGLU)
  int z = 0;                 // split
  int row_begin = 0, row_end = 0;
  int c_begin = 0, chunks = 0;
  float global = 0.0f;
};
__device__ __forceinline__ Work work_item(const Params& p, const uint16_t* ids, int listed, int i) {
  Work w;
  const unsigned per_split = static_cast<unsigned>(p.slabs) * static_cast<unsigned>(listed);
  if (static_cast<unsigned>(i) >= per_split * static_cast<unsigned>(p.splits)) return w;  // no rows
  unsigned rest = static_cast<unsigned>(i);
  w.chunks = p.chunks;
  if (p.splits > 1) {
    const unsigned z = rest / per_split;
    rest -= z * per_split;
    w.z = static_cast<int>(z);
    w.c_begin = p.chunks * w.z / p.splits;
    w.chunks = p.chunks * (w.z + 1) / p.splits - w.c_begin;
  }
  const unsigned listed_index = rest / static_cast<unsigned>(p.slabs);
  const int slab = static_cast<int>(rest - listed_index * static_cast<unsigned>(p.slabs));
  w.e = ids[listed_index];
  w.n0 = slab * kSlab;
  w.f0 = slab * (kSlab / 2);
  w.row_begin = p.a.offsets_E1[w.e];
  const int end = p.a.offsets_E1[w.e + 1];
  w.row_end = end < p.a.M ? end : static_cast<int>(p.a.M);
  w.global = p.a.b_global_E[w.e];
  return w;
}

// 8-row groups of the pass at m0 (at most kGroups).
template <int kGroups>
__device__ __forceinline__ int live_groups(const Work& w, int m0) {
  const int g8 = (w.row_end - m0 + 7) / 8;
  return g8 < kGroups ? g8 : kGroups;
}

// Grid dependency control (PTX griddepcontrol); both are no-ops unless the launch is programmatic
// (the wide launch after the narrow one on one stream, nvfp4_wide_pdl).
__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void wait_prerequisites() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// The passes of the CTA's items in order, pass(w, m0, live) for each (live: the pass's groups
// holding rows, at least one); producer and consumers walk the same sequence.
template <int kGroups, class Pass>
__device__ __forceinline__ void for_each_pass(const Params& p, const uint16_t* ids, int listed,
                                              Pass&& pass) {
  const int items = p.slabs * listed * p.splits;
  Work next = work_item(p, ids, listed, static_cast<int>(blockIdx.x));
  for (int i = static_cast<int>(blockIdx.x); i < items; i += static_cast<int>(gridDim.x)) {
    const Work w = next;
    next = work_item(p, ids, listed, i + static_cast<int>(gridDim.x));
    if (w.row_end <= w.row_begin) continue;
    for (int m0 = w.row_begin; m0 < w.row_end; m0 += 8 * kGroups) {
      pass(w, m0, live_groups<kGroups>(w, m0));
    }
  }
}

// Expects stage `stage`'s bytes and loads its codes and scales (the weights of chunk c of w).
template <int kGroups, bool kSwiglu, bool kWgmma>
__device__ __forceinline__ void load_weights(const Params& p, uint8_t* smem, uint64_t* full,
                                             const Work& w, int live, int c, int stage) {
  using R = Ring<kGroups, kWgmma>;
  const Nvfp4GroupedGemmArgs& a = p.a;
  uint8_t* dst = smem + stage * R::kStageBytes;
  uint64_t* bar = &full[stage];
  pipe::arrive_expect_bytes(
      bar, static_cast<uint32_t>(kCodeBytes + R::kScaleBytes + live * 2 * R::kGroupBytes));
  const int cc = w.c_begin + c;
  const int32_t kx = cc * kChunk;
  const int32_t code_y = static_cast<int32_t>(w.e * a.N + (kSwiglu ? w.f0 : w.n0));  // < 2^31
  const int32_t scale_y = static_cast<int32_t>(w.e * p.C + cc);
  pipe::load_2d(dst, &p.codes, bar, kx / 2, code_y);
  pipe::load_2d(dst + R::kScaleOffset, &p.scales, bar, kSwiglu ? w.f0 : w.n0, scale_y);
  if constexpr (kSwiglu) {
    const int32_t F = static_cast<int32_t>(a.N / 2);
    pipe::load_2d(dst + kCodeBytes / 2, &p.codes, bar, kx / 2, code_y + F);
    pipe::load_2d(dst + R::kScaleOffset + R::kScaleBytes / 2, &p.scales, bar, F + w.f0, scale_y);
  }
}

// The producer (one lane): for every pass and chunk of the CTA's items, a free stage filled by TMA
// boxes (codes, scales, the live groups' activation halves).
template <int kGroups, bool kSwiglu, bool kWgmma>
__device__ __forceinline__ void produce(const Params& p, uint8_t* smem, uint64_t* full,
                                        uint64_t* empty, const uint16_t* ids, int listed) {
  using R = Ring<kGroups, kWgmma>;
  pipe::prefetch_tensor_map(&p.codes);
  pipe::prefetch_tensor_map(&p.act);
  if (p.act_boxes != 0) {
    pipe::prefetch_tensor_map(&p.act16);
    pipe::prefetch_tensor_map(&p.act32);
  }
  pipe::prefetch_tensor_map(&p.scales);
  RingPos<R::kStages> pos;
  for_each_pass<kGroups>(p, ids, listed, [&](const Work& w, int m0, int live) {
    for (int c = 0; c < w.chunks; ++c, pos.next()) {
      pipe::wait(&empty[pos.stage], pos.phase ^ 1u);  // the first lap passes at once
      load_weights<kGroups, kSwiglu, kWgmma>(p, smem, full, w, live, c, pos.stage);
      uint8_t* act = smem + pos.stage * R::kStageBytes + kCodeBytes;
      uint64_t* bar = &full[pos.stage];
      const int32_t kx = (w.c_begin + c) * kChunk;
      // Groups [grp, grp + n) of each half in one box of 8 n rows: n = 4, 2, 1 while they fit
      // (act_boxes), else 1.
      for (int grp = 0; grp < live;) {
        const int rest = live - grp;
        const int n = p.act_boxes == 0 ? 1 : (rest >= 4 ? 4 : (rest >= 2 ? 2 : 1));
        const CUtensorMap* map = n == 4 ? &p.act32 : (n == 2 ? &p.act16 : &p.act);
        const int32_t y = m0 + 8 * grp;
        pipe::load_2d(act + grp * R::kGroupBytes, map, bar, kx, y);
        pipe::load_2d(act + R::kHalf1Offset + grp * R::kGroupBytes, map, bar, kx + kActHalf, y);
        grp += n;
      }
    }
  });
}

// One chunk of a stage for the consumer warp on mma.sync: the tiles' codes and scales, then per
// code word the live groups' activation units and MMAs. kLive (the pass's groups) is a template
// argument so the MMAs are not under a run-time predicate (mma.sync under one costs a WARPSYNC each).
template <int kGroups, int kLive, bool kSwiglu>
__device__ __forceinline__ void consume_chunk(const uint8_t* stage, int warp, int g, int t,
                                              float (&acc)[kTiles][kGroups][4]) {
  using R = Ring<kGroups>;
  // The lane's rows: row g of its half (t / 2) in every group, at swizzle phase `phase`.
  const int half = t >> 1;
  const uint8_t* act = stage + kCodeBytes + half * R::kHalf1Offset + g * 128;
  const int phase = (g + half * R::kHalfShiftRows) & 7;
  ChunkWeights cw;
  load_chunk_weights<kGroups, kSwiglu, false>(stage, warp, g, t, cw);
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // code word q: steps 2q, 2q + 1 (block 2t + q / 2)
    // The lane's 16 bytes of activation unit u of its row in each group (128-byte swizzle: unit u
    // at u ^ phase).
    const int u = 4 * (t & 1) + q;
    uint32_t a0[kTiles][4], a1[kTiles][4];  // the tiles' A operands of steps 2q, 2q + 1
    decode_steps(cw, q, a0, a1);
    // Step 2q's MMAs of every (tile, group), then step 2q + 1's: an accumulator's second MMA
    // waits for its first behind 2 x kLive - 1 independent ones.
    uint4 b[kLive];
#pragma unroll
    for (int grp = 0; grp < kLive; ++grp) {
      b[grp] = lds128(act + grp * R::kGroupBytes + ((u ^ phase) << 4));
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) mma_bf16(acc[tile][grp], a0[tile], b[grp].x, b[grp].y);
    }
#pragma unroll
    for (int grp = 0; grp < kLive; ++grp) {
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) mma_bf16(acc[tile][grp], a1[tile], b[grp].z, b[grp].w);
    }
  }
}

// consume_chunk for the run-time live group count (1 .. kGroups; warp-uniform).
template <int kGroups, bool kSwiglu, int kLive = kGroups>
__device__ __forceinline__ void consume_live(int live, const uint8_t* stage, int warp, int g, int t,
                                             float (&acc)[kTiles][kGroups][4]) {
  if (kLive == 1 || live == kLive) {
    consume_chunk<kGroups, kLive, kSwiglu>(stage, warp, g, t, acc);
  } else if constexpr (kLive > 1) {
    consume_live<kGroups, kSwiglu, kLive - 1>(live, stage, warp, g, t, acc);
  }
}

// kSwiglu (W13 with the SwiGLU epilogue): out gets h = act(bf16(gate), bf16(up)) as the unfused
// kernel computes it (core/activation.h). kSplit: split z stores its fp32 sums (scaled back by
// 2^8, not by the global) at partials_SMN[z, m, n] (SwiGLU: gate at n = f, up at n = F + f); the
// reduce kernel applies the global and the epilogue. A persistent grid: each CTA takes items
// blockIdx.x, + gridDim.x, ...; its ring runs on across items, so the producer fills the next
// item's first stages while the consumers finish the last. kWgmma: the MMAs on wgmma
// (consume_chunk_wgmma), the same epilogues.
template <int kGroups, bool kSwiglu, bool kSplit, bool kWgmma>
__device__ __forceinline__ void gemm_cta(const Params& p) {
  using R = Ring<kGroups, kWgmma>;
  const Nvfp4GroupedGemmArgs& a = p.a;
  if ((a.skip != nullptr && *a.skip != 0) || (a.replay_skip != nullptr && *a.replay_skip != 0)) {
    return;
  }
  // The ring at the first 1024-byte boundary of the shared window (128-byte swizzle atoms), as an
  // offset from smem_raw so the compiler keeps the shared address space (LDS, 32-bit addresses).
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (pipe::smem_addr(smem_raw) & 1023u)) & 1023u);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + R::kStages * R::kStageBytes);
  uint64_t* empty = full + R::kStages;
  int* chunk_n = reinterpret_cast<int*>(smem + R::kStages * R::kStageBytes + R::kBarrierBytes);
  uint16_t* ids = reinterpret_cast<uint16_t*>(chunk_n + kExpertChunks);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < R::kStages; ++s) {
      pipe::barrier_init(&full[s], 1);
      pipe::barrier_init(&empty[s], kConsumerWarps);
    }
    pipe::barrier_init_fence();
  }
  const int listed = select_experts(p, ids, chunk_n);  // its barriers also publish the inits
  // A dependent launch (the wide one) may start once every CTA is here: it takes the SM slots
  // these CTAs leave and reads nothing they write.
  allow_dependents();
  if (warp == kConsumerWarps) {
    if (lane == 0) produce<kGroups, kSwiglu, kWgmma>(p, smem, full, empty, ids, listed);
    return;
  }

  // Consumers: lane (g, t).
  const int64_t F = a.N / 2;
  const int g = lane / 4, t = lane % 4;
  RingPos<R::kStages> pos;
  for_each_pass<kGroups>(p, ids, listed, [&](const Work& w, int m0, int groups) {
    const int live = kGroups == 1 ? 1 : groups;  // a constant for one group
    const float global = w.global;
    if (a.combine_R != nullptr) prefetch_sources(a, m0, w.row_end, 8 * kGroups, lane);
    float acc[kTiles][kGroups][4] = {};
    if constexpr (kWgmma) {
      fence_accumulators(acc);  // zeroed before the first wgmma
      consume_pass_wgmma_live<kGroups, kSwiglu>(live, w.chunks, pos, smem, full, empty, warp, g, t,
                                                lane, acc);
      fence_accumulators(acc);  // read after the last wait
    } else {
      for (int c = 0; c < w.chunks; ++c, pos.next()) {
        pipe::wait(&full[pos.stage], pos.phase);
        consume_live<kGroups, kSwiglu>(live, smem + pos.stage * R::kStageBytes, warp, g, t, acc);
        __syncwarp();
        if (lane == 0) pipe::arrive(&empty[pos.stage]);
      }
    }

    // acc[tile][grp]: {(A row g, m 2t), (A row g, m 2t + 1), (A row g + 8, m 2t), (A row g + 8,
    // m 2t + 1)} of group grp.
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
      for (int grp = 0; grp < kGroups; ++grp) {
        if (grp >= live) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t m = m0 + grp * 8 + 2 * t + h;  // 64-bit: the row offsets below
          if (m >= w.row_end) continue;
          const float lo = __fmul_rn(acc[tile][grp][h], kSumFactor);
          const float hi = __fmul_rn(acc[tile][grp][2 + h], kSumFactor);
          if constexpr (kSwiglu) {
            const int64_t f = w.f0 + code_row<true, kWgmma>(warp, tile, 0, g);
            if (f >= F) continue;
            if constexpr (kSplit) {
              float* part = p.partials_SMN + (static_cast<int64_t>(w.z) * a.M + m) * a.N;
              part[f] = lo;
              part[F + f] = hi;
            } else {
              const float gate = bf16_to_float(to_bf16(__fmul_rn(lo, global)));
              const float up = bf16_to_float(to_bf16(__fmul_rn(hi, global)));
              a.out_MN[m * a.ld_out + f] = to_bf16(swiglu_forward(gate, up, a.act));
            }
          } else {
            const int64_t n = w.n0 + code_row<false, kWgmma>(warp, tile, 0, g);
            if constexpr (kSplit) {
              float* part = p.partials_SMN + (static_cast<int64_t>(w.z) * a.M + m) * a.N;
              if (n < a.N) part[n] = lo;
              if (n + 8 < a.N) part[n + 8] = hi;
            } else {
              bf16_t* out = out_row(a, m);
              if (n < a.N) out[n] = to_bf16(__fmul_rn(lo, global));
              if (n + 8 < a.N) out[n + 8] = to_bf16(__fmul_rn(hi, global));
            }
          }
        }
      }
    }
  });
}

// The kernel: the CTA's work, then a wait for the prerequisite grid (a no-op unless the launch is
// programmatic, or once waited). A dependent grid starts as this one's CTAs let it (gemm_cta) and
// takes the SM slots they leave; the wide launch, which reads nothing the narrow one writes, waits
// for it only here, so that its completion implies the narrow grid's for the launches after it.
template <int kGroups, bool kSwiglu, bool kSplit, bool kWgmma>
__global__ void __launch_bounds__(kGemmThreads) __maxnreg__(Ring<kGroups>::kMaxRegs)
    nvfp4_gemm_kernel(const __grid_constant__ Params p) {
  gemm_cta<kGroups, kSwiglu, kSplit, kWgmma>(p);
  wait_prerequisites();
}

// The expert owning row m: the last e with offsets_E1[e] <= m (experts without rows share their
// offset with the next one, which then owns m).
__device__ __forceinline__ int expert_of(const int32_t* offsets_E1, int E, int64_t m) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets_E1[mid] <= m) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Split-K reduce: out = bf16(global_e * (partial_0 + partial_1 + ...)), splits ascending, for the
// rows of the groups [offsets_E1[0], min(offsets_E1[E], M)); the same epilogues as the GEMM
// kernel's (plain rows, combine slots, SwiGLU on the reduced gate and up). Grid-stride over
// (row, output column); the grid is sized on host-known M.
template <bool kSwiglu>
__global__ void __launch_bounds__(256) nvfp4_splitk_reduce_kernel(const Nvfp4GroupedGemmArgs a,
                                                                  const float* partials_SMN,
                                                                  int splits) {
  if ((a.skip != nullptr && *a.skip != 0) || (a.replay_skip != nullptr && *a.replay_skip != 0)) {
    return;
  }
  const int64_t F = a.N / 2;
  const int64_t cols = kSwiglu ? F : a.N;
  const int64_t row_begin = a.offsets_E1[0];
  const int64_t row_end = a.offsets_E1[a.E] < a.M ? a.offsets_E1[a.E] : a.M;
  const int64_t plane = a.M * a.N;  // one split's partials
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = row_begin * cols + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < row_end * cols; i += stride) {
    const int64_t m = i / cols, n = i % cols;
    const float global = a.b_global_E[expert_of(a.offsets_E1, a.E, m)];
    const float* part = partials_SMN + m * a.N + n;
    float sum = part[0];
    for (int z = 1; z < splits; ++z) sum = __fadd_rn(sum, part[z * plane]);
    if constexpr (kSwiglu) {
      float up = part[F];
      for (int z = 1; z < splits; ++z) up = __fadd_rn(up, part[z * plane + F]);
      const float gate_bf16 = bf16_to_float(to_bf16(__fmul_rn(sum, global)));
      const float up_bf16 = bf16_to_float(to_bf16(__fmul_rn(up, global)));
      a.out_MN[m * a.ld_out + n] = to_bf16(swiglu_forward(gate_bf16, up_bf16, a.act));
    } else {
      out_row(a, m)[n] = to_bf16(__fmul_rn(sum, global));
    }
  }
}

void check_args(const Nvfp4GroupedGemmArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= kNvfp4MaxExperts, "E",
                  "1 .. " + std::to_string(kNvfp4MaxExperts) + " (the kernel's expert list)", a.E);
  EPMOE_CHECK_ARG(a.wide_above_rows >= 0, "wide_above_rows", ">= 0 (0: nvfp4_row_groups' rule)",
                  a.wide_above_rows);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % 32 == 0, "K", "> 0 and a multiple of 32 (16-byte code rows for TMA)",
                  a.K);
  EPMOE_CHECK_ARG(a.N > 0 && a.N % 2 == 0, "N",
                  "> 0 and even (16-byte rows of 8-byte scale groups for TMA)", a.N);
  EPMOE_CHECK_ARG(a.E * a.N < (int64_t{1} << 31) && a.M < (int64_t{1} << 31), "E * N, M",
                  "< 2^31 (TMA row coordinates)", std::to_string(a.E * a.N) + ", " + std::to_string(a.M));
  gemm::check_output_destination(a);
  gemm::check_device_pointer(a.b_codes_ENP, "b_codes_ENP", 16);
  gemm::check_device_pointer(a.b_scales, "b_scales", 16);
  gemm::check_device_pointer(a.b_global_E, "b_global_E", 4);
  gemm::check_device_pointer(a.offsets_E1, "offsets_E1", 4);
  EPMOE_CHECK_ARG(a.splits >= 0, "splits", ">= 0 (0: EPMOE_NVFP4_SPLITK or the heuristic)",
                  a.splits);
  EPMOE_CHECK_ARG(a.splitk_scratch_bytes >= 0, "splitk_scratch_bytes", ">= 0",
                  a.splitk_scratch_bytes);
  if (a.splitk_scratch_SMN != nullptr) {
    gemm::check_device_pointer(a.splitk_scratch_SMN, "splitk_scratch_SMN", 4);
  }
  if (a.M == 0) return;
  gemm::check_device_pointer(a.a_MK, "a_MK", 16);
  gemm::check_output_pointers(a, 2);
}

// CTAs of `kernel` resident per SM at its shared memory, cached per device (asked every launch).
template <auto kKernel>
int resident_ctas(int smem_bytes) {
  static std::atomic<int> cached[64] = {};
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = cached[device % 64];
  int n = slot.load(std::memory_order_relaxed);
  if (n == 0) {
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kGemmThreads, smem_bytes));
    n = n > 0 ? n : 1;
    slot.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The persistent grid: every resident CTA slot, at most one per item (slabs * E * splits, the
// most the device's expert list can give). programmatic: a programmatic dependent launch.
template <int kGroups, bool kSwiglu, bool kSplit, bool kWgmma>
void launch(const Params& p, cudaStream_t st, bool programmatic) {
  constexpr auto kernel = nvfp4_gemm_kernel<kGroups, kSwiglu, kSplit, kWgmma>;
  constexpr int smem = Ring<kGroups, kWgmma>::kSmemBytes;
  set_shared_memory_limit<kernel>(smem, /*max_carveout=*/true);
  const int64_t slots = static_cast<int64_t>(sm_count()) * resident_ctas<kernel>(smem);
  const int64_t items = static_cast<int64_t>(p.slabs) * p.a.E * p.splits;
  const unsigned grid = static_cast<unsigned>(items < slots ? items : slots);
  if (programmatic) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(kGemmThreads);
    config.dynamicSmemBytes = smem;
    config.stream = st;
    config.attrs = &attribute;
    config.numAttrs = 1;
    EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
    return;
  }
  kernel<<<grid, kGemmThreads, smem, st>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <int kGroups, bool kWgmma>
void launch_epilogue(const Params& p, bool split, cudaStream_t st, bool programmatic) {
  if (split && p.a.swiglu) {
    launch<kGroups, true, true, kWgmma>(p, st, programmatic);
  } else if (split) {
    launch<kGroups, false, true, kWgmma>(p, st, programmatic);
  } else if (p.a.swiglu) {
    launch<kGroups, true, false, kWgmma>(p, st, programmatic);
  } else {
    launch<kGroups, false, false, kWgmma>(p, st, programmatic);
  }
}

// Passes of 8 groups run on wgmma where EPMOE_NVFP4_WGMMA=1 (nvfp4_wgmma; off by default), every
// other launch on mma.sync.
template <int kGroups>
void launch_groups(const Params& p, bool split, cudaStream_t st, bool programmatic = false) {
  if (kGroups == kNvfp4MaxRowGroups && nvfp4_wgmma()) {
    launch_epilogue<kNvfp4MaxRowGroups, true>(p, split, st, programmatic);
  } else {
    launch_epilogue<kGroups, false>(p, split, st, programmatic);
  }
}

}  // namespace

int nvfp4_launch_splits(const Nvfp4GroupedGemmArgs& a) {
  // At most one split per chunk, and grid z's limit.
  const int64_t all = (a.K + kChunk - 1) / kChunk;
  const int64_t chunks = all < 65535 ? all : 65535;
  const int64_t per_split = nvfp4_splitk_scratch_bytes(2, a.M, a.N) / 2;
  const int64_t held = per_split == 0 ? 1 : a.splitk_scratch_bytes / per_split;
  const int64_t fit = a.splitk_scratch_SMN == nullptr || held < 1 ? 1 : held;  // splits it holds
  if (a.splits >= 1) {  // the caller's count, at most one split per chunk
    const int64_t n = a.splits < chunks ? a.splits : (chunks < 1 ? 1 : chunks);
    const int64_t need = nvfp4_splitk_scratch_bytes(static_cast<int>(n), a.M, a.N);
    EPMOE_CHECK_ARG(n <= 1 || fit >= n, "splitk_scratch_bytes",
                    ">= " + std::to_string(need) + " (" + std::to_string(n) + " splits)",
                    a.splitk_scratch_bytes);
    return static_cast<int>(n);
  }
  int64_t n = nvfp4_requested_splits();
  if (n < 1) {
    n = nvfp4_choose_splits(a.N, a.K, a.E, a.swiglu, sm_count()).splits;
  } else if (n > chunks) {
    n = chunks < 1 ? 1 : chunks;
  }
  return static_cast<int>(n < fit ? n : fit);  // what the scratch holds
}

void nvfp4_grouped_gemm(const Nvfp4GroupedGemmArgs& args, void* stream) {
  check_args(args);
  if (args.M == 0) return;
  const int splits = nvfp4_launch_splits(args);
  const Nvfp4RowGroups rows = nvfp4_launch_row_groups(args);
  // Experts with more rows than the narrow passes suit take the widest launch (an expert holds
  // at most M rows; the device picks each launch's experts from the offsets).
  const int64_t above = args.wide_above_rows > 0 ? args.wide_above_rows : rows.wide_above;
  const int32_t narrow_upto = static_cast<int32_t>(above < args.M ? above : args.M);
  Params p;
  p.a = args;
  p.C = nvfp4_scale_chunks(args.K);
  p.chunks = static_cast<int32_t>((args.K + kChunk - 1) / kChunk);
  p.partials_SMN = splits > 1 ? args.splitk_scratch_SMN : nullptr;
  TensorMap2d codes;
  codes.base = args.b_codes_ENP;
  codes.type = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  codes.inner = static_cast<uint64_t>(args.K / 2);
  codes.outer = static_cast<uint64_t>(args.E * args.N);
  codes.pitch_bytes = static_cast<uint64_t>(args.K / 2);
  codes.box_inner = kCodeRowBytes;
  codes.box_outer = args.swiglu ? kSlab / 2 : kSlab;
  p.codes = make_tensor_map(codes, "b_codes_ENP");
  TensorMap2d act;
  act.base = args.a_MK;
  act.type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  act.inner = static_cast<uint64_t>(args.K);
  act.outer = static_cast<uint64_t>(args.M);
  act.pitch_bytes = static_cast<uint64_t>(args.K * 2);
  act.box_inner = kActHalf;
  act.box_outer = 8;
  act.swizzle_128b = true;
  p.act = make_tensor_map(act, "a_MK");
  act.box_outer = 16;
  p.act16 = make_tensor_map(act, "a_MK");
  act.box_outer = 32;
  p.act32 = make_tensor_map(act, "a_MK");
  TensorMap2d scales;  // a chunk's 8 scales of a row as one 8-byte element
  scales.base = args.b_scales;
  scales.type = CU_TENSOR_MAP_DATA_TYPE_UINT64;
  scales.inner = static_cast<uint64_t>(args.N);
  scales.outer = static_cast<uint64_t>(args.E * p.C);
  scales.pitch_bytes = static_cast<uint64_t>(args.N * kNvfp4ChunkBlocks);
  scales.box_inner = args.swiglu ? kSlab / 2 : kSlab;
  scales.box_outer = 1;
  p.scales = make_tensor_map(scales, "b_scales");

  p.slabs = static_cast<int32_t>(nvfp4_grid_slabs(args.N, args.swiglu));
  p.splits = splits;
  EPMOE_CHECK_ARG(static_cast<int64_t>(p.slabs) * args.E * splits < (int64_t{1} << 31), "splits",
                  "slabs * E * splits < 2^31 (32-bit work items)", splits);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool split = splits > 1;
  const bool wide = narrow_upto < args.M;
  const bool forked = wide && args.fork.side_stream != nullptr;
  Params narrow = p;
  narrow.rows_above = 0;
  narrow.rows_upto = narrow_upto;
  narrow.act_boxes = nvfp4_act_boxes(false) ? 1 : 0;
  p.act_boxes = nvfp4_act_boxes(true) ? 1 : 0;
  p.rows_above = narrow_upto;
  p.rows_upto = static_cast<int32_t>(args.M);
  if (forked) {
    fork(args.fork, stream);
    launch_groups<kNvfp4MaxRowGroups>(p, split, static_cast<cudaStream_t>(args.fork.side_stream));
  }
  switch (rows.groups) {
    case 1: launch_groups<1>(narrow, split, st); break;
    case 2: launch_groups<2>(narrow, split, st); break;
    case 4: launch_groups<4>(narrow, split, st); break;
    default: launch_groups<kNvfp4MaxRowGroups>(narrow, split, st); break;
  }
  if (forked) {
    join(args.fork, stream);
  } else if (wide) {
    launch_groups<kNvfp4MaxRowGroups>(p, split, st, nvfp4_wide_pdl());
  }
  if (split) {
    const int64_t cols = args.swiglu ? args.N / 2 : args.N;
    const unsigned blocks = grid_for(args.M * cols, 256);
    if (args.swiglu) {
      nvfp4_splitk_reduce_kernel<true><<<blocks, 256, 0, st>>>(args, p.partials_SMN, splits);
    } else {
      nvfp4_splitk_reduce_kernel<false><<<blocks, 256, 0, st>>>(args, p.partials_SMN, splits);
    }
    EPMOE_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace epmoe::cuda
