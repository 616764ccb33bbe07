// Exhaustive device-side cross-checks of the element codecs against CUDA's own conversions
// (cuda_fp8.h / cuda_fp4.h; on sm_90 the fp8 encode is the hardware cvt.rn.satfinite.e4m3x2.f32).
// Plain C++ interface; the kernels are in formats_hw_check.cu.
#pragma once

#include <cstdint>

namespace epmoe::test {

struct HwMismatches {
  uint64_t count = 0;         // inputs whose codes differ
  uint32_t first_input = 0;   // smallest differing input (fp32 bits, or the code for decodes)
  uint32_t ours = 0, theirs = 0;  // the two results for first_input
};

// e4m3_from_float vs __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) for every fp32 bit pattern.
HwMismatches e4m3_encode_vs_cuda_all_floats();
// e2m1_from_float vs __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest) for every fp32 bit pattern.
HwMismatches e2m1_encode_vs_cuda_all_floats();
// e4m3_to_float vs __nv_cvt_fp8_to_halfraw for the 256 codes, e2m1_to_float vs
// __nv_cvt_fp4_to_halfraw for the 16 codes (as fp32 bits; every NaN counts as equal).
HwMismatches e4m3_e2m1_decode_vs_cuda();

}  // namespace epmoe::test
