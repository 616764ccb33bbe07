// NVFP4 weight-only grouped GEMM for few rows per expert (decode), swap-AB on mma.sync:
// the weights are the 16-row A operand of mma.m16n8k16 (decoded from E2M1 x E4M3 into bf16 in
// registers), eight activation rows the B operand, so one weight element is read once per 32
// activation rows (kGroups x 8) and the weight stream sets the time.
//
// Work: CTA (n-slab of 64 weight rows, expert e, K split z), four warps of 16 rows each; a warp
// sums its split's chunks for its 16 x 8 tiles. One split (grid z = 1): the warp sums all of K and
// stores bf16. Several (split-K, deterministic without atomics): split z sums the chunks
// [z * chunks / splits, (z + 1) * chunks / splits) (the last split also the K tail) and stores fp32
// partials [splits, M, N] into the caller's scratch; a reduce kernel sums them in ascending split
// order and applies the global scale and the epilogue (plain, combine slots, SwiGLU). Splits give
// the grid enough CTAs to keep HBM busy when N * E is small against K (mixtral W2: 64 slabs x 8
// experts = 512 CTAs of 112 chunks each). CTAs of experts without rows return at once (offsets
// read on the device).
//
// K order: an mma's 16 k are any 16 of K as long as A and B agree. Per 128-element chunk, lane
// quad position t (lane % 4) owns elements [32 t, 32 t + 32) of its rows (16 code bytes: one
// 16-byte load per row) and feeds elements 32 t + 4 j + {0, 1} / {2, 3} to step j's k pairs
// {2t, 2t+1} / {2t+8, 2t+9}; its activation elements are the same 32 (four 16-byte loads). A tail
// of K % 128 elements runs one 16-element block per step, lane t owning elements 4t .. 4t + 3.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/activation.h"
#include "core/formats/e2m1_bf16.h"
#include "core/layout.h"
#include "cuda/check.h"
#include "cuda/gemm/nvfp4_gemm.h"
#include "cuda/gemm/launch_checks.h"
#include "cuda/kernel_common.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kGemmThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;                    // mma M: weight rows (outputs' columns n)
constexpr int kSlab = kWarps * kRowsPerWarp;        // weight rows per CTA
constexpr int kGroups = 4;                          // 8-row activation groups per weight pass
constexpr int kChunk = 128;                         // K elements per chunk (64 code bytes a row)
constexpr int kDepth = 4;                           // chunks in flight per warp

struct Params {
  Nvfp4GroupedGemmArgs a;
  int64_t P, S;                    // code bytes and scale blocks per weight row
  float* partials_SMN = nullptr;   // split-K: [splits, M, N] fp32 (the caller's scratch)
};

// Streamed once: no L1 allocation. kWide: the row pitch P is a multiple of 16 (one 16-byte load),
// else two 8-byte loads (P % 8 == 0 since K % 16 == 0).
template <bool kWide>
__device__ __forceinline__ uint4 load_codes(const uint8_t* p) {
  uint4 v;
  if constexpr (kWide) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p));
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.z), "=r"(v.w)
                 : "l"(p + 8));
  }
  return v;
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

// One chunk of a lane's two weight rows (g and g + 8 of the warp's 16): 32 codes each, and their
// two block scales (blocks 2t, 2t + 1) in the low 16 bits of scales[r], the first in the low byte.
struct Chunk {
  uint4 codes[2];
  uint32_t scales[2];
};

// Per-thread view of the warp's weight rows: where the next chunk's loads read (advanced by each
// load, so the loop carries pointers instead of recomputing 64-bit addresses).
struct Lane {
  const uint8_t* codes[2];   // row g, row g + 8: this lane's code bytes of the next chunk
  const uint8_t* scales[2];  // their scale bytes of the next chunk
};

// kWide: the scale row pitch K / 16 is even as well (K % 32 == 0): one 2-byte load.
template <bool kWide>
__device__ __forceinline__ Chunk load_chunk(Lane& l) {
  Chunk ch;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ch.codes[r] = load_codes<kWide>(l.codes[r]);
    if constexpr (kWide) {
      ch.scales[r] = __ldg(reinterpret_cast<const unsigned short*>(l.scales[r]));
    } else {
      ch.scales[r] = static_cast<uint32_t>(__ldg(l.scales[r])) |
                     (static_cast<uint32_t>(__ldg(l.scales[r] + 1)) << 8);
    }
    l.codes[r] += kChunk / 2;
    l.scales[r] += kChunk / 16;
  }
  return ch;
}

// A block's decode table (core/formats/e2m1_bf16.h): the E2M1 magnitudes times the block scale.
__device__ __forceinline__ E2m1Bf16Table block_table(float scale) {
  const uint32_t s = scale_bf16x2(scale);
  return e2m1_bf16_table(mul_bf16x2(kE2m1Bf16x2_01, s), mul_bf16x2(kE2m1Bf16x2_23, s),
                         mul_bf16x2(kE2m1Bf16x2_45, s), mul_bf16x2(kE2m1Bf16x2_67, s));
}

// A fragments of the chunk's 8 steps: step j, registers {row g k-pair 0, row g+8 pair 0, row g
// pair 1, row g+8 pair 1} (mma.m16n8k16's A layout), each pair = one code byte, scaled.
__device__ __forceinline__ void decode_chunk(const Chunk& ch, uint32_t (&a)[8][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t words[4] = {ch.codes[r].x, ch.codes[r].y, ch.codes[r].z, ch.codes[r].w};
    // The lane's two block scales (blocks 2t, 2t + 1: elements 0..15, 16..31) in one conversion.
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(ch.scales[r]), __NV_E4M3);
    const float2 sc = __half22float2(__half2(h2));
    const E2m1Bf16Table tables[2] = {block_table(sc.x), block_table(sc.y)};
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // word q: elements 8q .. 8q + 7 = steps 2q, 2q + 1
      uint32_t e[4];
      e2m1x8_to_bf16x2(words[q], tables[q / 2], e);
      a[2 * q][r] = e[0];
      a[2 * q][2 + r] = e[1];
      a[2 * q + 1][r] = e[2];
      a[2 * q + 1][2 + r] = e[3];
    }
  }
}

// rows: this lane's 32 activation elements of the chunk in each group's row (clamped into the
// expert's rows; columns of rows past the end are computed and never stored), advanced to the
// next chunk. live: groups holding rows (warp-uniform).
__device__ __forceinline__ void mma_chunk(const uint32_t (&a)[8][4], const bf16_t* (&rows)[kGroups],
                                          int live, float (&acc)[kGroups][4]) {
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    if (q >= live) break;
    const uint4* x = reinterpret_cast<const uint4*>(rows[q]);
    const uint4 v[4] = {__ldg(x), __ldg(x + 1), __ldg(x + 2), __ldg(x + 3)};
    rows[q] += kChunk;
    const uint32_t w[16] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w,
                            v[2].x, v[2].y, v[2].z, v[2].w, v[3].x, v[3].y, v[3].z, v[3].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) mma_bf16(acc[q], a[j], w[2 * j], w[2 * j + 1]);
  }
}

// Activations staged in shared memory (kStageAct): each chunk's live activation rows (32 rows x
// 256 bytes at most) are copied once per CTA by cp.async into a ring of kActStages stages, issued
// kActStages - 1 chunks ahead, instead of each warp loading them through L1 just before its MMAs
// (Nsight Compute, bench/RESULTS.md f32be88: 39-48 % of stall cycles on L1TEX scoreboards, L1 hit
// rate 63 %). A row is 16 units of 16 bytes; lane (g, t) reads units 4t .. 4t + 3 of row g, so
// unit u of row r sits at u ^ 2 (bit 3 of u) ^ (r & 1): the 8 lanes of each 128-bit phase then hit
// 8 distinct bank groups.
constexpr int kActStages = 4;
constexpr int kActRows = 8 * kGroups;
constexpr int kActUnits = kChunk * 2 / 16;  // 16-byte units per row of a chunk

__device__ __forceinline__ int act_unit(int u, int row) { return u ^ (((u >> 3) & 1) << 1) ^ (row & 1); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The ring, [kActStages][kActRows][kActUnits] (32 KiB); only the staged kernels reference it.
__device__ __forceinline__ uint4* act_ring() {
  __shared__ alignas(128) uint4 ring[kActStages * kActRows * kActUnits];
  return ring;
}

// Chunk c's live rows (rows m0 + r, clamped into the group) into stage c % kActStages by every
// thread of the CTA, then one cp.async group (empty past the last chunk, so that every thread
// waits on the same group count).
__device__ __forceinline__ void stage_chunk(uint4* ring, const bf16_t* a_MK, int64_t K, int64_t m0,
                                            int64_t row_end, int live, int64_t first_chunk,
                                            int64_t c, int64_t chunks) {
  if (c < chunks) {
    uint4* stage = ring + (c % kActStages) * (kActRows * kActUnits);
    for (int piece = static_cast<int>(threadIdx.x); piece < live * 8 * kActUnits;
         piece += kGemmThreads) {
      const int r = piece / kActUnits, u = piece % kActUnits;
      const int64_t m = m0 + r < row_end ? m0 + r : row_end - 1;
      cp_async16(stage + r * kActUnits + act_unit(u, r), a_MK + m * K + (first_chunk + c) * kChunk + u * 8);
    }
  }
  cp_async_commit();
}

// mma_chunk on a staged chunk: the same MMAs in the same order, activation words from the stage.
__device__ __forceinline__ void mma_chunk_staged(const uint32_t (&a)[8][4], const uint4* stage,
                                                 int g, int t, int live,
                                                 float (&acc)[kGroups][4]) {
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    if (q >= live) break;
    const uint4* row = stage + (q * 8 + g) * kActUnits;
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = row[act_unit(4 * t + i, g)];
    const uint32_t w[16] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w,
                            v[2].x, v[2].y, v[2].z, v[2].w, v[3].x, v[3].y, v[3].z, v[3].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) mma_bf16(acc[q], a[j], w[2 * j], w[2 * j + 1]);
  }
}

// One 16-element block of the K tail: lane t owns elements 4t .. 4t + 3 (two code bytes) of each
// weight row (codes, scale: the block's first code byte and its scale) and activation row.
__device__ __forceinline__ void tail_block(const uint8_t* const (&codes)[2],
                                           const uint8_t* const (&scale)[2],
                                           const bf16_t* const (&rows)[kGroups], int live, int t,
                                           float (&acc)[kGroups][4]) {
  uint32_t a[4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* c = codes[r] + t * 2;
    const uint32_t w = static_cast<uint32_t>(c[0]) | (static_cast<uint32_t>(c[1]) << 8);
    const uint32_t s = scale_bf16x2(*scale[r]);
    uint32_t p0, p1;
    e2m1x4_to_bf16x2(w, p0, p1);
    a[r] = mul_bf16x2(p0, s);
    a[2 + r] = mul_bf16x2(p1, s);
  }
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    if (q >= live) break;
    const uint2 x = __ldg(reinterpret_cast<const uint2*>(rows[q] + t * 4));
    mma_bf16(acc[q], a, x.x, x.y);
  }
}

__device__ __forceinline__ bf16_t* out_row(const Nvfp4GroupedGemmArgs& a, int64_t m) {
  if (a.combine_R == nullptr) return a.out_MN + m * a.ld_out;
  const int32_t src = a.recv_src_M[m];
  return a.combine_R[src_rank(src, a.T, a.top_k)] + src_slot(src, a.T, a.top_k) * a.N;
}

// kSwiglu (W13 with the SwiGLU epilogue): a warp's A rows are 8 gate rows f0 + g and their 8 up
// rows F + f0 + g, so a lane holds gate and up of the same (row m, column f) and stores
// h = act(bf16(gate), bf16(up)) as the unfused kernel does (core/activation.h).
// kSplit: split blockIdx.z of gridDim.z stores its unscaled fp32 sums at partials_SMN[z, m, n]
// (gate at n = f, up at n = F + f); the reduce kernel applies the scale and the epilogue.
// kStageAct (single split): activations through the shared-memory ring above; every warp of the
// CTA then runs every chunk (a warp past N computes on clamped rows and stores nothing).
template <bool kWide, bool kSwiglu, bool kSplit, bool kStageAct = false>
__device__ __forceinline__ void nvfp4_gemm(const Params& p) {
  static_assert(!kStageAct || !kSplit, "staged activations: single split");
  const Nvfp4GroupedGemmArgs& a = p.a;
  const int e = static_cast<int>(blockIdx.y);
  if ((a.skip != nullptr && *a.skip != 0) || (a.replay_skip != nullptr && *a.replay_skip != 0)) {
    return;
  }
  const int64_t row_begin = a.offsets_E1[e];
  const int64_t row_end = a.offsets_E1[e + 1] < a.M ? a.offsets_E1[e + 1] : a.M;
  if (row_end <= row_begin) return;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;  // mma groupID: weight rows g, g + 8; activation row g of a group
  // Unfused: weight rows n0 + g, n0 + g + 8 of 16 per warp. kSwiglu: gate row f0 + g and up row
  // F + f0 + g of 8 columns per warp. Rows past the end: clamped, loaded, unstored.
  const int64_t F = a.N / 2;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSlab + warp * kRowsPerWarp;
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * (kSlab / 2) + warp * (kRowsPerWarp / 2);
  if constexpr (!kStageAct) {
    if (kSwiglu ? f0 >= F : n0 >= a.N) return;  // warp-uniform; no CTA-wide barrier follows
  }

  const int t = lane % 4;
  const uint8_t* code_rows[2];
  const uint8_t* scale_rows[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int64_t n;
    if constexpr (kSwiglu) {
      n = r * F + (f0 + g < F ? f0 + g : F - 1);
    } else {
      n = n0 + g + 8 * r < a.N ? n0 + g + 8 * r : a.N - 1;
    }
    code_rows[r] = a.b_codes_ENP + (e * a.N + n) * p.P;
    scale_rows[r] = a.b_scales_ENS + (e * a.N + n) * p.S;
  }
  [[maybe_unused]] const float global = a.b_global_E[e];  // split-K: the reduce applies it
  const int64_t all_chunks = a.K / kChunk;
  const int64_t z = kSplit ? static_cast<int64_t>(blockIdx.z) : 0;
  const int64_t splits = kSplit ? static_cast<int64_t>(gridDim.z) : 1;
  const int64_t c_begin = all_chunks * z / splits;  // 0 with one split
  const int64_t chunks = all_chunks * (z + 1) / splits - c_begin;
  const bool has_tail = z == splits - 1;

  for (int64_t m0 = row_begin; m0 < row_end; m0 += 8 * kGroups) {
    const int live = static_cast<int>((row_end - m0 + 7) / 8 < kGroups ? (row_end - m0 + 7) / 8
                                                                        : kGroups);
    const bf16_t* row_starts[kGroups];
    const bf16_t* rows[kGroups];  // the lane's elements of the next chunk
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int64_t m = m0 + q * 8 + g < row_end ? m0 + q * 8 + g : row_end - 1;
      row_starts[q] = a.a_MK + m * a.K;
      rows[q] = row_starts[q] + c_begin * kChunk + t * 32;
    }
    Lane l;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l.codes[r] = code_rows[r] + c_begin * (kChunk / 2) + t * 16;
      l.scales[r] = scale_rows[r] + c_begin * (kChunk / 16) + t * 2;
    }
    float acc[kGroups][4] = {};

    [[maybe_unused]] uint4* ring = nullptr;
    if constexpr (kStageAct) {
      ring = act_ring();
#pragma unroll
      for (int s = 0; s < kActStages - 1; ++s) {
        stage_chunk(ring, a.a_MK, a.K, m0, row_end, live, c_begin, s, chunks);
      }
    }
    Chunk buf[kDepth];
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      if (i < chunks) buf[i] = load_chunk<kWide>(l);
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += kDepth) {
#pragma unroll
      for (int i = 0; i < kDepth; ++i) {
        const int64_t c = c0 + i;
        if (c >= chunks) break;
        // Decode first, then refill the slot: the next load needs no registers of its own.
        uint32_t frag[8][4];
        decode_chunk(buf[i], frag);
        if (c + kDepth < chunks) buf[i] = load_chunk<kWide>(l);
        if constexpr (kStageAct) {
          // Chunk c has landed (this thread's copies), and after the barrier every thread's; the
          // barrier also ends every warp's reads of chunk c - 1's stage, which chunk
          // c + kActStages - 1 then refills.
          cp_async_wait<kActStages - 2>();
          __syncthreads();
          mma_chunk_staged(frag, ring + (c % kActStages) * (kActRows * kActUnits), g, t, live, acc);
          stage_chunk(ring, a.a_MK, a.K, m0, row_end, live, c_begin, c + kActStages - 1, chunks);
        } else {
          mma_chunk(frag, rows, live, acc);
        }
      }
    }
    if constexpr (kStageAct) {
      cp_async_wait<0>();
      __syncthreads();  // the next rows' copies may not overwrite stages still being read
    }
    for (int64_t b = all_chunks * (kChunk / 16); has_tail && b < a.K / 16; ++b) {
      const uint8_t* const codes[2] = {code_rows[0] + b * 8, code_rows[1] + b * 8};
      const uint8_t* const scale[2] = {scale_rows[0] + b, scale_rows[1] + b};
      const bf16_t* tail_rows[kGroups];
#pragma unroll
      for (int q = 0; q < kGroups; ++q) tail_rows[q] = row_starts[q] + b * 16;
      tail_block(codes, scale, tail_rows, live, t, acc);
    }

    // acc[q]: {(A row g, m 2t), (A row g, m 2t+1), (A row g+8, m 2t), (A row g+8, m 2t+1)} of
    // group q.
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (q >= live) break;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t m = m0 + q * 8 + 2 * t + i;
        if (m >= row_end) continue;
        if constexpr (kSplit) {
          float* part = p.partials_SMN + (z * a.M + m) * a.N;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t n = kSwiglu ? r * F + f0 + g : n0 + g + 8 * r;
            if (kSwiglu ? f0 + g < F : n < a.N) part[n] = acc[q][2 * r + i];
          }
        } else if constexpr (kSwiglu) {
          const int64_t f = f0 + g;
          if (f >= F) continue;
          const float gate = bf16_to_float(to_bf16(__fmul_rn(acc[q][i], global)));
          const float up = bf16_to_float(to_bf16(__fmul_rn(acc[q][2 + i], global)));
          a.out_MN[m * a.ld_out + f] = to_bf16(swiglu_forward(gate, up, a.act));
        } else {
          bf16_t* out = out_row(a, m);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t n = n0 + g + 8 * r;
            if (n < a.N) out[n] = to_bf16(__fmul_rn(acc[q][2 * r + i], global));
          }
        }
      }
    }
  }
}

template <bool kWide, bool kSwiglu, bool kSplit>
__global__ void __launch_bounds__(kGemmThreads) nvfp4_gemm_kernel(const Params p) {
  nvfp4_gemm<kWide, kSwiglu, kSplit>(p);
}

// The single-split kernel on 16-byte code rows compiled for 4 CTAs per SM (registers capped at
// 128; the SwiGLU one spills 16 bytes): the default, nvfp4_ctas_per_sm(); kStageAct: the
// activations through the shared-memory ring (nvfp4_activations()).
template <bool kSwiglu, bool kStageAct = false>
__global__ void __launch_bounds__(kGemmThreads, 4) nvfp4_gemm_kernel_4ctas(const Params p) {
  nvfp4_gemm<true, kSwiglu, false, kStageAct>(p);
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
  int64_t splits = (target + ctas - 1) / ctas;
  const int64_t by_chunks = chunks / kNvfp4MinChunksPerSplit;
  if (splits > by_chunks) splits = by_chunks;
  if (splits > kNvfp4MaxSplits) splits = kNvfp4MaxSplits;
  c.splits = splits < 1 ? 1 : static_cast<int>(splits);
  c.reason = std::to_string(ctas) + " CTAs (" + std::to_string(E) + " experts) for " +
             std::to_string(kNvfp4TargetCtasPerSm) + " x " + std::to_string(sms) + " SMs, " +
             std::to_string(chunks) + " chunks of K (>= " +
             std::to_string(kNvfp4MinChunksPerSplit) + " per split, <= " +
             std::to_string(kNvfp4MaxSplits) + " splits): " + std::to_string(c.splits) +
             " split(s)";
  return c;
}

// Unset: one split. The heuristic's split of mixtral-8x7b's W2 (3) measured 2.5 % slower than one
// (bench/RESULTS.md "e86d331"), so it runs only when asked for (EPMOE_NVFP4_SPLITK=auto).
int64_t nvfp4_requested_splits() {
  const char* env = std::getenv("EPMOE_NVFP4_SPLITK");
  if (env == nullptr) return 1;
  const bool automatic = std::strcmp(env, "auto") == 0;
  const int64_t n = automatic ? 0 : std::atoll(env);
  EPMOE_CHECK_ARG(automatic || n >= 1, "EPMOE_NVFP4_SPLITK", "auto or a count >= 1", env);
  return n;
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
  int64_t n = nvfp4_requested_splits();
  if (n < 1) {
    n = nvfp4_choose_splits(a.N, a.K, a.E, a.swiglu, sm_count()).splits;
  } else if (n > chunks) {
    n = chunks < 1 ? 1 : chunks;
  }
  return static_cast<int>(n < fit ? n : fit);  // what the scratch holds
}

int nvfp4_ctas_per_sm() {
  // Read per launch (~100 ns), for measurements. The decode GEMM is latency-bound at 12 warps per
  // SM (Nsight Compute, bench/RESULTS.md 7db1bac); 4 CTAs (the SwiGLU kernel capped at 128
  // registers, 16 bytes spilled) measured 7 % faster than 1x4 on every shape (5e64418).
  const char* env = std::getenv("EPMOE_NVFP4_OCCUPANCY");
  if (env == nullptr || std::strcmp(env, "4x4") == 0) return 4;
  EPMOE_CHECK_ARG(std::strcmp(env, "1x4") == 0, "EPMOE_NVFP4_OCCUPANCY", "1x4 or 4x4", env);
  return 1;
}

Nvfp4Activations nvfp4_activations(int64_t rows_per_group) {
  // Read per launch (~100 ns), for measurements.
  const char* env = std::getenv("EPMOE_NVFP4_ACTIVATIONS");
  if (env == nullptr || std::strcmp(env, "rows") == 0) {
    return rows_per_group > kNvfp4L1MaxRows ? Nvfp4Activations::staged : Nvfp4Activations::l1;
  }
  if (std::strcmp(env, "l1") == 0) return Nvfp4Activations::l1;
  EPMOE_CHECK_ARG(std::strcmp(env, "staged") == 0, "EPMOE_NVFP4_ACTIVATIONS", "rows, l1 or staged",
                  env);
  return Nvfp4Activations::staged;
}

namespace {
template <bool kSwiglu>
void launch_occupancy(const Params& p, dim3 grid, cudaStream_t st) {
  if (nvfp4_ctas_per_sm() == 1) {
    nvfp4_gemm_kernel<true, kSwiglu, false><<<grid, kGemmThreads, 0, st>>>(p);
  } else if (nvfp4_activations(p.a.rows_per_group > 0 ? p.a.rows_per_group : p.a.M / p.a.E) ==
             Nvfp4Activations::staged) {
    nvfp4_gemm_kernel_4ctas<kSwiglu, true><<<grid, kGemmThreads, 0, st>>>(p);
  } else {
    nvfp4_gemm_kernel_4ctas<kSwiglu><<<grid, kGemmThreads, 0, st>>>(p);
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
  // Wide loads: 16-byte code rows (P % 16 == 0, so K % 32 == 0 and the scale rows hold an even
  // number of bytes) and 2-byte aligned scales.
  const bool wide =
      p.P % 16 == 0 && reinterpret_cast<uintptr_t>(args.b_scales_ENS) % 2 == 0;
  if (splits > 1) {
    if (wide && args.swiglu) {
      nvfp4_gemm_kernel<true, true, true><<<grid, kGemmThreads, 0, st>>>(p);
    } else if (wide) {
      nvfp4_gemm_kernel<true, false, true><<<grid, kGemmThreads, 0, st>>>(p);
    } else if (args.swiglu) {
      nvfp4_gemm_kernel<false, true, true><<<grid, kGemmThreads, 0, st>>>(p);
    } else {
      nvfp4_gemm_kernel<false, false, true><<<grid, kGemmThreads, 0, st>>>(p);
    }
    EPMOE_CUDA_LAUNCH_CHECK();
    const int64_t cols = args.swiglu ? args.N / 2 : args.N;
    const unsigned blocks = grid_for(args.M * cols, 256);
    if (args.swiglu) {
      nvfp4_splitk_reduce_kernel<true><<<blocks, 256, 0, st>>>(p, splits);
    } else {
      nvfp4_splitk_reduce_kernel<false><<<blocks, 256, 0, st>>>(p, splits);
    }
    EPMOE_CUDA_LAUNCH_CHECK();
    return;
  }
  if (wide && args.swiglu) {
    launch_occupancy<true>(p, grid, st);
  } else if (wide) {
    launch_occupancy<false>(p, grid, st);
  } else if (args.swiglu) {
    nvfp4_gemm_kernel<false, true, false><<<grid, kGemmThreads, 0, st>>>(p);
  } else {
    nvfp4_gemm_kernel<false, false, false><<<grid, kGemmThreads, 0, st>>>(p);
  }
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
