// Host checks of the arguments of one call: dtype, shape, strides, device. Each failure throws
// Error(invalid_argument) naming the argument with the expected and the actual value.
#pragma once

#include "epmoe/config.h"
#include "epmoe/context.h"

namespace epmoe {

// One tensor argument: non-null, one of `dtypes`, exactly `shape`, contiguous, on `device`.
void check_tensor(const TensorRef& t, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape, const Device& device);

// Returns T' (rows of this call).
int64_t validate_forward(const ForwardArgs& a, const Config& c, int ep_size, const Device& device);
void validate_backward(const BackwardArgs& a, const Config& c, int ep_size, const Device& device);

}  // namespace epmoe
