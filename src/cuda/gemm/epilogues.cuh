// Epilogues of the grouped GEMM. Each consumer warpgroup owns 64 rows of the tile; it moves its
// accumulators through a 64 x 128-byte shared-memory stage so that global stores are 16-byte
// vectors along rows (wgmma fragments hold 2 adjacent columns per thread, which would otherwise
// give 4-byte scattered stores). Row destinations are per row, which is what lets the same
// staging serve plain stores, stores into peers' combine slots, and WGRAD's read-modify-write.
//
// Accumulator fragment of a 64 x N wgmma tile (per thread of the warpgroup, warp w, lane l):
//   value i = j + 2 h + 4 g  ->  row 16 w + l / 4 + 8 h,  column 8 g + 2 (l % 4) + j
// Loops below are unrolled with static bounds so every acc(i) is a register, never memory.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "core/activation.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "core/plan_terms.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"
#include "cuda/swiglu_backward_run8.cuh"  // chunk_dot_sum

namespace epmoe::cuda::gemm {

// The stage of one consumer warpgroup and the two phases that use it.
template <class Traits>
struct Stage {
  static constexpr int kPitch = 128 + 16;  // a 128-byte row chunk, +16 to spread banks
  static constexpr int kBytes = 64 * kPitch;
  char* smem;     // [64][kPitch]
  int wg;         // consumer warpgroup (names its barrier)
  int row_block;  // its rows in the tile: [64 * row_block, 64 * row_block + 64)
  int tid;        // thread in the warpgroup

  __device__ int frag_row(int h) const { return 16 * (tid / 32) + (tid % 32) / 4 + 8 * h; }
  __device__ int frag_col(int g) const { return 8 * g + 2 * (tid % 4); }

  __device__ void sync() const {
    barrier_sync(GemmBarrier::epilogue_wg0, wg, 128);
  }

  // Phase 1, bf16: columns [64 C, 64 C + 64) of this warpgroup's 64 rows. value(i, row, col) gives
  // the fp32 value of fragment element i at (row in the warpgroup, column in the tile).
  template <int C, class Value>
  __device__ void put_bf16(Value value) const {
    CUTE_UNROLL
    for (int gg = 0; gg < 8; ++gg) {
      const int g = 8 * C + gg;
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * g + 2 * h;
        const int row = frag_row(h), col = frag_col(g);
        *reinterpret_cast<uint32_t*>(smem + row * kPitch + (col - 64 * C) * 2) =
            pack_bf16x2(value(i, row, col), value(i + 1, row, col + 1));
      }
    }
  }

  // put_bf16 for a chunk c known at run time: a copy per chunk, the one of c taken. The chunk loops
  // of the SwiGLU epilogues stay rolled around it, so their math after the staging exists once in
  // the kernel: unrolled per chunk it made the kernel 6-16 thousand instructions, which the
  // instruction cache does not hold beside the other warpgroup's main loop.
  template <int kChunks, class Value>
  __device__ __forceinline__ void put_bf16_at(int c, Value value) const {
    cute::for_each(cute::make_int_sequence<kChunks>{}, [&](auto chunk) {
      if (c == decltype(chunk)::value) put_bf16<decltype(chunk)::value>(value);
    });
  }

  // Phase 1, fp32: columns [32 C, 32 C + 32).
  template <int C, class Acc>
  __device__ void put_f32(const Acc& acc) const {
    CUTE_UNROLL
    for (int gg = 0; gg < 4; ++gg) {
      const int g = 4 * C + gg;
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int i = 4 * g + 2 * h;
        const int row = frag_row(h), col = frag_col(g);
        *reinterpret_cast<float2*>(smem + row * kPitch + (col - 32 * C) * 4) =
            make_float2(acc(i), acc(i + 1));
      }
    }
  }

  // Phase 2: the warpgroup writes the 64 staged rows, 16 bytes a thread: in pass p (0..3) this
  // thread's row r = 16 p + tid / 8 goes to row_dst(r, p) (nullptr: masked), bytes
  // [0, valid_bytes) of it.
  template <class RowDst>
  __device__ void write_rows(int valid_bytes, RowDst row_dst) const {
    const int seg = tid % 8;
    if (seg * 16 >= valid_bytes) return;
    CUTE_UNROLL
    for (int pass = 0; pass < 4; ++pass) {
      const int r = pass * 16 + tid / 8;
      char* dst = row_dst(r, pass);
      if (dst != nullptr) {
        // A plain copy (LDS.128 then STG.E.128, batched across the passes): store_vec's asm would
        // order each pass's store before the next pass's shared-memory load.
        *reinterpret_cast<uint4*>(dst + seg * 16) =
            *reinterpret_cast<const uint4*>(smem + r * kPitch + seg * 16);
      }
    }
  }
};

// Runs body(Int<C>) for C = 0 .. kChunks-1 while column base + C * width < limit.
template <int kChunks, int kWidth, class Body>
__device__ __forceinline__ void for_each_chunk(int64_t base, int64_t limit, Body body) {
  cute::for_each(cute::make_int_sequence<kChunks>{}, [&](auto c) {
    if (base + decltype(c)::value * kWidth < limit) body(c);
  });
}

__device__ __forceinline__ int clamp_bytes(int64_t cols_left, int elem_bytes) {
  const int64_t bytes = cols_left * elem_bytes;
  return static_cast<int>(bytes <= 0 ? 0 : (bytes >= 128 ? 128 : bytes));
}

// ---- rows grouping: C rows stored at out + row * ld (bf16) ----
template <class Traits>
struct RowsEpilogue {
  struct Params {
    Placed out;   // [capacity, ld] bf16 (h13 of W13 placed by the layer plan)
    int64_t ld;
    int64_t n;    // columns
  };
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  bf16_t* out;  // p.out resolved once, before the mainloop
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ RowsEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), out(params.out.template get<bf16_t>()), stage{smem, wg, row_block, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    for_each_chunk<Traits::BLOCK_N / 64, 64>(col0, p.n, [&](auto c) {
      constexpr int C = decltype(c)::value;
      stage.template put_bf16<C>([&](int i, int, int) { return acc(i); });
      stage.sync();
      stage.write_rows(clamp_bytes(p.n - col0 - 64 * C, 2), [&](int r, int) -> char* {
        const int m = 64 * stage.row_block + r;
        if (m >= t.rows_valid) return nullptr;
        return reinterpret_cast<char*>(out + (t.row0 + m) * p.ld + col0 + 64 * C);
      });
      stage.sync();
    });
  }
};

// ---- rows grouping: each row stored into its owner's combine slot (peer pointer) ----
template <class Traits>
struct ScatterEpilogue {
  struct Params {
    bf16_t* const* dst_R;      // [R] device table: rank r's [T, K, D] buffer
    const int32_t* recv_src_M; // [capacity] encode_src of each row
    int64_t T;                 // Config T (slot stride)
    int K;
    int64_t n;                 // D
  };
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ ScatterEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), stage{smem, wg, row_block, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    bf16_t* row_base[4];  // the rows this thread writes in phase 2
    CUTE_UNROLL
    for (int pass = 0; pass < 4; ++pass) {
      const int m = 64 * stage.row_block + pass * 16 + stage.tid / 8;
      row_base[pass] = nullptr;
      if (m < t.rows_valid) {
        const int32_t src = p.recv_src_M[t.row0 + m];
        row_base[pass] = p.dst_R[src_rank(src, p.T, p.K)] + src_slot(src, p.T, p.K) * p.n + col0;
      }
    }
    for_each_chunk<Traits::BLOCK_N / 64, 64>(col0, p.n, [&](auto c) {
      constexpr int C = decltype(c)::value;
      stage.template put_bf16<C>([&](int i, int, int) { return acc(i); });
      stage.sync();
      stage.write_rows(clamp_bytes(p.n - col0 - 64 * C, 2), [&](int, int pass) -> char* {
        bf16_t* base = row_base[pass];
        return base == nullptr ? nullptr : reinterpret_cast<char*>(base + 64 * C);
      });
      stage.sync();
    });
  }
};

// ---- rows grouping, two B operands (gate, up): h13 = [gate | up] and h = act(gate, up) ----
// Per 64-column chunk: gate is staged (rounded) and written, each thread keeping its 16-byte
// segments; then up is staged and written, and each thread computes h on the same segments from
// the rounded values (exactly as the unfused chain does) and stores it with 16-byte stores. The
// SwiGLU math runs row-wise, out of the unrolled fragment loops (code size), and inline: a call
// while the accumulators are live makes them spill around it.
template <class Traits>
struct SwigluEpilogue {
  struct Params {
    Placed h13;   // [capacity, 2F] (placed by the layer plan)
    bf16_t* h;    // [capacity, F]
    int64_t F;
    ActivationParams act;
  };
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  bf16_t* h13;  // p.h13 resolved once, before the mainloop
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ SwigluEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), h13(params.h13.template get<bf16_t>()), stage{smem, wg, row_block, tid} {}

  // part 0: write the staged gate rows, keeping this thread's segments in gate_seg.
  // part 1: write the staged up rows and h = act(gate_seg, up).
  __device__ __forceinline__ void rows_out(const TileCoord& t, int64_t c0, int part, uint4* gate_seg) const {
    const int seg = stage.tid % 8;
    const int64_t f = c0 + seg * 8;
    if (f >= p.F) return;  // F % 8 == 0: a segment is all in or all out
#pragma unroll
    for (int pass = 0; pass < 4; ++pass) {
      const int r = pass * 16 + stage.tid / 8;
      const int m = 64 * stage.row_block + r;
      if (m >= t.rows_valid) continue;
      const int64_t row = t.row0 + m;
      const uint4 v = *reinterpret_cast<const uint4*>(stage.smem + r * Stage<Traits>::kPitch + seg * 16);
      if (part == 0) {
        gate_seg[pass] = v;
        store_vec(h13 + row * 2 * p.F + f, v);
        continue;
      }
      store_vec(h13 + row * 2 * p.F + p.F + f, v);
      const bf16_t* g8 = reinterpret_cast<const bf16_t*>(&gate_seg[pass]);
      const bf16_t* u8 = reinterpret_cast<const bf16_t*>(&v);
      uint4 h;
      bf16_t* h8 = reinterpret_cast<bf16_t*>(&h);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        h8[j] = float_to_bf16(swiglu_forward(bf16_to_float(g8[j]), bf16_to_float(u8[j]), p.act));
      }
      store_vec(p.h + row * p.F + f, h);
    }
  }

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& gate, const Acc1& up) const {
    constexpr int kChunks = Traits::BLOCK_N / 64;
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
#pragma unroll 1
    for (int c = 0; c < kChunks && f0 + 64 * c < p.F; ++c) {
      uint4 gate_seg[4];
      stage.template put_bf16_at<kChunks>(c, [&](int i, int, int) { return gate(i); });
      stage.sync();
      rows_out(t, f0 + 64 * c, 0, gate_seg);
      stage.sync();
      stage.template put_bf16_at<kChunks>(c, [&](int i, int, int) { return up(i); });
      stage.sync();
      rows_out(t, f0 + 64 * c, 1, gate_seg);
      stage.sync();
    }
  }
};

// ---- rows grouping: acc = grad_h; SwiGLU backward with the saved h13 ----
// grad_h13 = [d gate | d up] and h = act(gate, up) (the W2 WGRAD operand). grad_h is staged rounded
// to bf16 (as the unfused chain stores it); the SwiGLU math then runs row-wise on 8 consecutive
// columns per thread, with 16-byte loads of gate and up and 16-byte stores of the three outputs.
// Keeping the math out of the unrolled fragment loops keeps the kernel small: unrolled per
// fragment element it grew to ~34k instructions and ran from a thrashing instruction cache. It is
// inline: a call while the accumulators are live makes them spill around it.
// With row scores (Step::row_scores_M: the A rows are grad_y unscaled, so acc = dh): the SwiGLU
// backward takes score * dh, h is stored scaled by the score (bf16(score * act)), and each row's
// <dh, bf16(act)> over the 64-column chunk goes to score_parts_MC[row, chunk]: the 8 columns of
// a thread summed in order, then the 8 threads of the row (lanes 8a .. 8a + 7 of one warp) by a
// fixed xor tree; swiglu.cu's unfused kernel and the CPU twin sum in the same order.
template <class Traits>
struct SwigluBackwardEpilogue {
  struct Params {
    Placed h13;         // [capacity, 2F] saved (placed by the layer plan)
    bf16_t* grad_h13;   // [capacity, 2F]
    bf16_t* h;          // [capacity, F]
    int64_t F;
    ActivationParams act;
    const float* row_scores;  // [capacity] f32, nullable: grad_h is already scaled
    float* score_parts;       // [capacity, score_chunks] f32 (with row_scores)
    int64_t score_chunks;
  };
  static_assert(kScoreChunkCols == 64, "a score chunk is one 64-column staging chunk");
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  const bf16_t* h13;  // p.h13 resolved once, before the mainloop
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ SwigluBackwardEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), h13(params.h13.template get<const bf16_t>()), stage{smem, wg, row_block, tid} {}

  // This thread's inputs of the four passes over columns [c0, c0 + 64): gate and up (8 columns
  // each) and the row's score. Loaded before the chunk is staged, all four passes at once, so
  // their latency overlaps the staging and each other instead of stalling every pass (the
  // epilogue took longer than the main loop on short-K shapes: bench/RESULTS.md "W2 DGRAD").
  struct Inputs {
    uint4 gate[4], up[4];
    float score[4];
  };
  __device__ __forceinline__ bool row_in(const TileCoord& t, int64_t c0, int pass) const {
    const int m = 64 * stage.row_block + pass * 16 + stage.tid / 8;
    return c0 + (stage.tid % 8) * 8 < p.F && m < t.rows_valid;  // F % 8 == 0: a segment is all in or out
  }
  __device__ __forceinline__ Inputs load_inputs(const TileCoord& t, int64_t c0) const {
    Inputs in;
    const int64_t f = c0 + (stage.tid % 8) * 8;
    CUTE_UNROLL
    for (int pass = 0; pass < 4; ++pass) {
      const int64_t row = t.row0 + 64 * stage.row_block + pass * 16 + stage.tid / 8;
      in.gate[pass] = in.up[pass] = make_uint4(0, 0, 0, 0);
      in.score[pass] = 1.0f;
      if (row_in(t, c0, pass)) {
        in.gate[pass] = *reinterpret_cast<const uint4*>(h13 + row * 2 * p.F + f);
        in.up[pass] = *reinterpret_cast<const uint4*>(h13 + row * 2 * p.F + p.F + f);
        if (p.row_scores != nullptr) in.score[pass] = p.row_scores[row];
      }
    }
    return in;
  }

  // The staged grad_h rows of columns [c0, c0 + 64) of the tile: SwiGLU backward and the stores.
  // Every thread runs every pass (the xor tree needs all 8 threads of a row, valid or not).
  __device__ __forceinline__ void rows_out(const TileCoord& t, int64_t c0, const Inputs& in) const {
    const int seg = stage.tid % 8;
    const int64_t f = c0 + seg * 8;  // first of this thread's 8 columns
    const bool scored = p.row_scores != nullptr;  // kernel-uniform
    CUTE_UNROLL
    for (int pass = 0; pass < 4; ++pass) {
      const int r = pass * 16 + stage.tid / 8;
      const int m = 64 * stage.row_block + r;
      const int64_t row = t.row0 + m;
      float dot = 0.0f;
      if (row_in(t, c0, pass)) {
        const float score = in.score[pass];
        const uint4 gh = *reinterpret_cast<const uint4*>(stage.smem + r * Stage<Traits>::kPitch + seg * 16);
        const bf16_t* gh8 = reinterpret_cast<const bf16_t*>(&gh);
        const bf16_t* g8 = reinterpret_cast<const bf16_t*>(&in.gate[pass]);
        const bf16_t* u8 = reinterpret_cast<const bf16_t*>(&in.up[pass]);
        uint4 dg, du, h;
        bf16_t* dg8 = reinterpret_cast<bf16_t*>(&dg);
        bf16_t* du8 = reinterpret_cast<bf16_t*>(&du);
        bf16_t* h8 = reinterpret_cast<bf16_t*>(&h);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float gate = bf16_to_float(g8[j]), up = bf16_to_float(u8[j]);
          const float dh = bf16_to_float(gh8[j]);
          float d_gate, d_up;
          const float act = swiglu_backward_and_forward(gate, up, scored ? __fmul_rn(score, dh) : dh,
                                                        p.act, d_gate, d_up);
          dg8[j] = float_to_bf16(d_gate);
          du8[j] = float_to_bf16(d_up);
          const bf16_t act16 = float_to_bf16(act);
          dot = __fadd_rn(dot, __fmul_rn(dh, bf16_to_float(act16)));
          h8[j] = scored ? float_to_bf16(__fmul_rn(score, act)) : act16;
        }
        store_vec(p.grad_h13 + row * 2 * p.F + f, dg);
        store_vec(p.grad_h13 + row * 2 * p.F + p.F + f, du);
        store_vec(p.h + row * p.F + f, h);
      }
      if (scored) {
        const unsigned row_lanes = 0xffu << ((stage.tid % 32) & ~7);  // the row's 8 lanes
        dot = chunk_dot_sum(dot, row_lanes);
        if (seg == 0 && m < t.rows_valid) {
          p.score_parts[row * p.score_chunks + c0 / kScoreChunkCols] = dot;
        }
      }
    }
  }

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& grad_h, const Acc1&) const {
    constexpr int kChunks = Traits::BLOCK_N / 64;
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
#pragma unroll 1
    for (int c = 0; c < kChunks && f0 + 64 * c < p.F; ++c) {
      const Inputs in = load_inputs(t, f0 + 64 * c);  // in flight while the chunk is staged
      stage.template put_bf16_at<kChunks>(c, [&](int i, int, int) { return grad_h(i); });
      stage.sync();
      rows_out(t, f0 + 64 * c, in);
      stage.sync();
    }
  }
};

// ---- reduction grouping: C_e [m_out, n_out] in OutT, overwritten or accumulated ----
// Staged as fp32 for every output type: accumulation is round(prev + fp32 sum), and a second,
// bf16-staged path in the same kernel made ptxas serialize the wgmma pipeline (C7514).
template <class Traits, class OutT>
struct WgradEpilogue {
  struct Params {
    OutT* out;  // [groups, m_out, n_out]
    int64_t m_out;
    int64_t n_out;
    int accumulate;
  };
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ WgradEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), stage{smem, wg, row_block, tid} {}

  // An expert with no rows: its gradient is zero. Written from a zeroed stage, never from the
  // accumulators (reading them on a second path makes ptxas serialize the wgmma pipeline).
  __device__ void store_zeros(int64_t row0, int64_t col0, OutT* out) const {
    constexpr int kColsPerChunk = 128 / static_cast<int>(sizeof(OutT));
    for (int i = stage.tid; i < 64 * 8; i += 128) {
      *reinterpret_cast<uint4*>(stage.smem + (i / 8) * Stage<Traits>::kPitch + (i % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    stage.sync();
    for (int c0 = 0; c0 < Traits::BLOCK_N && col0 + c0 < p.n_out; c0 += kColsPerChunk) {
      stage.write_rows(clamp_bytes(p.n_out - col0 - c0, static_cast<int>(sizeof(OutT))),
                       [&](int r, int) -> char* {
                         const int64_t row = row0 + r;
                         if (row >= p.m_out) return nullptr;
                         return reinterpret_cast<char*>(out + row * p.n_out + col0 + c0);
                       });
    }
    stage.sync();
  }

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t row0 = static_cast<int64_t>(t.m_tile) * Traits::BLOCK_M + 64 * stage.row_block;
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    OutT* out = p.out + static_cast<int64_t>(t.group) * p.m_out * p.n_out;
    if (t.k_tiles == 0) {
      if (!p.accumulate) store_zeros(row0, col0, out);  // accumulating: nothing to add
      return;
    }
    const int seg = stage.tid % 8;  // 4 floats of a 32-float row chunk
    // The 16-byte (f32) or 8-byte (bf16) vector of 4 outputs a thread owns in a chunk's pass.
    using Vec = std::conditional_t<sizeof(OutT) == 4, float4, uint2>;
    for_each_chunk<Traits::BLOCK_N / 32, 32>(col0, p.n_out, [&](auto c) {
      constexpr int C = decltype(c)::value;
      const int64_t col = col0 + 32 * C + seg * 4;
      const bool in = col < p.n_out;  // n_out % 8 == 0: a segment is all in or all out
      // Accumulating: the four previous vectors are loaded before the staging, all in flight at
      // once (one DRAM round trip per chunk instead of one per pass, and hidden behind put_f32).
      Vec prev[4];
      CUTE_UNROLL
      for (int pass = 0; pass < 4; ++pass) {
        const int64_t row = row0 + pass * 16 + stage.tid / 8;
        prev[pass] = Vec{};
        if (p.accumulate && in && row < p.m_out) {
          prev[pass] = *reinterpret_cast<const Vec*>(out + row * p.n_out + col);
        }
      }
      stage.template put_f32<C>(acc);
      stage.sync();
      if (in) {
        CUTE_UNROLL
        for (int pass = 0; pass < 4; ++pass) {
          const int r = pass * 16 + stage.tid / 8;
          const int64_t row = row0 + r;
          if (row >= p.m_out) continue;
          const float4 v = *reinterpret_cast<const float4*>(stage.smem + r * Stage<Traits>::kPitch + seg * 16);
          OutT* dst = out + row * p.n_out + col;
          if constexpr (sizeof(OutT) == 4) {
            float4 o = v;
            if (p.accumulate) {
              const float4 pr = prev[pass];
              o = make_float4(pr.x + v.x, pr.y + v.y, pr.z + v.z, pr.w + v.w);
            }
            *reinterpret_cast<float4*>(dst) = o;
          } else {
            const float a[4] = {v.x, v.y, v.z, v.w};
            const bf16_t* pv = reinterpret_cast<const bf16_t*>(&prev[pass]);
            uint2 packed;
            bf16_t* po = reinterpret_cast<bf16_t*>(&packed);
            CUTE_UNROLL
            for (int j = 0; j < 4; ++j) {
              po[j] = float_to_bf16(p.accumulate ? bf16_to_float(pv[j]) + a[j] : a[j]);
            }
            *reinterpret_cast<uint2*>(dst) = packed;
          }
        }
      }
      stage.sync();
    });
  }
};

// ---- reduction grouping, bf16 output overwritten: TMA bulk-tensor stores ----
// Each warpgroup stages its 64 x BLOCK_N block as 64 x 64 boxes in the 128-byte swizzle the TMA
// expects, and one thread issues the box stores. They drain while the warpgroup runs the next
// tile's MMA; the stage is reused only after the stores have read it. Output bounds are the
// tensor map's, so edge tiles need no masking.
//
// kStoreWarp (cooperative tiles): warp 1 of the producer warpgroup issues the stores instead
// (store_warp, run by the kernel there). The consumers wait for their stage to be free, stage, and
// arrive on a barrier without waiting: the wait for the previous stores, the barrier between
// staging and issue, and the issue itself (~165 + ~520 of the ~1 500 epilogue clocks a tile on the
// timeline, bench/RESULTS.md 48c5244) leave the consumers' path. Per warpgroup w two named
// barriers of its 128 threads and the store warp's 32: staged (consumers arrive, the warp waits)
// and free (the warp arrives once the stores have read the stage, the consumers wait). The warp
// walks the consumers' tiles in the same order; it arrives `free` only for a tile that follows,
// so no barrier is left half-arrived at exit.
template <class Traits, class TmaStore, bool kStoreWarp_ = false>
struct WgradTmaEpilogue {
  static constexpr bool kStoreWarp = kStoreWarp_;
  static_assert(!kStoreWarp || !Traits::kPingPong, "the store warp follows cooperative tiles");
  static constexpr int kBoxes = Traits::BLOCK_N / 64;
  static constexpr int kBoxBytes = 64 * 128;
  static constexpr int kSmemBytesPerWarpgroup = kBoxes * kBoxBytes;
  static constexpr uint32_t kWarpBarrierThreads = 128 + 32;
  using SmemLayoutBox = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>{},
                                               Shape<_64, _64>{}));
  struct Params {
    TmaStore tma;  // [groups, m_out, n_out] bf16, 64 x 64 boxes
    int64_t m_out;
    int64_t n_out;
    int groups;
  };
  const Params& p;  // the kernel's __grid_constant__ parameter: the descriptor stays in param space
  char* smem;
  int wg;         // consumer warpgroup (names its barrier)
  int row_block;  // its rows in the tile, in units of 64
  int tid;
  __device__ WgradTmaEpilogue(const Params& params, char* stage_smem, int warpgroup, int rows, int thread)
      : p(params), smem(stage_smem), wg(warpgroup), row_block(rows), tid(thread) {}

  __device__ void sync() const {
    barrier_sync(GemmBarrier::epilogue_wg0, wg, 128);
  }

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    if constexpr (kStoreWarp) {
      barrier_sync(GemmBarrier::wgrad_free_wg0, wg, kWarpBarrierThreads);
    } else {
      if (tid == 0) {
        tma_store_wait<0>();  // the previous tile's stores have read the stage
        stamp_current_tile(Stamp::stage_free);
      }
      sync();
    }
    const int warp = tid / 32, lane = tid % 32;
    if (t.k_tiles == 0) {  // an expert with no rows: zeros, without reading the accumulators
      for (int i = tid; i < kSmemBytesPerWarpgroup / 16; i += 128) {
        reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
      }
    } else {
      // (row, col) of the warpgroup's 64 x BLOCK_N block lies in box col / 64, at byte row * 128 +
      // (((col % 64) / 8) ^ (row % 8)) * 16 + (col % 8) * 2 (the TMA 128-byte swizzle of
      // SmemLayoutBox). For fragment value i = j + 2 h + 4 g, row = 16 warp + lane / 4 + 8 h and
      // col = 8 g + 2 (lane % 4): the swizzle term depends on g % 8 alone, so 8 addresses per
      // thread with the box and h as immediates (ptxas hoisted 64 of them otherwise).
      char* base = smem + (16 * warp + lane / 4) * 128 + 4 * (lane % 4);
      const int r8 = (lane / 4) % 8;
      CUTE_UNROLL
      for (int gg = 0; gg < 8; ++gg) {
        char* chunk = base + ((gg ^ r8) * 16);
        CUTE_UNROLL
        for (int box = 0; box < kBoxes; ++box) {
          CUTE_UNROLL
          for (int h = 0; h < 2; ++h) {
            const int i = 4 * (8 * box + gg) + 2 * h;
            *reinterpret_cast<uint32_t*>(chunk + box * kBoxBytes + h * 8 * 128) =
                pack_bf16x2(acc(i), acc(i + 1));
          }
        }
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes before the TMA reads them
    if constexpr (kStoreWarp) {
      barrier_arrive(GemmBarrier::wgrad_staged_wg0, wg, kWarpBarrierThreads);
    } else {
      sync();
      if (tid == 0) {
        stamp_current_tile(Stamp::staged);
        issue(p, t, smem, row_block);
        tma_store_arrive();
      }
    }
  }

  // The box stores of one warpgroup's staged 64 x BLOCK_N block (one thread).
  __device__ static void issue(const Params& p, const TileCoord& t, char* stage, int rows) {
    Tensor mC = p.tma.get_tma_tensor(make_shape(p.m_out, p.n_out, p.groups));  // (m, n, e)
    const int m_blk = (t.m_tile * Traits::BLOCK_M) / 64 + rows;
    CUTE_UNROLL
    for (int j = 0; j < kBoxes; ++j) {
      const int n_blk = (t.n_tile * Traits::BLOCK_N) / 64 + j;
      if (static_cast<int64_t>(n_blk) * 64 >= p.n_out) break;
      Tensor gC = local_tile(mC(_, _, t.group), Shape<_64, _64>{}, make_coord(m_blk, n_blk));
      Tensor sC = make_tensor(make_smem_ptr(reinterpret_cast<cutlass::bfloat16_t*>(stage + j * kBoxBytes)),
                              SmemLayoutBox{});
      auto [tCgC, tCsC] = tma_partition(p.tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sC),
                                        group_modes<0, 2>(gC));
      copy(p.tma, tCsC, tCgC);
    }
  }

  // kStoreWarp: run by one whole warp of the producer warpgroup over the consumers' tiles;
  // stages_WB are the consumer warpgroups' stages (Traits::kConsumerWarpgroups of them).
  template <class Sched, class Stages>
  __device__ static void store_warp(const Params& p, Stages& stages_WB, const Sched& sched, int first_tile,
                                    int tile_stride) {
    constexpr int kWarpgroups = Traits::kConsumerWarpgroups;
    const bool leader = cute::elect_one_sync();
    if (first_tile < sched.total) {
      for (int w = 0; w < kWarpgroups; ++w) {
        barrier_arrive(GemmBarrier::wgrad_free_wg0, w, kWarpBarrierThreads);
      }
    }
    for (int tile = first_tile; tile < sched.total; tile += tile_stride) {
      const TileCoord t = sched.at(tile);
      for (int w = 0; w < kWarpgroups; ++w) {
        barrier_sync(GemmBarrier::wgrad_staged_wg0, w, kWarpBarrierThreads);
        if (leader) issue(p, t, stages_WB[w], w);
        __syncwarp();
      }
      if (leader) {
        tma_store_arrive();
        tma_store_wait<0>();  // the stores have read both stages
      }
      __syncwarp();
      if (tile + tile_stride < sched.total) {
        for (int w = 0; w < kWarpgroups; ++w) {
          barrier_arrive(GemmBarrier::wgrad_free_wg0, w, kWarpBarrierThreads);
        }
      }
    }
    if (leader) tma_store_wait<0>();
  }

  // Before the CTA exits: the last stores must have read shared memory.
  __device__ void finish() const {
    if constexpr (!kStoreWarp) {
      if (tid == 0) tma_store_wait<0>();
    }
  }
};

}  // namespace epmoe::cuda::gemm
