// FP8 E4M3 with 1x128 row blocks (activations), fp32 or UE8M0 scales: row_blocks.cuh with
// 8 lanes per block (16 consecutive elements per lane: two 16-byte bf16 loads in flight, one
// 16-byte store of codes, and the block's scale and index work spread over 16 elements), 4 blocks
// per warp.
#include "cuda/formats/formats.h"
#include "cuda/formats/row_blocks.cuh"

namespace epmoe::cuda {
namespace {
constexpr int kLanes = 8;
}  // namespace

void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS, void* stream) {
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void fp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS, void* stream) {
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream) {
  launch_quantize_row_blocks<Fp8Ue8m0Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void fp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream) {
  launch_quantize_row_blocks<Fp8Ue8m0Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void fp8_quantize_rows_s_major(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_SN,
                               int64_t ld, void* stream) {
  EPMOE_CHECK_ARG(ld >= 1, "ld", ">= N and >= 1", ld);
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_SN, stream, ld);
}
void fp8_quantize_rows_s_major(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_SN,
                               int64_t ld, void* stream) {
  EPMOE_CHECK_ARG(ld >= 1, "ld", ">= N and >= 1", ld);
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales_SN, stream, ld);
}
void fp8_quantize_rows_counted(const bf16_t* x_NL, int64_t N, int64_t L, const int32_t* count_1,
                               const int32_t* skip_1, uint8_t* q_NL, float* scales, int64_t ld,
                               void* stream) {
  EPMOE_CHECK_ARG(ld >= 0, "ld", ">= 0 (0: row-major scales)", ld);
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(x_NL, N, L, q_NL, scales, stream, ld,
                                                                 DeviceRows{count_1, skip_1, nullptr});
}
void fp8_quantize_rows_counted_at(const bf16_t* x_base, const int64_t* x_offset_1, int64_t N,
                                  int64_t L, const int32_t* count_1, const int32_t* skip_1,
                                  uint8_t* q_NL, float* scales, int64_t ld, void* stream) {
  EPMOE_CHECK_ARG(ld >= 0, "ld", ">= 0 (0: row-major scales)", ld);
  launch_quantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock, kLanes>(
      x_base, N, L, q_NL, scales, stream, ld, DeviceRows{count_1, skip_1, x_offset_1});
}
void fp8_dequantize_rows(const uint8_t* q_NL, const float* scales_NS, int64_t N, int64_t L, float* x_NL,
                         void* stream) {
  launch_dequantize_row_blocks<Fp8Fp32Scale, kFp8RowBlock>(q_NL, scales_NS, N, L, x_NL, stream);
}
void fp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL,
                         void* stream) {
  launch_dequantize_row_blocks<Fp8Ue8m0Scale, kFp8RowBlock>(q_NL, scales_NS, N, L, x_NL, stream);
}

}  // namespace epmoe::cuda
