// prepare_weights() for CUDA tensors: the codec launchers of formats.h on the caller's stream.
#include "core/formats/codecs.h"
#include "core/prepared_device.h"
#include "cuda/device_scope.h"
#include "cuda/formats/formats.h"

namespace epmoe {

void prepare_weights_cuda(const TensorRef& w_GNL, const PreparedWeights& p, void* stream) {
  cuda::DeviceScope scope(w_GNL.device.index);
  const bf16_t* w = w_GNL.as<bf16_t>();
  uint8_t* q = p.data.as<uint8_t>();
  switch (p.format) {
    case WeightFormat::fp8_block_fp32:
      cuda::fp8_quantize_weights(w, p.G, p.N, p.L, q, p.scales.as<float>(), stream);
      if (p.has_transposed()) {  // the DGRAD operand, as the per-call transpose makes it
        cuda::fp8_transpose_weights(q, p.scales.as<float>(), p.G, p.N, p.L, p.data_t.as<uint8_t>(),
                                    p.scales_t.as<float>(), stream);
      }
      return;
    case WeightFormat::fp8_block_ue8m0:
      cuda::fp8_quantize_weights(w, p.G, p.N, p.L, q, p.scales.as<uint8_t>(), stream);
      return;
    case WeightFormat::mxfp8:
      cuda::mxfp8_quantize_rows(w, p.G * p.N, p.L, q, p.scales.as<uint8_t>(), stream);
      return;
    case WeightFormat::nvfp4: {
      float* global = p.global_scale.as<float>();
      cuda::nvfp4_global_scales(w, p.G, p.G * p.N, p.L, global, stream);
      cuda::nvfp4_quantize_rows_prepared(w, p.G, p.G * p.N, p.L, global, q, p.scales.as<uint8_t>(),
                                         stream);
      cuda::nvfp4_codes_to_gemm_order(q, p.G * p.N, nvfp4_packed_bytes(p.L), stream);
      return;
    }
  }
}

}  // namespace epmoe
