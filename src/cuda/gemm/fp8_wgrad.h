// FP8 block-scaled weight gradient (reduction over each expert's rows), plain C++ launcher:
// device pointers, sizes and a cudaStream_t passed as void*. Kernel:
// gemm/grouped_wgrad_fp8_sm90.cuh; CPU twin: cpu::fp8_wgrad_expert_reference on the codes before
// their transpose (cpu/fp8_steps.h; the same two-level accumulation).
//
//   out[e][n, l] (+)= sum over the column blocks b of expert e of
//                     fma(sum_{i < 128} a[n, 128 b + i] * b[l, 128 b + i], sa[b, n] * sb[b, l])
//
// with the operands as the column quantizer writes them (cuda/formats/formats.h
// fp8_quantize_cols_transposed): expert e's rows in 128-row blocks from block
// sum_{e' < e} ceil(rows_e' / 128), partial blocks zero-padded.
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/tensor.h"

namespace epmoe::cuda {

// Letters: N output rows, L output columns, K = 128 * column blocks (core/fp8_terms.h fp8_col_k),
// B column blocks, E experts.
struct Fp8WgradArgs {
  const uint8_t* a_NK = nullptr;         // [N, K] E4M3, K-major
  const float* a_scales_BN = nullptr;    // [B, N] fp32: scale of (block b, row n) at b * N + n
  const uint8_t* b_LK = nullptr;         // [L, K] E4M3, K-major
  const float* b_scales_BL = nullptr;    // [B, L] fp32
  const int32_t* offsets_E1 = nullptr;   // device [E + 1], non-decreasing row offsets
  const int32_t* skip = nullptr;         // nullable device flag: non-zero = every expert is empty
  const int32_t* replay_skip = nullptr;  // the same (backward's replay: LayerPlan::replay_skip)
  int E = 0;
  int64_t N = 0, L = 0, K = 0;
  void* out_ENL = nullptr;               // [E, N, L] in out_dtype
  DType out_dtype = DType::bf16;         // bf16 or f32
  bool accumulate = false;               // out = round(out + sum), else out = round(sum)
  // Main loop, as Fp8GroupedGemmArgs::overlap: 0 one block accumulator, 1 two (bitwise the same
  // results), -1 EPMOE_FP8_OVERLAP=0|1 read per launch (unset: 1). bf16 overwritten (the TMA-store
  // epilogue) always runs with one: with two that kernel spills.
  int overlap = -1;
  // CTA pairs: 0 one CTA per tile; 1 2-CTA clusters on two n-tiles of one (expert, l-tile), each
  // CTA loading half of the shared B k-block and multicasting it to both (half of B's L2 reads;
  // bitwise the same results; one block accumulator whatever `overlap` says; only in builds with
  // EPMOE_GEMM_CONFIGS=ALL, else Error(invalid_argument)); -1 EPMOE_FP8_WGRAD_MULTICAST=0|1 read
  // per launch (unset: 0).
  int multicast = -1;
  // bf16 overwritten (the TMA-store epilogue, one block accumulator) on single CTAs: 1 the
  // producer copies each k-block's scales into its stage (needs N % 4 == 0, else 0); 0 the
  // consumers load and stage them (bitwise the same results); -1 EPMOE_FP8_WGRAD_SCALES=
  // stage|threads read per launch (unset: stage). The other epilogues and pairs load them.
  int stage_scales = -1;
  // bf16 overwritten with the scales in the stage, single CTAs: 1 192 x 128 tiles on three
  // consumer warpgroups, 0 128 x 128 on two (bitwise the same results); -1
  // EPMOE_FP8_WGRAD_TILE=128x128|192x128 read per launch (unset: 192x128).
  int tile = -1;
};

// The kernel fp8_grouped_wgrad runs for `args`, by the rules in grouped_wgrad_fp8.cu with the
// environment's overrides read now (Error(invalid_argument) as the launch would throw it): CTAs per
// tile (2: pairs multicasting B), the scales copied into the stages (bf16 overwritten), 192 x 128
// tiles (with them, on single CTAs), two block accumulators (f32 or accumulated, single CTAs).
struct Fp8WgradKernel {
  int cluster = 1;
  bool stage_scales = false;
  bool tile192 = false;
  bool overlap = false;
};
Fp8WgradKernel fp8_wgrad_kernel(const Fp8WgradArgs& args);
std::string to_string(const Fp8WgradKernel& k);  // e.g. "192 x 128, scales in the stage, single CTAs"

// An expert without rows (all of them when skipped): zeros, or nothing added when accumulating
// (the bf16 WGRAD's contract). Requirements (checked; Error(invalid_argument) naming the field):
// 1 <= E <= 512, N > 0, L > 0 and L % 8 == 0, K > 0 and K % 128 == 0 with K covering every
// expert's blocks, 16-byte aligned pointers. Persistent launch (one CTA per SM), no host sync,
// graph-capturable, deterministic (no atomics).
void fp8_grouped_wgrad(const Fp8WgradArgs& args, void* stream);

}  // namespace epmoe::cuda
