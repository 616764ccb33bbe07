// at::Tensor -> epmoe::TensorRef, and the caller's current stream. The only place besides the op
// files where torch types meet epmoe types.
#pragma once

#include <ATen/Tensor.h>

#include "epmoe/tensor.h"

namespace epmoe::torch_binding {

// A view of `t` (no copy). Throws epmoe::Error naming `name` for dtypes or ranks epmoe cannot
// describe; shape, contiguity and device are checked by the library call that receives it.
TensorRef ref(const at::Tensor& t, const char* name);
// Same for an optional tensor: an empty TensorRef (data == nullptr) when absent.
TensorRef ref(const c10::optional<at::Tensor>& t, const char* name);

epmoe::Device device_of(const c10::Device& d);
c10::Device torch_device(const epmoe::Device& d);

// The current CUDA stream of `device` as cudaStream_t (nullptr for the CPU). Resolved through the
// AOTI C shim so this file needs no CUDA headers.
void* current_stream(const epmoe::Device& device);

}  // namespace epmoe::torch_binding
