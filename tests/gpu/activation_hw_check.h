// Device-side check of swiglu_backward_and_forward (core/activation.h) against the two calls it
// stands for, swiglu_backward and swiglu_forward (h is the one computed apart), compiled by nvcc
// with the library's flags (its contraction and math library). Plain C++ interface; the kernel is
// in activation_hw_check.cu.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/activation.h"

namespace epmoe::test {

struct ActivationMismatch {
  uint64_t count = 0;   // elements where any of h, d_gate, d_up differs in bits (NaN == NaN)
  int64_t first = -1;   // first such element
  std::string error;    // a CUDA error, empty on success
};

// For every i: (h, d_gate, d_up) from the one-sigmoid function against the two calls, on the GPU.
ActivationMismatch swiglu_both_ways_on_device(const std::vector<float>& gate, const std::vector<float>& up,
                                              const std::vector<float>& dh, const ActivationParams& p);

}  // namespace epmoe::test
