// copy_placed_rows (placed_copy.h): a grid-stride copy of 16-byte vectors, its length and both
// addresses read on the device.
#include "cuda/placed_copy.h"

#include <algorithm>

#include "core/fp8_terms.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

struct CopyParams {
  Placed src, dst;
  const int32_t* header;
  const int32_t* replay_skip;
  int64_t capacity, row_bytes, fp8_L;
};

__global__ void __launch_bounds__(kThreads) copy_placed_kernel(const CopyParams p) {
  if (layout_skip(p.header) || replay_skipped(p.replay_skip)) return;
  const uint4* src = p.src.get<const uint4>();
  uint4* dst = p.dst.get<uint4>();
  if (src == nullptr || dst == nullptr || src == dst) return;
  const int64_t rows = layout_rows(p.header, p.capacity);
  const int64_t bytes = p.fp8_L > 0 ? fp8_rows_bytes(rows, p.fp8_L) : rows * p.row_bytes;
  const int64_t vecs = bytes / 16;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs; i += stride) {
    dst[i] = src[i];
  }
}

}  // namespace

void copy_placed_rows(const Placed& src, const Placed& dst, const int32_t* header, int64_t capacity,
                      int64_t row_bytes, int64_t fp8_L, const int32_t* replay_skip, void* stream) {
  EPMOE_CHECK_ARG(row_bytes % 16 == 0 && row_bytes >= 0, "row_bytes", "a multiple of 16",
                  row_bytes);
  check_aligned16(src.base, "src");
  check_aligned16(dst.base, "dst");
  CopyParams p{src, dst, header, replay_skip, capacity, row_bytes, fp8_L};
  const int64_t most = std::max(capacity * row_bytes, fp8_L > 0 ? fp8_rows_bytes(capacity, fp8_L) : 0);
  copy_placed_kernel<<<grid_for(most / 16, kThreads), kThreads, 0,
                       static_cast<cudaStream_t>(stream)>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
