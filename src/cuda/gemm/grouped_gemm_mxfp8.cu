// MXFP8 grouped GEMM (gemm/mxfp8_gemm.h), swap-AB on mma.sync as the NVFP4 kernel
// (grouped_gemm_nvfp4.cu): the weights are the 16-row A operand of mma.m16n8k16, eight activation
// rows the B operand. Both operands' E4M3 codes convert exactly to f16 (one cvt per pair: every
// E4M3 value is an f16 normal), the f16 mma sums in fp32, and each 32-element MX block gets its own
// accumulator: two mma steps from zero, then the block sum times 2^(sa + sw) is added to the
// lane's fp32 totals in block order (mx_block_scaled, the CPU's step). The scales never enter the
// tensor cores, so no bf16/f16 range limits the E8M0 exponents.
//
// Work: CTA (n-slab of 64 weight rows, expert e), four warps of 16 rows each; a warp walks its
// expert's rows 32 at a time (kGroups groups of 8) over all of K. CTAs of experts without rows
// return at once (offsets read on the device).
//
// K order inside a block: lane quad position t (lane % 4) owns elements [8t, 8t + 8) of the block
// (8 code bytes per row: one 8-byte load) and feeds elements 8t + 4s + {0, 1} / {2, 3} to step s's
// k pairs {2t, 2t+1} / {2t+8, 2t+9}, for the weight rows and the activation rows alike; both
// steps stay inside the block.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "core/formats/mxfp8.h"
#include "core/layout.h"
#include "cuda/check.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "cuda/gemm/launch_checks.h"
#include "cuda/kernel_common.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kGemmThreads = kWarps * 32;
constexpr int kRowsPerWarp = 16;               // mma M: weight rows (outputs' columns n)
constexpr int kSlab = kWarps * kRowsPerWarp;   // weight rows per CTA
constexpr int kGroups = 4;                     // 8-row activation groups per weight pass
constexpr int kUnroll = 4;                     // MX blocks loaded before their mma steps

// Two E4M3 codes (low 16 bits, the first in the low byte) as f16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(codes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

__device__ __forceinline__ bf16_t to_bf16(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragments of a block's two steps from the lane's 8 codes of weight rows g (w[0]) and g + 8
// (w[1]): step s, registers {row g pair 0, row g+8 pair 0, row g pair 1, row g+8 pair 1}.
__device__ __forceinline__ void weight_fragments(const uint2 (&w)[2], uint32_t (&a)[2][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    a[0][r] = e4m3x2_to_f16x2(w[r].x);
    a[0][2 + r] = e4m3x2_to_f16x2(w[r].x >> 16);
    a[1][r] = e4m3x2_to_f16x2(w[r].y);
    a[1][2 + r] = e4m3x2_to_f16x2(w[r].y >> 16);
  }
}

// The block's code-product sums of the lane's four outputs (mma C layout: {(row g, m 2t),
// (row g, m 2t+1), (row g+8, m 2t), (row g+8, m 2t+1)}), from zero.
__device__ __forceinline__ void block_sums(const uint32_t (&a)[2][4], uint2 x, float (&c)[4]) {
  c[0] = c[1] = c[2] = c[3] = 0.0f;
  mma_f16(c, a[0], e4m3x2_to_f16x2(x.x), e4m3x2_to_f16x2(x.x >> 16));
  mma_f16(c, a[1], e4m3x2_to_f16x2(x.y), e4m3x2_to_f16x2(x.y >> 16));
}

// The lane's pointers for one pass over 8 * kGroups activation rows: codes of row g of each
// group (at the lane's 8 elements of block 0), scale rows of its output rows 2t, 2t + 1.
struct Rows {
  const uint8_t* codes[kGroups];
  const uint8_t* scales[kGroups][2];
};

// kNb blocks from block b: loads first (weights, then every live group's activations), then the
// mma steps and the scaled sums added to acc in block order.
template <int kNb>
__device__ __forceinline__ void run_blocks(int64_t b, const uint8_t* const (&w_codes)[2],
                                           const uint8_t* const (&w_scales)[2], const Rows& x,
                                           int live, float (&acc)[kGroups][4]) {
  uint2 wc[kNb][2];
  uint32_t ws[kNb][2];
  uint2 xc[kGroups][kNb];
  uint32_t xs[kGroups][kNb][2];
#pragma unroll
  for (int i = 0; i < kNb; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      wc[i][r] = __ldg(reinterpret_cast<const uint2*>(w_codes[r] + (b + i) * kMxBlock));
      ws[i][r] = __ldg(w_scales[r] + b + i);
    }
  }
#pragma unroll
  for (int q = 0; q < kGroups; ++q) {
    if (q >= live) break;
#pragma unroll
    for (int i = 0; i < kNb; ++i) {
      xc[q][i] = __ldg(reinterpret_cast<const uint2*>(x.codes[q] + (b + i) * kMxBlock));
      xs[q][i][0] = __ldg(x.scales[q][0] + b + i);
      xs[q][i][1] = __ldg(x.scales[q][1] + b + i);
    }
  }
#pragma unroll
  for (int i = 0; i < kNb; ++i) {
    uint32_t a[2][4];
    weight_fragments(wc[i], a);
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (q >= live) break;
      float c[4];
      block_sums(a, xc[q][i], c);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint8_t sa = static_cast<uint8_t>(xs[q][i][j % 2]);
        const uint8_t sw = static_cast<uint8_t>(ws[i][j / 2]);
        acc[q][j] = __fadd_rn(acc[q][j], mx_block_scaled(c[j], sa, sw));
      }
    }
  }
}

__device__ __forceinline__ bf16_t* out_row(const Mxfp8GroupedGemmArgs& a, int64_t m) {
  if (a.combine_R == nullptr) return a.out_MN + m * a.ld_out;
  const int32_t src = a.recv_src_M[m];
  return a.combine_R[src_rank(src, a.T, a.top_k)] + src_slot(src, a.T, a.top_k) * a.N;
}

// kSwiglu (W13 with the SwiGLU epilogue): a warp's A rows are 8 gate rows f0 + g and their 8 up
// rows F + f0 + g, so a lane holds gate and up of the same (row m, column f) and stores
// h = act(bf16(gate), bf16(up)) as the unfused kernel does (core/activation.h).
template <bool kSwiglu>
__global__ void __launch_bounds__(kGemmThreads) mxfp8_gemm_kernel(const Mxfp8GroupedGemmArgs a) {
  const int e = static_cast<int>(blockIdx.y);
  if (a.skip != nullptr && *a.skip != 0) return;
  const int64_t row_begin = a.offsets_E1[e];
  const int64_t row_end = a.offsets_E1[e + 1] < a.M ? a.offsets_E1[e + 1] : a.M;
  if (row_end <= row_begin) return;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;  // mma groupID: weight rows g, g + 8; activation row g of a group
  const int t = lane % 4;
  // Unfused: weight rows n0 + g, n0 + g + 8 of 16 per warp. kSwiglu: gate row f0 + g and up row
  // F + f0 + g of 8 columns per warp. Rows past the end: clamped, loaded, unstored.
  const int64_t F = a.N / 2;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSlab + warp * kRowsPerWarp;
  const int64_t f0 = static_cast<int64_t>(blockIdx.x) * (kSlab / 2) + warp * (kRowsPerWarp / 2);
  if (kSwiglu ? f0 >= F : n0 >= a.N) return;  // warp-uniform; no CTA-wide barrier follows

  const int64_t S = a.K / kMxBlock;
  const uint8_t* w_codes[2];
  const uint8_t* w_scales[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int64_t n;
    if constexpr (kSwiglu) {
      n = r * F + (f0 + g < F ? f0 + g : F - 1);
    } else {
      n = n0 + g + 8 * r < a.N ? n0 + g + 8 * r : a.N - 1;
    }
    w_codes[r] = a.b_codes_ENK + (e * a.N + n) * a.K + 8 * t;
    w_scales[r] = a.b_scales_ENS + (e * a.N + n) * S;
  }

  for (int64_t m0 = row_begin; m0 < row_end; m0 += 8 * kGroups) {
    const int live = static_cast<int>((row_end - m0 + 7) / 8 < kGroups ? (row_end - m0 + 7) / 8
                                                                        : kGroups);
    Rows x;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int64_t m = m0 + q * 8 + g < row_end ? m0 + q * 8 + g : row_end - 1;
      x.codes[q] = a.a_codes_MK + m * a.K + 8 * t;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t ms = m0 + q * 8 + 2 * t + i < row_end ? m0 + q * 8 + 2 * t + i : row_end - 1;
        x.scales[q][i] = a.a_scales_MS + ms * S;
      }
    }
    float acc[kGroups][4] = {};
    int64_t b = 0;
    for (; b + kUnroll <= S; b += kUnroll) run_blocks<kUnroll>(b, w_codes, w_scales, x, live, acc);
    for (; b < S; ++b) run_blocks<1>(b, w_codes, w_scales, x, live, acc);

    // acc[q]: {(A row g, m 2t), (A row g, m 2t+1), (A row g+8, m 2t), (A row g+8, m 2t+1)} of
    // group q.
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      if (q >= live) break;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int64_t m = m0 + q * 8 + 2 * t + i;
        if (m >= row_end) continue;
        if constexpr (kSwiglu) {
          const int64_t f = f0 + g;
          if (f >= F) continue;
          const float gate = bf16_to_float(to_bf16(acc[q][i]));
          const float up = bf16_to_float(to_bf16(acc[q][2 + i]));
          a.out_MN[m * a.ld_out + f] = to_bf16(swiglu_forward(gate, up, a.act));
        } else {
          bf16_t* out = out_row(a, m);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t n = n0 + g + 8 * r;
            if (n < a.N) out[n] = to_bf16(acc[q][2 * r + i]);
          }
        }
      }
    }
  }
}

void check_args(const Mxfp8GroupedGemmArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= 65535, "E", "1 .. 65535 (grid y)", a.E);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % kMxBlock == 0, "K", "> 0 and a multiple of 32 (MX blocks)",
                  a.K);
  EPMOE_CHECK_ARG(a.N > 0, "N", "> 0", a.N);
  gemm::check_output_destination(a);
  gemm::check_device_pointer(a.b_codes_ENK, "b_codes_ENK", 16);
  gemm::check_device_pointer(a.b_scales_ENS, "b_scales_ENS", 1);
  gemm::check_device_pointer(a.offsets_E1, "offsets_E1", 4);
  if (a.M == 0) return;
  gemm::check_device_pointer(a.a_codes_MK, "a_codes_MK", 16);
  gemm::check_device_pointer(a.a_scales_MS, "a_scales_MS", 1);
  gemm::check_output_pointers(a, 2);
}

}  // namespace

void mxfp8_grouped_gemm(const Mxfp8GroupedGemmArgs& args, void* stream) {
  check_args(args);
  if (args.M == 0) return;
  const int64_t slabs =
      args.swiglu ? (args.N / 2 + kSlab / 2 - 1) / (kSlab / 2) : (args.N + kSlab - 1) / kSlab;
  EPMOE_CHECK_ARG(slabs <= 0x7fffffff, "N", "at most 2^31 - 1 slabs of 64 rows (grid x)", args.N);
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(args.E));
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (args.swiglu) {
    mxfp8_gemm_kernel<true><<<grid, kGemmThreads, 0, st>>>(args);
  } else {
    mxfp8_gemm_kernel<false><<<grid, kGemmThreads, 0, st>>>(args);
  }
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
