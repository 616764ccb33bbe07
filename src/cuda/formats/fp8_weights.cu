// FP8 E4M3 with 128x128 blocks (weights), fp32 or UE8M0 scales. One CTA per block (grid-stride
// over the blocks of all G matrices): thread t owns column t % 128 of rows t / 128, +2, +4, ...
// (each warp reads 32 consecutive elements of a row). Pass 1: amax, an integer max of |x| bits
// (warp shuffles, then shared memory; exact and order-free, so the same bits as the host loop).
// Pass 2: encode with the block scale (the re-read hits L2: a block is 64 KiB of fp32 at most).
#include "cuda/formats/formats.h"
#include "cuda/formats/row_blocks.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kB = kFp8WeightBlock;
constexpr int kRowsPerPass = kThreads / kB;  // 2 rows of a block per sweep of the CTA
static_assert(kThreads % kB == 0, "the CTA covers whole block rows");

template <class Policy, class T>
__global__ void __launch_bounds__(kThreads)
    quantize_weights_kernel(const T* __restrict__ w_GNL, int64_t G, int64_t N, int64_t L,
                            uint8_t* __restrict__ q_GNL, typename Policy::Scale* __restrict__ scales_GBS) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  const int64_t B = scale_blocks(N, kB), S = scale_blocks(L, kB);
  const int64_t blocks = G * B * S;
  const int col = static_cast<int>(threadIdx.x) % kB;
  const int row0 = static_cast<int>(threadIdx.x) / kB;
  for (int64_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {  // CTA-uniform
    const int64_t g = blk / (B * S), b = (blk / S) % B, s = blk % S;
    const int64_t rows = N - b * kB < kB ? N - b * kB : kB;
    const int64_t cols = L - s * kB < kB ? L - s * kB : kB;
    const int64_t base = (g * N + b * kB) * L + s * kB;  // element (0, 0) of the block
    uint32_t amax = 0;
    if (col < cols) {
      for (int64_t r = row0; r < rows; r += kRowsPerPass) amax = amax_bits_add(amax, load_as_float(w_GNL + base + r * L + col));
    }
    amax = group_max<32>(amax);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) amax = warp_amax[w] > amax ? warp_amax[w] : amax;
    __syncthreads();  // warp_amax is rewritten by the next block
    const typename Policy::Scale scale = Policy::from_amax(amax);
    if (threadIdx.x == 0) scales_GBS[blk] = scale;
    if (col < cols) {
      for (int64_t r = row0; r < rows; r += kRowsPerPass) {
        const int64_t i = base + r * L + col;
        q_GNL[i] = Policy::encode(load_as_float(w_GNL + i), scale);
      }
    }
  }
}

template <class Policy>
__global__ void __launch_bounds__(kThreads)
    dequantize_weights_kernel(const uint8_t* __restrict__ q_GNL, const typename Policy::Scale* __restrict__ scales_GBS,
                              int64_t G, int64_t N, int64_t L, float* __restrict__ w_GNL) {
  const int64_t B = scale_blocks(N, kB), S = scale_blocks(L, kB);
  const int64_t total = G * N * L;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t l = i % L, n = (i / L) % N, g = i / (N * L);
    w_GNL[i] = Policy::decode(q_GNL[i], scales_GBS[(g * B + n / kB) * S + l / kB]);
  }
}

template <class Policy, class T>
void launch_quantize(const T* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                     typename Policy::Scale* scales_GBS, void* stream) {
  check_codec_weights(G, N, L);
  const int64_t blocks = G * scale_blocks(N, kB) * scale_blocks(L, kB);
  check_codec_pointer(w_GNL, G * N * L, "w_GNL");
  check_codec_pointer(q_GNL, G * N * L, "q_GNL");
  check_codec_pointer(scales_GBS, blocks, "scales_GBS");
  if (G * N * L == 0) return;
  quantize_weights_kernel<Policy, T><<<grid_for(blocks * kThreads, kThreads), kThreads, 0,
                                       static_cast<cudaStream_t>(stream)>>>(w_GNL, G, N, L, q_GNL, scales_GBS);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <class Policy>
void launch_dequantize(const uint8_t* q_GNL, const typename Policy::Scale* scales_GBS, int64_t G, int64_t N,
                       int64_t L, float* w_GNL, void* stream) {
  check_codec_weights(G, N, L);
  check_codec_pointer(q_GNL, G * N * L, "q_GNL");
  check_codec_pointer(scales_GBS, G * scale_blocks(N, kB) * scale_blocks(L, kB), "scales_GBS");
  check_codec_pointer(w_GNL, G * N * L, "w_GNL");
  if (G * N * L == 0) return;
  dequantize_weights_kernel<Policy><<<grid_for(G * N * L, kThreads), kThreads, 0,
                                      static_cast<cudaStream_t>(stream)>>>(q_GNL, scales_GBS, G, N, L, w_GNL);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS, void* stream) {
  launch_quantize<Fp8Fp32Scale>(w_GNL, G, N, L, q_GNL, scales_GBS, stream);
}
void fp8_quantize_weights(const bf16_t* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS, void* stream) {
  launch_quantize<Fp8Fp32Scale>(w_GNL, G, N, L, q_GNL, scales_GBS, stream);
}
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS, void* stream) {
  launch_quantize<Fp8Ue8m0Scale>(w_GNL, G, N, L, q_GNL, scales_GBS, stream);
}
void fp8_quantize_weights(const bf16_t* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS, void* stream) {
  launch_quantize<Fp8Ue8m0Scale>(w_GNL, G, N, L, q_GNL, scales_GBS, stream);
}
void fp8_dequantize_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N, int64_t L,
                            float* w_GNL, void* stream) {
  launch_dequantize<Fp8Fp32Scale>(q_GNL, scales_GBS, G, N, L, w_GNL, stream);
}
void fp8_dequantize_weights(const uint8_t* q_GNL, const uint8_t* scales_GBS, int64_t G, int64_t N, int64_t L,
                            float* w_GNL, void* stream) {
  launch_dequantize<Fp8Ue8m0Scale>(q_GNL, scales_GBS, G, N, L, w_GNL, stream);
}

}  // namespace epmoe::cuda
