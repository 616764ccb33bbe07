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

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "core/activation.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

// The stage of one consumer warpgroup and the two phases that use it.
template <class Traits>
struct Stage {
  static constexpr int kPitch = Traits::kStagePitch;
  char* smem;  // [64][kPitch]
  int wg;      // consumer warpgroup (its rows are [64 * wg, 64 * wg + 64) of the tile)
  int tid;     // thread in the warpgroup

  __device__ int frag_row(int h) const { return 16 * (tid / 32) + (tid % 32) / 4 + 8 * h; }
  __device__ int frag_col(int g) const { return 8 * g + 2 * (tid % 4); }

  __device__ void sync() const {
    cutlass::arch::NamedBarrier::arrive_and_wait(
        128, static_cast<uint32_t>(GemmBarrier::epilogue_wg0) + static_cast<uint32_t>(wg));
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
        const uint32_t lo = float_to_bf16(value(i, row, col));
        const uint32_t hi = float_to_bf16(value(i + 1, row, col + 1));
        *reinterpret_cast<uint32_t*>(smem + row * kPitch + (col - 64 * C) * 2) = lo | (hi << 16);
      }
    }
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
    bf16_t* out;  // [capacity, ld]
    int64_t ld;
    int64_t n;    // columns
  };
  Params p;
  Stage<Traits> stage;
  __device__ RowsEpilogue(const Params& params, char* smem, int wg, int tid)
      : p(params), stage{smem, wg, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    for_each_chunk<Traits::BLOCK_N / 64, 64>(col0, p.n, [&](auto c) {
      constexpr int C = decltype(c)::value;
      stage.template put_bf16<C>([&](int i, int, int) { return acc(i); });
      stage.sync();
      stage.write_rows(clamp_bytes(p.n - col0 - 64 * C, 2), [&](int r, int) -> char* {
        const int m = 64 * stage.wg + r;
        if (m >= t.rows_valid) return nullptr;
        return reinterpret_cast<char*>(p.out + (t.row0 + m) * p.ld + col0 + 64 * C);
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
  Params p;
  Stage<Traits> stage;
  __device__ ScatterEpilogue(const Params& params, char* smem, int wg, int tid)
      : p(params), stage{smem, wg, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    bf16_t* row_base[4];  // the rows this thread writes in phase 2
    CUTE_UNROLL
    for (int pass = 0; pass < 4; ++pass) {
      const int m = 64 * stage.wg + pass * 16 + stage.tid / 8;
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
template <class Traits>
struct SwigluEpilogue {
  struct Params {
    bf16_t* h13;  // [capacity, 2F]
    bf16_t* h;    // [capacity, F]
    int64_t F;
    ActivationParams act;
  };
  Params p;
  Stage<Traits> stage;
  __device__ SwigluEpilogue(const Params& params, char* smem, int wg, int tid)
      : p(params), stage{smem, wg, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& gate, const Acc1& up) const {
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    for_each_chunk<Traits::BLOCK_N / 64, 64>(f0, p.F, [&](auto c) {
      constexpr int C = decltype(c)::value;
      const int valid = clamp_bytes(p.F - f0 - 64 * C, 2);
      cute::for_each(cute::make_int_sequence<3>{}, [&](auto part_c) {  // gate, up, h
        constexpr int part = decltype(part_c)::value;
        if constexpr (part == 0) stage.template put_bf16<C>([&](int i, int, int) { return gate(i); });
        if constexpr (part == 1) stage.template put_bf16<C>([&](int i, int, int) { return up(i); });
        if constexpr (part == 2) {
          // h comes from the rounded h13, exactly as the unfused chain computes it.
          stage.template put_bf16<C>([&](int i, int, int) {
            return swiglu_forward(round_to_bf16(gate(i)), round_to_bf16(up(i)), p.act);
          });
        }
        stage.sync();
        stage.write_rows(valid, [&](int r, int) -> char* {
          const int m = 64 * stage.wg + r;
          if (m >= t.rows_valid) return nullptr;
          const int64_t row = t.row0 + m;
          bf16_t* dst = part == 2 ? p.h + row * p.F + f0 + 64 * C
                                  : p.h13 + row * 2 * p.F + (part == 1 ? p.F : 0) + f0 + 64 * C;
          return reinterpret_cast<char*>(dst);
        });
        stage.sync();
      });
    });
  }
};

// ---- rows grouping: acc = grad_h; SwiGLU backward with the saved h13 ----
// grad_h13 = [d gate | d up] and h = act(gate, up) (the W2 WGRAD operand). grad_h is rounded to
// bf16 first, as the unfused chain stores it. Each thread loads the gate and up pairs of its own
// fragment once per 64-column chunk (4-byte loads; the 4 lanes of a row cover 16 contiguous bytes
// and the chunk's 8 column groups the rest of the row's 128 bytes, so L1 serves most of them).
template <class Traits>
struct SwigluBackwardEpilogue {
  struct Params {
    const bf16_t* h13;  // [capacity, 2F] saved
    bf16_t* grad_h13;   // [capacity, 2F]
    bf16_t* h;          // [capacity, F]
    int64_t F;
    ActivationParams act;
  };
  Params p;
  Stage<Traits> stage;
  __device__ SwigluBackwardEpilogue(const Params& params, char* smem, int wg, int tid)
      : p(params), stage{smem, wg, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& grad_h, const Acc1&) const {
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    for_each_chunk<Traits::BLOCK_N / 64, 64>(f0, p.F, [&](auto c) {
      constexpr int C = decltype(c)::value;
      // gate/up pairs of this thread's 16 (row, column pair) positions in the chunk.
      uint32_t gate2[16], up2[16];
      CUTE_UNROLL
      for (int gg = 0; gg < 8; ++gg) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int m = 64 * stage.wg + stage.frag_row(h);
          const int64_t f = f0 + stage.frag_col(8 * C + gg);
          gate2[2 * gg + h] = 0;
          up2[2 * gg + h] = 0;
          if (m < t.rows_valid && f < p.F) {
            const bf16_t* row = p.h13 + (t.row0 + m) * 2 * p.F;
            gate2[2 * gg + h] = *reinterpret_cast<const uint32_t*>(row + f);
            up2[2 * gg + h] = *reinterpret_cast<const uint32_t*>(row + p.F + f);
          }
        }
      }
      const int valid = clamp_bytes(p.F - f0 - 64 * C, 2);
      cute::for_each(cute::make_int_sequence<3>{}, [&](auto part_c) {  // d gate, d up, h
        constexpr int part = decltype(part_c)::value;
        stage.template put_bf16<C>([&](int i, int, int) {
          const int pair = 2 * ((i / 4) - 8 * C) + (i / 2) % 2;  // (gg, h) of element i
          const int shift = 16 * (i % 2);                         // column j of the pair
          const float g = bf16_to_float(static_cast<bf16_t>(gate2[pair] >> shift));
          const float u = bf16_to_float(static_cast<bf16_t>(up2[pair] >> shift));
          if constexpr (part == 2) {
            return swiglu_forward(g, u, p.act);
          } else {
            float dg, du;
            swiglu_backward(g, u, round_to_bf16(grad_h(i)), p.act, dg, du);
            return part == 0 ? dg : du;
          }
        });
        stage.sync();
        stage.write_rows(valid, [&](int r, int) -> char* {
          const int m = 64 * stage.wg + r;
          if (m >= t.rows_valid) return nullptr;
          const int64_t row = t.row0 + m;
          bf16_t* dst = part == 2 ? p.h + row * p.F + f0 + 64 * C
                                  : p.grad_h13 + row * 2 * p.F + (part == 1 ? p.F : 0) + f0 + 64 * C;
          return reinterpret_cast<char*>(dst);
        });
        stage.sync();
      });
    });
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
  Params p;
  Stage<Traits> stage;
  __device__ WgradEpilogue(const Params& params, char* smem, int wg, int tid)
      : p(params), stage{smem, wg, tid} {}

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
    const int64_t row0 = static_cast<int64_t>(t.m_tile) * Traits::BLOCK_M + 64 * stage.wg;
    const int64_t col0 = static_cast<int64_t>(t.n_tile) * Traits::BLOCK_N;
    OutT* out = p.out + static_cast<int64_t>(t.group) * p.m_out * p.n_out;
    if (t.k_tiles == 0) {
      if (!p.accumulate) store_zeros(row0, col0, out);  // accumulating: nothing to add
      return;
    }
    const int seg = stage.tid % 8;  // 4 floats of a 32-float row chunk
    for_each_chunk<Traits::BLOCK_N / 32, 32>(col0, p.n_out, [&](auto c) {
      constexpr int C = decltype(c)::value;
      stage.template put_f32<C>(acc);
      stage.sync();
      const int64_t col = col0 + 32 * C + seg * 4;
      if (col < p.n_out) {  // n_out % 8 == 0: a segment is all in or all out
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
              const float4 prev = *reinterpret_cast<const float4*>(dst);
              o = make_float4(prev.x + v.x, prev.y + v.y, prev.z + v.z, prev.w + v.w);
            }
            *reinterpret_cast<float4*>(dst) = o;
          } else {
            const float a[4] = {v.x, v.y, v.z, v.w};
            const uint2 prev = p.accumulate ? *reinterpret_cast<const uint2*>(dst) : make_uint2(0, 0);
            const bf16_t* pv = reinterpret_cast<const bf16_t*>(&prev);
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

}  // namespace epmoe::cuda::gemm
