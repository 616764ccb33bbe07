#include "epmoe/tensor.h"

#include <sstream>

#include "epmoe/error.h"

namespace epmoe {

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::u8:
    case DType::f8e4m3: return 1;
  }
  return 0;
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::f8e4m3: return "f8e4m3";
  }
  return "?";
}

std::string to_string(const Device& device) {
  return device.type == DeviceType::cpu ? std::string("cpu")
                                        : "cuda:" + std::to_string(device.index);
}

TensorRef TensorRef::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                Device device) {
  EPMOE_CHECK_ARG(shape.size() <= kMaxDims, "shape", "at most 4 dimensions", shape.size());
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t v : shape) t.shape[i++] = v;
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = s;
    s *= t.shape[d];
  }
  return t;
}

int64_t TensorRef::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorRef::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

namespace {
std::string dims_string(const std::array<int64_t, TensorRef::kMaxDims>& v, int n) {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < n; ++d) os << (d ? ", " : "") << v[d];
  os << ']';
  return os.str();
}
}  // namespace

std::string TensorRef::shape_string() const { return dims_string(shape, ndim); }
std::string TensorRef::stride_string() const { return dims_string(stride, ndim); }

}  // namespace epmoe
