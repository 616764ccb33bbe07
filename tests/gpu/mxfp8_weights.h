// GPU test support: MXFP8 prepared weights of one rank's inputs, prepared on the host (what the
// CPU backend reads) and uploaded to cuda:device (what the CUDA backend reads: the same bytes),
// and the mxfp8 config of a bf16 Problem.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "device_call.h"
#include "epmoe/config.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"

namespace epmoe::test {

// One MXFP8 weight [E, N, L].
struct Mxfp8Weight {
  Mxfp8Weight(const std::vector<bf16_t>& w_ENL, int64_t E, int64_t N, int64_t L,
              int ordinal = 0) {
    const PreparedWeightShapes s = prepared_weight_shapes(WeightFormat::mxfp8, E, N, L);
    q.assign(static_cast<size_t>(s.data.numel()), 0);
    scales.assign(static_cast<size_t>(s.scales.numel()), 0);
    host = PreparedWeights{WeightFormat::mxfp8, E, N, L, s.data, s.scales, {}, {}, {}};
    host.data.data = q.data();
    host.scales.data = scales.data();
    std::vector<bf16_t> w = w_ENL;  // prepare_weights takes a mutable view
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {E, N, L}), host);
    device = host;
    device.data.data = dq = upload(q);
    device.scales.data = ds = upload(scales);
    for (TensorRef* t : {&device.data, &device.scales}) t->device = Device::cuda(ordinal);
  }
  ~Mxfp8Weight() {
    cudaFree(dq);
    cudaFree(ds);
  }
  Mxfp8Weight(const Mxfp8Weight&) = delete;
  Mxfp8Weight& operator=(const Mxfp8Weight&) = delete;

  std::vector<uint8_t> q, scales;
  PreparedWeights host, device;
  uint8_t *dq = nullptr, *ds = nullptr;
};

// Both weights of one rank.
struct Mxfp8Weights {
  Mxfp8Weights(const Problem& p, const RankInputs& in, int ordinal = 0)
      : w13(in.w13_EFD, p.local_experts(), 2 * p.intermediate, p.hidden, ordinal),
        w2(in.w2_EDF, p.local_experts(), p.hidden, p.intermediate, ordinal) {}
  Mxfp8Weight w13, w2;
};

// The problem's config with precision mxfp8 (a Problem keeps bf16; the MXFP8 weights are built
// here).
inline Config mxfp8_config(const Problem& p) {
  ConfigFields f = p.config().fields();
  f.precision = Precision::mxfp8;
  f.inference = true;
  f.prepared_weights = true;
  return Config(f);
}

}  // namespace epmoe::test
