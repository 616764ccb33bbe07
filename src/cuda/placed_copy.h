// Copies between a layer's placed buffer (cuda/placed.h: in its slot at an offset only the device
// knows) and a plain one: the FP8 GEMM builds its TMA descriptors on the host, so its operands and
// outputs are the call scratch's, copied from and to the layer's places around it. Launchers only.
#pragma once

#include <cstdint>

#include "cuda/placed.h"

namespace epmoe::cuda {

// Copies the first bytes of src to dst as 16-byte vectors: rows * row_bytes of them, or
// fp8_rows_bytes(rows, fp8_L) (E4M3 rows + their S-major scales) when fp8_L > 0, with rows the
// layout's received rows (clamped to capacity). Nothing when both are the same address, the step
// is skipped (header) or *replay_skip != 0 (nullable). The grid is sized for capacity (graphs).
void copy_placed_rows(const Placed& src, const Placed& dst, const int32_t* header, int64_t capacity,
                      int64_t row_bytes, int64_t fp8_L, const int32_t* replay_skip, void* stream);

}  // namespace epmoe::cuda
