// Per-rank combine (Config.combine = per_rank): which ranks hold a partial row of a token, in the
// order the owner sums them. One definition for the CPU reference and the CUDA reduce kernels.
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace epmoe {

// The smallest rank above `after` that holds one of token t's active routes (ids_K: the token's
// published global expert ids, -1 = inactive; E = local experts per rank), or -1 when none is
// left. Walking after = -1, then the returned rank, visits every rank with a partial once, in
// ascending order (K^2 id reads per token at most).
EPMOE_HD int next_partial_rank(const int32_t* ids_K, int K, int E, int after) {
  int next = -1;
  for (int k = 0; k < K; ++k) {
    if (ids_K[k] < 0) continue;
    const int q = ids_K[k] / E;
    if (q > after && (next < 0 || q < next)) next = q;
  }
  return next;
}

}  // namespace epmoe
