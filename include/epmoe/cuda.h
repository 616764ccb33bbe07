// CUDA entry points of the public API (no CUDA types). In a build without the CUDA backend,
// cuda_device_count() returns 0 and the factories throw Error(backend).
#pragma once

#include <memory>
#include <string>

#include "epmoe/config.h"
#include "epmoe/transport.h"

namespace epmoe {

// Number of CUDA devices epmoe can use (0 without a driver, a GPU or the CUDA backend).
int cuda_device_count();

// EP = 1 on one GPU: a transport whose single rank computes on cuda:device. Symmetric buffers
// are plain device allocations; barriers are no-ops.
std::shared_ptr<Transport> make_single_gpu_transport(int device);

// The kernel each grouped GEMM of `config` at `ep_size` runs on the CUDA backend (tile, schedule,
// cluster, the WGRAD's stores, the FP8 kernels' tiles), each with the rule or environment override
// that chose it and the values it read: the launchers' own selectors, evaluated now on the host
// (no GPU needed). Error(invalid_argument) as plan_memory or a malformed override would throw it.
std::string explain_cuda_kernels(const Config& config, int ep_size);

}  // namespace epmoe
