// The CUDA half of prepare_weights() (src/cuda/formats/prepared_weights.cpp; no_cuda.cpp throws
// Error(backend) in a CPU-only build). Arguments are already checked.
#pragma once

#include "epmoe/prepared_weights.h"

namespace epmoe {

// w_GNL: bf16 on the CUDA device of `prepared`.
void prepare_weights_cuda(const TensorRef& w_GNL, const PreparedWeights& prepared, void* stream);

}  // namespace epmoe
