// explain_cuda_kernels: the kernel each grouped GEMM of a configuration runs on the CUDA backend,
// from the launchers' own selectors (gemm/gemm_config.h, the FP8 launchers' rules), so the text
// cannot drift from what runs. The tiles named per schedule are the launchers' instantiations:
// gemm/expert_gemm_common.h RowsTraits (ping-pong 64 rows and 5 stages, cooperative 128 and 4; a
// stage more at 192 columns),
// W13's two B operands of 128 columns, the TMA-store WGRAD's 128 x 256 (or 128 x 192) on 3 stages,
// the FP8 kernels' fp8_gemm.h Fp8Tile and fp8_wgrad.h Fp8WgradKernel.
#include <cstdlib>
#include <sstream>
#include <string>

#include "core/step.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/fp8_wgrad.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/nvfp4_gemm.h"
#include "cuda/mxfp8_forward.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"

namespace epmoe {
namespace {

using cuda::GemmKind;
using cuda::Schedule;
using cuda::WgradStore;
using cuda::WgradTile;

// ", m-tile bands of <rows> rows [why]" (or "none").
std::string bands_text(int rows, const std::string& why) {
  return ", m-tile bands " + (rows == 0 ? std::string("none") : "of " + std::to_string(rows) + " rows") + " [" +
         why + "]";
}

// swiglu_pair: W13 with the SwiGLU in its epilogue (two B operands of 128 columns, gate and up).
std::string bf16_rows_gemm(GemmKind kind, const Step& s, bool swiglu_pair = false) {
  namespace g = cuda::gemm;
  std::string why_schedule, why_cluster;
  const Schedule sched = g::select_schedule(kind, s, &why_schedule);
  const int cluster = g::select_cluster(kind, s, &why_cluster);
  const bool pp = sched == Schedule::pingpong;
  std::string tile = swiglu_pair ? "x 128 x 2 (gate, up)" : "x 256";
  std::string why_width;
  if (kind != GemmKind::w13_fprop) {  // the GEMMs with one B operand choose their tile's width
    const bool n192 = g::select_rows_tile_n(kind, s, sched, &why_width) == cuda::RowsTileN::n192;
    tile = n192 ? "x 192" : "x 256";
    why_width = ", tile width [" + why_width + "]";
  }
  tile = std::string(pp ? "64 " : "128 ") + tile;
  // The reduction length the launcher passes: h (W2 FPROP), grad_h13 (W13 DGRAD), else x / grad_y.
  const int64_t k = kind == GemmKind::w2_fprop    ? s.dims.F
                    : kind == GemmKind::w13_dgrad ? 2 * s.dims.F
                                                  : s.dims.D;
  std::string why_band;
  const int band_rows = g::select_band_rows(s, k, &why_band);
  return "bf16 " + tile + ", " + cuda::to_string(sched) + " [" + why_schedule + "], " +
         (cluster == 2 ? "CTA pairs" : "single CTAs") + " [" + why_cluster + "]" + why_width +
         bands_text(band_rows, why_band);
}

std::string bf16_wgrad(GemmKind kind, const Step& s) {
  namespace g = cuda::gemm;
  std::string why_schedule, why_cluster, why_store, why_tile, why_peel;
  const Schedule sched = g::select_schedule(kind, s, &why_schedule);
  const int cluster = g::select_cluster(kind, s, &why_cluster);
  std::string out = "bf16, " + std::string(cuda::to_string(sched)) + " [" + why_schedule + "], " +
                    (cluster == 2 ? "CTA pairs" : "single CTAs") + " [" + why_cluster + "]";
  if (s.wgrad_dtype != DType::bf16) {
    return out + ", 128 x 256, f32 stored by the threads (4 stages)";
  }
  // Overwritten bf16 (accumulate_wgrad is a call option: accumulated gradients take the threads'
  // stores).
  const WgradStore store = g::select_wgrad_store(kind, s, &why_store);
  const bool peel = g::select_wgrad_peel(kind, s, &why_peel);
  if (store == WgradStore::direct) {
    return out + ", 128 x 256, stored by the threads [" + why_store + "], k-tail peeled " +
           (peel ? "yes" : "no") + " [" + why_peel + "]";
  }
  const WgradTile tile = g::select_wgrad_tile(kind, s, &why_tile);
  const bool warp = store == WgradStore::tma_warp && sched == Schedule::cooperative && cluster == 1 &&
                    tile == WgradTile::n256;
  return out + ", " + (tile == WgradTile::n192 ? "128 x 192" : "128 x 256") + " [" + why_tile +
         "], TMA stores issued by " + (warp ? "a producer warp" : "the consumers") + " [" + why_store +
         "], k-tail peeled " + (peel ? "yes" : "no") + " [" + why_peel + "]" +
         " (accumulated: stored by the threads)";
}

std::string fp8_tile_text(cuda::Fp8Tile t) {
  switch (t) {
    case cuda::Fp8Tile::m128_n128:
      return "128 x 128, cooperative";
    case cuda::Fp8Tile::m64_n256:
      return "64 x 256 ping-pong, halves back to back";
    case cuda::Fp8Tile::m192_n128:
      return "192 x 128, cooperative, one block accumulator";
    case cuda::Fp8Tile::m64_n256_spread:
      return "64 x 256 ping-pong, halves on neighbouring CTAs";
    case cuda::Fp8Tile::from_env:
      break;
  }
  return "?";
}

// The cooperative tiles' row trimming (fp8_trim_rows_rule on T*K/E).
std::string fp8_trim(const Step& s, cuda::Fp8Tile t) {
  if (t != cuda::Fp8Tile::m128_n128 && t != cuda::Fp8Tile::m192_n128) return "";
  std::string why;
  const int trim = cuda::fp8_trim_rows_rule(balanced_rows_per_expert(s.dims), t, &why);
  return std::string(trim != 0 ? ", tiles trimmed to their rows" : ", whole tiles") + " [" + why + "]";
}

std::string fp8_bands(const Step& s) {
  std::string why;
  const int rows = cuda::gemm::select_fp8_band_rows(s, &why);
  return bands_text(rows, why);
}

// The FP8 GEMMs whose output rows are D wide (W2 FPROP, W13 DGRAD): fp8_tile_for_d_rows.
std::string fp8_d_rows(const Step& s, int64_t N, int64_t K) {
  std::string why;
  const cuda::Fp8Tile t = cuda::fp8_tile_for_d_rows(N, K, balanced_rows_per_expert(s.dims), &why);
  return "fp8 " + fp8_tile_text(t) + " [" + why + "]" + fp8_trim(s, t) + fp8_bands(s);
}

std::string fp8_128(const Step& s, const char* what) {
  const cuda::Fp8Tile t = cuda::fp8_tile_from_env();
  std::string out = std::string("fp8 ") + fp8_tile_text(t);
  if (t == cuda::Fp8Tile::m128_n128) {
    out += cuda::fp8_overlap_selected(-1) ? ", two block accumulators" : ", one block accumulator";
  }
  return out + fp8_trim(s, t) + fp8_bands(s) + what;
}

std::string fp8_wgrad(const Step& s, int64_t N, int64_t L) {
  cuda::Fp8WgradArgs a;
  a.N = N;
  a.L = L;
  a.out_dtype = s.wgrad_dtype;
  const cuda::Fp8WgradKernel k = cuda::fp8_wgrad_kernel(a);
  return "fp8 on column-quantized operands, " + cuda::to_string(k);
}

// mxfp8_forward.h's choice on the capacity rows.
std::string mxfp8_kernel(const Step& s) {
  std::string why;
  const cuda::Mxfp8Kernel k = cuda::mxfp8_kernel_for(s.capacity_rows, s.dims.E, &why);
  return std::string("mxfp8 ") + cuda::to_string(k) + " kernel, activation rows quantized 1x32 [" + why + "]";
}

// nvfp4_gemm.h's row groups on the balanced rows per expert, and its split-K as asked for (at
// launch lowered to what the scratch holds; auto: the heuristic on the SM count).
std::string nvfp4_kernel(const Step& s) {
  const int64_t n = cuda::nvfp4_requested_splits();
  const char* env = std::getenv("EPMOE_NVFP4_SPLITK");
  const std::string splits =
      env == nullptr ? "one split [default]"
                     : (n == 0 ? std::string("nvfp4_choose_splits' splits") : std::to_string(n) + " splits") +
                           " [EPMOE_NVFP4_SPLITK=" + env + " (override), at most what the scratch holds]";
  const cuda::Nvfp4RowGroups groups = cuda::nvfp4_row_groups(balanced_rows_per_expert(s.dims));
  return "nvfp4 weight-only (TMA-fed E2M1 weights decoded in the mainloop, bf16 activations), " +
         std::to_string(8 * groups.groups) + " rows a pass [rule: " + groups.reason + "], " + splits;
}

}  // namespace

std::string explain_cuda_kernels(const Config& config, int ep_size) {
  const MemoryPlan plan = plan_memory(config, ep_size);
  const ConfigFields& f = config.fields();
  Step s;
  s.dims.T = config.T();
  s.dims.K = f.top_k;
  s.dims.D = config.D();
  s.dims.F = config.F();
  s.dims.E = config.local_experts(ep_size);
  s.dims.R = ep_size;
  s.capacity_rows = plan.recv_capacity_rows;
  s.wgrad_dtype = f.wgrad_dtype;
  const int64_t D = s.dims.D, F = s.dims.F;
  std::ostringstream os;
  os << "CUDA grouped GEMMs at EP = " << ep_size << ": " << s.dims.E << " local experts, "
     << balanced_rows_per_expert(s.dims) << " rows per expert under balanced routing (T*K/E), capacity "
     << s.capacity_rows << " rows, precision " << to_string(f.precision) << (f.inference ? ", inference" : "")
     << " (the environment's overrides as set now)\n";
  auto line = [&](const char* name, const std::string& text) { os << "  " << name << ": " << text << "\n"; };
  // The stages Context runs (core/context.cpp expert_stages and backward).
  const bool fused = f.fuse_epilogues, per_rank = f.combine == CombineMode::per_rank;
  const std::string kept = "rows kept for the per-rank combine's send stage";
  const std::string w2_rows = per_rank ? kept
                              : fused  ? "rows into the combine slots"
                                       : "plain rows, then the scatter kernel";
  const std::string w13_rows = per_rank ? kept
                               : fused  ? "rows scattered back"
                                        : "plain rows, then the scatter kernel";
  if (f.precision == Precision::mxfp8) {
    const std::string k = mxfp8_kernel(s);
    line("w13_fprop", k + (fused ? ", SwiGLU in the epilogue" : ", plain h13 rows, then the SwiGLU kernel"));
    line("w2_fprop", k + ", " + w2_rows);
    return os.str();
  }
  if (f.precision == Precision::nvfp4) {
    const std::string k = nvfp4_kernel(s);
    line("w13_fprop", k + (fused ? ", SwiGLU in the epilogue" : ", plain h13 rows, then the SwiGLU kernel"));
    line("w2_fprop", k + ", " + w2_rows);
    return os.str();
  }
  if (f.precision == Precision::fp8_block) {
    line("w13_fprop", fp8_128(s, " (stores h13; the SwiGLU and h's E4M3 rows in their own kernel)"));
    line("w2_fprop", fp8_d_rows(s, D, F) + " (" + w2_rows + ")");
    if (f.inference) return os.str();
    line("w2_dgrad", fp8_128(s, " (then the SwiGLU backward: EPMOE_SWIGLU_BACKWARD)"));
    line("w13_dgrad", fp8_d_rows(s, D, 2 * F) + " (" + w13_rows + ")");
    os << "  weight gradients: " << plan.fp8_wgrad_reason << "\n";
    if (plan.fp8_wgrad == Fp8Wgrad::fp8) {
      line("w2_wgrad", fp8_wgrad(s, D, F));
      line("w13_wgrad", fp8_wgrad(s, 2 * F, D));
    } else {
      line("w2_wgrad", bf16_wgrad(GemmKind::w2_wgrad, s));
      line("w13_wgrad", bf16_wgrad(GemmKind::w13_wgrad, s));
    }
    return os.str();
  }
  std::string w13 = bf16_rows_gemm(GemmKind::w13_fprop, s, fused);
  w13 +=
      fused ? ", SwiGLU in the epilogue" : ", plain h13 rows, then the SwiGLU kernel (fuse_epilogues false)";
  if (fused && f.arrival_gated_w13) w13 += ", its producer gated on dispatch arrivals (arrival_gated_w13)";
  line("w13_fprop", w13);
  line("w2_fprop", bf16_rows_gemm(GemmKind::w2_fprop, s) + ", " + w2_rows);
  if (f.inference) return os.str();
  line("w2_dgrad", bf16_rows_gemm(GemmKind::w2_dgrad, s) + ", then the SwiGLU backward kernel");
  line("w13_dgrad", bf16_rows_gemm(GemmKind::w13_dgrad, s) + ", " + w13_rows);
  line("w2_wgrad", bf16_wgrad(GemmKind::w2_wgrad, s));
  line("w13_wgrad", bf16_wgrad(GemmKind::w13_wgrad, s));
  return os.str();
}

}  // namespace epmoe
