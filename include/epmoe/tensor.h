// TensorRef: a non-owning view (pointer, dtype, shape, strides in elements, device) used at the API
// boundary. epmoe never allocates or frees the memory a TensorRef points at.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace epmoe {

enum class DType : int { bf16, f16, f32, f64, i32, i64, u8, f8e4m3 };

std::size_t element_size(DType dtype);
const char* to_string(DType dtype);

enum class DeviceType : int { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU
  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int ordinal) { return {DeviceType::cuda, ordinal}; }
  bool operator==(const Device&) const = default;
};
std::string to_string(const Device& device);

struct TensorRef {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::bf16;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // in elements
  Device device{};

  // Contiguous (row-major) view.
  static TensorRef contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                              Device device = Device::cpu());

  int64_t numel() const;
  bool is_contiguous() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype); }
  std::string shape_string() const;   // "[64, 128]"
  std::string stride_string() const;  // "[128, 1]"
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace epmoe
