// FP8 block-scaled grouped GEMM (rows grouping), plain C++ launcher: device pointers, sizes and a
// cudaStream_t passed as void*. Kernel: gemm/grouped_gemm_fp8_sm90.cuh; CPU twin:
// cpu/gemm_fp8_reference.h (same layouts and the same two-level accumulation).
//
//   out[m, :] = bf16( sum_kb (a[m, kb-block] . b_e[:, kb-block]^T) * sa[m, kb] * sb_e[n / 128, kb] )
//   for the rows m of expert e, [offsets_E1[e], offsets_E1[e + 1]).
#pragma once

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "core/numeric.h"
#include "cuda/placed.h"

namespace epmoe::cuda {

// The kernel's tile. from_env: EPMOE_FP8_TILE=128x128|192x128|64x256|64x256-spread (read on every
// call; unset: 128x128). m128_n128: two cooperative warpgroups on a 128 x 128 tile, 6 stages of 32
// KiB. m192_n128: three on a 192 x 128 tile, 4 stages of 40 KiB, one block accumulator (1.2x the
// FLOPs per operand byte from L2; plain and combine-slot rows only): not faster than 128 x 128
// with two block accumulators on mixtral-8x7b's W13 FPROP and W2 DGRAD, slower elsewhere (bench/
// RESULTS.md a32061d); fp8_tile_for_d_rows picks it, trimmed to its rows, for experts of few rows.
// m64_n256: ping-pong, each warpgroup its own 64 x 256 tile, 5 stages of 40 KiB (more weight bytes
// in flight); a CTA runs the two 64-row halves of a 128-row block back to back. m64_n256_spread:
// the same tile, the two halves on neighbouring CTAs at the same time. All compute every output
// bitwise alike.
enum class Fp8Tile { from_env, m128_n128, m64_n256, m64_n256_spread, m192_n128 };

// The tile from_env stands for now (Error(invalid_argument) naming EPMOE_FP8_TILE if unrecognised).
Fp8Tile fp8_tile_from_env();

// The tile of the FP8 GEMMs whose output rows are D wide (W2 FPROP, W13 DGRAD): EPMOE_FP8_TILE when
// set, else where the contraction is shorter than the output row (K < N: the epilogue weighs most)
// 192 x 128 up to 192 rows per expert (T*K/E; an expert's rows then mostly fit one m-tile, which
// reads each weight block once, and trimming idles the warpgroups past them), ping-pong 64 x 256
// spread above (it runs the epilogue under the other warpgroup's MMA), else 128 x 128. 192 x 128
// trimmed against spread, deepseek-v3 fp8-train (~128 rows), two alternating pairs (bench/RESULTS.md
// "2026-12-03 · 1732616, ..., 466fccd"): W2 FPROP x0.94 / 0.96, W13 DGRAD x0.92 / 0.93. Stage ms
// 128 x 128 / spread with every FP8 GEMM on one tile (bench/RESULTS.md e86d331): W2 FPROP qwen3
// 0.385 / 0.327, deepseek-v3 1.853 / 1.512 (K < N), gpt-oss 0.756 / 0.821, mixtral 1.758 / 2.559;
// W13 DGRAD qwen3 0.578 / 0.545, deepseek-v3 3.474 / 2.985 (K < N), gpt-oss 1.336 / 1.576,
// mixtral 3.428 / 5.012. The other GEMMs ran faster on 128 x 128 on every shape.
// With `why`, appends the rule and values or the override that chose it.
Fp8Tile fp8_tile_for_d_rows(int64_t N, int64_t K, int64_t rows_per_expert, std::string* why = nullptr);

// The W2 DGRAD's SwiGLU backward in the epilogue (gemm/fp8_swiglu_epilogue.cuh): the GEMM's
// output is grad_h [M, F] (N = F, a multiple of 128), which is not stored; instead, bitwise what
// swiglu_backward_fp8_rows (swiglu.h) writes from the stored grad_h: grad_h13 and h (bf16), grad_h13
// quantized 1x128 along 2F, and with row scores the grad_scores partials. Rows outside the groups
// are untouched. The 128 x 128 tile only.
struct Fp8SwigluBackwardOut {
  Placed h13;                          // [M, 2F] saved h13 (a layer plan's placement, or plain)
  bf16_t* grad_h13_M2F = nullptr;      // [M, 2F]
  bf16_t* h_MF = nullptr;              // [M, F]
  uint8_t* q_M2F = nullptr;            // grad_h13's E4M3 codes [M, 2F]
  float* q_scales_SM = nullptr;        // their scales, (row m, block b) at q_scales_SM[b * q_ld + m]
  int64_t q_ld = 0;                    // >= M
  const float* row_scores_M = nullptr; // nullable: grad_h is already scaled
  float* score_parts_MC = nullptr;     // [M, F / 64] (with row_scores_M)
  ActivationParams act;
};

// Letters: M rows (capacity), K contraction, N output columns, E experts, S = ceil(K / 128),
// B = ceil(N / 128).
struct Fp8GroupedGemmArgs {
  const uint8_t* a_MK = nullptr;          // [M, K] E4M3, row pitch K
  const float* a_scales_SM = nullptr;     // 1x128 scales, S-major: (m, s) at s * ld_a_scales + m
  int64_t ld_a_scales = 0;                // >= M, a multiple of 4 (16-byte TMA rows)
  const uint8_t* b_ENK = nullptr;         // [E, N, K] E4M3 (prepared weights)
  const float* b_scales_EBS = nullptr;    // [E, B, S] 128x128 scales (fp8_quantize_weights' layout)
  const int32_t* offsets_E1 = nullptr;    // device [E + 1], non-decreasing, offsets_E1[E] <= M
  const int32_t* skip = nullptr;          // nullable device flag: non-zero = every group is empty
  const int32_t* replay_skip = nullptr;   // the same (backward's replay: LayerPlan::replay_skip)
  int band_rows = 0;                      // m-tile bands (gemm::select_fp8_band_rows); 0: none
  // Nullable device count: A is a received-rows operand (core/fp8_terms.h fp8_rows_bytes) of
  // clamp(*a_rows_1, 0, M) rows whose scales follow its codes (fp8_rows_scales_offset, ld
  // fp8_rows_ld), both known only on the device; a_scales_SM and ld_a_scales are then unused.
  const int32_t* a_rows_1 = nullptr;
  int E = 0;
  int64_t M = 0, N = 0, K = 0;
  bf16_t* out_MN = nullptr;               // row pitch ld_out; rows outside the groups untouched
  int64_t ld_out = 0;
  // Nullable device offset: the rows start *out_offset bytes past out_MN (a layer plan's placement,
  // placed.h), read by the kernel.
  const int64_t* out_offset = nullptr;
  // Set (grad_h13_M2F non-null) instead of out_MN: the SwiGLU backward epilogue.
  Fp8SwigluBackwardOut swiglu_backward;
  // Set instead of out_MN: row m goes to its owner's combine slot, combine_R[rank of src] at slot
  // (t, k) of src = recv_src_M[m] (core/layout.h encode_src; [T, K, N] bf16 buffers, peer pointers).
  bf16_t* const* combine_R = nullptr;     // device [R] table
  const int32_t* recv_src_M = nullptr;    // device [M]
  int64_t T = 0;
  int top_k = 0;
  Fp8Tile tile = Fp8Tile::from_env;
  // Main loop: 0 one block accumulator (wgmma, wait, promote); 1 two, the next k-block's MMA in
  // flight during the promotion (bitwise the same results); -1 the environment's
  // EPMOE_FP8_OVERLAP=0|1, read per launch (unset: 1). The 128 x 128 tile's; ping-pong has one loop.
  int overlap = -1;
  // 128 x 128 and 192 x 128 tiles: 1 a tile loads and multiplies only its 64-row blocks that hold
  // rows of its group (a warpgroup past them idles), 0 every block (the same results); -1 the
  // environment's EPMOE_FP8_TRIM_ROWS=0|1, read per launch (unset: 1).
  int trim_rows = -1;
};

// Requirements (checked; Error(invalid_argument) naming the field): 1 <= E <= 512, K > 0 and
// K % 16 == 0, N > 0 and N % 8 == 0, ld_out >= N and ld_out % 8 == 0 (or the combine fields, or
// swiglu_backward with N % 128 == 0, q_ld >= M and the 128 x 128 tile),
// ld_a_scales as above (or a_rows_1), 16-byte aligned pointers. The launch is persistent (one CTA per SM) and graph-capturable.
void fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, void* stream);

// Whether a launch with Fp8GroupedGemmArgs::overlap = `overlap` runs the two-accumulator loop.
bool fp8_overlap_selected(int overlap);

// Whether a launch with Fp8GroupedGemmArgs::trim_rows = `trim_rows` trims its tiles to their rows.
bool fp8_trim_rows_selected(int trim_rows);

// The layer's trim_rows (0 or 1) for experts of `rows_per_expert` rows under balanced routing
// (T*K/E) on `tile`: EPMOE_FP8_TRIM_ROWS when set, else trimmed on 192 x 128 (chosen for few rows,
// fp8_tile_for_d_rows) and from 256 rows on 128 x 128. Measured (bench/RESULTS.md
// "2026-12-03 · 1732616", fp8-train, stages against whole tiles): gpt-oss (~256 rows) W2 FPROP,
// W2 DGRAD and W13 DGRAD x0.92-0.95; qwen3 (~512) and mixtral (~2048) within the spread (the GEMM
// alone on routed rows x0.96-0.98); deepseek-v3 (~128) W13 FPROP and W2 DGRAD x1.08-1.10 slower.
// There the weights' bytes per FLOP are at the HBM ridge and an expert's two m-tiles, run side by
// side, read each weight block once; a trimmed half tile finishes first (not verified by a counter).
int fp8_trim_rows_rule(int64_t rows_per_expert, Fp8Tile tile, std::string* why = nullptr);

}  // namespace epmoe::cuda
