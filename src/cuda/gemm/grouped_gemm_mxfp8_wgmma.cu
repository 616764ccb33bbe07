// Launcher and the instantiations of the MXFP8 wgmma grouped GEMM (gemm/mxfp8_wgmma_gemm.h):
// rows into out_MN, rows into their owners' combine slots (W2), and W13's SwiGLU (h only, as
// the decode kernel's epilogue: gate and up of one output in the same thread).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/activation.h"
#include "cuda/check.h"
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/grouped_gemm_mxfp8_wgmma_sm90.cuh"
#include "cuda/gemm/launch.cuh"
#include "cuda/gemm/launch_checks.h"
#include "cuda/gemm/mxfp8_wgmma_gemm.h"
#include "cuda/placed.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

using namespace gemm;

namespace {

using Traits = Mxfp8WgmmaTraits;

// ---- W13 with SwiGLU: tile columns [0, 64) are gate f0 + c, [64, 128) their up rows ----
// h[m, f] = bf16(act(bf16(gate), bf16(up))) (core/activation.h; the decode kernel's and the
// unfused kernel's math), staged as one 64-column bf16 chunk and stored as 16-byte row segments.
struct SwigluHEpilogue {
  struct Params {
    bf16_t* h;  // [capacity, ld]
    int64_t ld;
    int64_t F;
    ActivationParams act;
  };
  static constexpr int kSmemBytesPerWarpgroup = Stage<Traits>::kBytes;
  Params p;
  Stage<Traits> stage;
  __device__ void finish() const {}
  __device__ SwigluHEpilogue(const Params& params, char* smem, int wg, int row_block, int tid)
      : p(params), stage{smem, wg, row_block, tid} {}

  template <class Acc0, class Acc1>
  __device__ void store(const TileCoord& t, const Acc0& acc, const Acc1&) const {
    const int64_t f0 = static_cast<int64_t>(t.n_tile) * (Traits::BLOCK_N / 2);
    // Fragment element i < 32 is (row, column c < 64); i + 32 is (row, c + 64): its up value.
    stage.template put_bf16<0>([&](int i, int, int) {
      const float gate = bf16_to_float(float_to_bf16(acc(i)));
      const float up = bf16_to_float(float_to_bf16(acc(i + 32)));
      return swiglu_forward(gate, up, p.act);
    });
    stage.sync();
    stage.write_rows(clamp_bytes(p.F - f0, 2), [&](int r, int) -> char* {
      const int m = 64 * stage.row_block + r;
      if (m >= t.rows_valid) return nullptr;
      return reinterpret_cast<char*>(p.h + (t.row0 + m) * p.ld + f0);
    });
    stage.sync();
  }
};

void check_args(const Mxfp8GroupedGemmArgs& a) {
  EPMOE_CHECK_ARG(a.E >= 1 && a.E <= kMaxGroups, "E", "1 .. " + std::to_string(kMaxGroups), a.E);
  EPMOE_CHECK_ARG(a.M >= 0, "M", ">= 0", a.M);
  EPMOE_CHECK_ARG(a.K > 0 && a.K % kMxBlock == 0, "K", "> 0 and a multiple of 32 (MX blocks)", a.K);
  check_output_destination(a);
  // The epilogues store 16-byte row segments: N (F with swiglu) and ld_out multiples of 8.
  if (a.swiglu) {
    EPMOE_CHECK_ARG(a.N > 0 && a.N % 16 == 0, "N",
                    "> 0 and a multiple of 16 with swiglu (F = N / 2 a multiple of 8)", a.N);
  } else {
    EPMOE_CHECK_ARG(a.N > 0 && a.N % 8 == 0, "N", "> 0 and a multiple of 8", a.N);
  }
  if (a.combine_R == nullptr) {
    EPMOE_CHECK_ARG(a.ld_out % 8 == 0, "ld_out", "a multiple of 8 (16-byte row stores)", a.ld_out);
  }
  check_device_pointer(a.b_codes_ENK, "b_codes_ENK", 16);
  check_device_pointer(a.b_scales_ENS, "b_scales_ENS", 1);
  check_device_pointer(a.offsets_E1, "offsets_E1", 4);
  if (a.M == 0) return;
  check_device_pointer(a.a_codes_MK, "a_codes_MK", 16);
  check_device_pointer(a.a_scales_MS, "a_scales_MS", 1);
  check_output_pointers(a, 16);
}

template <class Epilogue>
void launch(const Mxfp8GroupedGemmArgs& args, const typename Epilogue::Params& epi, void* stream) {
  const Operand a{args.a_codes_MK, args.M, args.K, args.K, 1};
  const Operand b{args.b_codes_ENK, args.N, args.K, args.K, 1, args.E, args.N * args.K};
  auto tma_a = make_tma<Traits, Major::K, Traits::BLOCK_M, 2>(a);
  auto tma_b = make_tma<Traits, Major::K, Traits::kHalfRows, 3>(b);
  GroupArgs groups;
  groups.offsets = args.offsets_E1;
  groups.skip = args.skip;
  groups.groups = args.E;
  groups.n = args.N;  // ceil(N / 128) tiles; with swiglu ceil(F / 64), the same count
  groups.k = args.K;
  Mxfp8ScaleArgs sc;
  sc.a_scales_MS = args.a_scales_MS;
  sc.b_scales_ENS = args.b_scales_ENS;
  sc.M = args.M;
  sc.N = args.N;
  sc.S = args.K / kMxBlock;
  sc.step = args.swiglu ? Traits::BLOCK_N / 2 : Traits::BLOCK_N;
  sc.origin1 = args.swiglu ? args.N / 2 : Traits::BLOCK_N / 2;
  sc.limit0 = args.swiglu ? args.N / 2 : args.N;
  sc.words = sc.S % 4 == 0 && reinterpret_cast<uintptr_t>(args.a_scales_MS) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(args.b_scales_ENS) % 4 == 0
                 ? 1
                 : 0;

  constexpr auto kernel =
      &grouped_gemm_mxfp8_wgmma_kernel<Epilogue, decltype(tma_a), decltype(tma_b)>;
  constexpr int kSmem =
      static_cast<int>(sizeof(Mxfp8SharedStorage<Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  kernel<<<device_sm_count(), Traits::kThreads, kSmem, static_cast<cudaStream_t>(stream)>>>(
      tma_a, tma_b, groups, sc, epi, a.rows, a.cols, b.rows, b.cols);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void mxfp8_grouped_gemm_wgmma(const Mxfp8GroupedGemmArgs& args, void* stream) {
  check_args(args);
  if (args.M == 0) return;  // no rows: every group is empty
  if (args.combine_R != nullptr) {
    const typename ScatterEpilogue<Traits>::Params epi{args.combine_R, args.recv_src_M, args.T,
                                                       args.top_k, args.N};
    launch<ScatterEpilogue<Traits>>(args, epi, stream);
  } else if (args.swiglu) {
    const SwigluHEpilogue::Params epi{args.out_MN, args.ld_out, args.N / 2, args.act};
    launch<SwigluHEpilogue>(args, epi, stream);
  } else {
    const typename RowsEpilogue<Traits>::Params epi{plain(args.out_MN), args.ld_out, args.N};
    launch<RowsEpilogue<Traits>>(args, epi, stream);
  }
}

}  // namespace epmoe::cuda
