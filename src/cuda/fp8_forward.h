// The FP8 block-scaled forward stages on CUDA (Config.precision = fp8_block; training contexts run
// them with a layer plan and in backward's replay too):
// the same steps as the CPU reference's cpu/stages_fp8.cpp (docs/formats.md, "FP8 training").
// publish and dispatch move E4M3 rows themselves (publish.cu, dispatch.cu); these launchers run
// the expert stages. Launchers only (no CUDA types).
#pragma once

#include "core/step.h"
#include "cuda/gemm/fp8_gemm.h"

namespace epmoe::cuda {

// h13 = bf16(x @ w13[e]^T): the received E4M3 x rows (in the x_gathered space at the received
// rows) times the 128x128-scaled E4M3 w13 (gemm/fp8_gemm.h).
void fp8_w13_fprop(const Step& s);
// h (the SwiGLU of the rounded h13, already in s.h_MF) quantized 1x128 along F into the FP8
// scratch at capacity rows (fp8_scratch_layout().h_q), the received rows only.
void fp8_quantize_h(const Step& s);
// EPMOE_FP8_ROW_QUANT (read per launch, for measurements): "producer" (unset) quantizes h,
// grad_h3 and grad_h13 1x128 in the kernels that write them (SwiGLU forward, gather_grad's pull,
// SwiGLU backward; the SwiGLU kernels when F % 128 == 0); "separate" reads the bf16 rows back in
// fp8_quantize_rows_counted. Both give the same bits.
bool fp8_rows_quantized_by_producer();
// The FP8 SwiGLU stage: the unfused SwiGLU kernel with h quantized as fp8_quantize_h does, in the
// kernel when F % 128 == 0 (otherwise, or with EPMOE_FP8_ROW_QUANT=separate, fp8_quantize_h after
// it). With the replay skipped neither h nor its codes are written (the W2 FPROP skips too).
void fp8_swiglu_forward(const Step& s);
// The fused stage: fp8_w13_fprop, then fp8_swiglu_forward.
void fp8_w13_swiglu(const Step& s);
// rows = bf16(h @ w2[e]^T) from the E4M3 h rows; scatter: into the owners' combine slots,
// otherwise into s.rows_MD.
void fp8_w2_fprop(const Step& s, bool scatter);

// Where an FP8 GEMM that produces [rows, D] writes (W2 FPROP, W13 DGRAD): scatter: into the owners'
// combine slots; otherwise s.rows_MD (the unfused chain's buffer).
void fp8_rows_output(const Step& s, bool scatter, Fp8GroupedGemmArgs& a);

}  // namespace epmoe::cuda
