// The CUDA backend: every stage enqueues one or two kernel launches on (cudaStream_t)Step::stream,
// with no host synchronisation and no allocation (CUDA-graph capturable). Memory functions are
// blocking. No CUDA types in this header.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "cuda/host_backed_arena.h"
#include "cuda/stream_fork.h"

namespace epmoe::cuda {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_ordinal);

  Device device() const override { return Device::cuda(ordinal_); }
  const char* name() const override { return "cuda"; }
  // The kernels read x_gathered, h13, h3 at arena + the layer plan's offsets (cuda/placed.h; the
  // GEMMs through one descriptor over the arena plus a row shift read on the device).
  bool places_saved_state() const override { return true; }
  // 16-byte rows (D % 8, F % 8), E*R within the route kernels' limit, encode_src in int32.
  void validate(const Config& config, int ep_size) const override;

  void* allocate(std::size_t bytes) override;
  void release(void* ptr) override;
  // One VMM range: device memory, then pinned host memory (cuda/host_backed_arena.h).
  HostBacked allocate_host_backed(std::size_t device_bytes, std::size_t host_bytes) override;
  void release_host_backed(void* ptr) override;
  void copy_to_device(void* dst, const void* src, std::size_t bytes) override;
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override;
  void synchronize(void* stream) override;

  void publish_forward(const Step& s) override;
  void route(const Step& s) override;
  void plan_forward(const Step& s) override;
  void save_input(const Step& s) override;
  void dispatch(const Step& s) override;
  void w13_gemm(const Step& s) override;
  void swiglu_forward(const Step& s) override;
  void w13_swiglu(const Step& s) override;
  void w2_gemm(const Step& s) override;
  void scatter_rows(const Step& s) override;
  void w2_scatter(const Step& s) override;
  void combine_send_forward(const Step& s) override;
  void combine_send_backward(const Step& s) override;
  void reduce_forward(const Step& s) override;

  void plan_backward(const Step& s) override;
  void restore_input(const Step& s) override;
  void publish_backward(const Step& s) override;
  void grad_scores(const Step& s) override;
  void gather_grad(const Step& s) override;
  void w2_dgrad(const Step& s) override;
  void swiglu_backward(const Step& s) override;
  void w2_dgrad_swiglu(const Step& s) override;
  void w2_wgrad(const Step& s) override;
  void w13_dgrad(const Step& s) override;
  void w13_dgrad_scatter(const Step& s) override;
  void w13_wgrad(const Step& s) override;
  void reduce_backward(const Step& s) override;

 private:
  int ordinal_;
  std::vector<HostBackedArena> host_backed_;  // live allocate_host_backed ranges
  std::unique_ptr<StreamFork> fork_;          // the NVFP4 GEMM's wide launch beside the narrow one
};

}  // namespace epmoe::cuda
