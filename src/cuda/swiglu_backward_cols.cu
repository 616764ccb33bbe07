// The SwiGLU backward of FP8 training that also writes the weight gradients' column operands:
// grad_h13 and h quantized 128x1 along each expert's rows (transposed codes and scales, bitwise
// fp8_quantize_cols_transposed of the bf16 rows) beside grad_h13's 1x128 rows and grad_scores'
// partials (bitwise swiglu_backward_fp8_rows). Neither bf16 grad_h13 nor h is stored: the
// W13 DGRAD reads the rows, the two FP8 WGRADs the columns, and nothing else reads them.
// Opt-in (EPMOE_FP8_COL_QUANT=swiglu, fp8_backward.h): it saves ~2.8 GB of bf16 traffic on
// mixtral-8x7b, but the SwiGLU math is bound by its exp and division work, not by memory, and this
// kernel issues 51 % more instructions than the plain SwiGLU backward (the column amax pass, three
// tile encodes) with barrier stalls the plain one has none of: 1.76 ms against 1.04 + 0.72 ms of
// the column passes it replaces (eae3f8e's form; bench/RESULTS.md 1ceb4b9). fwd+bwd ties at 2b8b02b.
//
// One CTA of 16 warps per (column block b of the expert layout, 128 columns f0 .. f0 + 127 of F):
//   1. a half warp per row (4 rows per thread, the next row's loads in flight) loads h13's gate
//      and up and grad_h for columns f0 .. + 127 (lane j: 8 columns, 16-byte vectors), runs the
//      SwiGLU backward (swiglu_backward_run8, the unfused kernel's math), writes grad_h13's 1x128
//      row codes (gate block f0 / 128 and up block (F + f0) / 128: the half warp holds both
//      whole) and the row's grad_scores partials (a 64-column chunk is 8 lanes, summed in the
//      unfused kernel's order), and stages d_gate, d_up and h as bf16 tiles [128, 128] in
//      shared memory;
//   2. 12 warps take the column amaxes of the staged rows as 16-byte vectors (an integer max of
//      |x| bits: exact and order-free), four partials a column; thread c < 384 combines column c's
//      into its scale (stored, coalesced) and encode bounds;
//   3. each tile encoded by 8 warps (fp8_cols_tile.cuh; warps 0-7 d_gate then h, 8-15 d_up),
//      staged in place over the tile once its readers have passed a barrier, then stored as
//      whole 128-byte rows of the transposed codes (warps 8-15 store d_up while 0-7 encode h).
// The SwiGLU math needs the unfused kernel's occupancy (it is bound by its exp and division
// work): 2 CTAs of 512 threads per SM, <= 64 registers (a few loop-invariant terms spill), the
// three tiles (96 KiB) and 10.5 KiB of column terms in shared memory each.
#include "cuda/swiglu_backward_cols.h"

#include "core/fp8_terms.h"
#include "core/plan_terms.h"
#include "cuda/formats/fp8_cols_tile.cuh"
#include "cuda/formats/fp8_row_vectors.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"
#include "cuda/swiglu_backward_run8.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

using namespace fp8_cols;
constexpr int kColsThreads = 2 * kEncodeThreads;  // two encode groups of 8 warps
constexpr int kOutputs = 3;                        // tiles: d_gate, d_up, h
constexpr int kRowVecs = kTile / kVec;               // 16 lanes: one row of the tile
constexpr int kRowGroups = kColsThreads / kRowVecs;  // 32 rows at a time
constexpr int kRowSteps = kBlock / kRowGroups;       // 4 rows per thread
static_assert(kOutputs * kTile <= kColsThreads, "a thread per column of the three tiles");
constexpr int kAmaxParts = kTile / 32;  // warps of the amax pass per tile (each: 32 rows x 128 columns)
static_assert(kRowVecs == 16, "a half warp per row");
constexpr int kTileBytes = kBlock * kTile * 2;
constexpr int kSmem = kOutputs * kTileBytes;

struct ColsParams {
  const int32_t* header;
  Placed h13;                 // [capacity, 2F] bf16: gate | up (layer plan)
  const bf16_t* grad_h_MF;    // [capacity, F]
  const float* row_scores_M;  // nullable: grad_h is already scaled
  float* score_parts_MC;      // [capacity, chunks] (with row scores)
  int64_t F, chunks;
  ActivationParams act;
  const int32_t* offsets_E1;
  int E;
  Fp8RowsOut q;               // grad_h13's 1x128 rows
  Fp8ColsOut g13, h;          // [2F, K] and [F, K] codes, [max_blocks, 2F] and [max_blocks, F] scales
  int64_t max_blocks;
};

// A barrier of one encode group (8 warps): ids 1 and 2 (0 is __syncthreads).
__device__ __forceinline__ void group_barrier(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(kEncodeThreads) : "memory");
}

// Row r of the block (zeros past its n rows): h13's gate and up and grad_h at columns f .. f + 7,
// and the row's score.
struct RowIn {
  uint4 gate, up, dh;
  float score;
};
__device__ __forceinline__ RowIn load_row(const ColsParams& p, const bf16_t* h13_M2F, int64_t m0, int r, int n,
                                          int64_t f, bool scored) {
  RowIn x{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), 1.0f};
  if (r < n) {
    const int64_t m = m0 + r;
    x.gate = load_vec(h13_M2F + m * 2 * p.F + f);
    x.up = load_vec(h13_M2F + m * 2 * p.F + p.F + f);
    x.dh = load_vec(p.grad_h_MF + m * p.F + f);
    if (scored) x.score = p.row_scores_M[m];
  }
  return x;
}

__global__ void __launch_bounds__(kColsThreads, 2) swiglu_backward_cols_kernel(const ColsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ __align__(16) float scale_XC[kOutputs][kTile], lo_XC[kOutputs][kTile], hi_XC[kOutputs][kTile];
  __shared__ __align__(16) uint32_t amax_XWC[kOutputs][kAmaxParts][kTile];  // per warp of the amax pass
  if (layout_skip(p.header)) return;  // uniform over the grid
  const bf16_t* h13_M2F = p.h13.get<const bf16_t>();
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, warp = t / 32;
  const int j = t % kRowVecs, g = t / kRowVecs;  // columns f0 + 8 j .., rows g + 32 i
  const int group = warp / 8, gwarp = warp % 8;  // encode group, its warp
  const int64_t F = p.F, f0 = static_cast<int64_t>(blockIdx.x) * kTile, f = f0 + kVec * j;
  const int64_t K = kBlock * p.max_blocks;
  const bool scored = p.row_scores_M != nullptr;
  const unsigned chunk_lanes = 0xffu << (lane & ~7);   // a 64-column chunk of one row
  const unsigned row_lanes = 0xffffu << (lane & 16);   // the row's 1x128 block
  auto tile = [&](int x) { return reinterpret_cast<bf16_t*>(smem + x * kTileBytes); };

  for (int64_t b = blockIdx.y; b < p.max_blocks; b += gridDim.y) {  // CTA-uniform
    int64_t m0 = 0, m1 = 0;
    if (!find_block(p.offsets_E1, p.E, b, m0, m1)) break;  // past the last block (later b too)
    const int n = static_cast<int>(m1 - m0);
    __syncthreads();  // the previous block's shared reads are done
    // One row per iteration, the next row's loads in flight meanwhile; not unrolled (nor the
    // encode below): the SwiGLU math and the encoders inline to thousands of instructions, and
    // unrolled copies stalled on instruction fetch (Nsight Compute).
    RowIn next = load_row(p, h13_M2F, m0, g, n, f, scored);
#pragma unroll 1
    for (int i = 0; i < kRowSteps; ++i) {
      const int r = g + kRowGroups * i;
      const RowIn in = next;
      if (i + 1 < kRowSteps) next = load_row(p, h13_M2F, m0, r + kRowGroups, n, f, scored);
      SwigluBackwardRun8 o{};
      if (r < n) {  // uniform over the half warp (one row): its shuffles below stay within it
        const int64_t m = m0 + r;
        o = swiglu_backward_run8(in.gate, in.up, in.dh, scored, in.score, p.act);
        store_fp8_run8(p.q, m, 2 * F, f, fp8_quantize_run8(o.d_gate, true, row_lanes));
        store_fp8_run8(p.q, m, 2 * F, F + f, fp8_quantize_run8(o.d_up, true, row_lanes));
        if (scored) {
          const float dot = chunk_dot_sum(o.dot, chunk_lanes);
          if (j % 8 == 0) p.score_parts_MC[m * p.chunks + f / kScoreChunkCols] = dot;
        }
      }
      // Rows past the block's end stay zeros: no amax, and the encode masks them to +0.
      *reinterpret_cast<uint4*>(tile(0) + r * kTile + kVec * j) = o.d_gate;
      *reinterpret_cast<uint4*>(tile(1) + r * kTile + kVec * j) = o.d_up;
      *reinterpret_cast<uint4*>(tile(2) + r * kTile + kVec * j) = o.h;
    }
    __syncthreads();

    if (t < kOutputs * kTile) {  // partial column amaxes: 16-byte vectors of rows u / 16 + 8 i
      const int x = t / kTile, u = t % kTile, jv = u % kRowVecs;
      const bf16_t* tile_RC = tile(x);
      uint32_t amax2[4] = {};  // |x| bf16 bits of columns 8 jv .. 8 jv + 7, two per word
#pragma unroll 4
      for (int r = u / kRowVecs; r < kBlock; r += kTile / kRowVecs) {
        const uint4 v = *reinterpret_cast<const uint4*>(tile_RC + r * kTile + kVec * jv);
        amax2[0] = __vmaxu2(amax2[0], v.x & 0x7fff7fffu);
        amax2[1] = __vmaxu2(amax2[1], v.y & 0x7fff7fffu);
        amax2[2] = __vmaxu2(amax2[2], v.z & 0x7fff7fffu);
        amax2[3] = __vmaxu2(amax2[3], v.w & 0x7fff7fffu);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) amax2[k] = __vmaxu2(amax2[k], __shfl_xor_sync(0xffffffffu, amax2[k], 16));
      if (lane < kRowVecs) {  // the fp32 bits of a bf16 are its bits << 16
        uint4* part_C = reinterpret_cast<uint4*>(&amax_XWC[x][u / 32][kVec * jv]);
        part_C[0] = make_uint4(amax2[0] << 16, amax2[0] & 0xffff0000u, amax2[1] << 16, amax2[1] & 0xffff0000u);
        part_C[1] = make_uint4(amax2[2] << 16, amax2[2] & 0xffff0000u, amax2[3] << 16, amax2[3] & 0xffff0000u);
      }
    }
    __syncthreads();
    if (t < kOutputs * kTile) {  // column t's amax, scale and bounds
      const int x = t / kTile, col = t % kTile;
      uint32_t amax = 0;
#pragma unroll
      for (int q = 0; q < kAmaxParts; ++q) amax = umax(amax, amax_XWC[x][q][col]);
      const float scale = fp8_scale_fp32(amax);
      const Fp8Fp32Bounds bounds = fp8_fp32_bounds(scale);
      scale_XC[x][col] = scale;
      lo_XC[x][col] = bounds.lo;
      hi_XC[x][col] = bounds.hi;
      if (x == 2) {
        p.h.scales_BL[b * F + f0 + col] = scale;
      } else {
        p.g13.scales_BL[b * 2 * F + x * F + f0 + col] = scale;
      }
    }
    __syncthreads();
    // Group 0 encodes d_gate then h, group 1 d_up; each stages its codes over its tile once every
    // reader of that tile has passed a barrier. Group 1 stores its tile while group 0 encodes h.
    uint32_t w[4][4];
    encode_words(tile(group), static_cast<const float*>(nullptr),
                 ColumnScales{scale_XC[group], lo_XC[group], hi_XC[group]}, lane, gwarp, w);
    __syncthreads();
    stage_chunk(w, n, lane, gwarp, reinterpret_cast<uint4*>(tile(group)));
    if (group == 0) {
      encode_words(tile(2), static_cast<const float*>(nullptr), ColumnScales{scale_XC[2], lo_XC[2], hi_XC[2]},
                   lane, gwarp, w);
      group_barrier(1);  // group 0 has read h's tile
      stage_chunk(w, n, lane, gwarp, reinterpret_cast<uint4*>(tile(2)));
      group_barrier(1);  // group 0's codes are staged
      store_staged(reinterpret_cast<const uint4*>(tile(0)), p.g13.qt_LK, K, b, f0, kTile, lane, gwarp);
      store_staged(reinterpret_cast<const uint4*>(tile(2)), p.h.qt_LK, K, b, f0, kTile, lane, gwarp);
    } else {
      group_barrier(2);  // group 1's codes are staged
      store_staged(reinterpret_cast<const uint4*>(tile(1)), p.g13.qt_LK, K, b, F + f0, kTile, lane, gwarp);
    }
  }
}

void check_cols(const Fp8ColsOut& c, const char* name) {
  EPMOE_CHECK_ARG(c.qt_LK != nullptr && c.scales_BL != nullptr, name, "column codes and scales", "nullptr");
  EPMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(c.qt_LK) % 16 == 0, name,
                  "16-byte aligned codes (whole 16-byte chunks of a column)",
                  reinterpret_cast<uintptr_t>(c.qt_LK));
}

}  // namespace

void swiglu_backward_fp8_cols(const Step& s, uint8_t* q_M2F, float* scales_SM, int64_t ld,
                              const Fp8ColsOut& grad_h13_cols, const Fp8ColsOut& h_cols, int64_t max_blocks) {
  const Fp8RowsOut rows{q_M2F, scales_SM, ld};
  const int64_t F = s.dims.F;
  EPMOE_CHECK_ARG(F % kTile == 0, "Config.intermediate_dim", "a multiple of 128 for the column tiles", F);
  EPMOE_CHECK_ARG(s.grad_h_MF != nullptr, "Step.grad_h_MF", "the unfused grad_h buffer", "nullptr");
  EPMOE_CHECK_ARG(q_M2F != nullptr && scales_SM != nullptr, "q_M2F", "grad_h13's E4M3 rows", "nullptr");
  EPMOE_CHECK_ARG(ld >= s.capacity_rows, "ld", ">= the capacity rows", ld);
  EPMOE_CHECK_ARG(max_blocks >= fp8_col_blocks(s.capacity_rows, s.dims.E), "max_blocks",
                  ">= fp8_col_blocks(capacity, E)", max_blocks);
  check_aligned16(q_M2F, "q_M2F");
  check_cols(grad_h13_cols, "grad_h13_cols");
  check_cols(h_cols, "h_cols");
  check_aligned16(s.grad_h_MF, "Step.grad_h_MF");
  if (s.capacity_rows == 0 || F == 0) return;
  ColsParams p{};
  p.header = s.layout.header;
  p.h13 = placed_h13(s);
  p.grad_h_MF = s.grad_h_MF;
  p.row_scores_M = s.row_scores_M;
  p.score_parts_MC = s.score_parts_MC;
  p.F = F;
  p.chunks = score_chunks(F);
  p.act = s.act;
  p.offsets_E1 = s.layout.expert_offsets_E1;
  p.E = s.dims.E;
  p.q = rows;
  p.g13 = grad_h13_cols;
  p.h = h_cols;
  p.max_blocks = max_blocks;
  set_shared_memory_limit<swiglu_backward_cols_kernel>(kSmem);
  const unsigned blocks = static_cast<unsigned>(max_blocks < 65535 ? max_blocks : 65535);
  swiglu_backward_cols_kernel<<<dim3(static_cast<unsigned>(F / kTile), blocks), kColsThreads, kSmem,
                                static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
