// ShmTransport: ranks are processes of one host. Every collective is one "round" in a control
// segment of shared memory: each rank writes its tag and payload into the round's slot and sets its
// bit in one 64-bit word; the last arrival also sets the word's complete bit. One atomic word per
// round makes arrival, completion and a timed-out rank's withdrawal race-free: a rank that gives up
// clears its bit only if the round has not completed, so every rank agrees on whether it did.
#include "epmoe/shm_transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/memory_plan.h"

namespace epmoe {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kReady = 0x45504d31;  // "EPM1": the control segment is initialised
constexpr int kSlots = 4;                // rounds in flight at once (ranks may run ahead by < 4)
constexpr std::size_t kTagBytes = 64;
constexpr uint64_t kComplete = uint64_t{1} << 63;

struct Slot {
  std::atomic<uint64_t> round;  // the round this slot serves now
  std::atomic<uint64_t> state;  // bit r: rank r arrived; kComplete: every rank arrived
  std::atomic<uint32_t> taken;  // ranks that copied the result out
  uint32_t bytes[kShmMaxRanks];
  char tags[kShmMaxRanks][kTagBytes];
  char payload[kShmMaxRanks][kShmMaxGatherBytes];
};

struct Control {
  std::atomic<uint32_t> ready;
  int32_t size;
  Slot slots[kSlots];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");

std::string errno_string() { return std::strerror(errno); }

std::string rank_list(uint64_t mask, int size) {
  std::string s;
  for (int r = 0; r < size; ++r) {
    if (mask & (uint64_t{1} << r)) s += (s.empty() ? "" : ", ") + std::to_string(r);
  }
  return s;
}

// Spins briefly, then sleeps with growing intervals: ranks may share few cores.
class Backoff {
 public:
  void wait() {
    if (++spins_ < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    if (sleep_us_ < 200) sleep_us_ *= 2;
  }

 private:
  int spins_ = 0;
  int sleep_us_ = 5;
};

// A mapping of a shared-memory object, unmapped on destruction.
struct Mapping {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Mapping() = default;
  Mapping(void* p, std::size_t n) : ptr(p), bytes(n) {}
  Mapping(Mapping&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~Mapping() {
    if (ptr != nullptr) munmap(ptr, bytes);
  }
};

// Maps the object `name` (created with `create`), `bytes` long, zero-filled when created.
Mapping map_object(const std::string& name, std::size_t bytes, bool create) {
  const int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
  const int fd = shm_open(name.c_str(), flags, 0600);
  EPMOE_EXPECT(fd >= 0, backend, "shm_open " + name, "a shared-memory object", errno_string());
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string err = errno_string();
    close(fd);
    shm_unlink(name.c_str());
    EPMOE_EXPECT(false, backend, "ftruncate " + name, detail::concat(bytes, " bytes"), err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string err = errno_string();
  close(fd);
  if (p == MAP_FAILED && create) shm_unlink(name.c_str());
  EPMOE_EXPECT(p != MAP_FAILED, backend, "mmap " + name, detail::concat(bytes, " bytes mapped"), err);
  return Mapping(p, bytes);
}

class ShmTransport final : public Transport {
 public:
  ShmTransport(std::string session, int rank, int size, std::chrono::milliseconds budget)
      : session_(std::move(session)), rank_(rank), size_(size), setup_budget_(budget) {
    const std::string name = "/epmoe-" + session_ + "-ctl";
    if (rank_ == 0) {
      control_map_ = map_object(name, sizeof(Control), true);
      control_ = new (control_map_.ptr) Control();
      control_->size = size_;
      for (int i = 0; i < kSlots; ++i) control_->slots[i].round.store(static_cast<uint64_t>(i));
      control_->ready.store(kReady, std::memory_order_release);
    } else {
      join(name);
    }
    // Every rank has mapped the control segment once this round completes.
    try {
      exchange("join", nullptr, 0, setup_budget_);
    } catch (...) {
      if (rank_ == 0) shm_unlink(name.c_str());
      throw;
    }
    if (rank_ == 0) shm_unlink(name.c_str());
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cpu(); }

  SymmetricBuffer allocate_symmetric(std::size_t bytes, std::string_view tag) override {
    const int handle = next_handle_++;
    const auto padded = static_cast<std::size_t>(
        align_bytes(static_cast<int64_t>(std::max<std::size_t>(bytes, 1))));
    std::vector<Mapping> maps(size_);
    maps[rank_] = map_object(buffer_name(handle, rank_), padded, true);
    const std::string label = "allocate_symmetric '" + std::string(tag) + "'";
    std::vector<uint64_t> all(size_);
    const uint64_t mine = bytes;
    try {
      exchange(label, &mine, sizeof(mine), setup_budget_, all.data());
      for (int r = 0; r < size_; ++r) {
        EPMOE_CHECK_ARG(all[r] == bytes, std::string(tag),
                        detail::concat(bytes, " bytes on every rank (as rank ", rank_, ")"),
                        detail::concat(all[r], " bytes on rank ", r));
      }
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) maps[r] = map_object(buffer_name(handle, r), padded, false);
      }
      // Every rank has mapped every copy: the names can go.
      exchange(label + " mapped", nullptr, 0, setup_budget_);
    } catch (...) {
      shm_unlink(buffer_name(handle, rank_).c_str());
      throw;
    }
    shm_unlink(buffer_name(handle, rank_).c_str());

    SymmetricBuffer buffer;
    buffer.local = maps[rank_].ptr;
    buffer.bytes = bytes;
    buffer.handle = handle;
    buffer.peers.resize(size_);
    for (int r = 0; r < size_; ++r) buffer.peers[r] = maps[r].ptr;
    buffers_.emplace_back(handle, std::move(maps));
    return buffer;
  }

  void release_symmetric(SymmetricBuffer& buffer) override {
    // Every rank must be done with its peers' copies before any mapping goes.
    const int32_t handle = buffer.handle;
    std::vector<int32_t> all(size_);
    exchange("release_symmetric", &handle, sizeof(handle), setup_budget_, all.data());
    for (int r = 0; r < size_; ++r) {
      EPMOE_EXPECT(all[r] == handle, internal, "SymmetricBuffer",
                   detail::concat("every rank to release buffer #", handle),
                   detail::concat("rank ", r, " releasing buffer #", all[r]));
    }
    for (auto it = buffers_.begin(); it != buffers_.end(); ++it) {
      if (it->first == handle) {
        buffers_.erase(it);
        break;
      }
    }
    buffer = SymmetricBuffer{};
  }

  void barrier(std::string_view tag, std::chrono::milliseconds budget) override {
    exchange("barrier '" + std::string(tag) + "'", nullptr, 0, budget);
  }

  void all_gather(const void* send, void* recv, std::size_t bytes,
                  std::chrono::milliseconds budget) override {
    EPMOE_CHECK_ARG(bytes <= kShmMaxGatherBytes, "all_gather.bytes",
                    detail::concat("at most ", kShmMaxGatherBytes, " bytes per rank"), bytes);
    exchange("all_gather", send, bytes, budget, recv);
  }

 private:
  void join(const std::string& name) {
    const auto deadline = Clock::now() + setup_budget_;
    Backoff backoff;
    for (;;) {
      const int fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd >= 0) {
        struct stat st {};
        const bool sized = fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof(Control));
        close(fd);
        if (sized) {
          control_map_ = map_object(name, sizeof(Control), false);
          control_ = static_cast<Control*>(control_map_.ptr);
          while (control_->ready.load(std::memory_order_acquire) != kReady) {
            EPMOE_EXPECT(Clock::now() < deadline, timeout, "shm session " + session_,
                         "rank 0 to initialise the control segment", "no initialisation in time");
            backoff.wait();
          }
          EPMOE_CHECK_ARG(control_->size == size_, "size",
                          detail::concat(size_, " ranks (as rank ", rank_, ")"),
                          detail::concat(control_->size, " ranks on rank 0"));
          return;
        }
      }
      EPMOE_EXPECT(Clock::now() < deadline, timeout, "shm session " + session_,
                   detail::concat("rank 0 to create the session within ", setup_budget_.count(),
                                  " ms"),
                   "no control segment (rank(s) 0 did not arrive)");
      backoff.wait();
    }
  }

  std::string buffer_name(int handle, int rank) const {
    return "/epmoe-" + session_ + "-b" + std::to_string(handle) + "-r" + std::to_string(rank);
  }

  // One collective: contributes `bytes` of `send`, waits up to `budget` for every rank, then copies
  // every rank's contribution (rank-major) into `recv` when it is not null.
  void exchange(const std::string& tag, const void* send, std::size_t bytes,
                std::chrono::milliseconds budget, void* recv = nullptr) {
    const auto deadline = Clock::now() + budget;
    const uint64_t n = next_round_;
    Slot& slot = control_->slots[n % kSlots];
    const uint64_t bit = uint64_t{1} << rank_;
    const uint64_t all = (size_ == 64) ? ~kComplete : ((uint64_t{1} << size_) - 1);
    Backoff backoff;
    // The slot is free once every rank has taken the round kSlots before this one.
    while (slot.round.load(std::memory_order_acquire) != n) {
      if (Clock::now() >= deadline) {
        detail::throw_error(ErrorKind::timeout, tag,
                            detail::concat("expected all ", size_, " ranks to finish collective #",
                                           n - kSlots, " within ", budget.count(),
                                           " ms before ", tag, ", got a rank still in it"),
                            __FILE__, __LINE__);
      }
      backoff.wait();
    }
    std::strncpy(slot.tags[rank_], tag.c_str(), kTagBytes - 1);
    slot.tags[rank_][kTagBytes - 1] = '\0';
    slot.bytes[rank_] = static_cast<uint32_t>(bytes);
    if (bytes > 0) std::memcpy(slot.payload[rank_], send, bytes);

    uint64_t state = slot.state.load();
    for (;;) {
      uint64_t next = state | bit;
      if ((next & all) == all) next |= kComplete;
      if (slot.state.compare_exchange_weak(state, next)) break;
    }
    backoff = Backoff();
    while (!(slot.state.load(std::memory_order_acquire) & kComplete)) {
      if (Clock::now() >= deadline) {
        // Withdraw unless the round completed meanwhile; one CAS decides, so all ranks agree.
        state = slot.state.load();
        bool withdrawn = false;
        while (!(state & kComplete)) {
          if (slot.state.compare_exchange_weak(state, state & ~bit)) {
            withdrawn = true;
            break;
          }
        }
        if (withdrawn) {
          detail::throw_error(
              ErrorKind::timeout, tag,
              detail::concat("expected all ", size_, " ranks at ", tag, " within ",
                             budget.count(), " ms, got no arrival from rank(s) ",
                             rank_list(all & ~state, size_), " (rank ", rank_,
                             " waited and withdrew; collective #", n, ")"),
              __FILE__, __LINE__);
        }
        break;
      }
      backoff.wait();
    }

    // Complete: read everything out before marking the round taken.
    std::string mismatch;
    for (int r = 0; r < size_ && mismatch.empty(); ++r) {
      if (std::strncmp(slot.tags[r], tag.c_str(), kTagBytes - 1) != 0) {
        mismatch = detail::concat("rank ", r, " calling ", slot.tags[r]);
      } else if (slot.bytes[r] != bytes) {
        mismatch = detail::concat(slot.bytes[r], " bytes from rank ", r);
      }
    }
    if (mismatch.empty() && recv != nullptr && bytes > 0) {
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<char*>(recv) + r * bytes, slot.payload[r], bytes);
      }
    }
    ++next_round_;
    if (slot.taken.fetch_add(1) + 1 == static_cast<uint32_t>(size_)) {
      slot.taken.store(0);
      slot.state.store(0);
      slot.round.store(n + kSlots, std::memory_order_release);
    }
    EPMOE_EXPECT(mismatch.empty(), internal, tag,
                 detail::concat("every rank at collective #", n, " to call ", tag, " with ", bytes,
                                " bytes"),
                 mismatch);
  }

  std::string session_;
  int rank_;
  int size_;
  std::chrono::milliseconds setup_budget_;
  Mapping control_map_;
  Control* control_ = nullptr;
  uint64_t next_round_ = 0;
  int next_handle_ = 0;
  std::vector<std::pair<int, std::vector<Mapping>>> buffers_;
};

bool valid_session(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

std::shared_ptr<Transport> make_shm_transport(const std::string& session, int rank, int size,
                                              std::chrono::milliseconds setup_budget) {
  EPMOE_CHECK_ARG(valid_session(session), "session",
                  "1 to 64 characters of [A-Za-z0-9_-]", "'" + session + "'");
  EPMOE_CHECK_ARG(size >= 1 && size <= kShmMaxRanks, "size",
                  detail::concat("1 to ", kShmMaxRanks, " ranks"), size);
  EPMOE_CHECK_ARG(rank >= 0 && rank < size, "rank",
                  detail::concat("a rank in [0, ", size, ")"), rank);
  return std::make_shared<ShmTransport>(session, rank, size, setup_budget);
}

}  // namespace epmoe
