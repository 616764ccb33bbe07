// Host-backed scratch (Config.scratch_device_bytes) on the CPU backend, whose 'device' memory is
// host memory: the context allocates the same arena total, reports the planned device / host
// split, and computes the same bits as with all scratch on the device.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/context.h"
#include "epmoe/memory_plan.h"
#include "moe_case.h"

namespace epmoe::test {
namespace {

Problem two_ranks(bool fused) {
  Problem p;
  p.ranks = 2;
  p.max_tokens = 16;
  p.hidden = 32;
  p.intermediate = 24;
  p.top_k = 2;
  p.experts = 8;
  p.fused = fused;
  return p;
}

// The smallest device part the planner allows: everything past the routing part is host-backed.
Problem host_backed(Problem p) {
  p.scratch_device_bytes = plan_memory(p.config(), p.ranks).scratch_device_minimum_bytes;
  return p;
}

TEST(HostBackedScratch, SameBitsAsAllDevice) {
  for (const bool fused : {true, false}) {
    const Problem p = two_ranks(fused);
    const Problem q = host_backed(p);
    const MemoryPlan plan = plan_memory(q.config(), q.ranks);
    ASSERT_TRUE(plan.host_backed_scratch) << q.name();
    const auto in = make_inputs(p, 7, p.max_tokens);
    expect_bitwise_equal(run_layer(p, in), run_layer(q, in), p.name() + " host-backed scratch");
  }
}

TEST(HostBackedScratch, ContextReportsThePlannedSplit) {
  const Problem p = host_backed(two_ranks(true));
  const MemoryPlan plan = plan_memory(p.config(), p.ranks);
  ASSERT_GT(plan.arena_host_bytes, 0);
  with_contexts(p, [&](int /*rank*/, Context& ctx) {
    const ArenaMemory a = ctx.arena_memory();
    EXPECT_NE(a.base, nullptr);
    EXPECT_EQ(a.device_bytes, plan.arena_device_bytes);
    EXPECT_EQ(a.host_bytes, plan.arena_host_bytes);
    EXPECT_EQ(a.device_held_bytes, plan.arena_device_bytes);
    EXPECT_EQ(a.host_held_bytes, plan.arena_host_bytes);
    EXPECT_EQ(a.device_held_bytes + a.host_held_bytes, plan.arena_bytes);  // the same total
  });
  const Problem all_device = two_ranks(true);
  const MemoryPlan q = plan_memory(all_device.config(), all_device.ranks);
  with_contexts(all_device, [&](int /*rank*/, Context& ctx) {
    const ArenaMemory a = ctx.arena_memory();
    EXPECT_EQ(a.device_bytes, q.arena_bytes);
    EXPECT_EQ(a.host_bytes, 0);
    EXPECT_EQ(a.device_held_bytes, q.arena_bytes);
    EXPECT_EQ(a.host_held_bytes, 0);
  });
}

}  // namespace
}  // namespace epmoe::test
