// CPU reference of the NVFP4 weight-only inference path (Config.precision = nvfp4): the W13 and
// W2 stages read each expert's weight decoded by the codec (core/formats/nvfp4.h: E2M1 element
// x (E4M3 block scale x fp32 global scale)) from the prepared code order
// (core/formats/nvfp4_gemm_order.h), then run the bf16 path's fp32 row loops on it.
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "cpu/cpu_backend.h"

namespace epmoe::cpu {

namespace {

// Expert e of an NVFP4 weight [E, N, L] decoded into fp32 [N, L] (codes and scales back in the
// codec's order first).
std::vector<float> decode_expert(const uint8_t* q_ENP, const uint8_t* scales_ECN8,
                                 const float* global_E, int e, int64_t N, int64_t L) {
  const int64_t P = nvfp4_packed_bytes(L), S = scale_blocks(L, kNvfp4Block);
  const int64_t C = nvfp4_scale_chunks(L);
  std::vector<uint8_t> q_NP(q_ENP + e * N * P, q_ENP + (e + 1) * N * P);
  nvfp4_codes_to_codec_order(q_NP.data(), N, P);
  std::vector<uint8_t> scales_NS(static_cast<size_t>(N * S));
  nvfp4_scales_to_codec_order(scales_ECN8 + e * C * N * kNvfp4ChunkBlocks, 1, N, L, scales_NS.data());
  std::vector<float> w_NL(static_cast<size_t>(N * L));
  nvfp4_dequantize_rows(q_NP.data(), scales_NS.data(), global_E + e, 1, N, L, w_NL.data());
  return w_NL;
}

}  // namespace

std::vector<float> nvfp4_w13_of(const Step& s, int e) {
  return decode_expert(s.w13_nvfp4_EFP, s.w13_nvfp4_scales, s.w13_nvfp4_global_E, e,
                       2 * s.dims.F, s.dims.D);
}

std::vector<float> nvfp4_w2_of(const Step& s, int e) {
  return decode_expert(s.w2_nvfp4_EDP, s.w2_nvfp4_scales, s.w2_nvfp4_global_E, e, s.dims.D,
                       s.dims.F);
}

}  // namespace epmoe::cpu
