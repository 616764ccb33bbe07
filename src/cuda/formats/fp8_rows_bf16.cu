// E4M3 rows (1x128 blocks, fp32 scales S-major: the fp8_rows_bytes layout of core/fp8_terms.h)
// decoded to bf16 rows: the x operand of the bf16 W13 WGRAD under Config.fp8_wgrad = bf16. Each
// value is float_to_bf16(fp8_decode_fp32(code, scale)), the host functions, so the bits are
// cpu::fp8_decode_rows_bf16's. One thread per run of 8 elements (inside one 128-block: one scale),
// one 16-byte store; grid-stride over the rows the device count holds, so one launch serves every
// count (CUDA graphs).
#include <cstdint>

#include "core/formats/codecs.h"
#include "core/formats/fp8_block.h"
#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

constexpr int kRun = 8;  // elements per thread: 8 codes in, 8 bf16 (16 bytes) out
static_assert(kFp8RowBlock % kRun == 0, "a run lies inside one scale block");

__global__ void __launch_bounds__(kThreads)
    decode_rows_bf16_kernel(const char* rows, const int64_t* rows_offset_1, const int32_t* rows_1,
                            int64_t M, int64_t L, const int32_t* skip_1, bf16_t* x_ML) {
  if (skip_1 != nullptr && *skip_1 != 0) return;  // uniform over the grid
  const char* base = rows + (rows_offset_1 != nullptr ? *rows_offset_1 : 0);
  const int64_t count = *rows_1;
  const int64_t n = count < 0 ? 0 : (count < M ? count : M);  // the layout is at n rows
  const uint8_t* q_ML = reinterpret_cast<const uint8_t*>(base);                          // [n, L]
  const float* scales_SM = reinterpret_cast<const float*>(base + fp8_rows_scales_offset(n, L));  // [S_L, ld]
  const int64_t ld = fp8_rows_ld(n);
  const int64_t runs_per_row = L / kRun;
  const int64_t runs = n * runs_per_row;
  const bool vec = reinterpret_cast<uintptr_t>(q_ML) % 8 == 0;  // L % 8 == 0: every run aligned
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < runs;
       r += stride) {
    const int64_t m = r / runs_per_row, l0 = (r % runs_per_row) * kRun;
    const float scale = scales_SM[(l0 / kFp8RowBlock) * ld + m];
    const uint8_t* q = q_ML + m * L + l0;
    uint8_t c[kRun];
    if (vec) {
      const uint2 w = *reinterpret_cast<const uint2*>(q);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        c[i] = static_cast<uint8_t>(w.x >> (8 * i));
        c[4 + i] = static_cast<uint8_t>(w.y >> (8 * i));
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRun; ++i) c[i] = q[i];
    }
    uint32_t p[kRun / 2];
#pragma unroll
    for (int i = 0; i < kRun / 2; ++i) {
      p[i] = static_cast<uint32_t>(float_to_bf16(fp8_decode_fp32(c[2 * i], scale))) |
             (static_cast<uint32_t>(float_to_bf16(fp8_decode_fp32(c[2 * i + 1], scale))) << 16);
    }
    *reinterpret_cast<uint4*>(x_ML + m * L + l0) = make_uint4(p[0], p[1], p[2], p[3]);
  }
}

}  // namespace

void fp8_decode_rows_bf16_counted(const char* rows, const int64_t* rows_offset_1,
                                  const int32_t* rows_1, int64_t M, int64_t L,
                                  const int32_t* skip_1, bf16_t* x_ML, void* stream) {
  check_codec_shape(M, L, "M", "L");
  EPMOE_CHECK_ARG(L % kRun == 0, "L", "a multiple of 8 (16-byte bf16 output vectors)", L);
  check_codec_pointer(rows, M * L, "rows");
  check_codec_pointer(x_ML, M * L, "x_ML");
  EPMOE_CHECK_ARG(rows_1 != nullptr, "rows_1", "the device count of the E4M3 rows", "nullptr");
  if (M * L == 0) return;
  check_aligned16(x_ML, "x_ML");
  decode_rows_bf16_kernel<<<grid_for(M * L / kRun, kThreads), kThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(rows, rows_offset_1, rows_1, M,
                                                                 L, skip_1, x_ML);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
