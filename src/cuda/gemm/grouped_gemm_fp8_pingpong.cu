// Launcher and the four instantiations of the FP8 block-scaled grouped GEMM's 64 x 256 ping-pong
// tile (grouped_gemm_fp8_pingpong_sm90.cuh): the two tile orders (pairs on one CTA, or spread over
// neighbouring CTAs), each with plain bf16 rows or rows stored into their owners' combine slots
// (the W2 forward). Arguments are checked by fp8_grouped_gemm (grouped_gemm_fp8.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/check.h"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/fp8_gemm_launch.h"
#include "cuda/gemm/grouped_gemm_fp8_pingpong_sm90.cuh"
#include "cuda/gemm/launch.cuh"

namespace epmoe::cuda::gemm {

namespace {

using Traits = Fp8PingPongTraits;

template <bool kPairs, class Epilogue>
void launch(const Fp8GroupedGemmArgs& args, const typename Epilogue::Params& epi, void* stream) {
  const Operand a{args.a_MK, args.M, args.K, args.K, 1};
  const Operand b{args.b_ENK, args.N, args.K, args.K, 1, args.E, args.N * args.K};
  auto tma_a = make_tma<Traits, Major::K, Traits::BLOCK_M, 2>(a);
  auto tma_b = make_tma<Traits, Major::K, Traits::BLOCK_N, 3>(b);
  constexpr auto kernel = &grouped_gemm_fp8_pingpong_kernel<kPairs, Epilogue, decltype(tma_a), decltype(tma_b)>;
  constexpr int kSmem = static_cast<int>(sizeof(Fp8SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  kernel<<<device_sm_count(), Traits::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      tma_a, tma_b, fp8_group_args(args), fp8_act_scales(args), fp8_weight_scales(args), epi, a.rows,
      a.cols, b.rows, b.cols);
  EPMOE_CUDA_LAUNCH_CHECK();
}

template <bool kPairs>
void launch_order(const Fp8GroupedGemmArgs& args, void* stream) {
  if (args.combine_R != nullptr) {
    const typename ScatterEpilogue<Traits>::Params epi{args.combine_R, args.recv_src_M, args.T,
                                                       args.top_k, args.N};
    launch<kPairs, ScatterEpilogue<Traits>>(args, epi, stream);
  } else {
    const typename RowsEpilogue<Traits>::Params epi{fp8_rows_out(args), args.ld_out, args.N};
    launch<kPairs, RowsEpilogue<Traits>>(args, epi, stream);
  }
}

}  // namespace

void fp8_grouped_gemm_pingpong(const Fp8GroupedGemmArgs& args, bool pairs, void* stream) {
  if (pairs) {
    launch_order<true>(args, stream);
  } else {
    launch_order<false>(args, stream);
  }
}

}  // namespace epmoe::cuda::gemm
