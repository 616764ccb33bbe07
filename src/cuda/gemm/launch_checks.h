// Host-side argument checks shared by the grouped GEMM launchers: device pointers, and the
// output destination of the weight-only kernels (rows, combine slots, or SwiGLU's h).
#pragma once

#include <cstdint>
#include <string>

#include "epmoe/error.h"

namespace epmoe::cuda::gemm {

inline void check_device_pointer(const void* p, const char* name, uintptr_t align) {
  EPMOE_CHECK_ARG(p != nullptr && reinterpret_cast<uintptr_t>(p) % align == 0, name,
                  "a non-null, " + std::to_string(align) + "-byte aligned device pointer",
                  reinterpret_cast<uintptr_t>(p));
}

// Args: the decode-shaped weight-only GEMMs' (MXFP8, NVFP4): one destination, combine slots
// (W2, no SwiGLU) or plain rows, SwiGLU taking gate rows [0, N/2) and up rows [N/2, N).
template <class Args>
void check_output_destination(const Args& a) {
  if (a.combine_R != nullptr) {
    EPMOE_CHECK_ARG(a.out_MN == nullptr, "out_MN", "nullptr with combine_R (one destination)",
                    "a pointer");
    EPMOE_CHECK_ARG(!a.swiglu, "swiglu", "false with combine_R (W2 has no SwiGLU)", "true");
    EPMOE_CHECK_ARG(a.T >= 1 && a.top_k >= 1, "T, top_k", ">= 1 with combine_R",
                    std::to_string(a.T) + ", " + std::to_string(a.top_k));
  } else if (a.swiglu) {
    EPMOE_CHECK_ARG(a.N % 2 == 0, "N", "even with swiglu (gate rows, then up rows)", a.N);
    EPMOE_CHECK_ARG(a.ld_out >= a.N / 2, "ld_out", ">= N / 2 with swiglu", a.ld_out);
  } else {
    EPMOE_CHECK_ARG(a.ld_out >= a.N, "ld_out", ">= N", a.ld_out);
  }
}

// The destination's pointers (only when rows exist: M > 0).
template <class Args>
void check_output_pointers(const Args& a, uintptr_t out_align) {
  if (a.combine_R != nullptr) {
    check_device_pointer(a.combine_R, "combine_R", 8);
    check_device_pointer(a.recv_src_M, "recv_src_M", 4);
  } else {
    check_device_pointer(a.out_MN, "out_MN", out_align);
  }
}

}  // namespace epmoe::cuda::gemm
