// Row-block E4M3 encoder/decoder kernels shared by FP8 1x128 (fp8_rows.cu) and MXFP8 1x32
// (mxfp8.cu): the format is a scale policy of core/formats (Fp8Fp32Scale, Fp8Ue8m0Scale,
// Mxfp8Scale), so the block rule and the element rounding are the host codecs' functions.
//
// Quantize: kLanes lanes of a warp own one block; lane j holds the kBlock / kLanes consecutive
// elements from j * kBlock / kLanes, read and written as vectors (16-byte loads of 8 bf16, one
// 8-byte store of their codes) where the lane's run is whole and aligned, element by element at a
// partial last block or an unaligned row. The block amax is an integer max over |x| bits
// (shuffles; exact and order-free), so scales and codes match the serial host loop bitwise.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "core/formats/codecs.h"
#include "core/formats/fp8_block.h"
#include "core/numeric.h"
#include "cuda/formats/e4m3_bounded.cuh"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {

__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const bf16_t* p) { return bf16_to_float(*p); }

// Max over the kLanes lanes of an aligned lane group (every lane of `mask` must call it; the
// mask holds whole groups).
template <int kLanes>
__device__ __forceinline__ uint32_t group_max(uint32_t v, unsigned mask = 0xffffffffu) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "a power of two");
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(mask, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// An unsigned type of kBytes bytes (1, 2, 4, 8 or 16): one vector memory access.
template <int kBytes> struct Vec;
template <> struct Vec<1> { using type = uint8_t; };
template <> struct Vec<2> { using type = uint16_t; };
template <> struct Vec<4> { using type = uint32_t; };
template <> struct Vec<8> { using type = uint2; };
template <> struct Vec<16> { using type = uint4; };

// Copies kCount elements of T from src to dst in vectors of up to 16 bytes; both kCount-element
// runs must be aligned to that vector size (the callers check src at run time, dst is local).
template <class T, int kCount, class Dst, class Src>
__device__ __forceinline__ void copy_run(Dst* dst, const Src* src) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * kCount;
  constexpr int kChunk = kBytes < 16 ? kBytes : 16;
  static_assert(kBytes % kChunk == 0 && (kChunk & (kChunk - 1)) == 0, "a power-of-two run");
  using V = typename Vec<kChunk>::type;
#pragma unroll
  for (int c = 0; c < kBytes / kChunk; ++c) {
    reinterpret_cast<V*>(dst)[c] = reinterpret_cast<const V*>(src)[c];
  }
}

template <class T, int kCount>
__device__ __forceinline__ bool run_aligned(const T* p) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * kCount;
  constexpr int kChunk = kBytes < 16 ? kBytes : 16;
  return reinterpret_cast<uintptr_t>(p) % kChunk == 0;
}

// A row count known only on the device (a stage's live or received rows): rows
// [0, clamp(*count_1, 0, N)) are encoded, none when *skip_1 != 0; both nullable. The grid is sized
// for N, so one launch serves every count (graph-capturable).
struct DeviceRows {
  const int32_t* count_1 = nullptr;
  const int32_t* skip_1 = nullptr;
  const int64_t* x_offset_1 = nullptr;  // nullable: x starts this many bytes past the pointer given
};

// Resident CTAs per SM the registers must allow (5 x 256 threads: 48 registers): a memory-bound loop
// needs enough warps, each with its lanes' 16-byte loads, to keep loads in flight.
constexpr int kRowQuantCtasPerSm = 5;

template <class Policy, int kBlock, int kLanes, class T>
__global__ void __launch_bounds__(kThreads, kRowQuantCtasPerSm)
    quantize_row_blocks_kernel(const T* __restrict__ x_NL, int64_t N, int64_t L, uint8_t* __restrict__ q_NL,
                               typename Policy::Scale* __restrict__ scales, int64_t scale_stride_n,
                               int64_t scale_stride_s, const DeviceRows rows) {
  static_assert(kBlock % kLanes == 0 && 32 % kLanes == 0, "lanes divide the block and the warp");
  if (rows.skip_1 != nullptr && *rows.skip_1 != 0) return;  // uniform over the grid
  if (rows.x_offset_1 != nullptr) {
    x_NL = reinterpret_cast<const T*>(reinterpret_cast<const char*>(x_NL) + *rows.x_offset_1);
  }
  if (rows.count_1 != nullptr) {
    const int64_t count = *rows.count_1;
    N = count < 0 ? 0 : (count < N ? count : N);
  }
  constexpr int kPerLane = kBlock / kLanes;
  constexpr int kBlocksPerWarp = 32 / kLanes;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int sub = lane % kLanes;
  const int64_t S = scale_blocks(L, kBlock);
  const int64_t tiles = (N * S + kBlocksPerWarp - 1) / kBlocksPerWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // This lane's block blk = (row, block) = (bn, bs), advanced by `step` blocks an iteration with a
  // carry instead of a 64-bit divide per iteration.
  const int64_t tile0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t blk0 = tile0 * kBlocksPerWarp + lane / kLanes;
  const int64_t step = warps * kBlocksPerWarp;
  const int64_t step_n = step / S, step_s = step % S;
  int64_t bn = blk0 / S, bs = blk0 % S;
  // Warp-uniform loop: every lane reaches the shuffles; lanes past the last block idle.
  for (int64_t tile = tile0; tile < tiles; tile += warps) {
    const bool valid = bn < N;  // blk < N * S
    const int64_t n = valid ? bn : 0, blk_s = valid ? bs : 0;
    const int64_t begin = blk_s * kBlock;
    bs += step_s;
    bn += step_n;
    if (bs >= S) {
      bs -= S;
      ++bn;
    }
    const int64_t len = valid ? (L - begin < kBlock ? L - begin : kBlock) : 0;
    const int64_t j0 = static_cast<int64_t>(sub) * kPerLane;  // this lane's run in the block
    const T* x_R = x_NL + n * L + begin + j0;
    const bool whole = j0 + kPerLane <= len;
    float v[kPerLane];
    if (whole && run_aligned<T, kPerLane>(x_R)) {
      alignas(16) T raw[kPerLane];
      copy_run<T, kPerLane>(raw, x_R);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = load_as_float(raw + i);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = j0 + i < len ? load_as_float(x_R + i) : 0.0f;
    }
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) amax = amax_bits_add(amax, v[i]);
    amax = group_max<kLanes>(amax);
    const typename Policy::Scale scale = Policy::from_amax(amax);
    if (!valid) continue;
    if (sub == 0) scales[n * scale_stride_n + blk_s * scale_stride_s] = scale;
    uint8_t* q_R = q_NL + n * L + begin + j0;
    alignas(16) uint8_t codes[kPerLane];
    if constexpr (std::is_same_v<Policy, Fp8Fp32Scale> && kPerLane % 8 == 0) {  // no divide per element
      const Fp8Fp32Bounds bounds = fp8_fp32_bounds(scale);
#pragma unroll
      for (int h = 0; h < kPerLane; h += 8) *reinterpret_cast<uint2*>(codes + h) = fp8_encode8_fp32(v + h, scale, bounds);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) codes[i] = Policy::encode(v[i], scale);
    }
    if (whole && run_aligned<uint8_t, kPerLane>(q_R)) {
      copy_run<uint8_t, kPerLane>(q_R, codes);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (j0 + i < len) q_R[i] = codes[i];
      }
    }
  }
}

template <class Policy, int kBlock>
__global__ void __launch_bounds__(kThreads)
    dequantize_row_blocks_kernel(const uint8_t* __restrict__ q_NL,
                                 const typename Policy::Scale* __restrict__ scales_NS, int64_t N, int64_t L,
                                 float* __restrict__ x_NL) {
  const int64_t S = scale_blocks(L, kBlock);
  const int64_t total = N * L;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t n = i / L, l = i % L;
    x_NL[i] = Policy::decode(q_NL[i], scales_NS[n * S + l / kBlock]);
  }
}

// Launchers behind the per-format overloads (host checks = the host codecs' checks). Scales go to
// scales_NS [N, S], or with ld_sn > 0 S-major: scale of (n, s) at scales[s * ld_sn + n], ld_sn >= N.
template <class Policy, int kBlock, int kLanes, class T>
void launch_quantize_row_blocks(const T* x_NL, int64_t N, int64_t L, uint8_t* q_NL,
                                typename Policy::Scale* scales, void* stream, int64_t ld_sn = 0,
                                DeviceRows rows = {}) {
  check_codec_shape(N, L, "N", "L");
  const int64_t S = scale_blocks(L, kBlock);
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(q_NL, N * L, "q_NL");
  if (ld_sn > 0) {
    EPMOE_CHECK_ARG(ld_sn >= N, "ld", ">= N (rows of the S-major scales)", ld_sn);
    check_codec_pointer(scales, S * ld_sn, "scales_SN");
  } else {
    check_codec_pointer(scales, N * S, "scales_NS");
  }
  if (N * L == 0) return;
  const auto kernel = quantize_row_blocks_kernel<Policy, kBlock, kLanes, T>;
  // One wave of resident CTAs (their registers allow fewer than kBlocksPerSm per SM): the grid-stride
  // loop then never leaves a second, partial wave of CTAs waiting behind the first.
  static std::atomic<int> resident{0};
  int per_sm = resident.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    per_sm = per_sm < 1 ? 1 : (per_sm > kBlocksPerSm ? kBlocksPerSm : per_sm);
    resident.store(per_sm, std::memory_order_relaxed);
  }
  const int64_t tiles = (N * S + (32 / kLanes) - 1) / (32 / kLanes);
  const int64_t needed = (tiles * 32 + kThreads - 1) / kThreads;
  const int64_t wave = static_cast<int64_t>(sm_count()) * per_sm;
  kernel<<<static_cast<unsigned>(needed < wave ? needed : wave), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          x_NL, N, L, q_NL, scales, ld_sn > 0 ? 1 : S, ld_sn > 0 ? ld_sn : 1, rows);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <class Policy, int kBlock>
void launch_dequantize_row_blocks(const uint8_t* q_NL, const typename Policy::Scale* scales_NS, int64_t N,
                                  int64_t L, float* x_NL, void* stream) {
  check_codec_shape(N, L, "N", "L");
  check_codec_pointer(q_NL, N * L, "q_NL");
  check_codec_pointer(scales_NS, N * scale_blocks(L, kBlock), "scales_NS");
  check_codec_pointer(x_NL, N * L, "x_NL");
  if (N * L == 0) return;
  dequantize_row_blocks_kernel<Policy, kBlock>
      <<<grid_for(N * L, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(q_NL, scales_NS, N, L, x_NL);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
