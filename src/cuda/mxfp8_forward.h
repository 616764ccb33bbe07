// The MXFP8 inference stages on CUDA (Config.precision = mxfp8, inference contexts): before each
// GEMM the codec quantizes its bf16 activation rows 1x32 (formats/formats.h
// mxfp8_quantize_rows_counted, bitwise the host codec) into Step.mxfp8_scratch, then the MXFP8
// grouped GEMM (gemm/mxfp8_gemm.h) multiplies them with the prepared weights
// (docs/formats.md "MXFP8 inference"). Launchers only (no CUDA types).
//
// Two GEMM kernels, chosen per call by mxfp8_kernel_for on host-known sizes (capacity rows M and
// local experts E): the decode kernel (gemm/mxfp8_gemm.h: mma.sync, 32 rows per weight pass,
// bitwise the CPU formula) and the wgmma kernel (gemm/mxfp8_wgmma_gemm.h: a weight tile read once
// per 128 rows, block sums on the fp8 tensor-core path, within the tolerance of the CPU formula).
#pragma once

#include <cstdint>
#include <string>

#include "core/step.h"

namespace epmoe::cuda {

enum class Mxfp8Kernel { decode, wgmma };

// auto: wgmma when M >= kMxfp8WgmmaRowsPerExpert * E (and E <= 512, the grouped GEMM's groups),
// else decode. EPMOE_MXFP8_KERNEL=decode|wgmma|auto overrides it (read per call, for benchmarks;
// unset = auto; anything else: Error(invalid_argument) naming EPMOE_MXFP8_KERNEL).
// 16: measured at decode T = 128 (e36a4de, EPMOE_MXFP8_KERNEL forced): wgmma / decode graph ms
// mixtral (32 rows per expert) 1.343 / 4.403, qwen3 (8) 0.700 / 0.751, deepseek-v3 (4) 9.32 / 9.50,
// gpt-oss (4) 3.00 / 2.72; prefill (>= 256 rows per expert) wgmma 8-12x decode.
inline constexpr int64_t kMxfp8WgmmaRowsPerExpert = 16;
// With `why`, appends the rule and values or the override that chose it.
Mxfp8Kernel mxfp8_kernel_for(int64_t M, int E, std::string* why = nullptr);
const char* to_string(Mxfp8Kernel kernel);
// The rule in words, with the override's value: what benchmarks print beside their rows.
std::string mxfp8_kernel_rule();

// h13 = bf16(mx(x_gathered) @ w13[e]^T).
void mxfp8_w13_fprop(const Step& s);
// The fused stage: h = act(bf16(gate), bf16(up)) from the GEMM's SwiGLU epilogue (h13 is not
// written); the same bits as mxfp8_w13_fprop followed by the unfused SwiGLU kernel.
void mxfp8_w13_swiglu(const Step& s);
// rows = bf16(mx(h) @ w2[e]^T); scatter: into the owners' combine slots, otherwise into
// s.rows_MD (per-rank combine: s.h3_MD).
void mxfp8_w2_fprop(const Step& s, bool scatter);

}  // namespace epmoe::cuda
