// The explicit transpose of FP8 weights quantized in 128x128 blocks (the DGRAD operand: the FP8
// grouped GEMM reads B as [E, N, K], so W2 / W13 DGRAD run it on w^T). Codes move through a 32x32
// byte tile in shared memory (coalesced reads and writes); a block's scale is its transpose's, so
// the scales are the [B, S] -> [S, B] transpose of each matrix. Pure data movement: bitwise the
// CPU twin cpu::fp8_transpose_weights.
#include "core/formats/codecs.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per tile column: each thread moves kTile / kTileRows bytes

// q_GNL [G, N, L] -> qt_GLN [G, L, N]; grid (tiles of L, tiles of N, G), block (kTile, kTileRows).
__global__ void __launch_bounds__(kTile * kTileRows)
    transpose_codes_kernel(const uint8_t* __restrict__ q_GNL, int64_t N, int64_t L,
                           uint8_t* __restrict__ qt_GLN) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int64_t g = blockIdx.z;
  const int64_t l0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const uint8_t* q_NL = q_GNL + g * N * L;
  uint8_t* qt_LN = qt_GLN + g * N * L;
  for (int r = static_cast<int>(threadIdx.y); r < kTile; r += kTileRows) {
    const int64_t n = n0 + r, l = l0 + threadIdx.x;
    if (n < N && l < L) tile[r][threadIdx.x] = q_NL[n * L + l];
  }
  __syncthreads();
  for (int r = static_cast<int>(threadIdx.y); r < kTile; r += kTileRows) {
    const int64_t l = l0 + r, n = n0 + threadIdx.x;
    if (n < N && l < L) qt_LN[l * N + n] = tile[threadIdx.x][r];
  }
}

// scales_GBS [G, B, S] -> scales_GSB [G, S, B], one thread per scale (grid-stride).
__global__ void __launch_bounds__(kThreads)
    transpose_scales_kernel(const float* __restrict__ scales_GBS, int64_t G, int64_t B, int64_t S,
                            float* __restrict__ scales_GSB) {
  const int64_t total = G * B * S;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t g = i / (B * S), b = (i / S) % B, s = i % S;
    scales_GSB[(g * S + s) * B + b] = scales_GBS[i];
  }
}

}  // namespace

void fp8_transpose_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                           int64_t L, uint8_t* qt_GLN, float* scales_t_GSB, void* stream) {
  check_codec_weights(G, N, L);
  const int64_t B = (N + kFp8WeightBlock - 1) / kFp8WeightBlock;
  const int64_t S = (L + kFp8WeightBlock - 1) / kFp8WeightBlock;
  check_codec_pointer(q_GNL, G * N * L, "q_GNL");
  check_codec_pointer(qt_GLN, G * N * L, "qt_GLN");
  check_codec_pointer(scales_GBS, G * B * S, "scales_GBS");
  check_codec_pointer(scales_t_GSB, G * B * S, "scales_t_GSB");
  const int64_t tiles_l = (L + kTile - 1) / kTile, tiles_n = (N + kTile - 1) / kTile;
  EPMOE_CHECK_ARG(G <= 65535 && tiles_n <= 65535, "G, N",
                  "at most 65535 matrices and 65535 * 32 rows (grid limits)",
                  std::to_string(G) + ", " + std::to_string(N));
  if (G * N * L == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(tiles_l), static_cast<unsigned>(tiles_n),
                  static_cast<unsigned>(G));
  transpose_codes_kernel<<<grid, dim3(kTile, kTileRows), 0, s>>>(q_GNL, N, L, qt_GLN);
  EPMOE_CUDA_LAUNCH_CHECK();
  transpose_scales_kernel<<<grid_for(G * B * S, kThreads), kThreads, 0, s>>>(scales_GBS, G, B, S,
                                                                               scales_t_GSB);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
