// NVFP4 weight-only grouped GEMM (rows grouping), plain C++ launcher: device pointers, sizes and a
// cudaStream_t passed as void*. Kernel: gemm/grouped_gemm_nvfp4.cu; CPU twin: the formula below
// on the codec's decoded weights (tests/gpu/test_gpu_gemm_nvfp4.cpp).
//
//   out[m, n] = bf16( global_e * sum_k a[m, k] * (e2m1(q_e[n, k]) * e4m3(scale_e[n, k / 16])) )
//   for the rows m of expert e, [offsets_E1[e], offsets_E1[e + 1]).
//
// e2m1 * e4m3 has at most 6 significant bits: the weight is decoded exactly into bf16 (times a
// power of two the epilogue undoes exactly) and the tensor cores sum in fp32 (their own order);
// the fp32 global multiplies the sum once. The codes come in the prepared order
// (core/formats/nvfp4_gemm_order.h), which prepare_weights writes.
#pragma once

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "core/numeric.h"
#include "cuda/stream_fork.h"

namespace epmoe::cuda {

// Letters: M rows (capacity), K contraction, N output columns, E experts, P = K / 2 code bytes.
struct Nvfp4GroupedGemmArgs {
  const bf16_t* a_MK = nullptr;           // [M, K] bf16, row pitch K
  const uint8_t* b_codes_ENP = nullptr;   // [E, N, P] packed E2M1, prepared order
  const uint8_t* b_scales = nullptr;      // E4M3 block scales [E, ceil(K/128), N, 8], prepared order
  const float* b_global_E = nullptr;      // [E] fp32 global scales
  const int32_t* offsets_E1 = nullptr;    // device [E + 1], non-decreasing, offsets_E1[E] <= M
  const int32_t* skip = nullptr;          // nullable device flag: non-zero = every group is empty
  const int32_t* replay_skip = nullptr;   // the same (backward's replay; unused by inference)
  int E = 0;
  int64_t M = 0, N = 0, K = 0;
  bf16_t* out_MN = nullptr;               // row pitch ld_out; rows outside the groups untouched
  int64_t ld_out = 0;
  // Set instead of out_MN: row m goes to its owner's combine slot, combine_R[rank of src] at slot
  // (t, k) of src = recv_src_M[m] (core/layout.h encode_src; [T, K, N] bf16 buffers, peer pointers).
  bf16_t* const* combine_R = nullptr;     // device [R] table
  const int32_t* recv_src_M = nullptr;    // device [M]
  int64_t T = 0;
  int top_k = 0;
  // The host's expectation of rows per group (balanced routing: T * top_k / E), for choices that
  // depend on it (nvfp4_row_groups); 0: M / E.
  int64_t rows_per_group = 0;
  // Experts with more rows than this take a second launch of kNvfp4MaxRowGroups groups a pass
  // (the device picks each launch's experts); 0: nvfp4_row_groups' wide_above;
  // kNvfp4NoWidePass: never.
  int64_t wide_above_rows = 0;
  // Where the wide launch runs: forked from the caller's stream onto fork.side_stream, issued
  // before the narrow launch, joined back before the split-K reduce (the two take disjoint
  // experts, so they may overlap). Null side stream: both on the caller's stream, narrow first.
  StreamForkView fork;
  // W13 with the SwiGLU epilogue: B holds the gate rows [0, N/2) then the up rows [N/2, N); out
  // gets h[m, f] = bf16(act(bf16(gate), bf16(up))) for f < N/2 (core/activation.h, the unfused
  // kernel's math), [M, N/2] with row pitch ld_out; no h13.
  bool swiglu = false;
  ActivationParams act;
  // Split-K (deterministic): K splits, each storing fp32 partials [splits, M, N] into this
  // scratch, then a reduce kernel summing them in split order. splits = 0: EPMOE_NVFP4_SPLITK=<n>
  // (>= 1), =auto nvfp4_choose_splits, unset one split; either is lowered to what the scratch holds (none
  // or too small: one split). splits >= 1: that count (at most K / 128), the scratch must hold it.
  float* splitk_scratch_SMN = nullptr;  // device, 4-byte aligned; nullable
  int64_t splitk_scratch_bytes = 0;
  int splits = 0;
};

// The kernel's work decomposition: slabs of kNvfp4Slab weight rows (SwiGLU: kNvfp4Slab / 2 columns
// f, their gate and up rows), K in stages of kNvfp4Chunk elements. Slabs per expert:
// nvfp4_grid_slabs (work items = slabs x experts with rows x splits).
constexpr int kNvfp4Slab = 128;
constexpr int kNvfp4Chunk = 128;
int64_t nvfp4_grid_slabs(int64_t N, bool swiglu);

// The split-K heuristic: enough CTAs for kNvfp4TargetCtasPerSm per SM, each split >=
// kNvfp4MinChunksPerSplit 128-element chunks of K, at most kNvfp4MaxSplits. reason: the numbers
// it decided on, printable.
constexpr int kNvfp4TargetCtasPerSm = 3;
constexpr int kNvfp4MinChunksPerSplit = 8;
constexpr int kNvfp4MaxSplits = 16;
struct Nvfp4Splits {
  int splits = 1;
  std::string reason;
};
Nvfp4Splits nvfp4_choose_splits(int64_t N, int64_t K, int E, bool swiglu, int sms);

// Bytes of the fp32 partials of `splits` splits (0 for one split: no scratch).
int64_t nvfp4_splitk_scratch_bytes(int splits, int64_t M, int64_t N);

// The splits asked for where Nvfp4GroupedGemmArgs::splits is 0: EPMOE_NVFP4_SPLITK=<n> (>= 1), 0
// for =auto (nvfp4_choose_splits), unset 1 (Error(invalid_argument) naming it otherwise).
int64_t nvfp4_requested_splits();

// The splits nvfp4_grouped_gemm launches with these arguments (the rules above; host only).
int nvfp4_launch_splits(const Nvfp4GroupedGemmArgs& args);

// Activation rows a pass over the weights covers: 8 x groups, groups the smallest of 1, 2, 4, 8
// holding the expected rows per expert plus two standard deviations of a balanced (Poisson)
// count, sqrt(rows): an expert with more rows takes another pass over its weights, and groups
// past an expert's rows run no MMAs. Decode T = 128: 4 rows (deepseek-v3, gpt-oss) -> 1 group,
// 8 (qwen3) -> 2, 32 (mixtral) -> 8. From the host's expectation only (graph-capturable).
// Experts with more than two such passes' rows (wide_above = 16 x groups; skewed routing) go to a
// second launch of 8 groups a pass, which decodes their weights once per 64 rows instead of once
// per 8 x groups; the device sorts the experts between the two launches by their offsets.
constexpr int kNvfp4MaxRowGroups = 8;
constexpr int64_t kNvfp4NoWidePass = INT64_MAX;
struct Nvfp4RowGroups {
  int groups = 1;
  int64_t wide_above = kNvfp4NoWidePass;  // rows; kNvfp4NoWidePass with 8 groups
  std::string reason;
};

// Experts a launch can take (the kernel lists them in shared memory).
constexpr int kNvfp4MaxExperts = 1024;
Nvfp4RowGroups nvfp4_row_groups(int64_t rows_per_group);

// EPMOE_NVFP4_ROW_GROUPS=<1|2|4|8> in place of nvfp4_row_groups' count (measurements; the wide
// launch as the rule puts it); 0 when unset (Error(invalid_argument) naming it otherwise).
int nvfp4_requested_row_groups();

// The row groups nvfp4_grouped_gemm launches with these arguments: nvfp4_row_groups of their
// rows_per_group (0: M / E), the count EPMOE_NVFP4_ROW_GROUPS forces with the rule's wide launch.
Nvfp4RowGroups nvfp4_launch_row_groups(const Nvfp4GroupedGemmArgs& args);

// Whether the NVFP4 stages hand the GEMM their backend's fork (nvfp4_forward.h):
// EPMOE_NVFP4_WIDE_FORK=1 yes, unset or 0 no (Error(invalid_argument) naming it otherwise). Off by
// default: measured at 54f5f22 (bench/RESULTS.md), the fork made skewed decode 12-22 % faster
// and balanced decode up to 15 % slower (qwen3; gpt-oss 6 %, deepseek-v3 even).
bool nvfp4_wide_fork();

// Whether the wide launch, without a fork, is a programmatic dependent launch after the narrow one
// on the caller's stream (its CTAs start as the narrow ones finish and take their SM slots; it
// completes only after the narrow grid): EPMOE_NVFP4_WIDE_PDL unset or 1 yes, 0 an ordinary launch
// (Error(invalid_argument) naming it otherwise). Measured at 0be8ef8 (bench/RESULTS.md): skewed
// decode up to 16 % faster (mixtral even), balanced even.
bool nvfp4_wide_pdl();

// Whether passes of 8 row groups (the wide launch, and the narrow one at 8 groups: mixtral decode)
// run their MMAs on wgmma (A, the decoded weights, from registers; B, the activation rows
// rearranged in shared memory to wgmma's k order) instead of mma.sync: EPMOE_NVFP4_WGMMA=1 yes,
// unset or 0 no (Error(invalid_argument) naming it otherwise). Bitwise equal to mma.sync on the
// GPU tests. Off by default: measured slower (bench/RESULTS.md, 218f6e7: mixtral decode graph
// x1.14, qwen3 skew x1.03), with 2 CTAs of 168 registers a thread an SM.
bool nvfp4_wgmma();

// Whether the producer of a launch (wide: the 8-group launch of the experts with many rows) loads
// a stage's activation rows in boxes of up to 4 row groups (32 rows; a pass's live groups in at
// most three boxes a half: 32, 16 and 8 rows) instead of one box per group: EPMOE_NVFP4_ACT_BOXES
// unset: the narrow launch only; 1 every launch, 0 none (Error(invalid_argument) naming it
// otherwise). The same bytes in the same shared-memory places either way (the 128-byte swizzle
// follows the address), so the same bits; fewer TMA issues from the one producer lane (with one
// box a group, 2 + 2 x live a chunk, SwiGLU 4 + 2 x live: 18 / 20 at 8 groups). Measured at
// 86a494e (bench/RESULTS.md): mixtral decode graph x0.95-0.97 balanced, x0.86 skew, the other
// shapes even; in the wide launch too, qwen3 and deepseek-v3 skew x1.06-1.09 slower.
bool nvfp4_act_boxes(bool wide);

// Requirements (checked; Error(invalid_argument) naming the field): 1 <= E <= kNvfp4MaxExperts, K > 0 and
// K % 32 == 0 (16-byte code rows for TMA), N > 0 and even (16-byte rows of 8-byte scale groups),
// E * N and M < 2^31, ld_out >= N (or the combine fields), a_MK, b_codes_ENP and b_scales
// 16-byte aligned, b_global_E 4-byte aligned; swiglu: N even, ld_out >= N / 2, no combine_R. Work items (ceil(N / 128),
// expert with rows, splits) (swiglu: (ceil(N / 2 / 64), ...)) over a persistent grid of the
// resident CTAs, one launch per row-group width (nvfp4_row_groups), then with splits > 1 the
// reduce kernel; graph-capturable (the splits and row
// groups depend on host-known sizes and the environment only; the TMA descriptors are kernel
// parameters); deterministic (one lane owns each output of a split and sums its chunks in a
// fixed order; the reduce sums the splits in order). Row groups change nothing but the passes:
// the same MMAs in the same order for every row. Several splits differ from one by the fp32
// summation order only.
void nvfp4_grouped_gemm(const Nvfp4GroupedGemmArgs& args, void* stream);

}  // namespace epmoe::cuda
