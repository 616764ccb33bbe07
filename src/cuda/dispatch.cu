// dispatch and gather_grad: one warp per pull (core/layout.h) of a grid-stride loop over the P
// pulls. The warp reads the source row once through the peer table (.cg 16-byte vectors; written
// by its owner before the barrier) and stores it to every local row of the pull, so a token whose
// K routes land on this rank crosses NVLink once. dispatch then releases the rows it stored on the
// per-128-row arrival counters, which an arrival-gated W13 acquires (gemm/arrival_gate.cuh).
// Where the pulls are too few to fill the grid (decode sizes), each pull is split into column
// slices of one batch (32 * kBatch vectors) run by separate warps, so a warp's load-then-store
// rounds over the row run side by side instead of one after another (pull_slices).
#include "cuda/dispatch.h"

#include "core/fp8_terms.h"
#include "cuda/formats/fp8_row_vectors.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"
#include "cuda/pull_walk.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kBatch = 4;  // row vectors a lane loads before it stores them (loads in flight)

struct PullParams {
  char* const* routing_R;        // [R] routing buffers: header | ids [T, K] i32 | scores [T, K] f32
  bf16_t* const* dispatch_R;     // [R] dispatch buffers [T, D] bf16
  const int32_t* header;         // layout header
  const int32_t* pull_src_P;     // [pull capacity] encode_pull of each pull
  const int32_t* pull_rows_PK;   // [pull capacity, K] local row of each route, -1 = none
  Placed out;                    // [capacity, D] bf16: x_gathered (placed by the layer plan) or grad_h3
  const int32_t* replay_skip;    // nullable: the backward replay's predicate (placed.h)
  uint32_t* arrivals_B;          // [ceil(capacity / 128)] arrival counters; nullptr: not counted
  // gather_grad with the score after the W2 DGRAD (Step::row_scores_M): rows copied unscaled and
  // each row's score stored here [capacity] f32; nullptr: rows scaled by their scores.
  float* row_scores_M;
  Fp8RowsOut q;  // kQuantize: the E4M3 rows of out (fp8_rows_bytes(capacity, D))
  int64_t T, D, pull_capacity, scores_offset;
  int K;
  int slices;  // warps per pull, each a column slice of whole batches (1 with arrival counters)
};

__device__ __forceinline__ void release_add(uint32_t* counter, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(v) : "memory");
}

// bf16(score * x) of 8 elements.
__device__ __forceinline__ uint4 scaled(uint4 u, float score) {
  Bf16x8 x = unpack8(u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) x.v[e] = __fmul_rn(score, x.v[e]);
  return pack8(x);
}

// kScale: gather_grad (each row scaled by its own route's score, or with row scores copied and
// the score stored per row), otherwise a plain copy. kQuantize (gather_grad in FP8 training): each
// stored row is also quantized 1x128 into p.q as fp8_quantize_rows_counted would from the stored
// bf16 (fp8_row_vectors.cuh).
template <bool kScale, bool kQuantize>
__global__ void __launch_bounds__(kThreads) pull_rows_kernel(const PullParams p) {
  static_assert(kScale || !kQuantize, "only gather_grad quantizes");
  // A programmatically dependent W13 may launch once every CTA of this grid has started: it waits
  // on the arrival counters, never on this grid's end, and these CTAs are all resident by then.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  bf16_t* out_MD = p.out.get<bf16_t>();  // [capacity, D]
  const int64_t pulls = p.header[kLayoutPulls];
  const int64_t P = pulls < 0 ? 0 : (pulls < p.pull_capacity ? pulls : p.pull_capacity);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t vecs = p.D / kVec;
  const int slices = kQuantize ? 1 : p.slices;  // FP8 gather_grad: one warp per pull (registers)
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < P * slices;
       i += warps) {
    const int64_t pull = folded_pull(slices == 1 ? i : i / slices, P);
    const int slice = slices == 1 ? 0 : static_cast<int>(i % slices);
    const int32_t src = p.pull_src_P[pull];
    const int r = static_cast<int>(src / p.T);
    const int64_t t = src % p.T;
    const bf16_t* row_D = p.dispatch_R[r] + t * p.D;          // [D] of rank r, token t (peer)
    const int32_t* rows_K = p.pull_rows_PK + pull * p.K;      // [K]
    const int32_t lane_row = lane_route_row(rows_K, p.K, lane);
    const float* scores_K = nullptr;                          // [K] the token's scores (peer)
    float lane_score = 0.0f;
    const bool scale = kScale && p.row_scores_M == nullptr;  // kernel-uniform
    if constexpr (kScale) {
      scores_K = reinterpret_cast<const float*>(p.routing_R[r] + p.scores_offset) + t * p.K;
      if (scale) {
        lane_score = lane_route_score(scores_K, p.K, lane);
      } else if (slice == 0) {
        for (int k = lane; k < p.K; k += 32) {
          const int32_t m = rows_K[k];
          if (m >= 0) p.row_scores_M[m] = __ldcg(scores_K + k);
        }
      }
    }
    // Lane l holds vectors v0 + l + 32 b with v0 warp-uniform: the loop runs on every lane (route
    // and quantization shuffles); quantizing, 16 lanes are one 1x128 block.
    for (int64_t v0 = slice * 32 * kBatch; v0 < vecs; v0 += static_cast<int64_t>(slices) * 32 * kBatch) {
      uint4 u[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t v = v0 + lane + 32 * b;
        if (v < vecs) u[b] = load_vec_cg(row_D + v * kVec);
      }
      if constexpr (kQuantize) {
        if (!scale) {  // row scores: the pull's local rows are one row, quantized once
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            if (v0 + 32 * b >= vecs) break;  // warp-uniform: no lane of this or a later b in the row
            const int64_t v = v0 + lane + 32 * b;
            const bool in = v < vecs;
            const uint4 w = in ? u[b] : make_uint4(0u, 0u, 0u, 0u);
            const Fp8Run8 q = fp8_quantize_run8(w, in, 0xffffffffu);
            if (!in) continue;
            for (int k = 0; k < p.K; ++k) {
              const int64_t m = rows_K[k];
              if (m < 0) continue;
              store_vec(out_MD + m * p.D + v * kVec, w);
              store_fp8_run8(p.q, m, p.D, v * kVec, q);
            }
          }
          continue;
        }
      }
      for (int k = 0; k < p.K; ++k) {
        const int64_t m = route_row(lane_row, rows_K, k);  // warp-uniform
        if (m < 0) continue;
        bf16_t* out_D = out_MD + m * p.D;  // [D] local row m
        float score = 0.0f;
        if (scale) score = route_score(lane_score, scores_K, k);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t v = v0 + lane + 32 * b;
          if constexpr (kQuantize) {
            if (v0 + 32 * b >= vecs) break;  // warp-uniform: no lane of this or a later b in the row
            const bool in = v < vecs;  // scale holds here: row scores took the branch above
            const uint4 w = scaled(in ? u[b] : make_uint4(0u, 0u, 0u, 0u), score);
            const Fp8Run8 q = fp8_quantize_run8(w, in, 0xffffffffu);
            if (in) {
              store_vec(out_D + v * kVec, w);
              store_fp8_run8(p.q, m, p.D, v * kVec, q);
            }
          } else {
            if (v >= vecs) continue;
            store_vec(out_D + v * kVec, scale ? scaled(u[b], score) : u[b]);
          }
        }
      }
    }
    if (p.arrivals_B != nullptr) {
      // Every lane's stores are ordered before the barrier; the releasing lanes publish them
      // (cumulativity) to the W13 producer's acquire load.
      __threadfence();
      __syncwarp();
      for (int k = lane; k < p.K; k += 32) {
        const int32_t m = rows_K[k];
        if (m >= 0) release_add(p.arrivals_B + m / kArrivalBlockRows, 1u);
      }
    }
  }
}

// Warps per pull: as many column slices (whole batches) as the persistent grid has warps to spare
// for the pulls the layout can hold, one per batch of the row at most; 1 with arrival counters
// (each pull releases its rows once). Host-known sizes only: the same geometry for every call.
int pull_slices(int64_t pull_capacity, int64_t D, bool arrivals) {
  if (arrivals) return 1;
  const int64_t batches = (D / kVec + 32 * kBatch - 1) / (32 * kBatch);
  const int64_t warps = static_cast<int64_t>(sm_count()) * kBlocksPerSm * (kThreads / 32);
  const int64_t spare = warps / (pull_capacity > 0 ? pull_capacity : 1);
  const int64_t slices = spare < batches ? spare : batches;
  return static_cast<int>(slices < 1 ? 1 : slices);
}

template <bool kScale, bool kQuantize = false>
void launch_pulls(const Step& s, Placed out, uint32_t* arrivals, Fp8RowsOut q = {}) {
  PullParams p{};
  p.routing_R = s.routing_R;
  p.dispatch_R = s.dispatch_R;
  p.header = s.layout.header;
  p.pull_src_P = s.layout.pull_src_P;
  p.pull_rows_PK = s.layout.pull_rows_PK;
  p.out = out;
  p.replay_skip = kScale ? nullptr : replay_skip_flag(s);
  p.arrivals_B = arrivals;
  p.row_scores_M = kScale ? s.row_scores_M : nullptr;
  p.T = s.dims.T;
  p.D = s.dims.D;
  p.pull_capacity = pull_capacity(s.capacity_rows, s.dims.T, s.dims.R);
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  p.q = q;
  p.slices = kQuantize ? 1 : pull_slices(p.pull_capacity, p.D, arrivals != nullptr);
  // One warp per pull slice; at most a persistent grid (kBlocksPerSm per SM, all resident at once).
  const int64_t threads = p.pull_capacity * p.slices * 32;
  pull_rows_kernel<kScale, kQuantize>
      <<<grid_for(threads, kThreads), kThreads, 0, static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

// FP8 (Config.precision = fp8_block): the source rows are E4M3 codes [T, D] with row-major fp32
// scales [T, S] (fp8_dispatch_layout); the received rows go to x_gathered as codes [rows, D] then
// S-major scales [S, ld] (fp8_rows_bytes at the received rows, core/fp8_terms.h).
struct Fp8PullParams {
  char* const* dispatch_R;       // [R] dispatch buffers: codes [T, D] u8 | scales [T, S] f32
  const int32_t* header;         // layout header
  const int32_t* pull_src_P;     // [pull capacity]
  const int32_t* pull_rows_PK;   // [pull capacity, K]
  Placed out;                    // x_gathered space: codes [rows, D] | scales [S, ld] f32
  const int32_t* replay_skip;    // nullable (placed.h)
  uint32_t* arrivals_B;          // [ceil(capacity / 128)] arrival counters
  int64_t T, D, S, capacity, pull_capacity, scales_offset;
  int K;
};

__global__ void __launch_bounds__(kThreads) pull_fp8_rows_kernel(const Fp8PullParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const int64_t rows = layout_rows(p.header, p.capacity);
  char* out = p.out.get<char>();
  uint8_t* q_MD = reinterpret_cast<uint8_t*>(out);                                        // [rows, D]
  float* scales_SM = reinterpret_cast<float*>(out + fp8_rows_scales_offset(rows, p.D));  // [S, ld]
  const int64_t ld = fp8_rows_ld(rows);
  const int64_t pulls = p.header[kLayoutPulls];
  const int64_t P = pulls < 0 ? 0 : (pulls < p.pull_capacity ? pulls : p.pull_capacity);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t vecs = p.D / 16;  // D % 16 == 0 (CudaBackend::validate for fp8_block)
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < P;
       i += warps) {
    const int64_t pull = folded_pull(i, P);
    const int32_t src = p.pull_src_P[pull];
    const char* base = p.dispatch_R[src / p.T];  // rank r's buffer (peer)
    const int64_t t = src % p.T;
    const uint4* codes_V = reinterpret_cast<const uint4*>(base + t * p.D);                // [D / 16]
    const float* scales_S = reinterpret_cast<const float*>(base + p.scales_offset) + t * p.S;  // [S]
    const int32_t* rows_K = p.pull_rows_PK + pull * p.K;  // [K]
    const int32_t lane_row = lane_route_row(rows_K, p.K, lane);
    // v0 warp-uniform (route_row shuffles on every lane); lane l holds vectors v0 + l + 32 b.
    for (int64_t v0 = 0; v0 < vecs; v0 += 32 * kBatch) {
      uint4 u[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t v = v0 + lane + 32 * b;
        if (v < vecs) u[b] = __ldcg(codes_V + v);
      }
      for (int k = 0; k < p.K; ++k) {
        const int64_t m = route_row(lane_row, rows_K, k);  // warp-uniform
        if (m < 0) continue;
        uint4* out_V = reinterpret_cast<uint4*>(q_MD + m * p.D);  // [D / 16] local row m
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t v = v0 + lane + 32 * b;
          if (v < vecs) out_V[v] = u[b];
        }
      }
    }
    for (int64_t b = lane; b < p.S; b += 32) {
      const float scale = __ldcg(scales_S + b);
      for (int k = 0; k < p.K; ++k) {
        const int64_t m = rows_K[k];
        if (m >= 0) scales_SM[b * ld + m] = scale;
      }
    }
    // Counted as the bf16 dispatch counts (the CPU twin counts the same; no FP8 GEMM waits on them).
    __threadfence();
    __syncwarp();
    for (int k = lane; k < p.K; k += 32) {
      const int32_t m = rows_K[k];
      if (m >= 0) release_add(p.arrivals_B + m / kArrivalBlockRows, 1u);
    }
  }
}

void launch_fp8_pulls(const Step& s) {
  Fp8PullParams p{};
  p.dispatch_R = reinterpret_cast<char* const*>(s.dispatch_R);
  p.header = s.layout.header;
  p.pull_src_P = s.layout.pull_src_P;
  p.pull_rows_PK = s.layout.pull_rows_PK;
  p.out = placed_x_gathered(s);
  p.replay_skip = replay_skip_flag(s);
  p.arrivals_B = arrivals_B(s);
  p.T = s.dims.T;
  p.D = s.dims.D;
  p.S = fp8_blocks(s.dims.D);
  p.capacity = s.capacity_rows;
  p.pull_capacity = pull_capacity(s.capacity_rows, s.dims.T, s.dims.R);
  p.scales_offset = fp8_dispatch_layout(s.dims.T, s.dims.D).scales;
  p.K = s.dims.K;
  EPMOE_CHECK_ARG(p.D % 16 == 0, "Config.hidden_dim", "a multiple of 16 with precision fp8_block",
                  p.D);
  const int64_t threads = p.pull_capacity * 32;
  pull_fp8_rows_kernel<<<grid_for(threads, kThreads), kThreads, 0,
                         static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void dispatch(const Step& s) {
  if (s.fp8) {
    launch_fp8_pulls(s);
    return;
  }
  // Arrival counters only for a W13 that waits on them: counting costs a fence per pull and one
  // warp per pull (no column slices), the decode pull's latency.
  launch_pulls<false>(s, placed_x_gathered(s), s.arrival_gated_w13 ? arrivals_B(s) : nullptr);
}
void gather_grad(const Step& s) { launch_pulls<true>(s, plain(s.grad_h3_MD), nullptr); }
void gather_grad_fp8_rows(const Step& s, uint8_t* q_MD, float* scales_SM, int64_t ld) {
  EPMOE_CHECK_ARG(s.dims.D % 16 == 0, "Config.hidden_dim",
                  "a multiple of 16 with precision fp8_block", s.dims.D);
  EPMOE_CHECK_ARG(ld >= s.capacity_rows, "ld", ">= the capacity rows", ld);
  EPMOE_CHECK_ARG(q_MD != nullptr && scales_SM != nullptr, "q_MD, scales_SM",
                  "the E4M3 rows' codes and scales", "nullptr");
  check_aligned16(q_MD, "q_MD");
  launch_pulls<true, true>(s, plain(s.grad_h3_MD), nullptr, Fp8RowsOut{q_MD, scales_SM, ld});
}

}  // namespace epmoe::cuda
