#include "cuda/mxfp8_forward.h"

#include <cstdlib>
#include <cstring>

#include "core/plan_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "cuda/gemm/mxfp8_wgmma_gemm.h"
#include "cuda/w2_rows_output.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

Mxfp8Kernel mxfp8_kernel_for(int64_t M, int E, std::string* why) {
  const char* env = std::getenv("EPMOE_MXFP8_KERNEL");  // per call (~100 ns), for measurements
  if (env != nullptr && std::strcmp(env, "auto") != 0) {
    if (why != nullptr) *why += std::string("EPMOE_MXFP8_KERNEL=") + env + " (override)";
    if (std::strcmp(env, "decode") == 0) return Mxfp8Kernel::decode;
    EPMOE_CHECK_ARG(std::strcmp(env, "wgmma") == 0, "EPMOE_MXFP8_KERNEL", "decode, wgmma or auto",
                    env);
    return Mxfp8Kernel::wgmma;
  }
  const bool prefill = E >= 1 && E <= kMaxGroups && M >= kMxfp8WgmmaRowsPerExpert * E;
  if (why != nullptr) {
    *why += "capacity " + std::to_string(M) + (prefill ? " >= " : " < ") +
            std::to_string(kMxfp8WgmmaRowsPerExpert) + " x " + std::to_string(E) + " experts";
  }
  return prefill ? Mxfp8Kernel::wgmma : Mxfp8Kernel::decode;
}

const char* to_string(Mxfp8Kernel kernel) {
  return kernel == Mxfp8Kernel::wgmma ? "wgmma" : "decode";
}

std::string mxfp8_kernel_rule() {
  const char* env = std::getenv("EPMOE_MXFP8_KERNEL");
  return "wgmma when capacity rows M >= " + std::to_string(kMxfp8WgmmaRowsPerExpert) +
         " * E (E <= " + std::to_string(kMaxGroups) + "), else decode; EPMOE_MXFP8_KERNEL=" +
         (env == nullptr ? std::string("(unset: auto)") : std::string(env));
}

namespace {

// Quantizes the received rows of a_MK [capacity, K] (count and skip from the layout header) into
// the step's scratch, and returns the GEMM's groups, skip flag and A operand; B and the output are
// the caller's. Inference contexts have no layer plan: x_gathered, h13, h3 are the Step's buffers.
Mxfp8GroupedGemmArgs quantized_gemm(const Step& s, const bf16_t* a_MK, int64_t N, int64_t K) {
  EPMOE_CHECK_ARG(s.layer_plan == nullptr && !s.replay, "Step.layer_plan",
                  "none with mxfp8 (inference saves nothing)", "a layer plan");
  EPMOE_CHECK_ARG(s.mxfp8_scratch != nullptr, "Step.mxfp8_scratch",
                  "the quantized rows' scratch (mxfp8_scratch_layout)", "nullptr");
  const int64_t M = s.capacity_rows;
  const Mxfp8ScratchLayout l = mxfp8_scratch_layout(s.dims, M);
  uint8_t* codes_MK = reinterpret_cast<uint8_t*>(s.mxfp8_scratch + l.codes);
  uint8_t* scales_MS = reinterpret_cast<uint8_t*>(s.mxfp8_scratch + l.scales);
  mxfp8_quantize_rows_counted(a_MK, M, K, s.layout.header + kLayoutRows,
                              s.layout.header + kLayoutSkip, codes_MK, scales_MS, s.stream);
  Mxfp8GroupedGemmArgs a;
  a.a_codes_MK = codes_MK;
  a.a_scales_MS = scales_MS;
  a.offsets_E1 = s.layout.expert_offsets_E1;
  a.skip = s.layout.header + kLayoutSkip;
  a.E = s.dims.E;
  a.M = M;
  a.N = N;
  a.K = K;
  return a;
}

void run_gemm(const Mxfp8GroupedGemmArgs& a, void* stream) {
  if (mxfp8_kernel_for(a.M, a.E) == Mxfp8Kernel::wgmma) {
    mxfp8_grouped_gemm_wgmma(a, stream);
  } else {
    mxfp8_grouped_gemm(a, stream);
  }
}

}  // namespace

void mxfp8_w13_fprop(const Step& s) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Mxfp8GroupedGemmArgs a = quantized_gemm(s, s.x_gathered_MD, 2 * F, D);
  a.b_codes_ENK = s.w13_mx_EFD;
  a.b_scales_ENS = s.w13_mx_scales_EFS;
  a.out_MN = s.h13_M2F;
  a.ld_out = 2 * F;
  run_gemm(a, s.stream);
}

void mxfp8_w13_swiglu(const Step& s) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Mxfp8GroupedGemmArgs a = quantized_gemm(s, s.x_gathered_MD, 2 * F, D);
  a.b_codes_ENK = s.w13_mx_EFD;
  a.b_scales_ENS = s.w13_mx_scales_EFS;
  a.swiglu = true;
  a.act = s.act;
  a.out_MN = s.h_MF;
  a.ld_out = F;
  run_gemm(a, s.stream);
}

void mxfp8_w2_fprop(const Step& s, bool scatter) {
  const int64_t D = s.dims.D, F = s.dims.F;
  Mxfp8GroupedGemmArgs a = quantized_gemm(s, s.h_MF, D, F);
  a.b_codes_ENK = s.w2_mx_EDF;
  a.b_scales_ENS = s.w2_mx_scales_EDS;
  w2_rows_output(s, scatter, a);
  run_gemm(a, s.stream);
}

}  // namespace epmoe::cuda
