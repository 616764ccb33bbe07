// Launcher and the one instantiation of the FP8 block-scaled grouped GEMM: 128 x 128 tiles,
// 128-deep k-blocks, 6 stages (32.5 KiB each), cooperative consumers, plain bf16 row epilogue.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/grouped_gemm_fp8_sm90.cuh"
#include "cuda/gemm/launch.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {

using namespace gemm;

namespace {

using Traits = Fp8GemmTraits<128, 6>;

void check_aligned(const void* p, const char* name) {
  EPMOE_CHECK_ARG(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, name,
                  "a non-null, 16-byte aligned device pointer", reinterpret_cast<uintptr_t>(p));
}

void check_args(const Fp8GroupedGemmArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= kMaxGroups, "E", "1 .. " + std::to_string(kMaxGroups), a.E);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % 16 == 0, "K", "> 0 and a multiple of 16", a.K);
  EPMOE_CHECK_ARG(a.N > 0 && a.N % 8 == 0, "N", "> 0 and a multiple of 8", a.N);
  EPMOE_CHECK_ARG(a.ld_out >= a.N && a.ld_out % 8 == 0, "ld_out", ">= N and a multiple of 8", a.ld_out);
  EPMOE_CHECK_ARG(a.ld_a_scales >= a.M && a.ld_a_scales % 4 == 0, "ld_a_scales", ">= M and a multiple of 4",
                  a.ld_a_scales);
  check_aligned(a.b_ENK, "b_ENK");
  check_aligned(a.b_scales_EBS, "b_scales_EBS");
  check_aligned(a.offsets_E1, "offsets_E1");
  if (a.M == 0) return;
  check_aligned(a.a_MK, "a_MK");
  check_aligned(a.a_scales_SM, "a_scales_SM");
  check_aligned(a.out_MN, "out_MN");
}

}  // namespace

void fp8_grouped_gemm(const Fp8GroupedGemmArgs& args, void* stream) {
  check_args(args);
  if (args.M == 0) return;  // no rows: every group is empty
  using Epilogue = RowsEpilogue<Traits>;
  const int64_t S = (args.K + Traits::BLOCK_K - 1) / Traits::BLOCK_K;
  const int64_t B = (args.N + 127) / 128;
  const Operand a{args.a_MK, args.M, args.K, args.K, 1};
  const Operand b{args.b_ENK, args.N, args.K, args.K, 1, args.E, args.N * args.K};
  auto tma_a = make_tma<Traits, Major::K, Traits::BLOCK_M, 2>(a);
  auto tma_b = make_tma<Traits, Major::K, Traits::BLOCK_N, 3>(b);
  GroupArgs groups;
  groups.offsets = args.offsets_E1;
  groups.skip = args.skip;
  groups.groups = args.E;
  groups.n = args.N;
  groups.k = args.K;
  const Fp8ActScales sa{args.a_scales_SM, args.ld_a_scales, args.M};
  const Fp8WeightScales sb{args.b_scales_EBS, B, S};
  const typename Epilogue::Params epi{plain(args.out_MN), args.ld_out, args.N};

  constexpr auto kernel = &grouped_gemm_fp8_kernel<Traits, Epilogue, decltype(tma_a), decltype(tma_b)>;
  constexpr int kSmem = static_cast<int>(sizeof(Fp8SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  kernel<<<device_sm_count(), Traits::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      tma_a, tma_b, groups, sa, sb, epi, a.rows, a.cols, b.rows, b.cols);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
