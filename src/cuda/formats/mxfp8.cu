// MXFP8 (E4M3 + E8M0 per 1x32): row_blocks.cuh with 4 lanes per block (8 consecutive elements
// per lane), 8 blocks per warp.
#include "cuda/formats/formats.h"
#include "cuda/formats/row_blocks.cuh"

namespace epmoe::cuda {
namespace {
constexpr int kLanes = 4;
}  // namespace

void mxfp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream) {
  launch_quantize_row_blocks<Mxfp8Scale, kMxBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void mxfp8_quantize_rows(const bf16_t* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS, void* stream) {
  launch_quantize_row_blocks<Mxfp8Scale, kMxBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream);
}
void mxfp8_quantize_rows_counted(const bf16_t* x_NL, int64_t N, int64_t L, const int32_t* count_1,
                                 const int32_t* skip_1, uint8_t* q_NL, uint8_t* scales_NS,
                                 void* stream) {
  launch_quantize_row_blocks<Mxfp8Scale, kMxBlock, kLanes>(x_NL, N, L, q_NL, scales_NS, stream, 0,
                                                           DeviceRows{count_1, skip_1, nullptr});
}
void mxfp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL,
                           void* stream) {
  launch_dequantize_row_blocks<Mxfp8Scale, kMxBlock>(q_NL, scales_NS, N, L, x_NL, stream);
}

}  // namespace epmoe::cuda
