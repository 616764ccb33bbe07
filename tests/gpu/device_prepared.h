// GPU test support: FP8 weights (fp8_block_fp32 with their transposed copies) of one rank's
// inputs on cuda:0, for calls that pass w13_prepared / w2_prepared: either prepared on the host
// (RankCall's prepare_weights) and uploaded, or prepared on the device (prepare_weights on CUDA)
// from bf16 weights already there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "device_call.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"

namespace epmoe::test {

struct DevicePrepared {
  // Host-prepared, uploaded.
  DevicePrepared(const Problem& p, const RankInputs& in) {
    Problem q = p;
    q.prepared_weights = true;
    const RankCall host(q, in);
    w13 = host.w13_prepared;
    w2 = host.w2_prepared;
    w13.data.data = w13_q = upload(host.w13_q);
    w13.scales.data = w13_s = upload(host.w13_scales);
    w2.data.data = w2_q = upload(host.w2_q);
    w2.scales.data = w2_s = upload(host.w2_scales);
    w13.data_t.data = w13_qt = upload(host.w13_qt);
    w13.scales_t.data = w13_st = upload(host.w13_scales_t);
    w2.data_t.data = w2_qt = upload(host.w2_qt);
    w2.scales_t.data = w2_st = upload(host.w2_scales_t);
    for (TensorRef* t : {&w13.data, &w13.scales, &w2.data, &w2.scales, &w13.data_t,
                         &w13.scales_t, &w2.data_t, &w2.scales_t}) {
      t->device = Device::cuda(0);
    }
  }
  // Prepared on the device from the bf16 weights w13_EFD / w2_EDF there (prepare_weights on
  // `stream`, then synchronized) into fresh buffers poisoned with 0xAA; refill() repeats it in
  // place.
  DevicePrepared(const Problem& p, const bf16_t* w13_EFD, const bf16_t* w2_EDF,
                 cudaStream_t stream)
      : w13_src(w13_EFD), w2_src(w2_EDF) {
    const int64_t E = p.local_experts(), D = p.hidden, F = p.intermediate;
    w13 = on_device(E, 2 * F, D, w13_q, w13_s, w13_qt, w13_st);
    w2 = on_device(E, D, F, w2_q, w2_s, w2_qt, w2_st);
    refill(stream);
  }
  void refill(cudaStream_t stream) const {
    ASSERT_NE(w13_src, nullptr) << "refill: prepared on the host";
    const auto bf16 = [](const bf16_t* w, const PreparedWeights& v) {
      return TensorRef::contiguous(const_cast<bf16_t*>(w), DType::bf16, {v.G, v.N, v.L},
                                   Device::cuda(0));
    };
    prepare_weights(bf16(w13_src, w13), w13, stream);
    prepare_weights(bf16(w2_src, w2), w2, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  ~DevicePrepared() {
    for (void* ptr : {(void*)w13_q, (void*)w13_s, (void*)w2_q, (void*)w2_s, (void*)w13_qt,
                      (void*)w13_st, (void*)w2_qt, (void*)w2_st}) {
      cudaFree(ptr);
    }
  }
  DevicePrepared(const DevicePrepared&) = delete;
  DevicePrepared& operator=(const DevicePrepared&) = delete;

  PreparedWeights w13, w2;
  uint8_t *w13_q = nullptr, *w2_q = nullptr, *w13_qt = nullptr, *w2_qt = nullptr;
  float *w13_s = nullptr, *w2_s = nullptr, *w13_st = nullptr, *w2_st = nullptr;

 private:
  static PreparedWeights on_device(int64_t E, int64_t N, int64_t L, uint8_t*& q, float*& s,
                                   uint8_t*& qt, float*& st) {
    const PreparedWeightShapes sh = prepared_weight_shapes(WeightFormat::fp8_block_fp32, E, N, L);
    PreparedWeights v{WeightFormat::fp8_block_fp32, E, N, L, sh.data, sh.scales, {},
                      sh.data_t, sh.scales_t};
    q = upload(std::vector<uint8_t>(static_cast<size_t>(sh.data.numel()), 0xAA));
    qt = upload(std::vector<uint8_t>(static_cast<size_t>(sh.data_t.numel()), 0xAA));
    s = upload(std::vector<float>(static_cast<size_t>(sh.scales.numel()), -1.0f));
    st = upload(std::vector<float>(static_cast<size_t>(sh.scales_t.numel()), -1.0f));
    v.data.data = q;
    v.scales.data = s;
    v.data_t.data = qt;
    v.scales_t.data = st;
    for (TensorRef* t : {&v.data, &v.scales, &v.data_t, &v.scales_t}) t->device = Device::cuda(0);
    return v;
  }

  const bf16_t* w13_src = nullptr;
  const bf16_t* w2_src = nullptr;
};

}  // namespace epmoe::test
