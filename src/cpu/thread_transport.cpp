// ThreadTransport: R ranks as threads of one process. Every collective is one "round" in a shared
// table: each rank contributes a tag and a payload, the round completes when all R have arrived.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "epmoe/transport.h"

namespace epmoe {

namespace {

// Collectives without a budget argument (setup and teardown) wait this long for their peers.
constexpr std::chrono::milliseconds kSetupBudget{60000};

using Payload = std::vector<char>;

// One collective call of all ranks. Ranks number their collectives 0, 1, 2, ... in call order, so
// round n of every rank meets in rounds[n] whatever kind of collective it is; tags catch ranks
// that call different collectives.
struct Round {
  explicit Round(int R) : arrived(R, false), seen(R, false), tags(R), payloads(R) {}
  std::vector<bool> arrived;  // contributing now
  std::vector<bool> seen;     // arrived at some point (a rank that timed out withdrew, but came)
  std::vector<std::string> tags;
  std::vector<Payload> payloads;
  int count = 0;
  bool complete = false;
  int taken = 0;  // ranks that have copied the result out; the last one erases the round
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

struct ThreadTransportGroup::State {
  explicit State(int R) : size(R), next_round(R, 0) {}

  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int64_t> next_round;  // per rank: number of its next collective
  std::map<int64_t, Round> rounds;  // std::map: references stay valid while others insert

  // Adds this rank's contribution to its next round and waits (up to `budget`) for every rank.
  // On timeout the contribution is withdrawn and the round number is not consumed, so the next
  // collective of all ranks still meets in one round. Returns every rank's payload (rank-major).
  std::vector<Payload> exchange(int rank, const std::string& tag, Payload payload,
                                std::chrono::milliseconds budget, int64_t* round_out = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + budget;
    std::unique_lock<std::mutex> lock(mu);
    const int64_t n = next_round[rank];
    Round& round = rounds.try_emplace(n, size).first->second;
    round.arrived[rank] = true;
    round.seen[rank] = true;
    round.tags[rank] = tag;
    round.payloads[rank] = std::move(payload);
    if (++round.count == size) {
      round.complete = true;
      cv.notify_all();
    }
    if (!cv.wait_until(lock, deadline, [&] { return round.complete; })) {
      // Name only the ranks that never came; ranks that came and gave up first are listed apart.
      std::vector<int> missing, gave_up;
      for (int r = 0; r < size; ++r) {
        if (!round.seen[r]) missing.push_back(r);
        if (round.seen[r] && !round.arrived[r]) gave_up.push_back(r);
      }
      round.arrived[rank] = false;
      round.tags[rank].clear();
      round.payloads[rank].clear();
      if (--round.count == 0) rounds.erase(n);
      lock.unlock();
      detail::throw_error(
          ErrorKind::timeout, tag,
          detail::concat("expected all ", size, " ranks at ", tag, " within ", budget.count(),
                         " ms, got no arrival from rank(s) ", rank_list(missing), " (rank ", rank,
                         " waited and withdrew",
                         gave_up.empty() ? "" : "; came but timed out first: rank(s) ",
                         rank_list(gave_up), "; collective #", n, ")"),
          __FILE__, __LINE__);
    }
    std::vector<Payload> result = round.payloads;
    const std::vector<std::string> tags = round.tags;
    ++next_round[rank];
    if (++round.taken == size) rounds.erase(n);
    lock.unlock();

    // Every rank sees the same tags, so a mismatch is reported on every rank alike.
    for (int r = 0; r < size; ++r) {
      EPMOE_EXPECT(tags[r] == tag, internal, tag,
                   detail::concat("every rank at collective #", n, " to call ", tag),
                   detail::concat("rank ", r, " calling ", tags[r]));
    }
    if (round_out != nullptr) *round_out = n;
    return result;
  }
};

namespace {

class ThreadTransport final : public Transport {
 public:
  ThreadTransport(std::shared_ptr<ThreadTransportGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  Device device() const override { return Device::cpu(); }

  SymmetricBuffer allocate_symmetric(std::size_t bytes, std::string_view tag) override {
    // Whole 128-byte blocks: aligned_alloc needs a multiple of the alignment.
    const auto padded = static_cast<std::size_t>(
        align_bytes(static_cast<int64_t>(std::max<std::size_t>(bytes, 1))));
    void* local = std::aligned_alloc(static_cast<std::size_t>(kAlignment), padded);
    EPMOE_EXPECT(local != nullptr, backend, std::string(tag),
                 detail::concat(padded, " bytes of host memory"), "an allocation failure");
    std::memset(local, 0, padded);

    struct Entry {
      void* ptr;
      std::size_t bytes;
    };
    const Entry mine{local, bytes};
    Payload payload(sizeof(Entry));
    std::memcpy(payload.data(), &mine, sizeof(Entry));
    std::vector<Payload> all;
    int64_t round = -1;
    try {
      all = state_->exchange(rank_, "allocate_symmetric '" + std::string(tag) + "'",
                             std::move(payload), kSetupBudget, &round);
    } catch (...) {
      std::free(local);
      throw;
    }
    SymmetricBuffer buffer;
    buffer.local = local;
    buffer.bytes = bytes;
    buffer.handle = static_cast<int>(round);
    buffer.peers.resize(all.size());
    for (std::size_t r = 0; r < all.size(); ++r) {
      Entry e{};
      std::memcpy(&e, all[r].data(), sizeof(Entry));
      if (e.bytes != bytes) {
        std::free(local);
        EPMOE_CHECK_ARG(false, std::string(tag),
                        detail::concat(bytes, " bytes on every rank (as rank ", rank_, ")"),
                        detail::concat(e.bytes, " bytes on rank ", r));
      }
      buffer.peers[r] = e.ptr;
    }
    return buffer;
  }

  void release_symmetric(SymmetricBuffer& buffer) override {
    // Every rank must be done reading its peers' copies before any copy is freed: one round.
    const int handle = buffer.handle;
    Payload payload(sizeof(int));
    std::memcpy(payload.data(), &handle, sizeof(int));
    std::vector<Payload> all =
        state_->exchange(rank_, "release_symmetric", std::move(payload), kSetupBudget);
    for (std::size_t r = 0; r < all.size(); ++r) {
      int theirs = 0;
      std::memcpy(&theirs, all[r].data(), sizeof(int));
      EPMOE_EXPECT(theirs == handle, internal, "SymmetricBuffer",
                   detail::concat("every rank to release buffer #", handle),
                   detail::concat("rank ", r, " releasing buffer #", theirs));
    }
    std::free(buffer.local);
    buffer = SymmetricBuffer{};
  }

  void barrier(std::string_view tag, std::chrono::milliseconds budget) override {
    state_->exchange(rank_, "barrier '" + std::string(tag) + "'", Payload{}, budget);
  }

  void all_gather(const void* send, void* recv, std::size_t bytes,
                  std::chrono::milliseconds budget) override {
    Payload payload(bytes);
    if (bytes > 0) std::memcpy(payload.data(), send, bytes);
    std::vector<Payload> all = state_->exchange(rank_, "all_gather", std::move(payload), budget);
    char* out = static_cast<char*>(recv);
    for (std::size_t r = 0; r < all.size(); ++r) {
      EPMOE_CHECK_ARG(all[r].size() == bytes, "all_gather.bytes",
                      detail::concat(bytes, " bytes from every rank (as rank ", rank_, ")"),
                      detail::concat(all[r].size(), " bytes from rank ", r));
      if (bytes > 0) std::memcpy(out + r * bytes, all[r].data(), bytes);
    }
  }

 private:
  std::shared_ptr<ThreadTransportGroup::State> state_;
  int rank_;
};

}  // namespace

ThreadTransportGroup::ThreadTransportGroup(int num_ranks) {
  EPMOE_CHECK_ARG(num_ranks >= 1, "num_ranks", "at least 1 rank", num_ranks);
  state_ = std::make_shared<State>(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    transports_.push_back(std::make_shared<ThreadTransport>(state_, r));
  }
}

ThreadTransportGroup::~ThreadTransportGroup() = default;

int ThreadTransportGroup::size() const { return state_->size; }

std::shared_ptr<Transport> ThreadTransportGroup::transport(int rank) {
  EPMOE_CHECK_ARG(rank >= 0 && rank < size(), "rank",
                  "a rank in [0, " + std::to_string(size()) + ")", rank);
  return transports_[rank];
}

}  // namespace epmoe
