// The SwiGLU backward of FP8 training that writes grad_h13's 1x128 rows and the two weight
// gradients' 128x1 column operands (grad_h13 and h) instead of their bf16 rows. Launcher only
// (no CUDA types).
#pragma once

#include <cstdint>

#include "core/step.h"

namespace epmoe::cuda {

// One column operand of the FP8 WGRAD (fp8_quantize_cols_transposed's outputs): codes [L, K]
// (K = 128 * max_blocks, block b at k = 128 b, K-major; 16-byte aligned) and fp32 scales [max_blocks, L].
struct Fp8ColsOut {
  uint8_t* qt_LK = nullptr;
  float* scales_BL = nullptr;
};

// swiglu_backward_fp8_rows's outputs except the bf16 rows: grad_h13's E4M3 rows (q_M2F [capacity,
// 2F], scales S-major at scales_SM[b * ld + m]) and the grad_scores partials, bitwise; and, bitwise
// as fp8_quantize_cols_transposed from the bf16 rows swiglu_backward would store, grad_h13's
// columns (L = 2F) and h's (L = F). Neither grad_h13 nor h is stored. F % 128 == 0;
// max_blocks >= fp8_col_blocks(capacity, E). Nothing when the step is skipped.
void swiglu_backward_fp8_cols(const Step& s, uint8_t* q_M2F, float* scales_SM, int64_t ld,
                              const Fp8ColsOut& grad_h13_cols, const Fp8ColsOut& h_cols, int64_t max_blocks);

}  // namespace epmoe::cuda
