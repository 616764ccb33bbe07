#include "cuda/gemm/tensor_map.h"

#include <string>

#include "cuda/driver_entry.h"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    EncodeTiled f = nullptr;
    load_driver_entry(f, "cuTensorMapEncodeTiled");
    return f;
  }();
  return fn;
}

uint32_t element_bytes(CUtensorMapDataType type) {
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64: return 8;
    default: break;
  }
  EPMOE_CHECK_ARG(false, "TensorMap2d.type", "uint8, bfloat16, float16, float32 or uint64",
                  static_cast<int>(type));
  return 0;
}

}  // namespace

CUtensorMap make_tensor_map(const TensorMap2d& t, const char* name) {
  const std::string what = std::string(name) + " (TMA descriptor)";
  const auto addr = reinterpret_cast<uintptr_t>(t.base);
  EPMOE_CHECK_ARG(t.base != nullptr && addr % 16 == 0, what.c_str(), "a 16-byte aligned base", addr);
  EPMOE_CHECK_ARG(t.pitch_bytes % 16 == 0 && t.pitch_bytes > 0, what.c_str(),
                  "a row pitch that is a multiple of 16 bytes", t.pitch_bytes);
  EPMOE_CHECK_ARG(t.inner >= 1 && t.outer >= 1, what.c_str(), "a non-empty tensor",
                  std::to_string(t.outer) + " x " + std::to_string(t.inner));
  const uint32_t bytes = element_bytes(t.type);
  EPMOE_CHECK_ARG(t.box_inner >= 1 && t.box_inner <= 256 && t.box_outer >= 1 && t.box_outer <= 256 &&
                      (t.box_inner * bytes) % 16 == 0 && (!t.swizzle_128b || t.box_inner * bytes <= 128),
                  what.c_str(), "box sizes in 1..256, whole 16 bytes (swizzled: <= 128 bytes)",
                  std::to_string(t.box_outer) + " x " + std::to_string(t.box_inner));
  CUtensorMap map;
  const cuuint64_t dims[2] = {t.inner, t.outer};
  const cuuint64_t strides[1] = {t.pitch_bytes};
  const cuuint32_t box[2] = {t.box_inner, t.box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(
      &map, t.type, 2, const_cast<void*>(t.base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE,
      t.swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  EPMOE_EXPECT(r == CUDA_SUCCESS, backend, what.c_str(), "CUDA_SUCCESS from cuTensorMapEncodeTiled",
               static_cast<int>(r));
  return map;
}

}  // namespace epmoe::cuda
