// The FP8 block-scaled backward stages on CUDA (Config.precision = fp8_block, training contexts):
// the steps of the CPU reference's cpu/stages_fp8.cpp (docs/formats.md, "FP8 training"), on the
// FP8 grouped GEMM (DGRADs, through each weight's explicit transpose) and the FP8 WGRAD (on the
// column-quantized operands). Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// grad_h3 (bf16, gather_grad's) quantized 1x128 along D into the FP8 scratch (received rows).
void fp8_quantize_grad_h3(const Step& s);
// The FP8 gather_grad stage: gather_grad with grad_h3 quantized as fp8_quantize_grad_h3 does, in
// the pull that writes it (EPMOE_FP8_ROW_QUANT=separate: gather_grad, then fp8_quantize_grad_h3).
void fp8_gather_grad(const Step& s);
// The FP8 SwiGLU backward: swiglu_backward with grad_h13 quantized as fp8_quantize_grad_h13 does,
// in the kernel that writes it when F % 128 == 0 (otherwise, or with
// EPMOE_FP8_ROW_QUANT=separate: swiglu_backward, then fp8_quantize_grad_h13). Where
// fp8_swiglu_backward_writes_cols, the kernel also writes the WGRADs' column operands of grad_h13
// and h and no bf16 rows (swiglu_backward_cols.h).
void fp8_swiglu_backward(const Step& s);
// Whether the FP8 SwiGLU backward writes grad_h13's and h's 128x1 column operands (grad_h13's over
// its bf16 rows in the call scratch, h's in col_b) for the FP8 WGRADs, which then quantize only
// grad_h3 and x: FP8 WGRADs (Step::fp8_wgrad), F % 128 == 0, rows quantized by their producers,
// the SwiGLU backward not in the GEMM epilogue, fp8_grad_h13_cols_fit, and EPMOE_FP8_COL_QUANT=swiglu
// (unset or =separate, the default: the bf16 rows stored and quantized by the WGRAD stages, the
// same bits). Opt-in because it did not win: on mixtral-8x7b the kernel took 1.76 ms against
// 1.04 ms for the SwiGLU backward plus 0.72 ms of column quantization it saves (eae3f8e), and
// fwd+bwd measured x1.01 slower there and a tie at 2b8b02b (bench/RESULTS.md 2026-12-01). A pure function of the step and the environment: the
// SwiGLU and WGRAD stages agree.
bool fp8_swiglu_backward_writes_cols(const Step& s);
// Whether the fused W2 DGRAD runs the SwiGLU backward in the FP8 GEMM's epilogue: F % 128 == 0,
// rows quantized by their producers (EPMOE_FP8_ROW_QUANT unset or producer), the 128 x 128 tile
// (EPMOE_FP8_TILE unset or 128x128), and swiglu_backward_in_epilogue() (swiglu.h:
// EPMOE_SWIGLU_BACKWARD=epilogue); otherwise (the default, faster as measured) the GEMM stores
// grad_h, then fp8_swiglu_backward.
bool fp8_swiglu_backward_in_epilogue(const Step& s);
// grad_h = bf16(grad_h3 @ w2[e]) on w2 transposed; swiglu_backward: then the SwiGLU backward with
// grad_h13's E4M3 rows, in the GEMM's epilogue (fp8_swiglu_backward_in_epilogue) or by
// fp8_swiglu_backward on the stored grad_h, the same bits either way; otherwise grad_h into
// s.grad_h_MF.
void fp8_w2_dgrad(const Step& s, bool swiglu_backward);
// grad_h13 (bf16, the SwiGLU backward's) quantized 1x128 along 2F into the FP8 scratch.
void fp8_quantize_grad_h13(const Step& s);
// grad rows = bf16(grad_h13 @ w13[e]) on w13 transposed; scatter: into the owners' combine slots,
// otherwise into s.rows_MD.
void fp8_w13_dgrad(const Step& s, bool scatter);
// grad_w2[e] (+)= grad_h3^T h and grad_w13[e] (+)= grad_h13^T x over the expert's rows, both
// operands quantized 128x1 along the rows as the CPU does (codes transposed, K-major), then the
// FP8 WGRAD (E4M3 wgmma per 128-row block, promoted with the two blocks' scales).
void fp8_w2_wgrad(const Step& s);
void fp8_w13_wgrad(const Step& s);
// Config.fp8_wgrad = bf16: grad_w13[e] (+)= grad_h13^T x on the bf16 WGRAD, x the received E4M3
// rows decoded to bf16 (fp8_decode_rows_bf16_counted) first. The W2 WGRAD is the bf16 one as it
// is (grad_h3 and the score-scaled h are bf16 in the FP8 steps too).
void fp8_w13_wgrad_bf16(const Step& s);

}  // namespace epmoe::cuda
