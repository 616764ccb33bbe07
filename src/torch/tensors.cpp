#include "torch/tensors.h"

#include <dlfcn.h>

#include <string>

#include "epmoe/error.h"

namespace epmoe::torch_binding {

namespace {

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kByte: return DType::u8;
    default: break;
  }
  EPMOE_CHECK_ARG(false, name, "dtype bfloat16, float16, float32, float64, int32, int64 or uint8",
                  std::string(c10::toString(t.scalar_type())));
}

}  // namespace

epmoe::Device device_of(const c10::Device& d) {
  if (d.is_cuda()) return epmoe::Device::cuda(d.index() < 0 ? 0 : d.index());
  EPMOE_CHECK_ARG(d.is_cpu(), "device", "cpu or cuda", d.str());
  return epmoe::Device::cpu();
}

c10::Device torch_device(const epmoe::Device& d) {
  if (d.type == DeviceType::cuda) return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.index));
  return c10::Device(c10::kCPU);
}

TensorRef ref(const at::Tensor& t, const char* name) {
  EPMOE_CHECK_ARG(t.defined(), name, "a tensor", "an undefined tensor");
  EPMOE_CHECK_ARG(t.dim() <= TensorRef::kMaxDims, name,
                  "at most " + std::to_string(TensorRef::kMaxDims) + " dimensions", t.dim());
  TensorRef r;
  r.data = t.data_ptr();
  r.dtype = dtype_of(t, name);
  r.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < r.ndim; ++d) {
    r.shape[d] = t.size(d);
    r.stride[d] = t.stride(d);
  }
  r.device = device_of(t.device());
  return r;
}

TensorRef ref(const c10::optional<at::Tensor>& t, const char* name) {
  if (!t.has_value() || !t->defined()) return TensorRef{};
  return ref(*t, name);
}

void* current_stream(const epmoe::Device& device) {
  if (device.type != DeviceType::cuda) return nullptr;
  // int aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream), in
  // libtorch_cuda (already loaded by `import torch` on CUDA builds).
  using Fn = int (*)(int32_t, void**);
  static Fn fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream"));
  EPMOE_EXPECT(fn != nullptr, backend, "torch", "a CUDA build of torch (libtorch_cuda loaded)",
               "no aoti_torch_get_current_cuda_stream symbol");
  void* stream = nullptr;
  EPMOE_EXPECT(fn(device.index, &stream) == 0, backend, "torch",
               "the current CUDA stream of cuda:" + std::to_string(device.index), "an error");
  return stream;
}

}  // namespace epmoe::torch_binding
