// Unfused SwiGLU forward and backward over the received rows (FP8: also the E4M3 rows of h or
// grad_h13). Launchers only (no CUDA types).
#pragma once

#include <cstdint>

#include "core/step.h"

namespace epmoe::cuda {

// h[m] = act(h13[m]) for m < M.
void swiglu_forward(const Step& s);
// swiglu_forward that also writes h quantized 1x128 along F (FP8): codes q_MF [capacity, F]
// (16-byte aligned) and fp32 scales S-major, (row m, block b) at scales_SM[b * ld + m],
// ld >= capacity; bitwise what fp8_quantize_rows_counted writes from the stored rows (rows [0, M),
// nothing past them, nothing when the step or the replay is skipped). F % 128 == 0.
void swiglu_forward_fp8_rows(const Step& s, uint8_t* q_MF, float* scales_SM, int64_t ld);
// grad_h13[m] = act'(h13[m]) * grad_h[m] and h[m] = act(h13[m]) for m < M.
void swiglu_backward(const Step& s);
// swiglu_backward that also writes grad_h13 quantized 1x128 along 2F (FP8 training): codes q_M2F
// [capacity, 2F] (16-byte aligned) and fp32 scales S-major, (row m, block b) at scales_SM[b * ld + m],
// ld >= capacity; bitwise what fp8_quantize_rows_counted writes from the stored rows (rows [0, M),
// nothing past them or when the step is skipped). F % 128 == 0 (no block spans gate and up).
void swiglu_backward_fp8_rows(const Step& s, uint8_t* q_M2F, float* scales_SM, int64_t ld);

// Where the fused W2 DGRAD + SwiGLU backward stage runs the SwiGLU backward, bf16 and FP8 alike:
// false (default) in swiglu_backward after the GEMM has stored grad_h; true in the GEMM's epilogue
// (EPMOE_SWIGLU_BACKWARD=epilogue, read per call, for measurements; =kernel or unset: false).
// The two give the same bits. The epilogue measured slower on all four bench shapes in both
// precisions: the cooperative tile's consumers load h13 and store three outputs with no MMA left
// to hide them (bench/RESULTS.md 0d97856 for FP8; 978eba8 and 3ae623b, epmoe vs epmoe-unfused,
// for bf16).
bool swiglu_backward_in_epilogue();

}  // namespace epmoe::cuda
