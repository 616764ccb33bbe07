// How the pull kernels (dispatch.cu, combine_partials.cu) walk the P pulls: one warp per pull of a
// grid-stride loop, with the pull's K routes read once into lanes.
#pragma once

#include <cstdint>

namespace epmoe::cuda {

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
