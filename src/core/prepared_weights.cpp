// prepare_weights(): host codecs for CPU tensors, the CUDA codec kernels for device tensors.
#include "epmoe/prepared_weights.h"

#include <string>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "core/numeric.h"
#include "core/prepared_device.h"
#include "core/validate.h"
#include "cpu/fp8_steps.h"
#include "epmoe/error.h"

namespace epmoe {

const char* to_string(WeightFormat format) {
  switch (format) {
    case WeightFormat::fp8_block_fp32: return "fp8_block_fp32";
    case WeightFormat::fp8_block_ue8m0: return "fp8_block_ue8m0";
    case WeightFormat::mxfp8: return "mxfp8";
    case WeightFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

PreparedWeightShapes prepared_weight_shapes(WeightFormat format, int64_t G, int64_t N, int64_t L) {
  check_codec_weights(G, N, L);
  PreparedWeightShapes s;
  switch (format) {
    case WeightFormat::fp8_block_fp32:
    case WeightFormat::fp8_block_ue8m0: {
      const DType scale = format == WeightFormat::fp8_block_fp32 ? DType::f32 : DType::u8;
      s.data = TensorRef::contiguous(nullptr, DType::u8, {G, N, L});
      const int64_t B = scale_blocks(N, kFp8WeightBlock), S = scale_blocks(L, kFp8WeightBlock);
      s.scales = TensorRef::contiguous(nullptr, scale, {G, B, S});
      if (format == WeightFormat::fp8_block_fp32) {
        s.data_t = TensorRef::contiguous(nullptr, DType::u8, {G, L, N});
        s.scales_t = TensorRef::contiguous(nullptr, DType::f32, {G, S, B});
      }
      return s;
    }
    case WeightFormat::mxfp8:
      s.data = TensorRef::contiguous(nullptr, DType::u8, {G, N, L});
      s.scales = TensorRef::contiguous(nullptr, DType::u8, {G, N, scale_blocks(L, kMxBlock)});
      return s;
    case WeightFormat::nvfp4:
      s.data = TensorRef::contiguous(nullptr, DType::u8, {G, N, nvfp4_packed_bytes(L)});
      s.scales = TensorRef::contiguous(nullptr, DType::u8,
                                       {G, nvfp4_scale_chunks(L), N, kNvfp4ChunkBlocks});
      s.global_scale = TensorRef::contiguous(nullptr, DType::f32, {G});
      return s;
  }
  EPMOE_CHECK_ARG(false, "format", "a WeightFormat", static_cast<int>(format));
  return s;
}

namespace {

void check_like(const TensorRef& got, const TensorRef& want, const std::string& name,
                const Device& device) {
  const int64_t* d = want.shape.data();
  switch (want.ndim) {
    case 1: check_tensor(got, name.c_str(), {want.dtype}, {d[0]}, device); break;
    case 3: check_tensor(got, name.c_str(), {want.dtype}, {d[0], d[1], d[2]}, device); break;
    case 4: check_tensor(got, name.c_str(), {want.dtype}, {d[0], d[1], d[2], d[3]}, device); break;
    default: EPMOE_ASSERT(false);
  }
}

}  // namespace

void check_prepared_weights(const PreparedWeights& p, const char* name, const Device& device) {
  const PreparedWeightShapes s = prepared_weight_shapes(p.format, p.G, p.N, p.L);
  const std::string n = name;
  check_like(p.data, s.data, n + ".data", device);
  check_like(p.scales, s.scales, n + ".scales", device);
  if (s.global_scale.ndim > 0) check_like(p.global_scale, s.global_scale, n + ".global_scale", device);
  if (!p.has_transposed()) return;
  EPMOE_CHECK_ARG(s.data_t.ndim > 0, n + ".data_t",
                  "none (the transposed copy is fp8_block_fp32 only)", to_string(p.format));
  check_like(p.data_t, s.data_t, n + ".data_t", device);
  check_like(p.scales_t, s.scales_t, n + ".scales_t", device);
}

void prepare_weights(const TensorRef& w_GNL, const PreparedWeights& p, void* stream) {
  check_prepared_weights(p, "prepared", w_GNL.device);
  check_tensor(w_GNL, "w_GNL", {DType::bf16}, {p.G, p.N, p.L}, w_GNL.device);
  const bf16_t* w = w_GNL.as<bf16_t>();
  if (p.G == 0) return;  // nothing to quantize (and no group for the NVFP4 global)
  if (w_GNL.device.type == DeviceType::cuda) {
    prepare_weights_cuda(w_GNL, p, stream);
    return;
  }
  // bf16 widens exactly: the host codecs take fp32.
  std::vector<float> x(static_cast<size_t>(w_GNL.numel()));
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_to_float(w[i]);
  uint8_t* q = p.data.as<uint8_t>();
  switch (p.format) {
    case WeightFormat::fp8_block_fp32:
      fp8_quantize_weights(x.data(), p.G, p.N, p.L, q, p.scales.as<float>());
      if (p.has_transposed()) {  // the DGRAD operand, as the per-call transpose makes it
        cpu::fp8_transpose_weights(q, p.scales.as<float>(), p.G, p.N, p.L, p.data_t.as<uint8_t>(),
                                   p.scales_t.as<float>());
      }
      return;
    case WeightFormat::fp8_block_ue8m0:
      fp8_quantize_weights(x.data(), p.G, p.N, p.L, q, p.scales.as<uint8_t>());
      return;
    case WeightFormat::mxfp8:
      mxfp8_quantize_rows(x.data(), p.G * p.N, p.L, q, p.scales.as<uint8_t>());
      return;
    case WeightFormat::nvfp4: {
      // One global scale per expert: groups = G over the G * N rows.
      float* global = p.global_scale.as<float>();
      nvfp4_global_scales(x.data(), p.G, p.G * p.N, p.L, global);
      std::vector<uint8_t> scales_GNS(static_cast<size_t>(p.G * p.N * scale_blocks(p.L, kNvfp4Block)));
      nvfp4_quantize_rows(x.data(), p.G, p.G * p.N, p.L, global, q, scales_GNS.data());
      // The GEMM's order (core/formats/nvfp4_gemm_order.h).
      nvfp4_codes_to_gemm_order(q, p.G * p.N, nvfp4_packed_bytes(p.L));
      nvfp4_scales_to_gemm_order(scales_GNS.data(), p.G, p.N, p.L, p.scales.as<uint8_t>());
      return;
    }
  }
}

}  // namespace epmoe
