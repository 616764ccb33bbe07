// Transport: how the R ranks of one EP group reach each other. A Context needs three things of it:
// symmetric buffers (each rank can address every rank's copy), barriers with a time budget, and a
// small host all-gather for setup. Implementations: ThreadTransport (ranks are threads of one
// process, CPU memory); a multi-process shared-memory transport and the NCCL symmetric-memory
// transport fit the same interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "epmoe/status.h"
#include "epmoe/tensor.h"

namespace epmoe {

struct SymmetricBuffer {
  void* local = nullptr;      // this rank's copy
  std::vector<void*> peers;   // peers[r]: rank r's copy as addressable by this rank; peers[rank] == local
  std::size_t bytes = 0;
  int handle = -1;            // transport-private
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where symmetric buffers live and where this rank computes.
  virtual Device device() const = 0;

  // Collective: every rank calls with the same bytes and tag, in the same order. The memory is
  // zero-filled. Throws Error(timeout) naming the missing rank if a peer does not take part.
  virtual SymmetricBuffer allocate_symmetric(std::size_t bytes, std::string_view tag) = 0;
  // Collective.
  virtual void release_symmetric(SymmetricBuffer& buffer) = 0;

  // Host barrier. Every rank's writes to symmetric memory before it are visible to every rank after
  // it. Throws Error(timeout) whose message names the tag and the ranks that did not arrive; a rank
  // that timed out withdraws its arrival, so the next barrier of all ranks still matches up.
  virtual void barrier(std::string_view tag, std::chrono::milliseconds budget) = 0;

  // Stream-ordered barrier for transports whose ranks compute on a device. The default waits on
  // the host (for transports whose ranks compute on the host, where stream is ignored). A device
  // barrier that runs past `budget` records StatusCode::barrier_timeout in `status` (the context's
  // status word in device memory; nullable) and returns instead of throwing or hanging.
  virtual void barrier_on_stream(void* stream, int channel, std::chrono::milliseconds budget,
                                 Status* status = nullptr);

  // Host all-gather of `bytes` from every rank into recv (rank-major, size() * bytes).
  virtual void all_gather(const void* send, void* recv, std::size_t bytes,
                          std::chrono::milliseconds budget) = 0;
};

// R ranks as threads of one process. Create one group, then hand transport(r) to the thread that
// plays rank r.
class ThreadTransportGroup {
 public:
  explicit ThreadTransportGroup(int num_ranks);
  ~ThreadTransportGroup();
  ThreadTransportGroup(const ThreadTransportGroup&) = delete;
  ThreadTransportGroup& operator=(const ThreadTransportGroup&) = delete;

  int size() const;
  std::shared_ptr<Transport> transport(int rank);

  struct State;  // shared by the ranks' transports

 private:
  std::shared_ptr<State> state_;
  std::vector<std::shared_ptr<Transport>> transports_;
};

}  // namespace epmoe
