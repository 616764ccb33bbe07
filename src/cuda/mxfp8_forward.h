// The MXFP8 inference stages on CUDA (Config.precision = mxfp8, inference contexts): before each
// GEMM the codec quantizes its bf16 activation rows 1x32 (formats/formats.h
// mxfp8_quantize_rows_counted, bitwise the host codec) into Step.mxfp8_scratch, then the MXFP8
// grouped GEMM (gemm/mxfp8_gemm.h) multiplies them with the prepared weights
// (docs/formats.md "MXFP8 inference"). Launchers only (no CUDA types).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// h13 = bf16(mx(x_gathered) @ w13[e]^T).
void mxfp8_w13_fprop(const Step& s);
// The fused stage: h = act(bf16(gate), bf16(up)) from the GEMM's SwiGLU epilogue (h13 is not
// written); the same bits as mxfp8_w13_fprop followed by the unfused SwiGLU kernel.
void mxfp8_w13_swiglu(const Step& s);
// rows = bf16(mx(h) @ w2[e]^T); scatter: into the owners' combine slots, otherwise into
// s.rows_MD (per-rank combine: s.h3_MD).
void mxfp8_w2_fprop(const Step& s, bool scatter);

}  // namespace epmoe::cuda
