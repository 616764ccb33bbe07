// 2-D TMA descriptors for the hand-written kernels (the CUTLASS GEMMs make theirs through CuTe).
// cuTensorMapEncodeTiled comes from the driver through cudaGetDriverEntryPointByVersion:
// libepmoe never links libcuda (src/cuda/CMakeLists.txt).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace epmoe::cuda {

// A row-major [outer, inner] tensor of `type` elements, rows `pitch_bytes` apart, read in boxes
// of box_outer rows x box_inner elements (dense in shared memory, or 128-byte swizzled).
// Out-of-bounds box elements read as zero. Checked (Error naming `name`): base 16-byte aligned,
// pitch a multiple of 16, box sizes in 1..256 (swizzled: box_inner * element size <= 128), and
// the driver's own result.
struct TensorMap2d {
  const void* base = nullptr;
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  uint64_t inner = 0, outer = 0, pitch_bytes = 0;
  uint32_t box_inner = 0, box_outer = 0;
  bool swizzle_128b = false;
};
CUtensorMap make_tensor_map(const TensorMap2d& t, const char* name);

}  // namespace epmoe::cuda
