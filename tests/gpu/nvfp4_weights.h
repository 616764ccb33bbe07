// GPU test support: NVFP4 prepared weights of one rank's inputs, prepared on the host (what the
// CPU backend reads) and uploaded to the calling thread's current device, cuda:device (what the
// CUDA backend reads: the same bytes), and the nvfp4 config of a bf16 Problem.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "device_call.h"
#include "epmoe/config.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"

namespace epmoe::test {

// One NVFP4 weight [E, N, L].
struct Nvfp4Weight {
  Nvfp4Weight(const std::vector<bf16_t>& w_ENL, int64_t E, int64_t N, int64_t L,
              int ordinal = 0) {
    const PreparedWeightShapes s = prepared_weight_shapes(WeightFormat::nvfp4, E, N, L);
    q.assign(static_cast<size_t>(s.data.numel()), 0);
    scales.assign(static_cast<size_t>(s.scales.numel()), 0);
    global.assign(static_cast<size_t>(E), 0.0f);
    host = PreparedWeights{WeightFormat::nvfp4, E, N, L, s.data, s.scales, s.global_scale, {}, {}};
    host.data.data = q.data();
    host.scales.data = scales.data();
    host.global_scale.data = global.data();
    std::vector<bf16_t> w = w_ENL;  // prepare_weights takes a mutable view
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {E, N, L}), host);
    device = host;
    device.data.data = dq = upload(q);
    device.scales.data = ds = upload(scales);
    device.global_scale.data = dg = upload(global);
    for (TensorRef* t : {&device.data, &device.scales, &device.global_scale}) {
      t->device = Device::cuda(ordinal);
    }
  }
  ~Nvfp4Weight() {
    cudaFree(dq);
    cudaFree(ds);
    cudaFree(dg);
  }
  Nvfp4Weight(const Nvfp4Weight&) = delete;
  Nvfp4Weight& operator=(const Nvfp4Weight&) = delete;

  std::vector<uint8_t> q, scales;
  std::vector<float> global;
  PreparedWeights host, device;
  uint8_t *dq = nullptr, *ds = nullptr;
  float* dg = nullptr;
};

// Both weights of one rank.
struct Nvfp4Weights {
  Nvfp4Weights(const Problem& p, const RankInputs& in, int ordinal = 0)
      : w13(in.w13_EFD, p.local_experts(), 2 * p.intermediate, p.hidden, ordinal),
        w2(in.w2_EDF, p.local_experts(), p.hidden, p.intermediate, ordinal) {}
  Nvfp4Weight w13, w2;
};

// The problem's config with precision nvfp4 (a Problem keeps bf16: RankCall would prepare FP8
// copies for prepared_weights; the NVFP4 ones are built here).
inline Config nvfp4_config(const Problem& p) {
  ConfigFields f = p.config().fields();
  f.precision = Precision::nvfp4;
  f.inference = true;
  f.prepared_weights = true;
  return Config(f);
}

}  // namespace epmoe::test
