#include "cuda/stream_fork.h"

#include <cuda_runtime_api.h>

#include "cuda/check.h"

namespace epmoe::cuda {

namespace {

// Destroys what v holds. Errors are dropped with the handles: this runs in a destructor or while
// a creation error propagates.
void release(StreamForkView& v) {
  if (v.side_stream != nullptr) {
    (void)cudaStreamSynchronize(static_cast<cudaStream_t>(v.side_stream));
    (void)cudaStreamDestroy(static_cast<cudaStream_t>(v.side_stream));
  }
  if (v.fork_event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(v.fork_event));
  if (v.join_event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(v.join_event));
  v = StreamForkView{};
}

}  // namespace

StreamFork::StreamFork() {
  try {
    cudaStream_t side = nullptr;
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    view_.side_stream = side;
    cudaEvent_t event = nullptr;
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    view_.fork_event = event;
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    view_.join_event = event;
  } catch (...) {
    release(view_);
    throw;
  }
}

StreamFork::~StreamFork() { release(view_); }

void fork(const StreamForkView& v, void* stream) {
  if (v.side_stream == nullptr) return;
  const auto event = static_cast<cudaEvent_t>(v.fork_event);
  EPMOE_CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(stream)));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(v.side_stream), event, 0));
}

void join(const StreamForkView& v, void* stream) {
  if (v.side_stream == nullptr) return;
  const auto event = static_cast<cudaEvent_t>(v.join_event);
  EPMOE_CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(v.side_stream)));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event, 0));
}

}  // namespace epmoe::cuda
