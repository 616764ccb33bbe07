// The NVFP4 weight-only inference stages on CUDA (Config.precision = nvfp4, inference contexts):
// the bf16 forward with W13 and W2 on the NVFP4 grouped GEMM (gemm/nvfp4_gemm.h) reading the
// prepared weights; activations stay bf16 (docs/formats.md "NVFP4 weight-only inference").
// Launchers only (no CUDA types). fork: handed to the GEMM for its wide launch (experts with many
// rows) with EPMOE_NVFP4_WIDE_FORK=1 (gemm/nvfp4_gemm.h); otherwise both launches run in s.stream.
#pragma once

#include "core/step.h"
#include "cuda/stream_fork.h"

namespace epmoe::cuda {

// h13 = bf16(global_e * (x_gathered @ decoded w13[e]^T)).
void nvfp4_w13_fprop(const Step& s, const StreamForkView& fork = {});
// The fused stage: h = act(bf16(gate), bf16(up)) from the GEMM's SwiGLU epilogue (h13 is not
// written: inference keeps nothing for backward); the same bits as nvfp4_w13_fprop followed by
// the unfused SwiGLU kernel.
void nvfp4_w13_swiglu(const Step& s, const StreamForkView& fork = {});
// rows = bf16(global_e * (h @ decoded w2[e]^T)); scatter: into the owners' combine slots,
// otherwise into s.rows_MD (per-rank combine: s.h3_MD).
void nvfp4_w2_fprop(const Step& s, bool scatter, const StreamForkView& fork = {});

}  // namespace epmoe::cuda
