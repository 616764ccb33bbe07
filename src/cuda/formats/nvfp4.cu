// NVFP4 (packed E2M1 + E4M3 per 1x16 + fp32 global per row group): the global-scale reduction,
// the quantizer and the dequantizer.
//   global: one warp per row (grid-stride), the finite |x| bits max-reduced in the warp and
//           atomicMax-ed into global_G (as unsigned bits; zeroed first), then converted in place
//           by nvfp4_global_scale. Integer max: the same bits as the host loop in any order.
//   quantize: 8 lanes per 16-element block, each lane one pair of elements = one packed byte.
//   gemm order: one thread per 4-byte code word (the prepared weights' order).
#include <cuda_runtime.h>

#include <string>

#include "core/formats/nvfp4_gemm_order.h"
#include "cuda/formats/formats.h"
#include "cuda/formats/row_blocks.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kLanes = kNvfp4Block / 2;  // one byte (two elements) per lane

template <class T>
__global__ void __launch_bounds__(kThreads)
    global_amax_kernel(const T* __restrict__ x_NL, int64_t rows_per_group, int64_t N, int64_t L,
                       unsigned int* __restrict__ amax_G) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t n = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; n < N; n += warps) {
    uint32_t amax = 0;
    for (int64_t l = lane; l < L; l += 32) amax = finite_amax_bits_add(amax, load_as_float(x_NL + n * L + l));
    amax = group_max<32>(amax);
    if (lane == 0 && amax != 0) atomicMax(amax_G + n / rows_per_group, amax);
  }
}

__global__ void global_scale_kernel(float* __restrict__ global_G, int64_t groups) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g < groups) global_G[g] = nvfp4_global_scale(f32_bits(global_G[g]));
}

// kPrepared: the scales go to the prepared [G, C, N / G, 8] order (nvfp4_prepared_scale_index)
// instead of the codec's [N, S].
template <class T, bool kPrepared = false>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ x_NL, int64_t rows_per_group, int64_t N, int64_t L,
                    const float* __restrict__ global_G, uint8_t* __restrict__ q_NP, uint8_t* __restrict__ scales_NS) {
  constexpr int kBlocksPerWarp = 32 / kLanes;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int sub = lane % kLanes;
  const int64_t S = scale_blocks(L, kNvfp4Block), P = nvfp4_packed_bytes(L);
  const int64_t total = N * S;
  const int64_t tiles = (total + kBlocksPerWarp - 1) / kBlocksPerWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t tile = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; tile < tiles;
       tile += warps) {  // warp-uniform
    const int64_t blk = tile * kBlocksPerWarp + lane / kLanes;
    const bool valid = blk < total;
    const int64_t n = valid ? blk / S : 0;
    const int64_t l0 = (valid ? (blk % S) * kNvfp4Block : 0) + 2 * sub;  // this lane's first element
    const bool has0 = valid && l0 < L, has1 = valid && l0 + 1 < L;
    const float v0 = has0 ? load_as_float(x_NL + n * L + l0) : 0.0f;
    const float v1 = has1 ? load_as_float(x_NL + n * L + l0 + 1) : 0.0f;
    const uint32_t amax = group_max<kLanes>(amax_bits_add(amax_bits_add(0u, v0), v1));
    if (!valid) continue;
    const float global = global_G[n / rows_per_group];
    const uint8_t scale = nvfp4_block_scale(amax, global);
    if (sub == 0) {
      if constexpr (kPrepared) {
        scales_NS[nvfp4_prepared_scale_index(n / rows_per_group, n % rows_per_group, blk % S,
                                             rows_per_group, nvfp4_scale_chunks(L))] = scale;
      } else {
        scales_NS[blk] = scale;
      }
    }
    if (has0) {
      const float element_scale = nvfp4_element_scale(scale, global);
      const uint8_t second = has1 ? nvfp4_encode(v1, element_scale) : uint8_t{0};
      q_NP[n * P + l0 / 2] = pack_e2m1x2(nvfp4_encode(v0, element_scale), second);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q_NP, const uint8_t* __restrict__ scales_NS,
                      const float* __restrict__ global_G, int64_t rows_per_group, int64_t N, int64_t L,
                      float* __restrict__ x_NL) {
  const int64_t S = scale_blocks(L, kNvfp4Block), P = nvfp4_packed_bytes(L);
  const int64_t total = N * L;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i / L, l = i % L;
    const float element_scale = nvfp4_element_scale(scales_NS[n * S + l / kNvfp4Block], global_G[n / rows_per_group]);
    const uint8_t byte = q_NP[n * P + l / 2];
    x_NL[i] = nvfp4_decode(l % 2 == 0 ? e2m1_first(byte) : e2m1_second(byte), element_scale);
  }
}

template <class T>
void launch_global_scales(const T* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G, void* stream) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(global_G, groups, "global_G");
  const auto s = static_cast<cudaStream_t>(stream);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(global_G, 0, static_cast<size_t>(groups) * sizeof(float), s));
  if (N * L > 0) {
    global_amax_kernel<T><<<grid_for(N * 32, kThreads), kThreads, 0, s>>>(
        x_NL, N / groups, N, L, reinterpret_cast<unsigned int*>(global_G));
    EPMOE_CUDA_LAUNCH_CHECK();
  }
  global_scale_kernel<<<static_cast<unsigned>((groups + kThreads - 1) / kThreads), kThreads, 0, s>>>(global_G,
                                                                                                     groups);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <class T, bool kPrepared = false>
void launch_quantize(const T* x_NL, int64_t groups, int64_t N, int64_t L, const float* global_G, uint8_t* q_NP,
                     uint8_t* scales_NS, void* stream) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  const int64_t S = scale_blocks(L, kNvfp4Block);
  const int64_t scale_bytes = kPrepared ? N * nvfp4_scale_chunks(L) * kNvfp4ChunkBlocks : N * S;
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(global_G, groups, "global_G");
  check_codec_pointer(q_NP, N * nvfp4_packed_bytes(L), "q_NP");
  check_codec_pointer(scales_NS, scale_bytes, "scales_NS");
  if (N * L == 0) return;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if constexpr (kPrepared) {  // the blocks past each row's S stay 0
    EPMOE_CUDA_CHECK(cudaMemsetAsync(scales_NS, 0, static_cast<size_t>(scale_bytes), st));
  }
  const int64_t tiles = (N * S + (32 / kLanes) - 1) / (32 / kLanes);
  quantize_kernel<T, kPrepared><<<grid_for(tiles * 32, kThreads), kThreads, 0, st>>>(
      x_NL, N / groups, N, L, global_G, q_NP, scales_NS);
  EPMOE_CUDA_LAUNCH_CHECK();
}

// Every whole 4-byte word of each P-byte row into the prepared order (nvfp4_gemm_word), in place:
// one thread a word, bytes read and written singly (rows need not be 4-byte aligned).
__global__ void __launch_bounds__(kThreads)
    gemm_order_kernel(uint8_t* __restrict__ q_NP, int64_t N, int64_t P) {
  const int64_t words = P / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * words; i += stride) {
    uint8_t* p = q_NP + (i / words) * P + (i % words) * 4;
    const uint32_t w = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                       (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
    const uint32_t v = nvfp4_gemm_word(w);
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
  }
}

}  // namespace

void nvfp4_global_scales(const float* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G, void* stream) {
  launch_global_scales(x_NL, groups, N, L, global_G, stream);
}
void nvfp4_global_scales(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G, void* stream) {
  launch_global_scales(x_NL, groups, N, L, global_G, stream);
}
void nvfp4_quantize_rows(const float* x_NL, int64_t groups, int64_t N, int64_t L, const float* global_G,
                         uint8_t* q_NP, uint8_t* scales_NS, void* stream) {
  launch_quantize(x_NL, groups, N, L, global_G, q_NP, scales_NS, stream);
}
void nvfp4_quantize_rows(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L, const float* global_G,
                         uint8_t* q_NP, uint8_t* scales_NS, void* stream) {
  launch_quantize(x_NL, groups, N, L, global_G, q_NP, scales_NS, stream);
}
void nvfp4_quantize_rows_prepared(const bf16_t* x_NL, int64_t groups, int64_t N, int64_t L,
                                  const float* global_G, uint8_t* q_NP, uint8_t* scales_GCN8,
                                  void* stream) {
  launch_quantize<bf16_t, true>(x_NL, groups, N, L, global_G, q_NP, scales_GCN8, stream);
}
void nvfp4_dequantize_rows(const uint8_t* q_NP, const uint8_t* scales_NS, const float* global_G, int64_t groups,
                           int64_t N, int64_t L, float* x_NL, void* stream) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  check_codec_pointer(q_NP, N * nvfp4_packed_bytes(L), "q_NP");
  check_codec_pointer(scales_NS, N * scale_blocks(L, kNvfp4Block), "scales_NS");
  check_codec_pointer(global_G, groups, "global_G");
  check_codec_pointer(x_NL, N * L, "x_NL");
  if (N * L == 0) return;
  dequantize_kernel<<<grid_for(N * L, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      q_NP, scales_NS, global_G, N / groups, N, L, x_NL);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void nvfp4_codes_to_gemm_order(uint8_t* q_NP, int64_t N, int64_t P, void* stream) {
  EPMOE_CHECK_ARG(N >= 0 && P >= 0, "N, P", ">= 0", std::to_string(N) + ", " + std::to_string(P));
  check_codec_pointer(q_NP, N * P, "q_NP");
  if (N * (P / 4) == 0) return;
  gemm_order_kernel<<<grid_for(N * (P / 4), kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      q_NP, N, P);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
