// NCCL transport (include/epmoe/nccl.h): one GPU per rank, an NCCL communicator from a unique id
// the caller distributes, symmetric buffers in NCCL symmetric windows (or CUDA IPC), host
// collectives as NCCL all-gathers with a time budget, and the stream barrier of nccl_kernels.cu.
//
// Host collectives (barrier, all_gather, allocate/release_symmetric) are numbered 1, 2, ... in
// call order, the same on every rank. Collective n is:
//   1. rendezvous: a one-CTA kernel on a private stream stores n into every rank's board[self]
//      (control buffer, symmetric) and waits, within the budget, until its own board[r] >= n for
//      every r. On timeout it lists the ranks whose board stayed below n (they never entered
//      collective n) and stores n - 1 back into the peers' boards: this rank withdraws, so its
//      next collective is n again and still meets the others' n. The host throws Error(timeout)
//      naming those ranks. Only when every rank is present does NCCL get a call, so an absent rank
//      never leaves a collective posted (nor blocks the host inside NCCL's lazy connection setup).
//   2. a 64-byte header (n, payload bytes, tag) is all-gathered with ncclAllGather: every rank
//      checks that all called the same collective with the same payload size;
//   3. the payload (if any) is all-gathered. Steps 2-3 run on another private stream polled with
//      cudaStreamQuery up to the same deadline. Should they still time out (a rank failed right
//      after the rendezvous), the posted collective cannot be withdrawn and would hold up every
//      device-wide synchronisation of the process: the communicator is aborted, the transport is
//      lost (later calls throw), and a new one must be created on every rank.
// During creation, before the control buffer exists, collectives are steps 2-3 only.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cuda/check.h"
#include "cuda/comm/nccl_check.h"
#include "cuda/comm/nccl_host.h"
#include "cuda/device_scope.h"
#include "cuda/comm/nccl_kernels.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/nccl.h"

namespace epmoe {
namespace nccl {
namespace {

using std::chrono::milliseconds;

// A rendezvous kernel that has not finished this long after its own budget never got an SM.
constexpr milliseconds kKernelGrace{2000};

using cuda::DeviceScope;

// Header of every host collective.
struct Header {
  uint64_t number;  // collective number on this transport
  uint64_t bytes;   // payload bytes of this rank
  char tag[48];     // what the caller called (truncated)
};
static_assert(sizeof(Header) == 64, "one 64-byte header per rank");

std::string header_tag(const Header& h) {
  return std::string(h.tag, strnlen(h.tag, sizeof(h.tag)));
}

// "2.28.9" of an NCCL version code (major * 10000 + minor * 100 + patch since 2.9).
std::string version_text(int code) {
  return detail::concat(code / 10000, ".", code % 10000 / 100, ".", code % 100);
}

// What every rank states about itself at creation.
struct Hello {
  int32_t peer_access;  // PeerAccess requested
  int32_t device;
  int64_t pid;
  uint64_t host;
  int32_t nccl_version;
  int32_t win_disabled;    // NCCL_WIN_ENABLE=0
  int32_t cumem_disabled;  // NCCL_CUMEM_ENABLE=0
  int32_t pad = 0;
};

// What every rank reports about one symmetric allocation.
struct AllocInfo {
  uint64_t bytes;
  int32_t ok;      // the local allocation succeeded
  int32_t ipc_ok;  // cudaIpcGetMemHandle succeeded (IPC path)
  void* ptr;
  cudaIpcMemHandle_t handle;
};

struct Allocation {
  void* local = nullptr;
  std::size_t bytes = 0;
  ncclWindow_t window = nullptr;  // LSA path
  std::vector<void*> opened;      // IPC path: handles opened from other processes
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(const ncclUniqueId& id, int rank, int size, int device,
                const NcclTransportOptions& options)
      : rank_(rank), size_(size), device_(device), options_(options) {
    DeviceScope scope(device_);
    try {
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
      EPMOE_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
      int count = 0, user_rank = 0, cu_device = 0;
      EPMOE_NCCL_CHECK(ncclCommCount(comm_, &count));
      EPMOE_NCCL_CHECK(ncclCommUserRank(comm_, &user_rank));
      EPMOE_NCCL_CHECK(ncclCommCuDevice(comm_, &cu_device));
      EPMOE_EXPECT(count == size_ && user_rank == rank_ && cu_device == device_, internal,
                   "ncclComm", detail::concat("rank ", rank_, " of ", size_, " on cuda:", device_),
                   detail::concat("rank ", user_rank, " of ", count, " on cuda:", cu_device));
      handshake();
      choose_peer_access();

      // Control buffer (board + barrier flags), its peer table on the device, barrier state.
      control_ = allocate(control_bytes(size_), "transport control", options_.setup_budget);
      control_R_ = static_cast<uint64_t**>(device_alloc(sizeof(void*) * size_));
      EPMOE_CUDA_CHECK(cudaMemcpy(control_R_, control_.peers.data(), sizeof(void*) * size_,
                                  cudaMemcpyHostToDevice));
      state_ = static_cast<BarrierState*>(device_alloc(sizeof(BarrierState)));
      missing_dev_R_ = static_cast<int32_t*>(device_alloc(sizeof(int32_t) * size_));
      EPMOE_CUDA_CHECK(cudaMallocHost(&missing_host_R_, sizeof(int32_t) * size_));
      EPMOE_CUDA_CHECK(cudaMallocHost(&board_host_R_, sizeof(uint64_t) * size_));
      bootstrapping_ = false;
      barrier("make_nccl_transport", options_.setup_budget);  // the first rendezvous
    } catch (...) {
      teardown(/*healthy=*/false);
      throw;
    }
  }

  ~NcclTransport() override {
    int previous = 0;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_;
    if (switched) cudaSetDevice(device_);
    bool healthy = comm_ != nullptr && !lost_;
    if (healthy) {
      try {
        // Peers may write into this rank's buffers until they are here too.
        collective("transport destruction", nullptr, 0, options_.setup_budget);
        if (access_ == PeerAccess::cuda_ipc) {
          // Exported memory must outlive every importer's handle: close, meet once more without
          // the rendezvous (it would write through the closed handles), then free.
          for (auto& [handle, a] : allocations_) close_imports(a);
          bootstrapping_ = true;
          collective("transport destruction imports closed", nullptr, 0, options_.setup_budget);
        }
      } catch (...) {
        healthy = false;
      }
    }
    teardown(healthy);
    if (switched) cudaSetDevice(previous);
  }

  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }

  SymmetricBuffer allocate_symmetric(std::size_t bytes, std::string_view tag) override {
    DeviceScope scope(device_);
    return allocate(bytes, std::string(tag), options_.setup_budget);
  }

  void release_symmetric(SymmetricBuffer& buffer) override {
    if (buffer.local == nullptr) return;
    DeviceScope scope(device_);
    const auto it = allocations_.find(buffer.handle);
    EPMOE_CHECK_ARG(it != allocations_.end() && it->second.local == buffer.local, "SymmetricBuffer",
                    "a buffer allocated by this transport",
                    detail::concat("handle ", buffer.handle));
    // Every rank must be done with its peers' copies before any copy goes.
    const int handle = buffer.handle;
    const std::vector<char> all =
        collective("release_symmetric", &handle, sizeof(handle), options_.setup_budget);
    for (int r = 0; r < size_; ++r) {
      int theirs = 0;
      std::memcpy(&theirs, all.data() + r * sizeof(int), sizeof(int));
      EPMOE_EXPECT(theirs == handle, internal, "SymmetricBuffer",
                   detail::concat("every rank to release buffer #", handle),
                   detail::concat("rank ", r, " releasing buffer #", theirs));
    }
    Allocation a = it->second;
    allocations_.erase(it);
    if (access_ == PeerAccess::cuda_ipc) {
      close_imports(a);
      // cudaFree of an exported region before every importer has closed it is undefined.
      collective("release_symmetric imports closed", nullptr, 0, options_.setup_budget);
    }
    free_local(a);
    buffer = SymmetricBuffer{};
  }

  void barrier(std::string_view tag, milliseconds budget) override {
    collective("barrier '" + std::string(tag) + "'", nullptr, 0, budget);
  }

  void barrier_on_stream(void* stream, int channel, milliseconds budget, Status* status) override {
    EPMOE_CHECK_ARG(channel >= 0 && channel < kBarrierChannels, "channel",
                    detail::concat("a stream-barrier channel in [0, ", kBarrierChannels, ")"),
                    channel);
    if (size_ == 1) return;  // nothing to wait for; stream order covers this rank's own writes
    // After an abort the peers' mappings are gone.
    EPMOE_EXPECT(comm_ != nullptr, backend, "barrier_on_stream", "a usable transport",
                 lost_reason_);
    DeviceScope scope(device_);
    StreamBarrierArgs a;
    a.control_R = control_R_;
    a.state = state_;
    a.status = status;
    a.budget_ns = static_cast<uint64_t>(std::max<int64_t>(budget.count(), 0)) * 1000000ull;
    a.rank = rank_;
    a.R = size_;
    a.channel = channel;
    launch_stream_barrier(a, static_cast<cudaStream_t>(stream));
  }

  void all_gather(const void* send, void* recv, std::size_t bytes, milliseconds budget) override {
    const std::vector<char> all = collective("all_gather", send, bytes, budget);
    if (bytes != 0) std::memcpy(recv, all.data(), all.size());
  }

  std::string peer_access_text() const {
    return access_ == PeerAccess::nccl_lsa ? "nccl-lsa" : "cuda-ipc (" + ipc_reason_ + ")";
  }

 private:
  // ---- host collectives ----

  // Collective `tag` of every rank; returns every rank's payload, rank-major.
  std::vector<char> collective(const std::string& tag, const void* payload, std::size_t bytes,
                               milliseconds budget) {
    DeviceScope scope(device_);
    EPMOE_EXPECT(!lost_, backend, tag, "a usable transport", lost_reason_);
    const auto deadline = Clock::now() + budget;
    const uint64_t n = collectives_ + 1;
    if (!bootstrapping_) rendezvous(tag, n, budget, deadline);
    collectives_ = n;

    Header mine{};
    mine.number = n;
    mine.bytes = bytes;
    std::strncpy(mine.tag, tag.c_str(), sizeof(mine.tag) - 1);
    const std::vector<char> raw = all_gather_raw(&mine, sizeof(Header), tag, n, budget, deadline);
    for (int r = 0; r < size_; ++r) {
      Header h{};
      std::memcpy(&h, raw.data() + r * sizeof(Header), sizeof(Header));
      // Every rank sees the same headers, so a mismatch fails on every rank alike.
      EPMOE_EXPECT(
          h.number == n && header_tag(h) == header_tag(mine), internal, tag,
          detail::concat("every rank at collective #", n, " to call ", header_tag(mine)),
          detail::concat("rank ", r, " calling ", header_tag(h), " as its collective #", h.number));
      EPMOE_CHECK_ARG(h.bytes == bytes, tag + " bytes",
                      detail::concat(bytes, " bytes from every rank (as rank ", rank_, ")"),
                      detail::concat(h.bytes, " bytes from rank ", r));
    }
    if (bytes == 0) return {};
    return all_gather_raw(payload, bytes, tag, n, budget, deadline);
  }

  // Step 1 of collective n (see the top of this file).
  void rendezvous(const std::string& tag, uint64_t n, milliseconds budget,
                  Clock::time_point deadline) {
    const auto left = std::max(deadline - Clock::now(), Clock::duration::zero());
    RendezvousArgs a;
    a.control_R = control_R_;
    a.missing_R = missing_dev_R_;
    a.number = n;
    a.budget_ns =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(left).count());
    a.rank = rank_;
    a.R = size_;
    launch_rendezvous(a, side_stream_);
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(missing_host_R_, missing_dev_R_, sizeof(int32_t) * size_,
                                     cudaMemcpyDeviceToHost, side_stream_));
    if (!wait_stream(side_stream_, deadline + kKernelGrace)) {
      // The kernel may still run later and announce n: this transport can no longer count.
      lost_ = true;
      lost_reason_ = "a transport whose rendezvous kernel for " + tag +
                     " never ran (the GPU was busy past the budget); create a new transport on "
                     "every rank";
      detail::throw_error(
          ErrorKind::timeout, tag,
          detail::concat("expected the rendezvous kernel of ", tag, " to finish within ",
                         budget.count(), " ms + ", kKernelGrace.count(),
                         " ms, got none (no SM freed up on cuda:", device_, ")"),
          __FILE__, __LINE__);
    }
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (missing_host_R_[r] != 0) missing.push_back(r);
    }
    if (!missing.empty()) {
      detail::throw_error(
          ErrorKind::timeout, tag,
          detail::concat("expected all ", size_, " ranks at ", tag, " within ", budget.count(),
                         " ms, got no arrival from rank(s) ", rank_list(missing), " (rank ", rank_,
                         " waited and withdrew; collective #", n, ")"),
          __FILE__, __LINE__);
    }
  }

  // Steps 2-3: ncclAllGather of `bytes` per rank through pinned + device staging.
  std::vector<char> all_gather_raw(const void* data, std::size_t bytes, const std::string& tag,
                                   uint64_t n, milliseconds budget, Clock::time_point deadline) {
    reserve_staging(bytes);
    std::memcpy(host_send_, data, bytes);
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(dev_send_, host_send_, bytes, cudaMemcpyHostToDevice, comm_stream_));
    EPMOE_NCCL_CHECK(ncclAllGather(dev_send_, dev_recv_, bytes, ncclUint8, comm_, comm_stream_));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(host_recv_, dev_recv_, bytes * size_, cudaMemcpyDeviceToHost,
                                     comm_stream_));
    bool done = false;
    try {
      done = wait_stream(comm_stream_, deadline, comm_);
    } catch (const Error&) {
      lose("a transport whose NCCL communicator failed during " + tag);
      throw;
    }
    if (!done) {
      std::string who;
      if (bootstrapping_) {
        who = "a rank did not arrive (which one is unknown while the transport is created or "
              "destroyed: no rendezvous then)";
      } else {
        const std::vector<int> missing = ranks_below(n);
        who = missing.empty() ? "every rank had arrived, but NCCL did not finish (a rank failed "
                                "right after arriving?)"
                              : "no arrival from rank(s) " + rank_list(missing);
      }
      // A posted NCCL collective cannot be withdrawn, and would hold up every device-wide
      // synchronisation of this process: abort the communicator instead.
      lose("a transport whose NCCL communicator was aborted after " + tag +
           " timed out; create a new transport on every rank");
      detail::throw_error(ErrorKind::timeout, tag,
                          detail::concat("expected all ", size_, " ranks to finish ", tag,
                                         " (collective #", n, ") within ", budget.count(),
                                         " ms, got ", who, "; the NCCL communicator is aborted"),
                          __FILE__, __LINE__);
    }
    return std::vector<char>(host_recv_, host_recv_ + bytes * size_);
  }

  // Aborts the communicator (its posted work ends) and refuses every later use.
  void lose(const std::string& reason) {
    lost_ = true;
    lost_reason_ = reason;
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    for (auto& [handle, a] : allocations_) a.window = nullptr;  // gone with the communicator
  }

  // Ranks whose board says they have not entered collective n (own board read on the side stream).
  std::vector<int> ranks_below(uint64_t n) {
    std::vector<int> below;
    if (control_.local == nullptr || board_host_R_ == nullptr) return below;
    if (cudaMemcpyAsync(board_host_R_, control_.local, sizeof(uint64_t) * size_,
                        cudaMemcpyDeviceToHost, side_stream_) != cudaSuccess ||
        !wait_stream(side_stream_, Clock::now() + kKernelGrace)) {
      return below;
    }
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && board_host_R_[board_word(r)] < n) below.push_back(r);
    }
    return below;
  }

  void reserve_staging(std::size_t bytes) {
    if (bytes <= staging_bytes_) return;  // grows only while nothing is in flight
    free_staging();
    const std::size_t cap = std::max<std::size_t>(bytes, 4096);
    EPMOE_CUDA_CHECK(cudaMallocHost(&host_send_, cap));
    EPMOE_CUDA_CHECK(cudaMallocHost(&host_recv_, cap * size_));
    EPMOE_CUDA_CHECK(cudaMalloc(&dev_send_, cap));
    EPMOE_CUDA_CHECK(cudaMalloc(&dev_recv_, cap * size_));
    staging_bytes_ = cap;
  }

  void free_staging() {
    if (host_send_ != nullptr) cudaFreeHost(host_send_);
    if (host_recv_ != nullptr) cudaFreeHost(host_recv_);
    if (dev_send_ != nullptr) cudaFree(dev_send_);
    if (dev_recv_ != nullptr) cudaFree(dev_recv_);
    host_send_ = host_recv_ = dev_send_ = dev_recv_ = nullptr;
    staging_bytes_ = 0;
  }

  template <class T>
  std::vector<T> gather(const T& mine, const std::string& tag, milliseconds budget) {
    const std::vector<char> raw = collective(tag, &mine, sizeof(T), budget);
    std::vector<T> all(size_);
    std::memcpy(all.data(), raw.data(), sizeof(T) * size_);
    return all;
  }

  // ---- creation ----

  void handshake() {
    Hello mine{};
    mine.peer_access = static_cast<int32_t>(options_.peer_access);
    mine.device = device_;
    mine.pid = static_cast<int64_t>(getpid());
    mine.host = host_hash();
    EPMOE_NCCL_CHECK(ncclGetVersion(&mine.nccl_version));
    mine.win_disabled = env_is_zero("NCCL_WIN_ENABLE") ? 1 : 0;
    mine.cumem_disabled = env_is_zero("NCCL_CUMEM_ENABLE") ? 1 : 0;
    hello_R_ = gather(mine, "make_nccl_transport", options_.setup_budget);
    for (int r = 0; r < size_; ++r) {  // checked after the gather: every rank fails alike
      const Hello& h = hello_R_[r];
      // The host API is stable within a minor version: the library must have the minor version
      // of the headers epmoe_nccl was built with. The device API's structs change even between
      // patch releases (choose_peer_access).
      EPMOE_EXPECT(h.nccl_version / 100 == NCCL_VERSION_CODE / 100, backend, "libnccl",
                   detail::concat("NCCL ", NCCL_MAJOR, ".", NCCL_MINOR,
                                  ".x at run time (the headers epmoe_nccl was built with)"),
                   detail::concat("NCCL ", version_text(h.nccl_version), " on rank ", r,
                                  "; rebuild against it"));
      EPMOE_CHECK_ARG(
          h.peer_access == mine.peer_access, "NcclTransportOptions.peer_access",
          detail::concat("the same on every rank (rank ", rank_, ": ",
                         to_string(options_.peer_access), ")"),
          detail::concat(to_string(static_cast<PeerAccess>(h.peer_access)), " on rank ", r));
      EPMOE_EXPECT(
          h.nccl_version == mine.nccl_version, backend, "libnccl",
          detail::concat("the same NCCL on every rank (rank ", rank_, ": ", mine.nccl_version, ")"),
          detail::concat(h.nccl_version, " on rank ", r));
      EPMOE_CHECK_ARG(
          r == rank_ || !same_process(r) || h.device != device_, "device",
          detail::concat("one CUDA device per rank (rank ", rank_, " on cuda:", device_, ")"),
          detail::concat("rank ", r, " on cuda:", h.device, " in the same process"));
    }
  }

  bool same_process(int r) const {
    return hello_R_[r].pid == hello_R_[rank_].pid && hello_R_[r].host == hello_R_[rank_].host;
  }

  // LSA where NCCL offers symmetric memory to the whole group, else CUDA IPC; every rank decides
  // alike (the probe is collective and its results are compared).
  void choose_peer_access() {
    access_ = PeerAccess::cuda_ipc;
    if (options_.peer_access == PeerAccess::cuda_ipc) {
      ipc_reason_ = "requested by NcclTransportOptions.peer_access";
      return;
    }
    std::string why;
    // ncclDevCommRequirements gained fields between 2.28.3 and 2.28.9: a library of another patch
    // release reads this build's struct as garbage (seen: 2.28.9 loaded first by PyTorch, under
    // 2.28.3 headers, failed ncclDevCommCreate with "out of memory"). The handshake holds only the
    // minor version alike, so every rank checks every rank's gathered version: all decide alike
    // without a collective.
    for (int r = 0; r < size_ && why.empty(); ++r) {
      if (hello_R_[r].nccl_version != NCCL_VERSION_CODE) {
        why = detail::concat("epmoe_nccl was built with the headers of NCCL ", version_text(NCCL_VERSION_CODE),
                             " but rank ", r, " runs NCCL ", version_text(hello_R_[r].nccl_version),
                             " (another libnccl.so.2 loaded first, e.g. PyTorch's): the device API's "
                             "structures differ between releases; build with NCCL_HOME at the NCCL the "
                             "process loads");
      }
    }
    for (int r = 0; r < size_ && why.empty(); ++r) {
      // Environment switches are per process: checked before the (collective) probe so that no
      // rank enters it alone.
      if (hello_R_[r].win_disabled != 0) {
        why = detail::concat("NCCL_WIN_ENABLE=0 on rank ", r, " disables NCCL symmetric windows");
      } else if (hello_R_[r].cumem_disabled != 0) {
        why = detail::concat("NCCL_CUMEM_ENABLE=0 on rank ", r,
                             " disables the cuMem memory NCCL symmetric windows need");
      }
    }
    int32_t ok = 0;
    if (why.empty()) {
      ok = probe_symmetric_memory(comm_, size_, rank_, &lsa_first_, &why) ? 1 : 0;
      const std::vector<int32_t> all =
          gather(ok, "make_nccl_transport probe", options_.setup_budget);
      for (int r = 0; r < size_; ++r) {
        if (all[r] == 0 && ok != 0) {
          ok = 0;
          why = detail::concat("rank ", r, " has no NCCL symmetric memory");
        }
      }
    }
    if (ok != 0) {
      access_ = PeerAccess::nccl_lsa;
      return;
    }
    EPMOE_EXPECT(options_.peer_access != PeerAccess::nccl_lsa, backend,
                 "NcclTransportOptions.peer_access",
                 "NCCL symmetric memory with every rank load/store-accessible (nccl_lsa)", why);
    ipc_reason_ = why;
  }

  // ---- symmetric memory ----

  void* device_alloc(std::size_t bytes) {
    void* p = nullptr;
    EPMOE_CUDA_CHECK(cudaMalloc(&p, bytes));
    owned_device_.push_back(p);
    EPMOE_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
  }

  // Collective: the local allocation first, then one all-gather of every rank's outcome, so that
  // a rank that failed to allocate fails every rank instead of leaving them in a registration.
  SymmetricBuffer allocate(std::size_t bytes, const std::string& tag, milliseconds budget) {
    const std::string what = "allocate_symmetric '" + tag + "'";
    const std::size_t size = std::max<std::size_t>(bytes, 1);
    Allocation a;
    a.bytes = bytes;
    AllocInfo mine{};
    mine.bytes = bytes;
    std::string local_error;
    try {
      if (access_ == PeerAccess::nccl_lsa) {
        EPMOE_NCCL_CHECK(ncclMemAlloc(&a.local, size));
      } else {
        EPMOE_CUDA_CHECK(cudaMalloc(&a.local, size));
        mine.ipc_ok = cudaIpcGetMemHandle(&mine.handle, a.local) == cudaSuccess ? 1 : 0;
        if (mine.ipc_ok == 0) (void)cudaGetLastError();  // needed only for peers in other processes
      }
      EPMOE_CUDA_CHECK(cudaMemsetAsync(a.local, 0, size, side_stream_));
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
      mine.ok = 1;
      mine.ptr = a.local;
    } catch (const Error& e) {
      local_error = e.what();
      free_local(a);
    }
    std::vector<AllocInfo> all;
    try {
      all = gather(mine, what, budget);
    } catch (...) {
      free_local(a);
      throw;
    }
    std::vector<int> failed;
    for (int r = 0; r < size_; ++r) {
      if (all[r].ok == 0) failed.push_back(r);
    }
    if (!failed.empty()) {
      free_local(a);
      detail::throw_error(ErrorKind::backend, what,
                          detail::concat("expected ", bytes,
                                         " bytes of device memory on every rank, got "
                                         "an allocation failure on rank(s) ",
                                         rank_list(failed),
                                         local_error.empty() ? "" : " (here: " + local_error + ")"),
                          __FILE__, __LINE__);
    }
    for (int r = 0; r < size_; ++r) {
      if (all[r].bytes != bytes) {
        free_local(a);
        EPMOE_CHECK_ARG(false, what,
                        detail::concat(bytes, " bytes on every rank (as rank ", rank_, ")"),
                        detail::concat(all[r].bytes, " bytes on rank ", r));
      }
    }
    SymmetricBuffer b;
    b.local = a.local;
    b.bytes = bytes;
    b.peers.assign(size_, nullptr);
    try {
      if (access_ == PeerAccess::nccl_lsa) {
        map_lsa_peers(a, size, b.peers);
      } else {
        map_ipc_peers(a, all, b.peers);
      }
    } catch (...) {
      close_imports(a);
      free_local(a);
      throw;
    }
    b.peers[rank_] = a.local;
    b.handle = next_handle_++;
    allocations_[b.handle] = a;
    return b;
  }

  void map_lsa_peers(Allocation& a, std::size_t size, std::vector<void*>& peers) {
    // Collective: every rank got here (all allocations succeeded).
    EPMOE_NCCL_CHECK(ncclGroupStart());
    const ncclResult_t reg =
        ncclCommWindowRegister(comm_, a.local, size, &a.window, NCCL_WIN_COLL_SYMMETRIC);
    const ncclResult_t end = ncclGroupEnd();
    EPMOE_NCCL_CHECK(reg);
    EPMOE_NCCL_CHECK(end);
    EPMOE_EXPECT(a.window != nullptr, backend, "ncclCommWindowRegister",
                 "a symmetric window (the probe found NCCL symmetric memory)", "no window");
    if (peer_ptrs_dev_ == nullptr)
      peer_ptrs_dev_ = static_cast<void**>(device_alloc(sizeof(void*) * size_));
    launch_lsa_pointers(a.window, lsa_first_, size_, peer_ptrs_dev_, side_stream_);
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(peers.data(), peer_ptrs_dev_, sizeof(void*) * size_,
                                     cudaMemcpyDeviceToHost, side_stream_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(side_stream_));
    for (int r = 0; r < size_; ++r) {
      EPMOE_EXPECT(peers[r] != nullptr, backend, "ncclGetLsaPointer",
                   detail::concat("a pointer to rank ", r, "'s window"), "nullptr");
    }
  }

  void map_ipc_peers(Allocation& a, const std::vector<AllocInfo>& all, std::vector<void*>& peers) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (same_process(r)) {
        // Ranks of one process share one address space: enable peer access and use the pointer.
        const int peer_device = hello_R_[r].device;
        int can = 0;
        EPMOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, peer_device));
        EPMOE_EXPECT(can != 0, backend, "peer access",
                     detail::concat("cuda:", device_, " able to reach cuda:", peer_device,
                                    " (rank ", r, ")"),
                     "no peer access between them");
        const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          EPMOE_CUDA_CHECK(e);
        }
        peers[r] = all[r].ptr;
      } else {
        EPMOE_EXPECT(all[r].ipc_ok != 0, backend, "cudaIpcGetMemHandle",
                     detail::concat("an IPC handle from rank ", r), "none (IPC unsupported there)");
        void* p = nullptr;
        EPMOE_CUDA_CHECK(cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess));
        a.opened.push_back(p);
        peers[r] = p;
      }
    }
  }

  void close_imports(Allocation& a) {
    for (void* p : a.opened) cudaIpcCloseMemHandle(p);  // best effort on every path
    a.opened.clear();
  }

  void free_local(Allocation& a) {
    if (a.window != nullptr && comm_ != nullptr) ncclCommWindowDeregister(comm_, a.window);
    a.window = nullptr;
    if (a.local != nullptr) {
      if (access_ == PeerAccess::nccl_lsa) {
        ncclMemFree(a.local);
      } else {
        cudaFree(a.local);
      }
    }
    a.local = nullptr;
  }

  // Frees everything; `healthy`: every rank is here (else abort NCCL instead of destroying it).
  void teardown(bool healthy) {
    if (healthy) {
      for (auto& [handle, a] : allocations_) close_imports(a);
      for (auto& [handle, a] : allocations_) free_local(a);
      allocations_.clear();
    }
    if (comm_ != nullptr) {
      if (healthy) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    for (auto& [handle, a] : allocations_) {  // after an abort: the windows went with the comm
      close_imports(a);
      a.window = nullptr;
      free_local(a);
    }
    allocations_.clear();
    free_staging();
    for (void* p : owned_device_) cudaFree(p);
    owned_device_.clear();
    if (missing_host_R_ != nullptr) cudaFreeHost(missing_host_R_);
    if (board_host_R_ != nullptr) cudaFreeHost(board_host_R_);
    missing_host_R_ = nullptr;
    board_host_R_ = nullptr;
    if (comm_stream_ != nullptr) cudaStreamDestroy(comm_stream_);
    if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
    comm_stream_ = side_stream_ = nullptr;
  }

  const int rank_, size_, device_;
  const NcclTransportOptions options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;  // the NCCL all-gathers of host collectives
  cudaStream_t side_stream_ = nullptr;  // rendezvous, memsets, board reads: never behind NCCL
  std::vector<Hello> hello_R_;
  PeerAccess access_ = PeerAccess::cuda_ipc;
  std::string ipc_reason_;
  int lsa_first_ = 0;  // LSA index of world rank 0

  bool bootstrapping_ = true;  // no control buffer yet: collectives without rendezvous
  uint64_t collectives_ = 0;   // host collectives entered (and not withdrawn)
  bool lost_ = false;          // aborted, or the collective count may no longer match
  std::string lost_reason_;

  SymmetricBuffer control_;            // board_R + flags_CR (nccl_kernels.h)
  uint64_t** control_R_ = nullptr;     // [R] device table of control_.peers
  BarrierState* state_ = nullptr;      // [1] device
  int32_t* missing_dev_R_ = nullptr;   // [R] rendezvous result
  int32_t* missing_host_R_ = nullptr;  // [R] pinned
  uint64_t* board_host_R_ = nullptr;   // [R] pinned
  void** peer_ptrs_dev_ = nullptr;     // [R] LSA pointer query result
  std::vector<void*> owned_device_;

  char *host_send_ = nullptr, *host_recv_ = nullptr;  // pinned staging: [bytes], [R * bytes]
  char *dev_send_ = nullptr, *dev_recv_ = nullptr;    // device staging: [bytes], [R * bytes]
  std::size_t staging_bytes_ = 0;

  std::map<int, Allocation> allocations_;
  int next_handle_ = 0;
};

}  // namespace
}  // namespace nccl

const char* to_string(PeerAccess access) {
  switch (access) {
    case PeerAccess::automatic:
      return "automatic";
    case PeerAccess::nccl_lsa:
      return "nccl_lsa";
    case PeerAccess::cuda_ipc:
      return "cuda_ipc";
  }
  return "?";
}

NcclUniqueId nccl_unique_id() {
  ncclUniqueId id;
  EPMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  NcclUniqueId out;
  static_assert(sizeof(id.internal) == kNcclUniqueIdBytes, "NCCL_UNIQUE_ID_BYTES changed");
  std::memcpy(out.data(), id.internal, kNcclUniqueIdBytes);
  return out;
}

std::shared_ptr<Transport> make_nccl_transport(const void* unique_id, std::size_t unique_id_bytes,
                                               int rank, int size, int device,
                                               const NcclTransportOptions& options) {
  EPMOE_CHECK_ARG(
      unique_id != nullptr && unique_id_bytes == kNcclUniqueIdBytes, "unique_id",
      detail::concat(kNcclUniqueIdBytes, " bytes from nccl_unique_id()"),
      unique_id == nullptr ? std::string("nullptr") : detail::concat(unique_id_bytes, " bytes"));
  EPMOE_CHECK_ARG(size >= 1 && size <= nccl::kMaxRanks, "size",
                  detail::concat("an EP size in [1, ", nccl::kMaxRanks, "]"), size);
  EPMOE_CHECK_ARG(rank >= 0 && rank < size, "rank", detail::concat("a rank in [0, ", size, ")"),
                  rank);
  const int count = cuda_device_count();
  EPMOE_CHECK_ARG(device >= 0 && device < count, "device",
                  detail::concat("a CUDA ordinal in [0, ", count, ")"), device);
  EPMOE_CHECK_ARG(options.setup_budget.count() > 0, "NcclTransportOptions.setup_budget",
                  "a positive budget", detail::concat(options.setup_budget.count(), " ms"));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id, kNcclUniqueIdBytes);
  return std::make_shared<nccl::NcclTransport>(id, rank, size, device, options);
}

std::string nccl_peer_access(const Transport& transport) {
  const auto* t = dynamic_cast<const nccl::NcclTransport*>(&transport);
  return t == nullptr ? std::string() : t->peer_access_text();
}

}  // namespace epmoe
