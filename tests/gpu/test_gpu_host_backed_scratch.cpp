// Host-backed scratch on one GPU (Config.scratch_device_bytes; cuda/host_backed_arena.h): the
// arena is one VMM range, device memory then pinned host memory. Forward and backward give the
// same bits as with all scratch in device memory (the kernels do not know where a page lives),
// the host part is host memory by the driver's own record of the allocation, the default path is
// one cudaMalloc, and contexts release their ranges (create/close repeatedly).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/host_backed_arena.h"
#include "device_call.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/memory_plan.h"
#include "moe_case.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

Problem problem(int64_t T, int64_t D, int64_t F, int experts, int K) {
  return make_problem(1, T, D, F, K, experts);
}

// share 0: the routing part alone on the device; 0.5: the device part ends inside the call scratch.
Problem with_device_share(Problem p, double share) {
  const MemoryPlan plan = plan_memory(p.config(), 1);
  const int64_t minimum = plan.scratch_device_minimum_bytes;
  p.scratch_device_bytes =
      minimum + static_cast<int64_t>(share * static_cast<double>(plan.scratch_bytes - minimum));
  return p;
}

std::vector<RankOutputs> run_gpu_layer(const Config& config, const Problem& p,
                                       const RankInputs& in) {
  auto ctx = Context::create(config, make_single_gpu_transport(0));
  DeviceCall call(p, in);
  std::vector<RankOutputs> out{run_once(*ctx, call, nullptr)};
  out.push_back(run_once(*ctx, call, nullptr));  // the same context again: scratch reused
  ctx->close();
  return out;
}
std::vector<RankOutputs> run_gpu_layer(const Problem& p, const RankInputs& in) {
  return run_gpu_layer(p.config(), p, in);
}

TEST(GpuHostBackedScratch, SameBitsAsAllDevice) {
  EPMOE_REQUIRE_GPU();
  std::vector<Problem> problems{problem(64, 128, 96, 8, 2), problem(333, 256, 520, 16, 4)};
  Problem unfused = problem(96, 192, 136, 8, 2);
  unfused.fused = false;
  problems.push_back(unfused);
  uint64_t seed = 41;
  for (const Problem& p : problems) {
    const auto in = make_inputs(p, seed++, p.max_tokens);
    const auto all_device = run_gpu_layer(p, in[0]);
    for (const double share : {0.0, 0.5}) {
      const Problem q = with_device_share(p, share);
      ASSERT_TRUE(plan_memory(q.config(), 1).host_backed_scratch) << q.name();
      expect_bitwise_equal(all_device, run_gpu_layer(q, in[0]),
                           p.name() + " host-backed scratch, device share " + std::to_string(share));
    }
  }
}

// Both at once: the minimum slot budget (the layer recomputes; backward's replay rebuilds
// x_gathered in the call scratch and the W13 GEMMs read it through the arena descriptor) with
// only the routing part on the device, so that x_gathered lies in host pages. 2D = 272 (granule
// 2176): the call scratch sits behind a non-zero pad. Same bits as the full save on the device.
TEST(GpuHostBackedScratch, RecomputeFromHostBackedCallScratch) {
  EPMOE_REQUIRE_GPU();
  const Problem p = problem(96, 136, 104, 8, 2);
  const auto in = make_inputs(p, 47, 61);
  const MemoryPlan plan = plan_memory(p.config(), 1);
  ASSERT_EQ(plan.packing_granule_bytes, 2176);
  ASSERT_GT(plan.call_scratch_pad_bytes, 0);
  const auto all_device = run_gpu_layer(p, in[0]);
  ConfigFields f = p.config().fields();
  f.slots.slot_bytes = plan.minimum_slot_bytes;
  f.scratch_device_bytes = plan.scratch_device_minimum_bytes;
  const Config config(f);
  const MemoryPlan split = plan_memory(config, 1);
  ASSERT_TRUE(split.host_backed_scratch);
  ASSERT_EQ(split.scratch_device_bytes, split.scratch_device_minimum_bytes);
  expect_bitwise_equal(all_device, run_gpu_layer(config, p, in[0]),
                       p.name() + " recompute from a host-backed call scratch");
}

TEST(GpuHostBackedScratch, HostPartIsHostMemory) {
  EPMOE_REQUIRE_GPU();
  const Problem p = with_device_share(problem(64, 128, 96, 8, 2), 0.5);
  const MemoryPlan plan = plan_memory(p.config(), 1);
  auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
  const ArenaMemory a = ctx->arena_memory();
  ASSERT_EQ(a.device_bytes, plan.arena_device_bytes);
  ASSERT_EQ(a.host_bytes, plan.arena_host_bytes);
  ASSERT_GT(a.device_bytes, 0);
  ASSERT_GT(a.host_bytes, 0);
  // Physical parts: whole granules (2 MiB on H100/H200), at least the planned bytes.
  EXPECT_GE(a.device_held_bytes, a.device_bytes);
  EXPECT_GE(a.host_held_bytes, a.host_bytes);
  EXPECT_EQ(a.device_held_bytes % 4096, 0);
  EXPECT_EQ(a.host_held_bytes % 4096, 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.base) % 128, 0u);
  const char* base = static_cast<const char*>(a.base);
  using cuda::MappedLocation;
  EXPECT_EQ(cuda::mapped_location(base), MappedLocation::device);
  EXPECT_EQ(cuda::mapped_location(base + a.device_bytes - 1), MappedLocation::device);
  EXPECT_EQ(cuda::mapped_location(base + a.device_bytes), MappedLocation::host);
  EXPECT_EQ(cuda::mapped_location(base + a.device_bytes + a.host_bytes - 1), MappedLocation::host);
  ctx->close();
}

TEST(GpuHostBackedScratch, DefaultIsOneCudaMalloc) {
  EPMOE_REQUIRE_GPU();
  const Problem p = problem(64, 128, 96, 8, 2);
  const MemoryPlan plan = plan_memory(p.config(), 1);
  auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
  const ArenaMemory a = ctx->arena_memory();
  EXPECT_EQ(a.device_bytes, plan.arena_bytes);
  EXPECT_EQ(a.host_bytes, 0);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, a.base), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
  ctx->close();
}

TEST(GpuHostBackedScratch, CreateAndCloseRepeatedly) {
  EPMOE_REQUIRE_GPU();
  const Problem p = with_device_share(problem(64, 128, 96, 8, 2), 0.0);
  size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int i = 0; i < 20; ++i) {
    auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
    ctx->close();
    ctx->close();  // idempotent
  }
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  // Nothing held after close (a leak would be >= 20 device granules of 2 MiB).
  EXPECT_GE(free_after + (8u << 20), free_before);
}

}  // namespace
}  // namespace epmoe::test
