// ThreadTransport: barriers with a time budget (timeout names the missing rank and withdraws),
// symmetric buffers visible across ranks, all_gather, collective mismatch detection.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <latch>
#include <string>
#include <vector>

#include "epmoe/error.h"
#include "epmoe/transport.h"
#include "harness.h"

namespace epmoe {
namespace {

using namespace std::chrono_literals;
using test::run_on_ranks;

TEST(ThreadTransport, RanksSizeAndDevice) {
  run_on_ranks(3, [](int rank, std::shared_ptr<Transport> t) {
    EXPECT_EQ(t->rank(), rank);
    EXPECT_EQ(t->size(), 3);
    EXPECT_EQ(t->device(), Device::cpu());
  });
}

TEST(ThreadTransport, RejectsBadGroupSizeAndRank) {
  try {
    ThreadTransportGroup bad(0);
    FAIL() << "a group of 0 ranks was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_EQ(e.argument(), "num_ranks");
  }
  ThreadTransportGroup group(2);
  try {
    group.transport(2);
    FAIL() << "rank 2 of a 2-rank group was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "rank");
  }
}

TEST(ThreadTransport, BarrierTimeoutNamesMissingRankAndNextBarrierMatches) {
  // Rank 2 skips the first barrier; ranks 0 and 1 time out naming rank 2 and withdraw. Rank 2 then
  // joins the next barrier only after both have withdrawn, and all three meet there.
  std::latch both_timed_out(2);
  std::atomic<int> timeouts{0};
  run_on_ranks(3, [&](int rank, std::shared_ptr<Transport> t) {
    if (rank != 2) {
      const auto start = std::chrono::steady_clock::now();
      try {
        t->barrier("first", 100ms);
        ADD_FAILURE() << "rank " << rank << " passed a barrier rank 2 never reached";
      } catch (const Error& e) {
        const auto waited = std::chrono::steady_clock::now() - start;
        EXPECT_EQ(e.kind(), ErrorKind::timeout);
        const std::string msg = e.what();
        EXPECT_NE(msg.find("first"), std::string::npos) << msg;
        EXPECT_NE(msg.find("rank(s) 2 "), std::string::npos) << msg;
        EXPECT_NE(e.argument().find("first"), std::string::npos) << e.argument();
        EXPECT_GE(waited, 100ms);
        EXPECT_LT(waited, 5s);
        ++timeouts;
      }
      both_timed_out.count_down();
    } else {
      both_timed_out.wait();
    }
    t->barrier("second", 10s);
    t->barrier("third", 10s);
  });
  EXPECT_EQ(timeouts.load(), 2);
}

TEST(ThreadTransport, TimeoutNamesEveryMissingRank) {
  std::latch done(1);
  run_on_ranks(4, [&](int rank, std::shared_ptr<Transport> t) {
    if (rank == 1) {
      try {
        t->barrier("lonely", 50ms);
        ADD_FAILURE() << "barrier passed without ranks 0, 2, 3";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("rank(s) 0, 2, 3 "), std::string::npos) << e.what();
      }
      done.count_down();
    } else {
      done.wait();
    }
    t->barrier("all", 10s);
  });
}

TEST(ThreadTransport, MismatchedCollectivesFailOnEveryRank) {
  std::atomic<int> errors{0};
  run_on_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    try {
      t->barrier(rank == 0 ? "forward" : "backward", 10s);
      ADD_FAILURE() << "ranks met at barriers with different tags";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::internal);
      const std::string msg = e.what();
      EXPECT_NE(msg.find("forward"), std::string::npos) << msg;
      EXPECT_NE(msg.find("backward"), std::string::npos) << msg;
      ++errors;
    }
    t->barrier("after", 10s);  // the failed round is consumed on every rank alike
  });
  EXPECT_EQ(errors.load(), 2);
}

TEST(ThreadTransport, SymmetricBuffersAreZeroAlignedAndVisibleAcrossRanks) {
  constexpr int R = 4;
  constexpr std::size_t kBytes = 1000;  // not a multiple of 128
  run_on_ranks(R, [&](int rank, std::shared_ptr<Transport> t) {
    SymmetricBuffer b = t->allocate_symmetric(kBytes, "test");
    ASSERT_EQ(b.peers.size(), static_cast<std::size_t>(R));
    EXPECT_EQ(b.peers[rank], b.local);
    EXPECT_EQ(b.bytes, kBytes);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.local) % 128, 0u);
    auto* mine = static_cast<unsigned char*>(b.local);
    for (std::size_t i = 0; i < kBytes; ++i) ASSERT_EQ(mine[i], 0) << "byte " << i;

    // Rank-coded bytes in the own copy; every rank reads every peer's copy after a barrier.
    for (std::size_t i = 0; i < kBytes / 2; ++i)
      mine[i] = static_cast<unsigned char>(rank * 50 + i % 50);
    t->barrier("written", 10s);
    for (int q = 0; q < R; ++q) {
      const auto* theirs = static_cast<const unsigned char*>(b.peers[q]);
      for (std::size_t i = 0; i < kBytes / 2; ++i) {
        ASSERT_EQ(theirs[i], static_cast<unsigned char>(q * 50 + i % 50)) << "rank " << q;
      }
    }
    // Remote stores: each rank writes its id into the upper half of its right neighbour's copy.
    auto* right = static_cast<unsigned char*>(b.peers[(rank + 1) % R]);
    right[kBytes / 2 + rank] = static_cast<unsigned char>(100 + rank);
    t->barrier("stored", 10s);
    const int left = (rank + R - 1) % R;
    EXPECT_EQ(mine[kBytes / 2 + left], 100 + left);

    SymmetricBuffer second = t->allocate_symmetric(64, "second");
    EXPECT_NE(second.local, b.local);
    EXPECT_NE(second.handle, b.handle);
    t->release_symmetric(second);
    t->release_symmetric(b);
    EXPECT_EQ(b.local, nullptr);
    EXPECT_TRUE(b.peers.empty());
  });
}

TEST(ThreadTransport, SymmetricSizeMismatchFailsOnEveryRank) {
  std::atomic<int> errors{0};
  run_on_ranks(2, [&](int rank, std::shared_ptr<Transport> t) {
    try {
      t->allocate_symmetric(rank == 0 ? 256 : 512, "sized");
      ADD_FAILURE() << "ranks allocated different sizes";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
      EXPECT_EQ(e.argument(), "sized");
      ++errors;
    }
  });
  EXPECT_EQ(errors.load(), 2);
}

TEST(ThreadTransport, AllGatherIsRankMajor) {
  constexpr int R = 3;
  run_on_ranks(R, [&](int rank, std::shared_ptr<Transport> t) {
    for (int round = 0; round < 3; ++round) {  // back-to-back rounds must not mix
      const int32_t send[2] = {rank * 10 + round, -rank};
      int32_t recv[2 * R] = {};
      t->all_gather(send, recv, sizeof(send), 10s);
      for (int q = 0; q < R; ++q) {
        EXPECT_EQ(recv[2 * q], q * 10 + round);
        EXPECT_EQ(recv[2 * q + 1], -q);
      }
    }
  });
}

TEST(ThreadTransport, SingleRankCollectivesReturnAtOnce) {
  run_on_ranks(1, [](int, std::shared_ptr<Transport> t) {
    t->barrier("solo", 1ms);
    SymmetricBuffer b = t->allocate_symmetric(16, "solo");
    EXPECT_EQ(b.peers.size(), 1u);
    int64_t v = 7, out = 0;
    t->all_gather(&v, &out, sizeof(v), 1ms);
    EXPECT_EQ(out, 7);
    t->release_symmetric(b);
  });
}

}  // namespace
}  // namespace epmoe
