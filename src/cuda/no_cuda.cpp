// Built when epmoe is configured without CUDA.
#include "core/backend.h"
#include "core/prepared_device.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"

namespace epmoe {

int cuda_device_count() { return 0; }

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal) {
  EPMOE_EXPECT(false, backend, "Device", "a build with the CUDA backend (EPMOE_CUDA=ON)",
               "a CPU-only build asked for cuda:" + std::to_string(device_ordinal));
  return nullptr;
}

std::shared_ptr<Transport> make_single_gpu_transport(int device) {
  EPMOE_EXPECT(false, backend, "Device", "a build with the CUDA backend (EPMOE_CUDA=ON)",
               "a CPU-only build asked for cuda:" + std::to_string(device));
  return nullptr;
}

void prepare_weights_cuda(const TensorRef& w_GNL, const PreparedWeights& /*prepared*/,
                          void* /*stream*/) {
  EPMOE_EXPECT(false, backend, "w_GNL", "a build with the CUDA backend (EPMOE_CUDA=ON)",
               "a CPU-only build asked for cuda:" + std::to_string(w_GNL.device.index));
}

std::string explain_cuda_kernels(const Config& /*config*/, int /*ep_size*/) {
  EPMOE_EXPECT(false, backend, "explain_cuda_kernels", "a build with the CUDA backend (EPMOE_CUDA=ON)",
               "a CPU-only build");
  return {};
}

}  // namespace epmoe
