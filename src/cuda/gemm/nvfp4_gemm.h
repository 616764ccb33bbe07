// NVFP4 weight-only grouped GEMM (rows grouping), plain C++ launcher: device pointers, sizes and a
// cudaStream_t passed as void*. Kernel: gemm/grouped_gemm_nvfp4.cu; CPU twin: the formula below
// on the codec's decoded weights (tests/gpu/test_gpu_gemm_nvfp4.cpp).
//
//   out[m, n] = bf16( global_e * sum_k a[m, k] * (e2m1(q_e[n, k]) * e4m3(scale_e[n, k / 16])) )
//   for the rows m of expert e, [offsets_E1[e], offsets_E1[e + 1]).
//
// e2m1 * e4m3 has at most 6 significant bits: the weight is decoded exactly into bf16 and the
// tensor cores sum in fp32 (their own order); the fp32 global multiplies the sum once.
#pragma once

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "core/numeric.h"

namespace epmoe::cuda {

// Letters: M rows (capacity), K contraction, N output columns, E experts, P = K / 2 code bytes,
// S = K / 16 scale blocks.
struct Nvfp4GroupedGemmArgs {
  const bf16_t* a_MK = nullptr;           // [M, K] bf16, row pitch K
  const uint8_t* b_codes_ENP = nullptr;   // [E, N, P] packed E2M1 (low nibble first)
  const uint8_t* b_scales_ENS = nullptr;  // [E, N, S] E4M3 block scales
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
  // depend on it (nvfp4_activations); 0: M / E.
  int64_t rows_per_group = 0;
  // W13 with the SwiGLU epilogue: B holds the gate rows [0, N/2) then the up rows [N/2, N); out
  // gets h[m, f] = bf16(act(bf16(gate), bf16(up))) for f < N/2 (core/activation.h, the unfused
  // kernel's math), [M, N/2] with row pitch ld_out; no h13.
  bool swiglu = false;
  ActivationParams act;
  // Split-K (deterministic): K splits, each storing fp32 partials [splits, M, N] into this
  // scratch, then a reduce kernel summing them in split order. splits = 0: EPMOE_NVFP4_SPLITK=<n>
  // (>= 1), =auto nvfp4_choose_splits, unset one split (measured fastest); either is lowered to what the scratch holds (none
  // or too small: one split). splits >= 1: that count (at most K / 128), the scratch must hold it.
  float* splitk_scratch_SMN = nullptr;  // device, 4-byte aligned; nullable
  int64_t splitk_scratch_bytes = 0;
  int splits = 0;
};

// The split-K heuristic: enough CTAs for kNvfp4TargetCtasPerSm per SM (each of 4 warps, kDepth
// chunks in flight per warp), each split >= kNvfp4MinChunksPerSplit 128-element chunks of K, at
// most kNvfp4MaxSplits. reason: the numbers it decided on, printable.
constexpr int kNvfp4TargetCtasPerSm = 8;
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

// CTAs of 4 warps per SM the single-split kernel on 16-byte code rows (K % 32 == 0) is compiled
// for, each warp with 4 chunks of weights in flight: EPMOE_NVFP4_OCCUPANCY=4x4 (unset: registers
// capped at 128) or 1x4 (uncapped: 128 registers unfused, 166 with SwiGLU); the same bits. Decode
// graph ms 1x4 / 4x4: 0.268 / 0.249, 3.107 / 2.877, 0.977 / 0.909, 1.296 / 1.200 (qwen3,
// deepseek-v3, gpt-oss, mixtral); 5 and 6 CTAs (96 / 80 registers, 180-708 bytes of spill loads)
// were 7-130 % slower (bench/RESULTS.md 5e64418).
int nvfp4_ctas_per_sm();

// Where the 4x4 kernel's warps read the activations: through L1 (l1: global loads per warp just
// before the MMAs) or staged (a shared-memory ring per CTA filled by cp.async a few chunks ahead;
// grouped_gemm_nvfp4.cu); the same bits either way. The rule: staged when the expected rows per
// group (Nvfp4GroupedGemmArgs::rows_per_group) exceed kNvfp4L1MaxRows, one 8-row group reading too
// little to pay for the ring's barriers. Decode graph ms l1 / staged at 4 / 4 / 8 / 32 rows per
// expert (deepseek-v3 / gpt-oss / qwen3 / mixtral): 2.88-2.91 / 3.02-3.05, 0.915-0.923 /
// 0.951-0.952, 0.251-0.256 / 0.250, 1.213 / 0.978-0.984 (bench/RESULTS.md f0243ba).
// EPMOE_NVFP4_ACTIVATIONS=l1|staged forces one (unset or rows: the rule). Per CTA on the device
// (by its expert's rows) was tried: both paths in one kernel spill 400-900 bytes at 128 registers.
enum class Nvfp4Activations { l1, staged };
constexpr int64_t kNvfp4L1MaxRows = 8;
Nvfp4Activations nvfp4_activations(int64_t rows_per_group);

// Requirements (checked; Error(invalid_argument) naming the field): E >= 1, K > 0 and
// K % 16 == 0, N > 0, ld_out >= N (or the combine fields), a_MK and b_codes_ENP 16-byte aligned,
// b_global_E 4-byte aligned; swiglu: N even, ld_out >= N / 2, no combine_R. Grid (ceil(N / 64), E,
// splits) (swiglu: (ceil(N / 2 / 32), E, splits)), then with splits > 1 the reduce kernel;
// graph-capturable (the splits depend on host-known sizes and the environment only);
// deterministic (one warp owns each output of a split and sums its chunks in a fixed order; the
// reduce sums the splits in order). One split: bitwise the single-kernel result it always was;
// several differ from it by the fp32 summation order only.
void nvfp4_grouped_gemm(const Nvfp4GroupedGemmArgs& args, void* stream);

}  // namespace epmoe::cuda
