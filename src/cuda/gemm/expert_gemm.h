// The six grouped GEMMs of the routed experts, one launcher per stage (plain C++, no CUDA types in
// the interface). Each reads its per-expert row counts from s.layout on the device and does
// nothing when the step is skipped. Kernels: gemm/grouped_gemm_sm90.cuh (TMA + wgmma, persistent).
#pragma once

#include "core/step.h"

namespace epmoe::cuda {

// h13 = x_gathered @ w13[e]^T; with swiglu also h = act(bf16(h13)) from the same accumulators.
void w13_fprop(const Step& s, bool swiglu);
// y rows = h @ w2[e]^T; scatter: each row stored into its owner's combine slot (peer pointer),
// otherwise into s.rows_MD.
void w2_fprop(const Step& s, bool scatter);
// grad_h = grad_h3 @ w2[e]; swiglu_backward: grad_h13 and h from bf16(grad_h) and saved h13,
// otherwise grad_h into s.grad_h_MF.
void w2_dgrad(const Step& s, bool swiglu_backward);
// grad rows = grad_h13 @ w13[e]; scatter as w2_fprop.
void w13_dgrad(const Step& s, bool scatter);
// grad_w2[e] (+)= grad_h3[e]^T @ h[e]
void w2_wgrad(const Step& s);
// grad_w13[e] (+)= grad_h13[e]^T @ x_gathered[e]
void w13_wgrad(const Step& s);

}  // namespace epmoe::cuda
