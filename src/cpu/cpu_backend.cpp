// CPU backend: host memory (128-byte aligned, zero-filled) and the factory. Stages live in
// stages_forward.cpp and stages_backward.cpp.
#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "epmoe/error.h"
#include "epmoe/memory_plan.h"

namespace epmoe {

namespace cpu {

void* CpuBackend::allocate(std::size_t bytes) {
  // The arena is carved at 128-byte offsets; aligned_alloc needs a multiple of the alignment.
  const auto padded =
      static_cast<std::size_t>(align_bytes(static_cast<int64_t>(std::max<std::size_t>(bytes, 1))));
  void* p = std::aligned_alloc(static_cast<std::size_t>(kAlignment), padded);
  EPMOE_EXPECT(p != nullptr, backend, "host memory", detail::concat(padded, " allocatable bytes"),
               "an allocation failure");
  std::memset(p, 0, padded);
  return p;
}

void CpuBackend::release(void* ptr) { std::free(ptr); }

Backend::HostBacked CpuBackend::allocate_host_backed(std::size_t device_bytes,
                                                     std::size_t host_bytes) {
  return {allocate(device_bytes + host_bytes), device_bytes, host_bytes};
}

void CpuBackend::release_host_backed(void* ptr) { release(ptr); }

void CpuBackend::copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void CpuBackend::copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void CpuBackend::synchronize(void* /*stream*/) {}  // every stage has finished when it returns

}  // namespace cpu

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu::CpuBackend>(); }

}  // namespace epmoe
