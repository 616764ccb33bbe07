// EP = 1 on one GPU: the only rank is this process. Symmetric buffers are plain zero-filled device
// allocations whose peer table is {local}; barriers have nothing to wait for; the all-gather of
// one rank is a copy.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "cuda/check.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/transport.h"

namespace epmoe {
namespace {

class SingleGpuTransport final : public Transport {
 public:
  explicit SingleGpuTransport(int device) : device_(device) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return Device::cuda(device_); }

  SymmetricBuffer allocate_symmetric(std::size_t bytes, std::string_view /*tag*/) override {
    int previous = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&previous));
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaSuccess) err = cudaMemset(ptr, 0, bytes);
    if (err != cudaSuccess && ptr != nullptr) cudaFree(ptr);
    cudaSetDevice(previous);
    EPMOE_CUDA_CHECK(err);
    SymmetricBuffer b;
    b.local = ptr;
    b.peers = {ptr};
    b.bytes = bytes;
    b.handle = 0;
    return b;
  }

  void release_symmetric(SymmetricBuffer& buffer) override {
    if (buffer.local == nullptr) return;
    int previous = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&previous));
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    const cudaError_t err = cudaFree(buffer.local);
    cudaSetDevice(previous);
    EPMOE_CUDA_CHECK(err);
    buffer = SymmetricBuffer{};
  }

  // One rank: nothing to wait for. Stream order already makes this rank's writes visible to its
  // later kernels.
  void barrier(std::string_view /*tag*/, std::chrono::milliseconds /*budget*/) override {}
  void barrier_on_stream(void* /*stream*/, int /*channel*/, std::chrono::milliseconds /*budget*/,
                         Status* /*status*/) override {}

  void all_gather(const void* send, void* recv, std::size_t bytes,
                  std::chrono::milliseconds /*budget*/) override {
    if (bytes != 0) std::memcpy(recv, send, bytes);
  }

 private:
  int device_;
};

}  // namespace

std::shared_ptr<Transport> make_single_gpu_transport(int device) {
  const int count = cuda_device_count();
  EPMOE_EXPECT(device >= 0 && device < count, backend, "device",
               "a CUDA ordinal in [0, " + std::to_string(count) + ")", device);
  return std::make_shared<SingleGpuTransport>(device);
}

}  // namespace epmoe
