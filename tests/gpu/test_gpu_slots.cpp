// Activation-slot kernels (cuda/slots.cu) against their CPU twins: the one-thread forward and
// backward planners give the same LayerPlan and slot state bit for bit over a stack of layers,
// and the input copies move the live rows of x (and the replay's restore zeroes the dispatch
// arrival counters) only when the layer replays.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/slot_plan.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

constexpr int kR = 3;       // ranks the planner accounts for (it needs only their row counts)
constexpr int kLayers = 4;  // L

// Device and host copies of one slot's planner inputs and outputs.
struct PlannerRig {
  Backend& dev;
  Backend& host;
  SlotGeometry g;
  struct Side {
    char* block = nullptr;  // header [32] | recv_rows [R] | state | saved [R] | plans [L]
    Step step;
  } d, h;
  static constexpr int64_t kHeader = 0, kRows = 128, kState = 256, kSaved = 384, kPlans = 512;
  static constexpr int64_t kBytes = kPlans + kLayers * 128;

  PlannerRig(Backend& device, Backend& cpu, const SlotGeometry& geometry)
      : dev(device), host(cpu), g(geometry) {
    d.block = static_cast<char*>(dev.allocate(kBytes));
    h.block = static_cast<char*>(host.allocate(kBytes));
    for (Side* s : {&d, &h}) {
      s->step.dims = Dims{g.T, g.D, g.F, g.K, 1, g.R};
      s->step.layout.header = reinterpret_cast<int32_t*>(s->block + kHeader);
      s->step.layout.recv_rows_R = reinterpret_cast<int32_t*>(s->block + kRows);
      s->step.slot_state = reinterpret_cast<SlotState*>(s->block + kState);
      s->step.slot_saved_R = reinterpret_cast<int64_t*>(s->block + kSaved);
      s->step.slot_geometry = g;
      s->step.slot = 0;
      s->step.rank = 1;
    }
  }
  ~PlannerRig() {
    dev.release(d.block);
    host.release(h.block);
  }
  void set_layer(int layer, const std::vector<int32_t>& rows, bool skip) {
    std::vector<int32_t> header(32, 0);
    header[kLayoutSkip] = skip ? 1 : 0;
    for (Side* s : {&d, &h}) {
      s->step.layer_plan = reinterpret_cast<LayerPlan*>(s->block + kPlans + layer * 128);
    }
    std::memcpy(h.block + kHeader, header.data(), 128);
    std::memcpy(h.block + kRows, rows.data(), rows.size() * 4);
    dev.copy_to_device(d.block + kHeader, header.data(), 128);
    dev.copy_to_device(d.block + kRows, rows.data(), rows.size() * 4);
  }
  void expect_same(const std::string& what) {
    std::vector<char> got(kBytes);
    dev.synchronize(nullptr);
    dev.copy_to_host(got.data(), d.block, kBytes);
    EXPECT_EQ(std::memcmp(got.data(), h.block, kBytes), 0) << what;
  }
  LayerPlan host_plan(int layer) const {
    LayerPlan p;
    std::memcpy(&p, h.block + kPlans + layer * 128, sizeof(p));
    return p;
  }
};

SlotGeometry geometry(int64_t packed_bytes) {
  SlotGeometry g;
  g.T = 64;
  g.D = 136;  // 2D = 272: granule lcm(128, 272) = 2176
  g.F = 96;
  g.K = 4;
  g.R = kR;
  g.layers_per_slot = kLayers;
  g.granule = packing_granule(g.D);
  g.packed_bytes = packed_bytes;
  g.packed_base = 3 * g.granule;
  g.scratch_x_gathered = 1 << 20;
  g.scratch_h13 = (1 << 20) + (1 << 16);
  return g;
}

TEST(GpuSlots, PlannersMatchTheCpuTwinOverAStack) {
  EPMOE_REQUIRE_GPU();
  std::unique_ptr<Backend> dev = make_cuda_backend(0);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int32_t> rows_of(0, 600);
  // Budgets from the minimum (every layer recomputes) to far above (none does), plus skips.
  const int64_t x_b = input_save_bytes(64, 136, packing_granule(136));
  for (int64_t packed : {kLayers * x_b, 3 * x_b + 400000, int64_t{1200000}, int64_t{1} << 40}) {
    PlannerRig rig(*dev, *cpu, geometry(packed));
    std::vector<std::vector<int32_t>> rows(kLayers, std::vector<int32_t>(kR));
    const bool skip_layer_2 = packed == 1200000;
    int recomputed = 0;
    for (int l = 0; l < kLayers; ++l) {
      for (int32_t& r : rows[l]) r = rows_of(rng);
      rig.set_layer(l, rows[l], skip_layer_2 && l == 2);
      dev->plan_forward(rig.d.step);
      cpu->plan_forward(rig.h.step);
      rig.expect_same("forward, packed " + std::to_string(packed) + ", layer " + std::to_string(l));
      recomputed += rig.host_plan(l).recompute;
    }
    if (packed == kLayers * x_b) {
      EXPECT_EQ(recomputed, kLayers) << "the minimum saves inputs only";
    }
    if (packed == int64_t{1} << 40) {
      EXPECT_EQ(recomputed, 0);
    }
    for (int l = kLayers - 1; l >= 0; --l) {  // LIFO, each layer with the layout its forward saw
      rig.set_layer(l, rows[l], skip_layer_2 && l == 2);
      dev->plan_backward(rig.d.step);
      cpu->plan_backward(rig.h.step);
      rig.expect_same("backward, packed " + std::to_string(packed) + ", layer " + std::to_string(l));
    }
  }
}

TEST(GpuSlots, BackwardRewindsToEmpty) {
  EPMOE_REQUIRE_GPU();
  std::unique_ptr<Backend> dev = make_cuda_backend(0);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  const int64_t x_b = input_save_bytes(64, 136, packing_granule(136));
  PlannerRig rig(*dev, *cpu, geometry(2 * x_b + 300000));
  const std::vector<std::vector<int32_t>> rows = {{100, 7, 300}, {0, 0, 0}, {512, 3, 9}, {40, 41, 42}};
  for (int l = 0; l < kLayers; ++l) {
    rig.set_layer(l, rows[l], false);
    dev->plan_forward(rig.d.step);
    cpu->plan_forward(rig.h.step);
  }
  rig.expect_same("after the forwards");
  for (int l = kLayers - 1; l >= 0; --l) {
    rig.set_layer(l, rows[l], false);
    dev->plan_backward(rig.d.step);
    cpu->plan_backward(rig.h.step);
  }
  rig.expect_same("after the backwards");
  SlotState st;
  std::vector<int64_t> saved(kR);
  dev->copy_to_host(&st, rig.d.block + PlannerRig::kState, sizeof(st));
  dev->copy_to_host(saved.data(), rig.d.block + PlannerRig::kSaved, kR * 8);
  EXPECT_EQ(st.layers, 0);
  EXPECT_EQ(saved, std::vector<int64_t>(kR, 0));
  EXPECT_GT(st.peak_bytes, 0);
}

TEST(GpuSlots, InputCopiesRunOnlyForReplayingLayers) {
  EPMOE_REQUIRE_GPU();
  std::unique_ptr<Backend> dev = make_cuda_backend(0);
  const int64_t T = 64, D = 136, live = 37;
  const int64_t x_bytes = T * D * 2;
  char* arena = static_cast<char*>(dev->allocate(static_cast<size_t>(4 * x_bytes)));
  auto* x_TD = static_cast<bf16_t*>(dev->allocate(static_cast<size_t>(x_bytes)));
  auto* dispatch_TD = static_cast<bf16_t*>(dev->allocate(static_cast<size_t>(x_bytes)));
  auto** dispatch_R = static_cast<bf16_t**>(dev->allocate(8));
  auto* header = static_cast<int32_t*>(dev->allocate(128));
  auto* plan = static_cast<LayerPlan*>(dev->allocate(sizeof(LayerPlan)));
  dev->copy_to_device(dispatch_R, &dispatch_TD, 8);
  std::vector<int32_t> h(32, 0);
  h[kLayoutLive] = static_cast<int32_t>(live);
  dev->copy_to_device(header, h.data(), 128);
  std::vector<bf16_t> x(static_cast<size_t>(T * D));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<bf16_t>(0x3f00 + i % 251);
  dev->copy_to_device(x_TD, x.data(), static_cast<size_t>(x_bytes));

  Step s;
  s.dims = Dims{T, D, 96, 4, 1, 1};
  s.capacity_rows = 300;  // 3 dispatch arrival counters, which the replay's restore zeroes
  const RouteScratchLayout rl = route_scratch_layout(s.dims, s.capacity_rows);
  auto* route_scratch = static_cast<char*>(dev->allocate(static_cast<size_t>(rl.total)));
  s.route_scratch = route_scratch;
  const std::vector<uint32_t> stale(static_cast<size_t>(arrival_blocks(s.capacity_rows)), 0xffffffffu);
  s.rank = 0;
  s.arena = arena;
  s.x_TD = x_TD;
  s.dispatch_R = dispatch_R;
  s.layout.header = header;
  s.layer_plan = plan;
  for (int replay : {0, 1}) {
    LayerPlan p;
    p.recompute = replay;
    p.replay_skip = replay ? 0 : 1;
    p.x_offset = 2 * x_bytes;
    dev->copy_to_device(plan, &p, sizeof(p));
    const std::vector<bf16_t> zeros(static_cast<size_t>(T * D), 0);
    dev->copy_to_device(arena + p.x_offset, zeros.data(), static_cast<size_t>(x_bytes));
    dev->copy_to_device(dispatch_TD, zeros.data(), static_cast<size_t>(x_bytes));
    dev->copy_to_device(arrivals_B(s), stale.data(), stale.size() * 4);
    dev->save_input(s);
    dev->restore_input(s);
    dev->synchronize(nullptr);
    std::vector<bf16_t> slot(x.size()), back(x.size());
    dev->copy_to_host(slot.data(), arena + p.x_offset, static_cast<size_t>(x_bytes));
    dev->copy_to_host(back.data(), dispatch_TD, static_cast<size_t>(x_bytes));
    for (int64_t i = 0; i < T * D; ++i) {
      const bf16_t want = replay && i < live * D ? x[static_cast<size_t>(i)] : bf16_t{0};
      ASSERT_EQ(slot[static_cast<size_t>(i)], want) << "slot, replay " << replay << ", element " << i;
      ASSERT_EQ(back[static_cast<size_t>(i)], want) << "dispatch, replay " << replay << ", element " << i;
    }
    std::vector<uint32_t> counters(stale.size());
    dev->copy_to_host(counters.data(), arrivals_B(s), counters.size() * 4);
    EXPECT_EQ(counters, replay ? std::vector<uint32_t>(stale.size(), 0u) : stale)
        << "arrival counters, replay " << replay;
  }
  for (void* ptr : {static_cast<void*>(arena), static_cast<void*>(x_TD),
                    static_cast<void*>(dispatch_TD), static_cast<void*>(dispatch_R),
                    static_cast<void*>(header), static_cast<void*>(plan),
                    static_cast<void*>(route_scratch)}) {
    dev->release(ptr);
  }
}

}  // namespace
}  // namespace epmoe::test
