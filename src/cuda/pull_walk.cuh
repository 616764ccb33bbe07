// How the pull kernels (dispatch.cu, combine_partials.cu) walk the P pulls: one warp per pull of a
// grid-stride loop, in folded order, with the pull's K routes read once into lanes.
#pragma once

#include <cstdint>

namespace epmoe::cuda {

// The pull of walk position i in [0, P): 0, P-1, 1, P-2, ... (a bijection on [0, P)). Pulls are
// numbered in (source rank, token) order, so walking them in order runs every pull of one source
// rank before the next: at EP = 2 all local ones (HBM only, NVLink idle) then all remote ones.
// Folded, the first and the last source rank's pulls run side by side through the whole kernel.
// Each pull writes its own rows, so the order changes no result.
__device__ __forceinline__ int64_t folded_pull(int64_t i, int64_t P) {
  return (i & 1) == 0 ? i / 2 : P - 1 - i / 2;
}

// A pull's routes held one per lane (lane k: route k, for k < 32) and broadcast by shuffle, so the
// warp reads the K row indices and scores once per pull, not once per route and column batch (a
// token's scores live on its owner: each read is an NVLink round trip). Every lane of the warp
// must call route_row / route_score together (k warp-uniform).
constexpr int kLaneRoutes = 32;

__device__ __forceinline__ int32_t lane_route_row(const int32_t* rows_K, int K, int lane) {
  return lane < K ? rows_K[lane] : -1;
}
__device__ __forceinline__ int32_t route_row(int32_t lane_row, const int32_t* rows_K, int k) {
  return k < kLaneRoutes ? __shfl_sync(0xffffffffu, lane_row, k) : rows_K[k];
}
__device__ __forceinline__ float lane_route_score(const float* scores_K, int K, int lane) {
  return lane < K ? __ldcg(scores_K + lane) : 0.0f;
}
__device__ __forceinline__ float route_score(float lane_score, const float* scores_K, int k) {
  return k < kLaneRoutes ? __shfl_sync(0xffffffffu, lane_score, k) : __ldcg(scores_K + k);
}

}  // namespace epmoe::cuda
