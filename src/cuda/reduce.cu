// Reductions over the K route slots of each token. Every sum runs in a fixed order (k ascending,
// d ascending) with separate fp32 multiply and add (__fmul_rn / __fadd_rn: never contracted to
// an FMA), so the results equal the CPU reference's bit for bit.
#include "cuda/reduce.h"

#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"

namespace epmoe::cuda {
namespace {

struct ReduceParams {
  char* const* routing_R;        // [R] routing buffers: header | ids [T, K] i32 | scores [T, K] f32
  bf16_t* const* combine_R;      // [R] combine buffers [T, K, D] bf16
  const int32_t* header;         // layout header
  const int32_t* route_row_TK;   // [T * K] row of each own route in its receiver, -1 = inactive
  bf16_t* out_TD;                // [T', D] bf16: y or grad_x
  Placed h3;                     // [T, K, D] bf16 (layer plan), nullable: saved copy of the slots
  float* grad_scores_TK;         // [T', K] f32 (backward, score after the W2 DGRAD) or nullptr
  int64_t tokens, D, scores_offset;
  int K, rank;
};

// Routes whose slot vectors a thread loads all before it adds them (K up to this; more: one at a
// time). The loads are independent, so the K round trips to memory overlap; the adds still run in
// k order.
constexpr int kLoadedRoutes = 8;

// kScaled: forward (score-weighted, h3 copy), otherwise the backward plain sum.
template <bool kScaled>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const ReduceParams p) {
  const bool skip = layout_skip(p.header);
  const int64_t live = live_rows(p.header, p.tokens);
  const bf16_t* combine_TKD = p.combine_R[p.rank];  // [T, K, D] own slots, written by peers
  const float* scores_TK =
      reinterpret_cast<const float*>(p.routing_R[p.rank] + p.scores_offset);  // [T, K] own, f32
  bf16_t* h3_TKD = kScaled ? p.h3.get<bf16_t>() : nullptr;  // [T, K, D], nullable
  const int64_t vecs_per_row = p.D / kVec;
  const int64_t total = p.tokens * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t t = j / vecs_per_row;
    const int64_t col = (j % vecs_per_row) * kVec;
    Bf16x8 acc;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc.v[e] = 0.0f;
    // Route k's slot vector u into acc (and the h3 copy), in k order.
    auto add = [&](int64_t slot, uint4 u) {
      const Bf16x8 c = unpack8(u);
      if constexpr (kScaled) {
        if (h3_TKD != nullptr) store_vec(h3_TKD + slot * p.D + col, u);
        const float score = scores_TK[slot];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc.v[e] = __fadd_rn(acc.v[e], __fmul_rn(score, c.v[e]));
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc.v[e] = __fadd_rn(acc.v[e], c.v[e]);
      }
    };
    // Inactive routes: their slots are never read.
    if (!skip && t < live && p.K <= kLoadedRoutes) {
      const int32_t* rows_K = p.route_row_TK + t * p.K;
      uint4 u[kLoadedRoutes];
#pragma unroll
      for (int k = 0; k < kLoadedRoutes; ++k) {
        if (k < p.K && rows_K[k] >= 0) u[k] = load_vec_cg(combine_TKD + (t * p.K + k) * p.D + col);
      }
#pragma unroll
      for (int k = 0; k < kLoadedRoutes; ++k) {
        if (k < p.K && rows_K[k] >= 0) add(t * p.K + k, u[k]);
      }
    } else if (!skip && t < live) {
      for (int k = 0; k < p.K; ++k) {
        const int64_t slot = t * p.K + k;
        if (p.route_row_TK[slot] >= 0) add(slot, load_vec_cg(combine_TKD + slot * p.D + col));
      }
    }
    store_vec(p.out_TD + t * p.D + col, pack8(acc));
  }
  if constexpr (!kScaled) {
    if (p.grad_scores_TK == nullptr) return;
    // The expert ranks' grad_scores, in the own routing buffer's score slots (scores_from_parts).
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.tokens * p.K;
         i += stride) {
      const bool active = !skip && i / p.K < live && p.route_row_TK[i] >= 0;
      p.grad_scores_TK[i] = active ? __ldcg(scores_TK + i) : 0.0f;
    }
  }
}

template <bool kScaled>
void launch_reduce(const Step& s, bf16_t* out_TD, const char* out_name) {
  check_aligned16(out_TD, out_name);
  ReduceParams p{};
  p.routing_R = s.routing_R;
  p.combine_R = s.combine_R;
  p.header = s.layout.header;
  p.route_row_TK = s.layout.route_row_TK;
  p.out_TD = out_TD;
  p.h3 = kScaled ? placed_h3(s) : plain(nullptr);
  p.grad_scores_TK = !kScaled && s.row_scores_M != nullptr ? s.grad_scores_TK : nullptr;
  p.tokens = s.tokens;
  p.D = s.dims.D;
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  p.rank = s.rank;
  const int64_t items = s.tokens * (s.dims.D / kVec);
  reduce_kernel<kScaled><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

// ---- grad_scores: one warp per token. grad_y[t] is read once per group of up to 8 routes; each
// lane sums its 16-byte column vectors of every route in d order, then the warp reduces with a
// fixed xor tree (deterministic; a different order from the CPU's sequential sum, so the two agree
// to fp32 rounding, not bitwise). Inactive routes and padding rows give 0 without reading h3.
constexpr int kDotWarps = 8;
constexpr int kDotThreads = kDotWarps * 32;
constexpr int kDotRoutes = 8;  // routes per pass over grad_y[t]

struct DotParams {
  const int32_t* header;         // layout header
  const int32_t* route_row_TK;   // [T * K]
  const bf16_t* grad_y_TD;       // [T', D] bf16
  Placed h3;                     // [T, K, D] bf16 (layer plan), nullable: the own combine buffer
  bf16_t* const* combine_R;      // [R] combine buffers [T, K, D] bf16
  float* grad_scores_TK;         // [T', K] f32
  int64_t tokens, D;
  int K, rank;
};

__global__ void __launch_bounds__(kDotThreads) grad_scores_kernel(const DotParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const bool skip = layout_skip(p.header);
  const int64_t live = live_rows(p.header, p.tokens);
  const bf16_t* saved_TKD = p.h3.get<const bf16_t>();
  const bf16_t* h3_TKD = saved_TKD != nullptr ? saved_TKD : p.combine_R[p.rank];  // [T, K, D] bf16
  const int64_t vecs = p.D / kVec;
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * kDotWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kDotWarps + threadIdx.x / 32; t < p.tokens;
       t += warps_total) {  // warp-uniform
    const bf16_t* g_D = p.grad_y_TD + t * p.D;  // [D] bf16
    for (int k0 = 0; k0 < p.K; k0 += kDotRoutes) {
      bool active[kDotRoutes];
      float acc[kDotRoutes];
#pragma unroll
      for (int j = 0; j < kDotRoutes; ++j) {
        const int k = k0 + j;
        active[j] = !skip && k < p.K && t < live && p.route_row_TK[t * p.K + k] >= 0;
        acc[j] = 0.0f;
      }
      for (int64_t v = lane; v < vecs; v += 32) {
        const Bf16x8 g = unpack8(load_vec(g_D + v * kVec));
#pragma unroll
        for (int j = 0; j < kDotRoutes; ++j) {
          if (!active[j]) continue;
          const Bf16x8 h = unpack8(load_vec_cg(h3_TKD + (t * p.K + k0 + j) * p.D + v * kVec));
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[j] = __fadd_rn(acc[j], __fmul_rn(g.v[e], h.v[e]));
        }
      }
#pragma unroll
      for (int j = 0; j < kDotRoutes; ++j) {
#pragma unroll
        for (int d = 16; d > 0; d /= 2) acc[j] = __fadd_rn(acc[j], __shfl_xor_sync(0xffffffffu, acc[j], d));
        if (lane == 0 && k0 + j < p.K) p.grad_scores_TK[t * p.K + k0 + j] = active[j] ? acc[j] : 0.0f;
      }
    }
  }
}

// ---- grad_scores with the score after the W2 DGRAD (Step::row_scores_M): one thread per
// received row sums its per-64-column partials in ascending chunk order (the CPU twin's order)
// and stores the result into the owner's routing buffer in place of the route's score, which
// only this rank reads (gather_grad); the owner's reduce_backward copies it into grad_scores.
struct PartsParams {
  char* const* routing_R;        // [R] routing buffers: header | ids [T, K] i32 | scores [T, K] f32
  const int32_t* header;         // layout header
  const int32_t* recv_src_M;     // [capacity] encode_src of each received row
  const float* score_parts_MC;   // [capacity, chunks] f32
  int64_t capacity, chunks, T, scores_offset;
  int K;
};

__global__ void __launch_bounds__(kThreads) scores_from_parts_kernel(const PartsParams p) {
  if (layout_skip(p.header)) return;
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; m < M; m += stride) {
    const float* parts_C = p.score_parts_MC + m * p.chunks;  // [chunks]
    float acc = 0.0f;
    for (int64_t c = 0; c < p.chunks; ++c) acc = __fadd_rn(acc, parts_C[c]);
    const int32_t src = p.recv_src_M[m];
    float* owner_TK = reinterpret_cast<float*>(p.routing_R[src_rank(src, p.T, p.K)] +
                                               p.scores_offset);  // [T, K] (peer)
    __stcg(owner_TK + src_slot(src, p.T, p.K), acc);
  }
}

void scores_from_parts(const Step& s) {
  PartsParams p{};
  p.routing_R = s.routing_R;
  p.header = s.layout.header;
  p.recv_src_M = s.layout.recv_src_M;
  p.score_parts_MC = s.score_parts_MC;
  p.capacity = s.capacity_rows;
  p.chunks = score_chunks(s.dims.F);
  p.T = s.dims.T;
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  scores_from_parts_kernel<<<grid_for(s.capacity_rows, kThreads), kThreads, 0,
                             static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void reduce_forward(const Step& s) { launch_reduce<true>(s, s.y_TD, "y_TD"); }
void reduce_backward(const Step& s) { launch_reduce<false>(s, s.grad_x_TD, "grad_x_TD"); }

void grad_scores(const Step& s) {
  if (s.row_scores_M != nullptr) {
    scores_from_parts(s);
    return;
  }
  check_aligned16(s.grad_y_TD, "grad_y_TD");
  DotParams p{};
  p.header = s.layout.header;
  p.route_row_TK = s.layout.route_row_TK;
  p.grad_y_TD = s.grad_y_TD;
  p.h3 = placed_h3(s);
  p.combine_R = s.combine_R;
  p.grad_scores_TK = s.grad_scores_TK;
  p.tokens = s.tokens;
  p.D = s.dims.D;
  p.K = s.dims.K;
  p.rank = s.rank;
  grad_scores_kernel<<<grid_for(s.tokens * 32, kDotThreads), kDotThreads, 0,
                       static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
