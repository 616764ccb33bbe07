// A side stream and two events, for launches that may run beside the caller's stream: fork on an
// event recorded in the caller's stream, launch on the side stream, join the caller's stream back
// on the other event. Graph-capturable (a capture follows the events into the side stream and
// back) and eager alike. Made once per backend, outside any capture (stream and event creation
// are not capturable). No CUDA types here.
#pragma once

namespace epmoe::cuda {

// What a launcher takes: all three set, or side_stream null (run on the caller's stream).
struct StreamForkView {
  void* side_stream = nullptr;  // cudaStream_t, non-blocking
  void* fork_event = nullptr;   // cudaEvent_t, timing disabled
  void* join_event = nullptr;
};

// Owner of one fork on the current device.
class StreamFork {
 public:
  StreamFork();
  ~StreamFork();
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;
  StreamForkView view() const { return view_; }

 private:
  StreamForkView view_;
};

// fork(v, stream): the side stream waits for what `stream` holds so far; join(v, stream): `stream`
// waits for what the side stream holds so far. Nothing happens where v.side_stream is null.
void fork(const StreamForkView& v, void* stream);
void join(const StreamForkView& v, void* stream);

}  // namespace epmoe::cuda
