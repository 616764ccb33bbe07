// dispatch and gather_grad: one 16-byte vector per thread-iteration of a grid-stride loop over the
// [capacity, D/8] vectors of the received rows; rows m >= M (device count) do nothing. Source rows
// are read through the peer table with .cg loads (written by their owner before the barrier).
#include "cuda/dispatch.h"

#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

struct GatherParams {
  char* const* routing_R;          // [R] routing buffers: header | ids [T, K] i32 | scores [T, K] f32
  bf16_t* const* dispatch_R;       // [R] dispatch buffers [T, D] bf16
  const int32_t* header;           // layout header
  const int32_t* recv_src_M;       // [capacity] encode_src of each received row
  bf16_t* out_MD;                  // [capacity, D] bf16
  int64_t T, D, capacity, scores_offset;
  int K;
};

// kScale: gather_grad (row scaled by the owner's score of the route), otherwise a plain copy.
template <bool kScale>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const GatherParams p) {
  if (layout_skip(p.header)) return;
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t vecs_per_row = p.D / kVec;
  const int64_t total = M * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / vecs_per_row;
    const int64_t col = (j % vecs_per_row) * kVec;
    const int32_t src = p.recv_src_M[m];
    const int r = src_rank(src, p.T, p.K);
    const int64_t slot = src_slot(src, p.T, p.K);  // t*K + k
    const int64_t t = slot / p.K;
    const uint4 u = load_vec_cg(p.dispatch_R[r] + t * p.D + col);  // [T, D] of rank r, row t
    if constexpr (kScale) {
      const float* scores_TK = reinterpret_cast<const float*>(p.routing_R[r] + p.scores_offset);  // [T, K]
      const float score = __ldcg(scores_TK + slot);
      Bf16x8 v = unpack8(u);
#pragma unroll
      for (int e = 0; e < kVec; ++e) v.v[e] = __fmul_rn(score, v.v[e]);
      store_vec(p.out_MD + m * p.D + col, pack8(v));
    } else {
      store_vec(p.out_MD + m * p.D + col, u);
    }
  }
}

template <bool kScale>
void launch_gather(const Step& s, bf16_t* out_MD) {
  GatherParams p{};
  p.routing_R = s.routing_R;
  p.dispatch_R = s.dispatch_R;
  p.header = s.layout.header;
  p.recv_src_M = s.layout.recv_src_M;
  p.out_MD = out_MD;
  p.T = s.dims.T;
  p.D = s.dims.D;
  p.capacity = s.capacity_rows;
  p.scores_offset = routing_buffer_layout(s.dims.T, s.dims.K).scores_offset;
  p.K = s.dims.K;
  const int64_t items = s.capacity_rows * (s.dims.D / kVec);
  gather_rows_kernel<kScale><<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void dispatch(const Step& s) { launch_gather<false>(s, s.x_gathered_MD); }
void gather_grad(const Step& s) { launch_gather<true>(s, s.grad_h3_MD); }

}  // namespace epmoe::cuda
