// Per-rank combine kernels. send: one warp per pull of a grid-stride loop over the P pulls (the
// pull's routes and scores read once, pull_walk.cuh); each lane sums its 16-byte column vectors of
// the pull's local rows in k order and stores the rounded sum once through the peer table (.cg).
// reduce: grid-stride over [T', D/8] vectors of the owner. Separate fp32 multiply and add
// (__fmul_rn / __fadd_rn, never an FMA) in the CPU reference's order, so both backends agree
// bitwise.
#include "cuda/combine_partials.h"

#include "core/combine_ranks.h"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"
#include "cuda/pull_walk.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kBatch = 4;  // column vectors a lane sums per pass (independent loads in flight)

struct SendParams {
  char* const* routing_R;        // [R] routing buffers: header | ids [T, K] i32 | scores [T, K] f32
  bf16_t* const* combine_R;      // [R] combine buffers [T, R, D] bf16
  const int32_t* header;         // layout header
  const int32_t* pull_src_P;     // [pull capacity] encode_pull of each pull
  const int32_t* pull_rows_PK;   // [pull capacity, K] local row of each route, -1 = none
  Placed rows;                   // [capacity, D] bf16: h3 (W2, placed) or W13 DGRAD rows_MD
  const int32_t* replay_skip;    // nullable: the backward replay's predicate (placed.h)
  int64_t T, D, pull_capacity, scores_offset;
  int K, R, rank;
};

template <bool kScaled>
__global__ void __launch_bounds__(kThreads) send_partials_kernel(const SendParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const int64_t pulls = p.header[kLayoutPulls];
  const int64_t P = pulls < 0 ? 0 : (pulls < p.pull_capacity ? pulls : p.pull_capacity);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t vecs = p.D / kVec;
  const bf16_t* rows_MD = p.rows.get<const bf16_t>();
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < P;
       i += warps) {  // warp-uniform
    const int64_t pull = folded_pull(i, P);
    const int32_t src = p.pull_src_P[pull];
    const int r = static_cast<int>(src / p.T);
    const int64_t t = src % p.T;
    const int32_t* rows_K = p.pull_rows_PK + pull * p.K;  // [K]
    const int32_t lane_row = lane_route_row(rows_K, p.K, lane);
    const float* scores_K = nullptr;                      // [K] the token's scores (peer)
    float lane_score = 1.0f;
    if constexpr (kScaled) {
      scores_K = reinterpret_cast<const float*>(p.routing_R[r] + p.scores_offset) + t * p.K;
      lane_score = lane_route_score(scores_K, p.K, lane);
    }
    bf16_t* out_D = p.combine_R[r] + (t * p.R + p.rank) * p.D;  // [D] on the owner (peer)
    // base is warp-uniform (every lane runs every pass: route_row shuffles); lane l sums the
    // vectors base + l + 32 b.
    for (int64_t base = 0; base < vecs; base += 32 * kBatch) {
      Bf16x8 acc[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[b].v[e] = 0.0f;
      }
      for (int k = 0; k < p.K; ++k) {
        const int64_t m = route_row(lane_row, rows_K, k);  // warp-uniform
        float score = 1.0f;
        if constexpr (kScaled) score = route_score(lane_score, scores_K, k);
        if (m < 0) continue;
        const bf16_t* row_D = rows_MD + m * p.D;  // [D] local row m
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t v = base + lane + 32 * b;
          if (v >= vecs) continue;
          const Bf16x8 x = unpack8(load_vec(row_D + v * kVec));
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if constexpr (kScaled) {
              acc[b].v[e] = __fadd_rn(acc[b].v[e], __fmul_rn(score, x.v[e]));
            } else {
              acc[b].v[e] = __fadd_rn(acc[b].v[e], x.v[e]);
            }
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t v = base + lane + 32 * b;
        if (v < vecs) store_vec_cg(out_D + v * kVec, pack8(acc[b]));
      }
    }
  }
}

struct ReduceParams {
  char* const* routing_R;      // [R] routing buffers (own: ids [T, K] i32)
  bf16_t* const* combine_R;    // [R] combine buffers [T, R, D] bf16 (own: written by peers)
  const int32_t* header;       // layout header
  const int32_t* route_row_TK; // [T * K] row of each own route in its receiver, -1 = inactive
  bf16_t* out_TD;              // [T', D] bf16: y or grad_x
  float* grad_scores_TK;       // [T', K] f32 (backward) or nullptr
  int64_t tokens, D, ids_offset, scores_offset;  // scores_offset: of the routing buffer
  int K, E, R, rank;
};

__global__ void __launch_bounds__(kThreads) reduce_partials_kernel(const ReduceParams p) {
  const bool skip = layout_skip(p.header);
  const int64_t live = live_rows(p.header, p.tokens);
  const int32_t* ids_TK = reinterpret_cast<const int32_t*>(p.routing_R[p.rank] + p.ids_offset);
  const bf16_t* combine_TRD = p.combine_R[p.rank];
  const int64_t vecs_per_row = p.D / kVec;
  const int64_t total = p.tokens * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t t = j / vecs_per_row;
    const int64_t col = (j % vecs_per_row) * kVec;
    Bf16x8 acc;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc.v[e] = 0.0f;
    if (!skip && t < live) {
      const int32_t* ids_K = ids_TK + t * p.K;
      for (int q = next_partial_rank(ids_K, p.K, p.E, -1); q >= 0;
           q = next_partial_rank(ids_K, p.K, p.E, q)) {
        const Bf16x8 c = unpack8(load_vec_cg(combine_TRD + (t * p.R + q) * p.D + col));
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc.v[e] = __fadd_rn(acc.v[e], c.v[e]);
      }
    }
    store_vec(p.out_TD + t * p.D + col, pack8(acc));
  }
  if (p.grad_scores_TK == nullptr) return;
  // [T, K]: the expert ranks' grad_scores, stored in place of the scores (reduce.cu, grad_scores)
  const float* owner_TK = reinterpret_cast<const float*>(p.routing_R[p.rank] + p.scores_offset);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.tokens * p.K;
       i += stride) {
    const bool active = !skip && i / p.K < live && p.route_row_TK[i] >= 0;
    p.grad_scores_TK[i] = active ? __ldcg(owner_TK + i) : 0.0f;
  }
}

}  // namespace

void send_partials(const Step& s, bool scaled) {
  SendParams p{};
  p.routing_R = s.routing_R;
  p.combine_R = s.combine_R;
  p.header = s.layout.header;
  p.pull_src_P = s.layout.pull_src_P;
  p.pull_rows_PK = s.layout.pull_rows_PK;
  p.rows = scaled ? placed_h3_rows(s) : plain(s.rows_MD);
  p.replay_skip = replay_skip_flag(s);
  p.T = s.dims.T;
  p.D = s.dims.D;
  p.pull_capacity = pull_capacity(s.capacity_rows, s.dims.T, s.dims.R);
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  p.R = s.dims.R;
  p.rank = s.rank;
  // One warp per pull; at most a persistent grid.
  const int64_t threads = p.pull_capacity * 32;
  const auto stream = static_cast<cudaStream_t>(s.stream);
  if (scaled) {
    send_partials_kernel<true><<<grid_for(threads, kThreads), kThreads, 0, stream>>>(p);
  } else {
    send_partials_kernel<false><<<grid_for(threads, kThreads), kThreads, 0, stream>>>(p);
  }
  EPMOE_CUDA_LAUNCH_CHECK();
}

void reduce_partials(const Step& s, bf16_t* out_TD, const char* out_name, float* grad_scores_TK) {
  check_aligned16(out_TD, out_name);
  ReduceParams p{};
  p.routing_R = s.routing_R;
  p.combine_R = s.combine_R;
  p.header = s.layout.header;
  p.route_row_TK = s.layout.route_row_TK;
  p.out_TD = out_TD;
  p.grad_scores_TK = grad_scores_TK;
  p.tokens = s.tokens;
  p.D = s.dims.D;
  p.ids_offset = routing_buffer_layout(s.dims.T, s.dims.K).ids_offset;
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  p.E = s.dims.E;
  p.R = s.dims.R;
  p.rank = s.rank;
  const int64_t items = s.tokens * (s.dims.D / kVec);
  reduce_partials_kernel<<<grid_for(items, kThreads), kThreads, 0,
                           static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
