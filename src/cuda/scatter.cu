// scatter_rows: grid-stride over [capacity, D/8] vectors; rows m >= M (device count) do nothing.
// Stores go through the peer table with .cg (the owner reads them after the combine barrier).
#include "cuda/scatter.h"

#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"

namespace epmoe::cuda {
namespace {

struct ScatterParams {
  bf16_t* const* combine_R;    // [R] combine buffers [T, K, D] bf16
  const int32_t* header;       // layout header
  const int32_t* recv_src_M;   // [capacity] encode_src of each received row
  const bf16_t* rows_MD;       // [capacity, D] bf16
  const int32_t* replay_skip;  // nullable: the backward replay's predicate (placed.h)
  int64_t T, D, capacity;
  int K;
};

__global__ void __launch_bounds__(kThreads) scatter_rows_kernel(const ScatterParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const int64_t M = layout_rows(p.header, p.capacity);
  const int64_t vecs_per_row = p.D / kVec;
  const int64_t total = M * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total; j += stride) {
    const int64_t m = j / vecs_per_row;
    const int64_t col = (j % vecs_per_row) * kVec;
    const int32_t src = p.recv_src_M[m];
    bf16_t* slot_D = p.combine_R[src_rank(src, p.T, p.K)] + src_slot(src, p.T, p.K) * p.D;  // [D]
    store_vec_cg(slot_D + col, load_vec(p.rows_MD + m * p.D + col));
  }
}

}  // namespace

void scatter_rows(const Step& s) {
  ScatterParams p{};
  p.combine_R = s.combine_R;
  p.header = s.layout.header;
  p.recv_src_M = s.layout.recv_src_M;
  p.rows_MD = s.rows_MD;
  p.replay_skip = replay_skip_flag(s);
  p.T = s.dims.T;
  p.D = s.dims.D;
  p.capacity = s.capacity_rows;
  p.K = s.dims.K;
  const int64_t items = s.capacity_rows * (s.dims.D / kVec);
  scatter_rows_kernel<<<grid_for(items, kThreads), kThreads, 0, static_cast<cudaStream_t>(s.stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
