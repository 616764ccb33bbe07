// NVFP4 weight-only grouped GEMM for few rows per expert (decode), swap-AB on mma.sync:
// the weights are the 16-row A operand of mma.m16n8k16 (decoded from E2M1 x E4M3 into bf16 in
// registers), eight activation rows the B operand, so one weight element is read once per
// kGroups x 8 activation rows and the weight stream sets the time.
//
// Work: CTA (n-slab of 256 weight rows, expert e, K split z) of four warps; a warp owns kTiles =
// 4 m16 tiles (64 weight rows) and feeds each activation fragment it reads to all four tiles. One
// split (grid z = 1): the warp sums all of K and stores bf16. Several (split-K, deterministic
// without atomics): split z sums the chunks [z * chunks / splits, (z + 1) * chunks / splits) (the
// last split also the K tail) and stores fp32 partials [splits, M, N] into the caller's scratch;
// a reduce kernel sums them in ascending split order and applies the global scale and the
// epilogue (plain, combine slots, SwiGLU). CTAs of experts without rows return at once.
//
// Staging (offsets: nvfp4_stage_layout.h, run thread by thread on the host by
// tests/cpp/test_nvfp4_stage_layout.cpp): a ring of kStages shared-memory stages per CTA (2; 3
// with split-K), one 128-element chunk of K each: every lane copies its own 16 code bytes of its
// 8 weight rows (cp.async.cg: 16-byte, L2 only, no registers held while in flight), 4 scale
// bytes, and the CTA copies the chunk's activation rows once (16-byte units, stored in fragment
// order so a warp reads them conflict-free). One __syncthreads per chunk publishes stage c and
// frees stage c - 1 for chunk c + kStages - 1.
// K % 64 != 0 (or scales not 4-byte aligned): the copies go through registers (synchronous; a
// slow, rare path with the same consumer).
//
// K order: an mma's 16 k are any 16 of K as long as A and B agree. Per chunk, lane quad position
// t (lane % 4) owns elements [32 t, 32 t + 32) of its rows: half h (block 2t + h, 8 code bytes)
// feeds steps 4h .. 4h + 3, step s taking elements 32 t + 16 h + 4 s + {0, 1} / {2, 3} as its
// k pairs {2t, 2t+1} / {2t+8, 2t+9}; the activation fragments are the same elements. A tail of
// K % 128 elements runs one 16-element block per step from global memory, lane t owning elements
// 4t .. 4t + 3. Each (tile, group) accumulator sums its steps in K order, chunk by chunk.
//
// Arithmetic per CTA and chunk (G = kGroups, dead groups included; at 4.8 TB/s over 132 SMs an
// SM must take ~19 B/clk of weights; a CTA's chunk = 16 KiB of codes = ~860 SM clocks of HBM):
// - weights: 16 KiB of codes + 2 KiB of scales, HBM -> smem by cp.async, each byte written once
//   and read once (a lane's 8 code bytes of a row per half: 2-way conflicted, 2 wavefronts per
//   128 bytes; the reads of all 16 at once held 4 registers per row through both halves).
// - activations: G x 2 KiB, L2 -> smem once per CTA (was once per warp and 16 weight rows: 8x
//   the weight bytes through L1 at G = 4), read by each warp once per chunk: 4 x 2 G KiB, i.e.
//   0.5 G bytes of smem reads per code byte (G = 4: 2).
//   smem traffic per code byte: 1 (fill) + 1 (weight reads) + 0.5 G + 0.125 G (activation fill):
//   4.5 at G = 4, ~86 of the 128 B/clk at the roofline; 2.6 (~50 B/clk) at G = 1.
// - tensor cores: 8 G mma.m16n8k16 per KiB of codes (16 rows x 16 k each), 64 G flops per code
//   byte: G = 4 (mixtral, 32 rows) needs ~2.4 kflop/clk/SM, near mma.sync's rate on Hopper;
//   G = 1 (deepseek, ~4 rows) a quarter of it.
// - ALU per KiB of codes (warp instructions, SASS): decode 8 words x 16 (e2m1_bf16.h) = 128,
//   block tables 4 x 11 = 44, 8 G mma, ~9 smem loads, ~4 copies of 2 instructions each.
// - registers: accumulators 4 x G x 4, one half's activation fragments (8 G), a tile-half's codes
//   (4) and A (16), two tables (8); bounded for 4 CTAs (128) at G = 1, 2; 3 (168) at G = 4;
//   -Xptxas -v numbers in docs/cuda_backend.md.
// - in flight: kStages - 1 = 1 chunk per CTA (16 KiB of codes); smem per CTA kStages x (18 +
//   2 G) KiB = 40 (G = 1) .. 52 (G = 4) KiB: the registers, not the smem, set 3 .. 4 CTAs per SM,
//   48 .. 64 KiB in flight (Little: 20 B/clk x ~1.5 k clk of loaded latency = 30 KiB). Split-K
//   (2 CTAs per SM, register-bound): 3 stages, 2 chunks per CTA, 64 KiB per SM.
// Measured before this loop order (3 stages, tiles outer, a branch per live group; Nsight
// Compute, mixtral W13, G = 4): 8 warps per SM, issue slots 31 % busy, 43 % of the stalls on
// fixed-latency dependencies (4 dependent mma per accumulator back to back), DRAM 22 %. Now:
// 12 warps at G = 4 (16 at G = 1, 2), a branch-free chunk (dead groups computed, not stored),
// back-to-back mma on independent accumulators, 2 instructions per cp.async; the chunk loop is
// ~1010 SASS instructions at G = 4 (was 1319), ~900 at G = 2 (1086), ~845 at G = 1 (940): ~250
// / ~225 / ~210 per KiB, of which the decode and its tables are ~170. At the roofline a KiB
// takes ~54 SM clocks = ~216 issue slots: the decode alone needs ~80 % of them, so 80 % of the
// roofline (~270 slots per KiB) needs ~85 % of the issue slots busy at G = 1 and ~95 % at G = 4:
// beyond mma.sync's decode-bound kernels; the realistic ceiling is ~50 .. 60 % of the roofline.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/activation.h"
#include "core/formats/e2m1_bf16.h"
#include "core/layout.h"
#include "cuda/check.h"
#include "cuda/gemm/nvfp4_gemm.h"
#include "cuda/gemm/launch_checks.h"
#include "cuda/gemm/nvfp4_stage_layout.h"
#include "cuda/kernel_common.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

// The stage layout and the CTA's shape (nvfp4_stage_layout.h, shared with the host model).
using nvfp4_stage::act_copy_element;
using nvfp4_stage::act_copy_offset;
using nvfp4_stage::act_copy_row;
using nvfp4_stage::act_offset;
using nvfp4_stage::code_offset;
using nvfp4_stage::kChunk;
using nvfp4_stage::kRowsPerWarp;
using nvfp4_stage::kSlab;
using nvfp4_stage::kTiles;
using nvfp4_stage::scale_copy_block;
using nvfp4_stage::scale_copy_r;
using nvfp4_stage::scale_offset;
using nvfp4_stage::stage_bytes;
constexpr int kGemmThreads = nvfp4_stage::kThreads;

// The ring's stages: one chunk in flight per CTA with 3 .. 4 CTAs per SM, two with split-K's 2
// CTAs (Little: ~30 KiB of codes in flight per SM at 20 B/clk and ~1.5 k clk of loaded latency).
template <bool kSplit>
constexpr int ring_stages() {
  return kSplit ? 3 : 2;
}
// CTAs per SM that the shared memory holds (228 KiB, 1 KiB reserved per CTA).
template <int kGroups, bool kSplit>
constexpr int smem_ctas_per_sm() {
  return (228 * 1024) / (ring_stages<kSplit>() * stage_bytes(kGroups) + 1024);
}
// The resident CTAs the registers are bounded for (65536 / (128 x CTAs) per thread: 4 -> 128, 3
// -> 168, 2 -> 255), never more than the shared memory holds: 4 at 1 and 2 groups, 3 at 4 (64
// accumulators); split-K 2 (it spills at 3). -Xptxas -v and SASS: docs/cuda_backend.md.
template <int kGroups, bool kSplit>
constexpr int ctas_per_sm() {
  constexpr int by_registers = kSplit ? 2 : (kGroups == 4 ? 3 : 4);
  constexpr int by_smem = smem_ctas_per_sm<kGroups, kSplit>();
  return by_registers < by_smem ? by_registers : by_smem;
}

struct Params {
  Nvfp4GroupedGemmArgs a;
  int64_t P, S;                    // code bytes and scale blocks per weight row
  float* partials_SMN = nullptr;   // split-K: [splits, M, N] fp32 (the caller's scratch)
};

// Streamed once: no L1 allocation; two 8-byte loads (P % 8 == 0 since K % 16 == 0).
__device__ __forceinline__ uint4 load_codes_narrow(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
      : "=r"(v.x), "=r"(v.y)
      : "l"(p));
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
      : "=r"(v.z), "=r"(v.w)
      : "l"(p + 8));
  return v;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, cached in L2 only (the weight stream, the activations).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One E4M3 block scale as bf16x2 (both halves), exact: E4M3 -> f16 (hardware) -> fp32 -> bf16.
__device__ __forceinline__ uint32_t scale_bf16x2(float f) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ uint32_t scale_bf16x2(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return scale_bf16x2(__half2float(__half(h)));
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t x, uint32_t y) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
  return r;
}

__device__ __forceinline__ bf16_t to_bf16(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A block's decode table (core/formats/e2m1_bf16.h): the E2M1 magnitudes times the block scale.
__device__ __forceinline__ E2m1Bf16Table block_table(uint8_t scale) {
  const uint32_t s = scale_bf16x2(scale);
  return e2m1_bf16_table(mul_bf16x2(kE2m1Bf16x2_01, s), mul_bf16x2(kE2m1Bf16x2_23, s),
                         mul_bf16x2(kE2m1Bf16x2_45, s), mul_bf16x2(kE2m1Bf16x2_67, s));
}

// A thread's weight rows inside expert e's weights, as 32-bit byte offsets (N * P < 2^32,
// checked) from which a chunk's copy addresses are one add each: tile i's row g (r = 0) and
// g + 8 (r = 1), code_off = n P + 16 t (the lane's 16 code bytes of chunk 0), and the row whose
// scales the lane copies, scale_off = n S + scale_copy_block.
struct Lane {
  const uint8_t* codes;    // expert e's codes
  const uint8_t* scales;   // expert e's scales
  uint32_t code_off[kTiles][2];
  uint32_t scale_off[kTiles];
};

// This thread's share of chunk c (of the whole K) into a stage (nvfp4_stage_layout.h): its 16
// code bytes of each of its 8 weight rows, 4 scale bytes of one row per tile (another lane reads
// them), and one activation unit per group (act_MK + act_off[q]: the unit's elements in chunk 0;
// 32-bit element offsets from the pass's first row, < 32 K < 2^32). copy_weights: the warp's rows
// exist (warp-uniform).
template <bool kWide, int kGroups>
__device__ __forceinline__ void copy_chunk(const Lane& l, uint32_t c, uint8_t* stage, int warp,
                                           int tid, bool copy_weights, const bf16_t* act_MK,
                                           const uint32_t (&act_off)[kGroups]) {
  const int lane = tid % 32, g = lane / 4;
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {  // dead groups too (clamped rows): the mma read them
    cp_async16(stage + act_copy_offset(q, tid), act_MK + (act_off[q] + c * kChunk));
  }
  if (!copy_weights) return;
  // The chunk's bases once (64-bit adds), then one 64-bit add of a 32-bit offset per copy.
  const uint8_t* const codes_c = l.codes + c * (kChunk / 2);
  const uint8_t* const scales_c = l.scales + c * (kChunk / 16);
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* src = codes_c + l.code_off[i][r];
      uint8_t* dst = stage + code_offset(warp, i, r, lane);
      if constexpr (kWide) {
        cp_async16(dst, src);
      } else {
        *reinterpret_cast<uint4*>(dst) = load_codes_narrow(src);
      }
    }
    const uint8_t* src = scales_c + l.scale_off[i];
    uint8_t* dst = stage + scale_offset(warp, i, scale_copy_r(lane), g, scale_copy_block(lane));
    if constexpr (kWide) {
      cp_async4(dst, src);
    } else {
      *reinterpret_cast<uint32_t*>(dst) =
          static_cast<uint32_t>(__ldg(src)) | (static_cast<uint32_t>(__ldg(src + 1)) << 8) |
          (static_cast<uint32_t>(__ldg(src + 2)) << 16) |
          (static_cast<uint32_t>(__ldg(src + 3)) << 24);
    }
  }
}

// The warp's tiles x groups of one chunk from a stage, half by half (K order per
// accumulator: steps 0 .. 3, then 4 .. 7, as the tail and the host model sum them). Per half h:
// each group's activation fragments of the half (two 16-byte loads: v[q][j], units 2h + j)
// feed all kTiles tiles; a tile's 8 code bytes of each row (half h) are decoded into the A
// fragments of steps 4h .. 4h + 3, a[s][0..3], registers {row g k-pair 0, row g+8 pair 0, row g
// pair 1, row g+8 pair 1} (mma.m16n8k16's A layout), each pair = one code byte, scaled. The mma
// run step by step over the groups, so back-to-back mma write different accumulators. Dead
// groups (a pass's rows past row_end: clamped copies of its last row) run too and are not
// stored: the chunk has no branch, so the scheduler may overlap a tile's decode with the
// previous tile's mma (a dead group costs 8 mma per KiB of codes, ~4 % of the instructions).
template <int kGroups>
__device__ __forceinline__ void mma_chunk(const uint8_t* stage, int warp, int lane,
                                          float (&acc)[kTiles][kGroups][4]) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint4 v[kGroups][2];
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        v[q][j] = *reinterpret_cast<const uint4*>(stage + act_offset(q, 2 * h + j, lane));
      }
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      uint32_t a[4][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint2 w =
            *reinterpret_cast<const uint2*>(stage + code_offset(warp, i, r, lane) + 8 * h);
        const E2m1Bf16Table table = block_table(stage[scale_offset(warp, i, r, g, 2 * t + h)]);
        uint32_t e[4];
        e2m1x8_to_bf16x2(w.x, table, e);  // elements 16 h + 0 .. 7
        a[0][r] = e[0];
        a[0][2 + r] = e[1];
        a[1][r] = e[2];
        a[1][2 + r] = e[3];
        e2m1x8_to_bf16x2(w.y, table, e);  // elements 16 h + 8 .. 15
        a[2][r] = e[0];
        a[2][2 + r] = e[1];
        a[3][r] = e[2];
        a[3][2 + r] = e[3];
      }
#pragma unroll
      for (int st = 0; st < 4; ++st) {
#pragma unroll
        for (int q = 0; q < kGroups; ++q) {
          const uint4& x = v[q][st / 2];
          mma_bf16(acc[i][q], a[st], st % 2 == 0 ? x.x : x.z, st % 2 == 0 ? x.y : x.w);
        }
      }
    }
  }
}

// One 16-element block b of the K tail, from global memory: lane t owns elements 4t .. 4t + 3
// (two code bytes) of each weight row and activation row (row_starts: the groups' rows).
template <int kGroups>
__device__ __forceinline__ void tail_block(const Lane& l, int64_t b,
                                           const bf16_t* const (&row_starts)[kGroups], int live,
                                           int t, float (&acc)[kTiles][kGroups][4]) {
  uint2 x[kGroups] = {};
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    if (q >= live) break;
    x[q] = __ldg(reinterpret_cast<const uint2*>(row_starts[q] + b * 16 + t * 4));
  }
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row_S = (l.code_off[i][r] - 16u * static_cast<uint32_t>(t)) / 8u;
      const uint8_t* c = l.codes + row_S * 8 + b * 8 + t * 2;
      const uint32_t w = static_cast<uint32_t>(c[0]) | (static_cast<uint32_t>(c[1]) << 8);
      const uint32_t s = scale_bf16x2(l.scales[row_S + b]);
      uint32_t p0, p1;
      e2m1x4_to_bf16x2(w, p0, p1);
      a[r] = mul_bf16x2(p0, s);
      a[2 + r] = mul_bf16x2(p1, s);
    }
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (q >= live) break;
      mma_bf16(acc[i][q], a, x[q].x, x[q].y);
    }
  }
}

__device__ __forceinline__ bf16_t* out_row(const Nvfp4GroupedGemmArgs& a, int64_t m) {
  if (a.combine_R == nullptr) return a.out_MN + m * a.ld_out;
  const int32_t src = a.recv_src_M[m];
  return a.combine_R[src_rank(src, a.T, a.top_k)] + src_slot(src, a.T, a.top_k) * a.N;
}

// kGroups: 8-row activation groups per weight pass (more rows loop, re-streaming the weights).
// kWide: cp.async staging (K % 64 == 0, scales 4-byte aligned), else through registers.
// kSwiglu (W13 with the SwiGLU epilogue): tile i's A rows are 8 gate rows f0 + 8 i + g and their
// 8 up rows F + f0 + 8 i + g, so a lane holds gate and up of the same (row m, column f) and
// stores h = act(bf16(gate), bf16(up)) as the unfused kernel does (core/activation.h).
// kSplit: split blockIdx.z of gridDim.z stores its unscaled fp32 sums at partials_SMN[z, m, n]
// (gate at n = f, up at n = F + f); the reduce kernel applies the scale and the epilogue.
// Dynamic shared memory: ring_stages<kSplit>() * stage_bytes(kGroups).
template <int kGroups, bool kWide, bool kSwiglu, bool kSplit>
__global__ void __launch_bounds__(kGemmThreads, ctas_per_sm<kGroups, kSplit>())
    nvfp4_gemm_kernel(const Params p) {
  constexpr int kStages = ring_stages<kSplit>();
  extern __shared__ uint4 smem_stages[];
  uint8_t* const smem = reinterpret_cast<uint8_t*>(smem_stages);
  const Nvfp4GroupedGemmArgs& a = p.a;
  const int e = static_cast<int>(blockIdx.y);
  if ((a.skip != nullptr && *a.skip != 0) || (a.replay_skip != nullptr && *a.replay_skip != 0)) {
    return;
  }
  const int64_t row_begin = a.offsets_E1[e];
  const int64_t row_end = a.offsets_E1[e + 1] < a.M ? a.offsets_E1[e + 1] : a.M;
  if (row_end <= row_begin) return;  // CTA-uniform, before any barrier
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // mma groupID: a tile's weight rows g, g + 8
  // Unfused: tile i = weight rows n0 + 16 i + g, n0 + 16 i + g + 8. kSwiglu: tile i = gate row
  // f0 + 8 i + g and up row F + f0 + 8 i + g. Rows past the end: clamped, loaded, unstored; a
  // warp with none (warp_live false) copies and computes nothing but joins the barriers.
  const int64_t F = a.N / 2;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSlab + warp * kRowsPerWarp;
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * (kSlab / 2) + warp * (kRowsPerWarp / 2);
  const bool warp_live = kSwiglu ? f0 < F : n0 < a.N;

  Lane l;
  l.codes = a.b_codes_ENP + static_cast<int64_t>(e) * a.N * p.P;
  l.scales = a.b_scales_ENS + static_cast<int64_t>(e) * a.N * p.S;
  // Opaque, like the offsets: held (or spilled) rather than recomputed from e, N, P and the row
  // clamps at every copy of every chunk (the compiler otherwise rematerializes them).
  asm volatile("" : "+l"(l.codes), "+l"(l.scales));
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int64_t n;
      if constexpr (kSwiglu) {
        const int64_t f = f0 + 8 * i + g;
        n = r * F + (f < F ? f : F - 1);
      } else {
        n = n0 + 16 * i + g + 8 * r < a.N ? n0 + 16 * i + g + 8 * r : a.N - 1;
      }
      l.code_off[i][r] = static_cast<uint32_t>(n * p.P + 16 * t);
      asm volatile("" : "+r"(l.code_off[i][r]));
      if (r == scale_copy_r(lane)) {
        l.scale_off[i] = static_cast<uint32_t>(n * p.S + scale_copy_block(lane));
      }
    }
    asm volatile("" : "+r"(l.scale_off[i]));
  }
  [[maybe_unused]] const float global = a.b_global_E[e];  // split-K: the reduce applies it
  // Chunk counts in 32 bits (N * K / 2 < 2^32 with N >= 1: K / 128 < 2^26).
  const int all_chunks = static_cast<int>(a.K / kChunk);
  const int z = kSplit ? static_cast<int>(blockIdx.z) : 0;
  const int splits = kSplit ? static_cast<int>(gridDim.z) : 1;
  const int c_begin = static_cast<int>(static_cast<int64_t>(all_chunks) * z / splits);
  const int chunks =
      static_cast<int>(static_cast<int64_t>(all_chunks) * (z + 1) / splits) - c_begin;
  // The K tail's 16-element blocks [tail_begin, tail_end): the last split's.
  const int64_t tail_begin = static_cast<int64_t>(all_chunks) * (kChunk / 16);
  const int64_t tail_end = z == splits - 1 ? a.K / 16 : tail_begin;
  const uint32_t c_first = static_cast<uint32_t>(c_begin);
  // This thread's activation unit of each group: row 8 q + unit_row, elements act_copy_element
  // .. + 7 of a chunk.
  const int unit_row = act_copy_row(tid);
  constexpr int kStageBytes = stage_bytes(kGroups);

  for (int64_t m0 = row_begin; m0 < row_end; m0 += 8 * kGroups) {
    const int live = static_cast<int>((row_end - m0 + 7) / 8 < kGroups ? (row_end - m0 + 7) / 8
                                                                        : kGroups);
    const bf16_t* act_MK = a.a_MK + m0 * a.K;  // the pass's first row
    uint32_t act_off[kGroups];
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int64_t m = m0 + q * 8 + unit_row < row_end ? m0 + q * 8 + unit_row : row_end - 1;
      act_off[q] = static_cast<uint32_t>((m - m0) * a.K + act_copy_element(tid));
    }
    float acc[kTiles][kGroups][4] = {};

    // Ring: chunk c in stage c % kStages. Before the copies into a stage, every warp is past its
    // reads of it (the barrier of the previous pass, or of the chunk after it).
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < chunks) {
        copy_chunk<kWide, kGroups>(l, c_first + static_cast<uint32_t>(s), smem + s * kStageBytes,
                                   warp, tid, warp_live, act_MK, act_off);
      }
      cp_async_commit();
    }
    int read_stage = 0, write_stage = kStages - 1;
    for (int c = 0; c < chunks; ++c) {
      // Chunk c's copies are done (this thread's), then visible to all and stage c - 1 is free.
      cp_async_wait<kStages - 2>();
      __syncthreads();
      if (c + kStages - 1 < chunks) {
        copy_chunk<kWide, kGroups>(l, c_first + static_cast<uint32_t>(c + kStages - 1),
                                   smem + write_stage * kStageBytes, warp, tid, warp_live, act_MK,
                                   act_off);
      }
      cp_async_commit();
      if (warp_live) mma_chunk<kGroups>(smem + read_stage * kStageBytes, warp, lane, acc);
      read_stage = read_stage == kStages - 1 ? 0 : read_stage + 1;
      write_stage = write_stage == kStages - 1 ? 0 : write_stage + 1;
    }
    if (!warp_live) continue;  // warp-uniform; the next pass's barrier waits for it
    if (tail_begin < tail_end) {
      const bf16_t* row_starts[kGroups];  // the lane's activation rows
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        const int64_t mg = m0 + q * 8 + g < row_end ? m0 + q * 8 + g : row_end - 1;
        row_starts[q] = a.a_MK + mg * a.K;
      }
      for (int64_t b = tail_begin; b < tail_end; ++b) {
        tail_block<kGroups>(l, b, row_starts, live, t, acc);
      }
    }

    // acc[i][q]: {(A row g, m 2t), (A row g, m 2t+1), (A row g+8, m 2t), (A row g+8, m 2t+1)} of
    // tile i and group q. The pass's first row through an empty asm: the stores' addresses and
    // bounds are computed here, not hoisted above the chunk loop and held in registers across it.
    int64_t m_pass = m0;
    asm volatile("" : "+l"(m_pass));
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        if (q >= live) break;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t m = m_pass + q * 8 + 2 * t + j;
          if (m >= row_end) continue;
          const int64_t f = f0 + 8 * i + g;
          if constexpr (kSplit) {
            float* part = p.partials_SMN + (z * a.M + m) * a.N;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int64_t n = kSwiglu ? r * F + f : n0 + 16 * i + g + 8 * r;
              if (kSwiglu ? f < F : n < a.N) part[n] = acc[i][q][2 * r + j];
            }
          } else if constexpr (kSwiglu) {
            if (f >= F) continue;
            const float gate = bf16_to_float(to_bf16(__fmul_rn(acc[i][q][j], global)));
            const float up = bf16_to_float(to_bf16(__fmul_rn(acc[i][q][2 + j], global)));
            a.out_MN[m * a.ld_out + f] = to_bf16(swiglu_forward(gate, up, a.act));
          } else {
            bf16_t* out = out_row(a, m);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int64_t n = n0 + 16 * i + g + 8 * r;
              if (n < a.N) out[n] = to_bf16(__fmul_rn(acc[i][q][2 * r + j], global));
            }
          }
        }
      }
    }
  }
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
__global__ void __launch_bounds__(256) nvfp4_splitk_reduce_kernel(const Params p, int splits) {
  const Nvfp4GroupedGemmArgs& a = p.a;
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
    const float* part = p.partials_SMN + m * a.N + n;
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
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= 65535, "E", "1 .. 65535 (grid y)", a.E);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % 16 == 0, "K", "> 0 and a multiple of 16 (NVFP4 blocks)", a.K);
  EPMOE_CHECK_ARG(a.N > 0, "N", "> 0", a.N);
  gemm::check_output_destination(a);
  EPMOE_CHECK_ARG(a.K < (int64_t{1} << 27), "K",
                  "< 2^27 (32-bit activation offsets over a pass's 32 rows)", a.K);
  EPMOE_CHECK_ARG(a.N * (a.K / 2) <= int64_t{0xffffffff}, "N, K",
                  "N * K / 2 < 2^32 (32-bit offsets inside one expert's codes)",
                  std::to_string(a.N) + ", " + std::to_string(a.K));
  EPMOE_CHECK_ARG(a.groups == 0 || a.groups == 1 || a.groups == 2 || a.groups == 4, "groups",
                  "0 (EPMOE_NVFP4_GROUPS or the heuristic), 1, 2 or 4", a.groups);
  gemm::check_device_pointer(a.b_codes_ENP, "b_codes_ENP", 16);
  gemm::check_device_pointer(a.b_scales_ENS, "b_scales_ENS", 1);
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

}  // namespace

int64_t nvfp4_splitk_scratch_bytes(int splits, int64_t M, int64_t N) {
  return splits <= 1 ? 0 : static_cast<int64_t>(splits) * M * N * 4;
}

namespace {
int64_t nvfp4_grid_ctas(int64_t N, int E, bool swiglu) {
  const int64_t slabs = swiglu ? (N / 2 + kSlab / 2 - 1) / (kSlab / 2) : (N + kSlab - 1) / kSlab;
  return slabs * E;
}
}  // namespace

Nvfp4Splits nvfp4_choose_splits(int64_t N, int64_t K, int E, bool swiglu, int sms) {
  Nvfp4Splits c;
  const int64_t ctas = nvfp4_grid_ctas(N, E, swiglu);
  const int64_t chunks = K / kChunk;
  const int64_t target = static_cast<int64_t>(kNvfp4TargetCtasPerSm) * sms;
  // The most splits whose CTAs still fit one wave of resident CTAs (a second, partial wave
  // would idle SMs at its end); at least one.
  int64_t splits = target / ctas;
  const int64_t by_chunks = chunks / kNvfp4MinChunksPerSplit;
  if (splits > by_chunks) splits = by_chunks;
  if (splits > kNvfp4MaxSplits) splits = kNvfp4MaxSplits;
  c.splits = splits < 1 ? 1 : static_cast<int>(splits);
  c.reason = std::to_string(ctas) + " CTAs (" + std::to_string(E) + " experts) within " +
             std::to_string(kNvfp4TargetCtasPerSm) + " x " + std::to_string(sms) + " SMs, " +
             std::to_string(chunks) + " chunks of K (>= " +
             std::to_string(kNvfp4MinChunksPerSplit) + " per split, <= " +
             std::to_string(kNvfp4MaxSplits) + " splits): " + std::to_string(c.splits) +
             " split(s)";
  return c;
}

int nvfp4_launch_splits(const Nvfp4GroupedGemmArgs& a) {
  // At most one split per chunk, and grid z's limit.
  const int64_t chunks = a.K / kChunk < 65535 ? a.K / kChunk : 65535;
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
  // Unset: the heuristic. (With 64-row CTAs its split of mixtral-8x7b's W2, 3 of 512 CTAs,
  // measured 2.5 % slower than one, bench/RESULTS.md "e86d331"; with 256-row CTAs one split is
  // 128 CTAs, under one per SM.) EPMOE_NVFP4_SPLITK=1 forces one.
  int64_t n = 0;
  if (const char* env = std::getenv("EPMOE_NVFP4_SPLITK"); env != nullptr) {
    const bool automatic = std::strcmp(env, "auto") == 0;
    n = automatic ? 0 : std::atoll(env);
    EPMOE_CHECK_ARG(automatic || n >= 1, "EPMOE_NVFP4_SPLITK", "auto or a count >= 1", env);
  }
  if (n < 1) {
    n = nvfp4_choose_splits(a.N, a.K, a.E, a.swiglu, sm_count()).splits;
  } else if (n > chunks) {
    n = chunks < 1 ? 1 : chunks;
  }
  return static_cast<int>(n < fit ? n : fit);  // what the scratch holds
}

Nvfp4Groups nvfp4_choose_groups(int64_t M, int E) {
  Nvfp4Groups c;
  const int64_t mean = E < 1 ? M : (M + E - 1) / E;
  // Twice the mean fits one pass: routed counts vary around it, and a second pass re-streams
  // the expert's weights while dead groups cost only their accumulators' registers.
  c.groups = 2 * mean <= 8 ? 1 : (2 * mean <= 16 ? 2 : 4);
  c.reason = std::to_string(M) + " rows over " + std::to_string(E) + " experts: ~" +
             std::to_string(mean) + " per expert; the fewest groups holding twice that (at most " +
             "4): " + std::to_string(c.groups) + " 8-row group(s) (" +
             std::to_string(kTiles * c.groups * 4) + " accumulator registers per thread)";
  return c;
}

int nvfp4_launch_groups(const Nvfp4GroupedGemmArgs& a) {
  if (a.groups != 0) return a.groups;
  if (const char* env = std::getenv("EPMOE_NVFP4_GROUPS"); env != nullptr) {
    const int n = std::atoi(env);
    EPMOE_CHECK_ARG(n == 1 || n == 2 || n == 4, "EPMOE_NVFP4_GROUPS", "1, 2 or 4", env);
    return n;
  }
  return nvfp4_choose_groups(a.M, a.E).groups;
}

namespace {
// The shared-memory limit is a per-device attribute of each instantiation: set once per device,
// with the carveout preference for shared memory (the resident CTAs are counted in it; L1 keeps
// only scale copies and the K tail).
template <int kGroups, bool kWide, bool kSwiglu, bool kSplit>
void launch_kernel(const Params& p, dim3 grid, cudaStream_t st) {
  constexpr int kBytes = ring_stages<kSplit>() * stage_bytes(kGroups);
  static std::atomic<uint64_t> set_on{0};  // bit d: set on device d
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device % 64);
  if ((set_on.load(std::memory_order_acquire) & bit) == 0) {
    const auto kernel = nvfp4_gemm_kernel<kGroups, kWide, kSwiglu, kSplit>;
    EPMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          cudaSharedmemCarveoutMaxShared));
    set_on.fetch_or(bit, std::memory_order_release);
  }
  nvfp4_gemm_kernel<kGroups, kWide, kSwiglu, kSplit><<<grid, kGemmThreads, kBytes, st>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <int kGroups, bool kWide>
void launch_gemm(const Params& p, dim3 grid, cudaStream_t st, bool swiglu, bool split) {
  if (split && swiglu) {
    launch_kernel<kGroups, kWide, true, true>(p, grid, st);
  } else if (split) {
    launch_kernel<kGroups, kWide, false, true>(p, grid, st);
  } else if (swiglu) {
    launch_kernel<kGroups, kWide, true, false>(p, grid, st);
  } else {
    launch_kernel<kGroups, kWide, false, false>(p, grid, st);
  }
}
}  // namespace

void nvfp4_grouped_gemm(const Nvfp4GroupedGemmArgs& args, void* stream) {
  check_args(args);
  if (args.M == 0) return;
  const int splits = nvfp4_launch_splits(args);
  const Params p{args, args.K / 2, args.K / 16, splits > 1 ? args.splitk_scratch_SMN : nullptr};
  const int64_t slabs = nvfp4_grid_ctas(args.N, 1, args.swiglu);
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(args.E),
                  static_cast<unsigned>(splits));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  // cp.async staging: 16-byte code copies (P % 16 == 0) and 4-byte scale copies (S % 4 == 0,
  // so K % 64 == 0, and 4-byte aligned scales). Otherwise register copies, four groups only.
  const bool wide =
      p.S % 4 == 0 && reinterpret_cast<uintptr_t>(args.b_scales_ENS) % 4 == 0;
  const bool split = splits > 1;
  if (!wide) {
    launch_gemm<4, false>(p, grid, st, args.swiglu, split);
  } else {
    switch (nvfp4_launch_groups(args)) {
      case 1:
        launch_gemm<1, true>(p, grid, st, args.swiglu, split);
        break;
      case 2:
        launch_gemm<2, true>(p, grid, st, args.swiglu, split);
        break;
      default:
        launch_gemm<4, true>(p, grid, st, args.swiglu, split);
        break;
    }
  }
  if (!split) return;
  const int64_t cols = args.swiglu ? args.N / 2 : args.N;
  const unsigned blocks = grid_for(args.M * cols, 256);
  if (args.swiglu) {
    nvfp4_splitk_reduce_kernel<true><<<blocks, 256, 0, st>>>(p, splits);
  } else {
    nvfp4_splitk_reduce_kernel<false><<<blocks, 256, 0, st>>>(p, splits);
  }
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
