// GPU test support: host-prepared FP8 weights (fp8_block_fp32, RankCall's prepare_weights) of one
// rank's inputs, uploaded to cuda:0, for calls that pass w13_prepared / w2_prepared.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_call.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"

namespace epmoe::test {

struct DevicePrepared {
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
    for (TensorRef* t : {&w13.data, &w13.scales, &w2.data, &w2.scales}) t->device = Device::cuda(0);
  }
  ~DevicePrepared() {
    for (void* ptr : {(void*)w13_q, (void*)w13_s, (void*)w2_q, (void*)w2_s}) cudaFree(ptr);
  }
  DevicePrepared(const DevicePrepared&) = delete;
  DevicePrepared& operator=(const DevicePrepared&) = delete;

  PreparedWeights w13, w2;
  uint8_t *w13_q, *w2_q;
  float *w13_s, *w2_s;
};

}  // namespace epmoe::test
