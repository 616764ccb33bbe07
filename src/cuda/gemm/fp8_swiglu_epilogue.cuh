// The FP8 W2 DGRAD's epilogue: acc = grad_h; the SwiGLU backward with the saved h13 and the 1x128
// E4M3 rows of grad_h13 (what the W13 DGRAD reads), bitwise what the unfused chain writes (the
// GEMM storing bf16 grad_h, then swiglu.cu's swiglu_backward_fp8_rows): grad_h13 and h (bf16),
// grad_h13's codes and scales, and with row scores the grad_scores partials.
//
// F % 128 == 0 and BLOCK_N == 128: a tile's 128 columns of grad_h at f0 give exactly one 1x128
// block of d gate (grad_h13 columns f0 ..) and one of d up (F + f0 ..). So that a row's block is
// 16 lanes of a warp, as in the unfused kernel (the same fp8_quantize_run8: integer amax over the
// 16 lanes, scale, division-free encode), the warpgroup stages 32 rows x 128 columns at a time
// (rows 0-31 from warps 0-1, then rows 32-63 from warps 2-3: a warp's fragment rows are its 16)
// rounded to bf16 as the unfused GEMM stores grad_h, and thread t then owns columns
// 8 (t % 16) .. + 7 of staged row t / 16 + 8 p in pass p. The 8 lanes of a 64-column half are a
// grad_scores chunk: the same xor tree as the unfused kernel. The math runs in a pass loop that is
// not unrolled (code size, as for the bf16 SwigluBackwardEpilogue); the h13 it loads is prefetched
// into L2 before the tile's main loop (prefetch, which the kernel calls where an epilogue has it),
// and each pass issues the next pass's loads before its math.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "core/activation.h"
#include "core/formats/fp8_block.h"
#include "core/numeric.h"
#include "core/plan_terms.h"
#include "cuda/formats/fp8_row_vectors.cuh"
#include "cuda/gemm/grouped_gemm_sm90.cuh"
#include "cuda/placed.h"
#include "cuda/swiglu_backward_run8.cuh"

namespace epmoe::cuda::gemm {

template <class Traits>
struct SwigluBackwardFp8Epilogue {
  struct Params {
    Placed h13;               // [capacity, 2F] saved (placed by the layer plan)
    bf16_t* grad_h13;         // [capacity, 2F]
    bf16_t* h;                // [capacity, F]
    Fp8RowsOut q;             // grad_h13's E4M3 rows: codes [capacity, 2F], S-major scales
    int64_t F;                // a multiple of 128
    ActivationParams act;
    const float* row_scores;  // [capacity] f32, nullable: grad_h is already scaled
    float* score_parts;       // [capacity, score_chunks] f32 (with row_scores)
    int64_t score_chunks;
  };
  static_assert(Traits::BLOCK_N == kFp8RowBlock, "a tile's columns are one 1x128 block");
  static_assert(kScoreChunkCols * 2 == Traits::BLOCK_N, "a score chunk is 8 lanes of a block's 16");
  static constexpr int kRows = 32;                         // staged rows a round
  static constexpr int kPitch = 2 * Traits::BLOCK_N + 16;  // bytes; +16 spreads the banks
  static constexpr int kSmemBytesPerWarpgroup = kRows * kPitch;
  Params p;
  const bf16_t* h13;  // p.h13 resolved once, before the mainloop
  char* smem;         // [kRows][kPitch]
  int wg;             // consumer warpgroup (names its barrier)
  int row_block;      // its rows in the tile: [64 * row_block, 64 * row_block + 64)
  int tid;            // thread in the warpgroup
  __device__ void finish() const {}
  __device__ SwigluBackwardFp8Epilogue(const Params& params, char* stage, int warpgroup, int rows, int thread)
      : p(params), h13(params.h13.template get<const bf16_t>()), smem(stage), wg(warpgroup),
        row_block(rows), tid(thread) {}

  // Before the tile's main loop: the h13 runs this thread's passes will load, requested into L2, so
  // that the passes (run one after another) wait on L2 rather than DRAM.
  __device__ void prefetch(const TileCoord& t) const {
    const int64_t f = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N + 8 * (tid % 16);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {  // round i / 4, pass i % 4
      const int m = 64 * row_block + 32 * (i / 4) + 8 * (i % 4) + tid / 16;
      if (m < t.rows_valid) {
        const bf16_t* gate = h13 + (static_cast<int64_t>(t.row0) + m) * 2 * p.F + f;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(gate)));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(gate + p.F)));
      }
    }
  }

  __device__ void sync() const {
    barrier_sync(GemmBarrier::epilogue_wg0, wg, 128);
  }

  // This warp's 16 fragment rows (16 (w % 2) + l / 4 + 8 h of the round's 32), all 128 columns
  // (value i = j + 2 h + 4 g at column 8 g + 2 (l % 4) + j), rounded to bf16.
  template <class Acc>
  __device__ __forceinline__ void put(const Acc& acc) const {
    const int warp = tid / 32, lane = tid % 32;
    CUTE_UNROLL
    for (int g = 0; g < Traits::BLOCK_N / 8; ++g) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * g + 2 * h;
        const int row = 16 * (warp % 2) + lane / 4 + 8 * h, col = 8 * g + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(smem + row * kPitch + col * 2) = pack_bf16x2(acc(i), acc(i + 1));
      }
    }
  }

  // Gate and up of this thread's run in pass `pass` of round `half`, if its row is in the group.
  __device__ __forceinline__ void load_h13(const TileCoord& t, int64_t f, int half, int pass, uint4& gate,
                                           uint4& up) const {
    const int m = 64 * row_block + 32 * half + 8 * pass + tid / 16;
    if (m >= t.rows_valid) return;
    const bf16_t* h13_2F = h13 + (static_cast<int64_t>(t.row0) + m) * 2 * p.F;  // [2F]
    gate = load_vec(h13_2F + f);
    up = load_vec(h13_2F + p.F + f);
  }

  // The staged rows of round `half` (warpgroup rows [32 half, 32 half + 32)): SwiGLU backward,
  // quantization and the stores. A row's 16 lanes are all valid or all masked. The next pass's h13
  // loads are issued before this pass's math.
  __device__ __forceinline__ void rows_out(const TileCoord& t, int64_t f0, int half) const {
    const int seg = tid % 16;
    const int64_t f = f0 + 8 * seg;  // first of this thread's 8 columns; f < F
    const int lane = tid % 32;
    const unsigned block_lanes = 0xffffu << (lane & 16);  // the row's 16 lanes: one 1x128 block
    const unsigned chunk_lanes = 0xffu << (lane & 24);    // 8 of them: one 64-column score chunk
    const bool scored = p.row_scores != nullptr;          // kernel-uniform
    const int64_t F = p.F;
    uint4 gate_next = make_uint4(0u, 0u, 0u, 0u), up_next = gate_next;
    load_h13(t, f, half, 0, gate_next, up_next);
#pragma unroll 1
    for (int pass = 0; pass < 4; ++pass) {
      const uint4 gate = gate_next, up = up_next;
      if (pass + 1 < 4) load_h13(t, f, half, pass + 1, gate_next, up_next);
      const int r = 8 * pass + tid / 16;
      const int m = 64 * row_block + 32 * half + r;
      if (m >= t.rows_valid) continue;
      const int64_t row = static_cast<int64_t>(t.row0) + m;
      const float score = scored ? p.row_scores[row] : 1.0f;
      const SwigluBackwardRun8 o = swiglu_backward_run8(
          gate, up, *reinterpret_cast<const uint4*>(smem + r * kPitch + seg * 16), scored, score, p.act);
      bf16_t* grad_2F = p.grad_h13 + row * 2 * F;  // [2F]
      store_vec(grad_2F + f, o.d_gate);
      store_vec(grad_2F + F + f, o.d_up);
      store_vec(p.h + row * F + f, o.h);
      store_fp8_run8(p.q, row, 2 * F, f, fp8_quantize_run8(o.d_gate, true, block_lanes));
      store_fp8_run8(p.q, row, 2 * F, F + f, fp8_quantize_run8(o.d_up, true, block_lanes));
      if (scored) {
        const float dot = chunk_dot_sum(o.dot, chunk_lanes);
        if (seg % 8 == 0) p.score_parts[row * p.score_chunks + f / kScoreChunkCols] = dot;
      }
    }
  }

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& grad_h, const Acc1&) const {
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      if (64 * row_block + 32 * half >= t.rows_valid) break;  // uniform over the warpgroup
      if (tid / 64 == half) put(grad_h);
      sync();
      rows_out(t, f0, half);
      sync();
    }
  }
};

}  // namespace epmoe::cuda::gemm
