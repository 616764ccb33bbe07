// plan_memory: exact bytes. Every expected number is worked out by hand in the comment beside it
// (A(n) = ceil(n / 128) * 128), never by calling the plan_terms functions the planner uses.
//
// Layout of one layer at M rows (src/core/layout.h), with P_cap = min(M, R*T) pulls:
//   A(32*4) header + A((E+1)*4) expert offsets + A(R*4) recv rows + A(M*4) recv src + A(T*K*4)
//   + A(P_cap*4) pull sources + A(P_cap*K*4) pull rows
// G = lcm(128, 2D) packing granule; G(n) = n rounded up to a multiple of G.
// Layer metadata: LayerPlan 128 + layout(M); slot metadata G(L * layer metadata).
// Full save at M rows: G(A(M*D*2) + A(M*2F*2) + A(T*K*D*2)); input save G(A(T*D*2)).
// Slot minimum / balanced / maximum useful: metadata + L * (input / full(T*K) / full(M)).
// Planner state: A(N*32) + A(N*R*8).
// Call scratch at M rows: layout(M) + A(M*D*2) + A(M*2F*2) + A(M*F*2) | + A(M*D*2) + A(M*2F*2)
//   | unfused: + A(M*D*2) + A(M*F*2).
// Route scratch: A(R*T*K*4) + A(R*Eg*4) + A(R*ceil(T*K/2048)*Eg*4) + A(R*T*4) pull of each token
//   + A(R*ceil(T/1024)*4) pulls per token chunk + A(ceil(M/128)*4) dispatch arrival counters.
// Scratch = route | pad | call scratch (| fp8 terms); the pad is the least multiple of 128 that
// makes route + pad + layout(M) a multiple of G (the slots are too), so x_gathered, right after
// the call scratch's layout, starts on a whole row of D bf16.
// E.g. ci-tiny, R=1 (M=128, P_cap=64): layout 1408 + A(64*4)=256 + A(64*2*4)=512 = 2176; route
// scratch 768 + A(64*4)=256 + A(1*4)=128 + A(1*4)=128 = 1280. R=2 (P_cap=128): layout 1408 + 512
// + 1024 = 2944; route scratch 1280 + 512 + 128 + 128 = 2048. small(), R=2 (M=8, P_cap=8): layout
// 640 + 128 + 128 = 896; route scratch 384 + 128 + 128 + 128 = 768. Every total below adds these.
// Pads (G = 256 at D = 128): ci-tiny R=1 1280 + 2176 = 3456 = 13.5 G -> 128; R=2 2048 + 2944 =
// 4992 = 19.5 G -> 128; small() R=2 768 + 896 = 1664 = 6.5 G -> 128.
#include <gtest/gtest.h>

#include <string>

#include "core/plan_terms.h"
#include "epmoe/config.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "memory_plan_test_configs.h"

namespace epmoe {
namespace {

using namespace plan_test;

TEST(MemoryPlan, CiTinyOneRank) {
  const MemoryPlan p = plan_memory(Config(ci_tiny()), 1);
  EXPECT_EQ(p.ep_size, 1);
  EXPECT_EQ(p.experts_global, 8);
  EXPECT_EQ(p.experts_local, 8);
  EXPECT_EQ(p.balanced_recv_rows, 128);   // T*K = 64*2
  EXPECT_EQ(p.max_recv_rows, 128);        // T*R*min(K,E) = 64*1*2
  EXPECT_EQ(p.capacity_factor, 1.0);      // min(1, R=1)
  EXPECT_EQ(p.recv_capacity_rows, 128);   // min(ceil(128*1), 128)
  EXPECT_EQ(p.routing_buffer_bytes, 1152);    // 128 + A(128*4)=512 + A(128*4)=512
  EXPECT_EQ(p.dispatch_buffer_bytes, 16384);  // A(64*128*2)
  EXPECT_EQ(p.combine_buffer_bytes, 32768);   // A(64*2*128*2)
  EXPECT_EQ(p.symmetric_bytes, 50304);        // 1152 + 16384 + 32768
  // layout(128) = 128 + A(9*4)=128 + A(1*4)=128 + A(128*4)=512 + A(128*4)=512
  EXPECT_EQ(p.routing_metadata_bytes, 2176);      // + pulls A(64*4)=256 + A(64*2*4)=512
  EXPECT_EQ(p.layer_metadata_bytes, 2304);          // 128 + 2176
  EXPECT_EQ(p.packing_granule_bytes, 256);          // lcm(128, 2*128)
  EXPECT_EQ(p.saved_input_bytes_per_layer, 16384);  // A(64*128*2), a multiple of 256
  // A(128*128*2)=32768 + A(128*192*2)=49152 = 81920 = 320*256
  EXPECT_EQ(p.saved_full_bytes_balanced, 81920);
  EXPECT_EQ(p.saved_full_bytes_capacity, 81920);  // capacity rows == balanced rows
  EXPECT_EQ(p.num_slots, 1);
  EXPECT_EQ(p.layers_per_slot, 1);
  EXPECT_EQ(p.slot_metadata_bytes, 2304);              // G(1 * 2304) = 9*256
  EXPECT_EQ(p.minimum_slot_bytes, 18688);              // 2304 + 16384
  EXPECT_EQ(p.balanced_full_save_slot_bytes, 84224);  // 2304 + 81920
  EXPECT_EQ(p.maximum_useful_slot_bytes, 84224);
  EXPECT_EQ(p.slot_sizing, SlotSizing::maximum_useful);
  EXPECT_EQ(p.slot_bytes, 84224);
  EXPECT_EQ(p.activation_bytes, 84224);  // 1 slot
  EXPECT_EQ(p.planner_state_bytes, 256);  // A(32) + A(1*1*8)
  // A(1*128*4)=512 + A(1*8*4)=128 + A(1*1*8*4)=128   (1 chunk of 2048 routes)
  EXPECT_EQ(p.route_scratch_bytes, 1280);
  EXPECT_EQ(p.call_scratch_pad_bytes, 128);  // 1280 + layout 2176 = 3456 = 13.5 * 256
  // 1408 + x_gathered 32768 + h13 49152 + h A(128*96*2)=24576
  EXPECT_EQ(p.forward_scratch_bytes, 108672);
  // 108672 + grad_h3 32768 + grad_h13 49152 + row scores A(128*4)=512 + score parts
  // A(128*2*4)=1024 (F = 96: 2 chunks of 64 columns)
  EXPECT_EQ(p.backward_scratch_bytes, 192128);
  EXPECT_EQ(p.scratch_bytes, 193536);           // 1280 + 128 + 192128
  EXPECT_EQ(p.status_bytes, 128);               // A(40)
  EXPECT_EQ(p.peer_table_bytes, 384);           // 3 * A(1*8)
  EXPECT_EQ(p.arena_bytes, 277760);             // 84224 + 193536
  EXPECT_EQ(p.total_bytes, 328832);             // 277760 + 50304 + 128 + 384 + 256
  EXPECT_FALSE(p.inference);
}

TEST(MemoryPlan, CiTinyTwoRanks) {
  const MemoryPlan p = plan_memory(Config(ci_tiny()), 2);
  EXPECT_EQ(p.experts_local, 4);           // 8 / 2
  EXPECT_EQ(p.balanced_recv_rows, 128);    // 64*2
  EXPECT_EQ(p.max_recv_rows, 256);         // 64*2*min(2,4)
  EXPECT_EQ(p.recv_capacity_rows, 128);    // min(ceil(128*1), 256)
  EXPECT_EQ(p.symmetric_bytes, 50304);     // R-independent: 1152 + 16384 + 32768
  // layout(128) = 128 + A(5*4)=128 + A(2*4)=128 + 512 + 512
  EXPECT_EQ(p.routing_metadata_bytes, 2944);       // + pulls A(128*4)=512 + A(128*2*4)=1024
  EXPECT_EQ(p.saved_full_bytes_capacity, 81920);  // 32768 + 49152
  EXPECT_EQ(p.slot_bytes, 84992);                 // metadata 128 + 2944 = 12*256, + 81920
  // A(2*128*4)=1024 + A(2*8*4)=128 + A(2*1*8*4)=128
  EXPECT_EQ(p.route_scratch_bytes, 2048);
  EXPECT_EQ(p.call_scratch_pad_bytes, 128);     // 2048 + layout 2944 = 4992 = 19.5 * 256
  EXPECT_EQ(p.backward_scratch_bytes, 192896);
  EXPECT_EQ(p.scratch_bytes, 195072);           // 2048 + 128 + 192896
  EXPECT_EQ(p.peer_table_bytes, 384);           // 3 * A(2*8)
  EXPECT_EQ(p.planner_state_bytes, 256);        // A(32) + A(1*2*8)
  EXPECT_EQ(p.arena_bytes, 280064);             // 84992 + 195072
  EXPECT_EQ(p.total_bytes, 331136);             // 280064 + 50304 + 128 + 384 + 256
}

TEST(MemoryPlan, SmallTwoRanksTwoLayers) {
  const MemoryPlan p = plan_memory(Config(small()), 2);
  EXPECT_EQ(p.experts_local, 2);         // 4 / 2
  EXPECT_EQ(p.balanced_recv_rows, 8);    // 4*2
  EXPECT_EQ(p.max_recv_rows, 16);        // 4*2*min(2,2)
  EXPECT_EQ(p.recv_capacity_rows, 8);    // min(ceil(8*1), 16)
  EXPECT_EQ(p.routing_buffer_bytes, 384);    // 128 + A(8*4)=128 + A(8*4)=128
  EXPECT_EQ(p.dispatch_buffer_bytes, 1024);  // A(4*128*2)
  EXPECT_EQ(p.combine_buffer_bytes, 2048);   // A(4*2*128*2)
  EXPECT_EQ(p.symmetric_bytes, 3456);        // 384 + 1024 + 2048
  // layout(8) = 128 + A(3*4)=128 + A(2*4)=128 + A(8*4)=128 + A(8*4)=128
  //   + pulls (P_cap = min(8, 2*4) = 8) A(8*4)=128 + A(8*2*4)=128
  EXPECT_EQ(p.routing_metadata_bytes, 896);
  EXPECT_EQ(p.layer_metadata_bytes, 1024);         // 128 + 896
  EXPECT_EQ(p.saved_input_bytes_per_layer, 1024);  // A(4*128*2), a multiple of G = 256
  // A(8*128*2)=2048 + A(8*256*2)=4096
  EXPECT_EQ(p.saved_full_bytes_balanced, 6144);
  EXPECT_EQ(p.saved_full_bytes_capacity, 6144);
  EXPECT_EQ(p.layers_per_slot, 2);
  EXPECT_EQ(p.slot_metadata_bytes, 2048);              // G(2 * 1024)
  EXPECT_EQ(p.minimum_slot_bytes, 4096);               // 2048 + 2 * 1024
  EXPECT_EQ(p.balanced_full_save_slot_bytes, 14336);   // 2048 + 2 * 6144
  EXPECT_EQ(p.maximum_useful_slot_bytes, 14336);
  EXPECT_EQ(p.slot_bytes, 14336);
  EXPECT_EQ(p.activation_bytes, 14336);
  EXPECT_EQ(p.planner_state_bytes, 256);               // A(1*32) + A(1*2*8)
  // A(2*8*4)=128 + A(2*4*4)=128 + A(2*1*4*4)=128 + pull of each token A(2*4*4)=128
  //   + pulls per chunk A(2*1*4)=128 + arrival counters A(1*4)=128
  EXPECT_EQ(p.route_scratch_bytes, 768);
  EXPECT_EQ(p.call_scratch_pad_bytes, 128);    // 768 + layout 896 = 1664 = 6.5 * 256
  // 896 + x_gathered 2048 + h13 4096 + h A(8*128*2)=2048
  EXPECT_EQ(p.forward_scratch_bytes, 9088);
  // 9088 + grad_h3 2048 + grad_h13 4096 + row scores A(8*4)=128 + score parts A(8*2*4)=128
  EXPECT_EQ(p.backward_scratch_bytes, 15488);
  EXPECT_EQ(p.scratch_bytes, 16384);           // 768 + 128 + 15488
  EXPECT_EQ(p.peer_table_bytes, 384);          // 3 * A(16)
  EXPECT_EQ(p.arena_bytes, 30720);             // 14336 + 16384
  EXPECT_EQ(p.total_bytes, 34944);             // 30720 + 3456 + 128 + 384 + 256
}

// small() at R=2: activations 14,336, scratch 16,384 = route 768 + pad 128 + call 15,488 (layout
// 896 first, then x_gathered at 14336 + 768 + 128 + 896 = 16128 = 63 * 256), total 34,944
// (SmallTwoRanksTwoLayers). The device floor is route + pad + layout = 768 + 128 + 896 = 1,792.
// The kernel rules' rows per local expert: balanced_recv_rows over the local experts, worked by
// hand (the capacity factor does not enter it).
TEST(MemoryPlan, BalancedRowsPerExpert) {
  EXPECT_EQ(balanced_rows_per_expert(Dims{4096, 7168, 2048, 8, 256, 1}), 128);  // 4096*8/256
  EXPECT_EQ(balanced_rows_per_expert(Dims{128, 4096, 14336, 2, 8, 1}), 32);     // decode 128*2/8
  EXPECT_EQ(balanced_rows_per_expert(Dims{64, 128, 96, 2, 4, 2}), 32);          // 64*2/4
  EXPECT_EQ(balanced_rows_per_expert(Dims{5, 8, 8, 2, 0, 1}), 10);              // no experts: /1
}

TEST(MemoryPlan, AllScratchOnDeviceByDefault) {
  const MemoryPlan p = plan_memory(Config(small()), 2);
  EXPECT_FALSE(p.host_backed_scratch);
  EXPECT_EQ(p.scratch_device_minimum_bytes, 1792);  // route 768 + pad 128 + layout 896
  EXPECT_EQ(p.scratch_device_bytes, 16384);
  EXPECT_EQ(p.arena_device_bytes, 30720);
  EXPECT_EQ(p.arena_host_bytes, 0);
  EXPECT_EQ(p.device_total_bytes, 34944);
  expect_contains(p.explain(), "all scratch in device memory; device total 0.000 GiB (34,944 bytes)");
}

TEST(MemoryPlan, HostBackedScratchSplitsTheArena) {
  ConfigFields f = small();
  f.scratch_device_bytes = 10000;  // rounded down to 9,984 (78 * 128)
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_TRUE(p.host_backed_scratch);
  EXPECT_EQ(p.scratch_bytes, 16384);  // the plan's other terms do not move
  EXPECT_EQ(p.arena_bytes, 30720);
  EXPECT_EQ(p.total_bytes, 34944);
  EXPECT_EQ(p.scratch_device_bytes, 9984);
  EXPECT_EQ(p.arena_device_bytes, 24320);  // 14336 + 9984
  EXPECT_EQ(p.arena_host_bytes, 6400);     // 16384 - 9984
  EXPECT_EQ(p.device_total_bytes, 28544);  // 34944 - 6400
  const std::string text = p.explain();
  expect_contains(text, "host-backed scratch (Config.scratch_device_bytes): device 0.000 GiB "
                        "(9,984 bytes) + pinned host 0.000 GiB (6,400 bytes); routing part kept "
                        "on device 0.000 GiB (1,792 bytes)");
  expect_contains(text, "arena: device 0.000 GiB (24,320 bytes) (slots + device scratch), then "
                        "host 0.000 GiB (6,400 bytes)");
  expect_contains(text, "device total: 0.000 GiB (28,544 bytes)");
}

TEST(MemoryPlan, HostBackedScratchAtTheRoutingMinimum) {
  ConfigFields f = small();
  f.scratch_device_bytes = 1792 + 127;  // floor to 128: the minimum itself
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.scratch_device_bytes, 1792);
  EXPECT_EQ(p.arena_host_bytes, 14592);  // 16384 - 1792
  f.inference = true;                    // no slots: the arena starts with the scratch
  f.slots.num_slots = 0;
  const MemoryPlan q = plan_memory(Config(f), 2);
  EXPECT_EQ(q.call_scratch_pad_bytes, 128);  // the same 768 + 896 = 6.5 * 256
  EXPECT_EQ(q.arena_device_bytes, 1792);
  EXPECT_EQ(q.arena_host_bytes, 14592);
}

TEST(MemoryPlan, ScratchDeviceBytesAboveTheScratchKeepsAllOnDevice) {
  ConfigFields f = small();
  f.scratch_device_bytes = 16384;
  EXPECT_FALSE(plan_memory(Config(f), 2).host_backed_scratch);
  f.scratch_device_bytes = 16256;  // 128 short of the scratch: its last 128 bytes on the host
  EXPECT_EQ(plan_memory(Config(f), 2).arena_host_bytes, 128);
  f.scratch_device_bytes = int64_t{1} << 40;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_FALSE(p.host_backed_scratch);
  EXPECT_EQ(p.scratch_device_bytes, 16384);
  EXPECT_EQ(p.arena_host_bytes, 0);
}

TEST(MemoryPlan, ScratchDeviceBytesBelowTheRoutingPartFail) {
  ConfigFields f = small();
  f.scratch_device_bytes = 1791;  // floors to 1664 < route 768 + pad 128 + layout 896 = 1792
  expect_plan_error(f, 2, "Config.scratch_device_bytes", "1791");
  try {
    (void)plan_memory(Config(f), 2);
  } catch (const Error& e) {
    expect_contains(e.what(), ">= 1792 (route scratch 768 + pad 128 + layout 896 bytes");
  }
  f.scratch_device_bytes = 0;
  expect_plan_error(f, 2, "Config.scratch_device_bytes", "0");
}

TEST(MemoryPlan, UnfusedScratchAddsRowsAndGradH) {
  ConfigFields f = small();
  f.fuse_epilogues = false;
  const MemoryPlan p = plan_memory(Config(f), 2);
  // fused 9088 + rows_MD A(8*128*2)=2048
  EXPECT_EQ(p.forward_scratch_bytes, 11136);
  // fused 15488 + rows_MD 2048 + grad_h A(8*128*2)=2048
  EXPECT_EQ(p.backward_scratch_bytes, 19584);
  EXPECT_EQ(p.scratch_bytes, 20480);   // 768 + pad 128 + 19584
  EXPECT_EQ(p.arena_bytes, 34816);     // 14336 + 20480
  EXPECT_EQ(p.total_bytes, 39040);     // 34816 + 3456 + 128 + 384 + 256
  // Everything outside the call scratch is unchanged (the pad only depends on route + layout).
  EXPECT_EQ(p.slot_bytes, 14336);
  EXPECT_EQ(p.route_scratch_bytes, 768);
  EXPECT_EQ(p.call_scratch_pad_bytes, 128);
}

TEST(MemoryPlan, CapacityFactorAboveRIsClamped) {
  ConfigFields f = small();
  f.capacity_factor = 3.0;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.requested_capacity_factor, 3.0);
  EXPECT_EQ(p.capacity_factor, 2.0);       // min(3, R=2)
  EXPECT_EQ(p.recv_capacity_rows, 16);     // min(ceil(8*2), 16)
  // layout(16) = 128 + 128 + 128 + A(16*4)=128 + 128 + pulls (P_cap = min(16, 8)) 128 + 128
  EXPECT_EQ(p.routing_metadata_bytes, 896);
  EXPECT_EQ(p.saved_full_bytes_balanced, 6144);  // at T*K = 8 rows, as without clamping
  // A(16*128*2)=4096 + A(16*256*2)=8192 = 12288 = 48*256
  EXPECT_EQ(p.saved_full_bytes_capacity, 12288);
  EXPECT_EQ(p.minimum_slot_bytes, 4096);              // 2048 + 2 * 1024
  EXPECT_EQ(p.balanced_full_save_slot_bytes, 14336);  // 2048 + 2 * 6144
  EXPECT_EQ(p.maximum_useful_slot_bytes, 26624);      // 2048 + 2 * 12288
  EXPECT_EQ(p.slot_bytes, 26624);
  // 896 + 4096 + 8192 + h A(16*128*2)=4096
  EXPECT_EQ(p.forward_scratch_bytes, 17280);
  EXPECT_EQ(p.backward_scratch_bytes, 29824);  // 17280 + 4096 + 8192 + 128 + A(16*2*4)=128
  EXPECT_EQ(p.call_scratch_pad_bytes, 128);    // route 768 (6 x 128) + layout 896 = 6.5 * 256
  EXPECT_EQ(p.scratch_bytes, 30720);           // 768 + 128 + 29824
  EXPECT_EQ(p.arena_bytes, 57344);             // 26624 + 30720
  EXPECT_EQ(p.total_bytes, 61568);             // 57344 + 3456 + 128 + 384 + 256
  const std::string text = p.explain();
  expect_contains(text, "capacity factor: 2 (requested 3, clamped to R");
  // A factor of exactly R is not clamped.
  f.capacity_factor = 2.0;
  const MemoryPlan q = plan_memory(Config(f), 2);
  EXPECT_EQ(q.recv_capacity_rows, 16);
  EXPECT_EQ(q.explain().find("clamped"), std::string::npos);
}

TEST(MemoryPlan, TopologyBoundCapsRows) {
  // K=4 but only E=2 local experts: a token reaches a rank at most twice.
  ConfigFields f = fields(4, 128, 128, 4, 4);
  f.capacity_factor = 1.5;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.balanced_recv_rows, 16);   // 4*4
  EXPECT_EQ(p.max_recv_rows, 16);        // 4*2*min(4,2)
  EXPECT_EQ(p.recv_capacity_rows, 16);   // min(ceil(16*1.5)=24, 16)
  EXPECT_EQ(p.capacity_factor, 1.5);     // not clamped (1.5 <= R)
}

TEST(MemoryPlan, DecimalFactorDoesNotAddASpuriousRow) {
  // 50 * 1.1 is 55.00000000000001 in binary; the capacity is 55 rows, not 56.
  ConfigFields f = fields(25, 128, 128, 4, 2);
  f.capacity_factor = 1.1;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.balanced_recv_rows, 50);   // 25*2
  EXPECT_EQ(p.max_recv_rows, 100);       // 25*2*min(2,2)
  EXPECT_EQ(p.recv_capacity_rows, 55);   // 50 * 1.1
  f.capacity_factor = 1.05;              // 52.5 -> 53
  EXPECT_EQ(plan_memory(Config(f), 2).recv_capacity_rows, 53);
  f.capacity_factor = 1e-9;              // rounds to 0 rows -> at least 1
  EXPECT_EQ(plan_memory(Config(f), 2).recv_capacity_rows, 1);
}

TEST(MemoryPlan, ExactSlotBytesAreAligned) {
  ConfigFields f = small();
  f.slots.num_slots = 3;
  f.slots.slot_bytes = 5000;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_sizing, SlotSizing::exact);
  EXPECT_EQ(p.slot_bytes, 5120);          // 5000 rounded up to G = 256: 20*256
  EXPECT_EQ(p.activation_bytes, 15360);   // 3 * 5120
  EXPECT_EQ(p.planner_state_bytes, 256);  // A(3*32) + A(3*2*8)
  EXPECT_EQ(p.arena_bytes, 31744);        // 15360 + scratch 16384
  EXPECT_EQ(p.total_bytes, 35968);        // 31744 + 3456 + 128 + 384 + 256
  // 4096 < 5120 < balanced 14336
  expect_contains(p.explain(), "some layers recompute at balanced routing");
}

TEST(MemoryPlan, ExactSlotBytesAtTheMinimum) {
  ConfigFields f = small();
  f.slots.slot_bytes = 4000;  // G(4000) = 4096 = the minimum 2048 + 2 * 1024
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_bytes, 4096);
  expect_contains(p.explain(), "all layers recompute (minimum budget)");
}

TEST(MemoryPlan, ExactSlotBytesBelowTheMinimumFail) {
  ConfigFields f = small();
  f.slots.slot_bytes = 3300;  // G(3300) = 3328 < minimum 4096
  expect_plan_error(f, 2, "Config.slots.slot_bytes", "3300");
  try {
    (void)plan_memory(Config(f), 2);
  } catch (const Error& e) {
    expect_contains(e.what(), ">= 4096");
  }
  f.slots.slot_bytes = 0;
  expect_plan_error(f, 2, "Config.slots.slot_bytes", "0");
}

TEST(MemoryPlan, SlotCapacityFactor) {
  ConfigFields f = small();
  f.slots.slot_capacity_factor = 0.3;
  MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_sizing, SlotSizing::factor);
  EXPECT_EQ(p.slot_capacity_factor, 0.3);
  // 4096 + ceil(0.3 * (14336 - 4096) = 3072) = 7168 = G(7168) (28*256)
  EXPECT_EQ(p.slot_bytes, 7168);
  EXPECT_EQ(p.activation_bytes, 7168);
  EXPECT_EQ(p.total_bytes, 27776);  // 7168 + 16384 + 3456 + 128 + 384 + 256

  f.slots.slot_capacity_factor = 0.5;  // 4096 + 5120 = 9216 (36*256)
  EXPECT_EQ(plan_memory(Config(f), 2).slot_bytes, 9216);
  f.slots.slot_capacity_factor = 0.0;  // the minimum
  p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_bytes, 4096);
  expect_contains(p.explain(), "all layers recompute (minimum budget)");

  // Capacity above balanced: factor 1 fits balanced routing only.
  f.capacity_factor = 2.0;
  f.slots.slot_capacity_factor = 1.0;
  p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_bytes, 14336);  // 4096 + 1 * 10240; maximum useful is 26624
  expect_contains(p.explain(),
                  "balanced routing fits without recompute; heavier routing may recompute");
  f.slots.slot_capacity_factor = 2.5;  // 4096 + 2.5 * 10240 = 29696 > maximum useful 26624
  p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.slot_bytes, 29696);
  expect_contains(p.explain(), "every layer saves everything (no recompute)");
  expect_contains(p.explain(), "3,072 bytes above the maximum useful size");  // 29696 - 26624
}

TEST(MemoryPlan, DeepSeekV3Like) {
  // T=4096, D=7168, F=2048, 256 experts, top-8, R=8 (E=32), capacity factor 1.5.
  ConfigFields f = fields(4096, 7168, 2048, 256, 8);
  f.capacity_factor = 1.5;
  const MemoryPlan p = plan_memory(Config(f), 8);
  EXPECT_EQ(p.experts_local, 32);
  EXPECT_EQ(p.balanced_recv_rows, 32768);    // 4096*8
  EXPECT_EQ(p.max_recv_rows, 262144);        // 4096*8*min(8,32)
  EXPECT_EQ(p.recv_capacity_rows, 49152);    // 32768*1.5
  EXPECT_EQ(p.routing_buffer_bytes, 262272);       // 128 + 2 * A(32768*4)=131072
  EXPECT_EQ(p.dispatch_buffer_bytes, 58720256);    // 4096*7168*2
  EXPECT_EQ(p.combine_buffer_bytes, 469762048);    // 4096*8*7168*2
  EXPECT_EQ(p.symmetric_bytes, 528744576);         // 262272 + 58720256 + 469762048
  // layout(49152) = 128 + A(33*4)=256 + A(8*4)=128 + 49152*4=196608 + 32768*4=131072
  //   + pulls (P_cap = min(49152, 8*4096) = 32768) 32768*4=131072 + 32768*8*4=1048576 = 1507840
  EXPECT_EQ(p.routing_metadata_bytes, 1507840);
  EXPECT_EQ(p.packing_granule_bytes, 14336);          // lcm(128, 14336)
  EXPECT_EQ(p.saved_input_bytes_per_layer, 58720256);  // 4096*7168*2 = 4096*14336
  // x_gathered 32768*7168*2=469762048 + h13 32768*4096*2=268435456
  // = 738197504 = 51492*14336 + 8192 -> 51493*14336
  EXPECT_EQ(p.saved_full_bytes_balanced, 738203648);
  // 49152*7168*2=704643072 + 49152*4096*2=402653184
  // = 1107296256 = 77238*14336 + 12288 -> 77239*14336
  EXPECT_EQ(p.saved_full_bytes_capacity, 1107298304);
  EXPECT_EQ(p.slot_metadata_bytes, 1519616);          // 128 + 1507840 = 1507968 -> 106*14336
  EXPECT_EQ(p.minimum_slot_bytes, 60239872);          // 1519616 + 58720256
  EXPECT_EQ(p.slot_bytes, 1108817920);                // 1519616 + 1107298304
  // 8*32768*4=1048576 + 8*256*4=8192 + 8*16*256*4=131072   (16 chunks of 2048 routes)
  //   + pull of each token 8*4096*4=131072 + pulls per chunk A(8*4*4)=128 + counters 384*4=1536
  EXPECT_EQ(p.route_scratch_bytes, 1320576);
  // route 1320576 + layout 1507840 = 2828416 = 197 * 14336 + 4224 -> pad 14336 - 4224 = 10112
  EXPECT_EQ(p.call_scratch_pad_bytes, 10112);
  // 1507840 + 704643072 + 402653184 + h 49152*2048*2=201326592
  EXPECT_EQ(p.forward_scratch_bytes, 1310130688);
  // + grad_h3 704643072 + grad_h13 402653184 + row scores 49152*4=196608
  //   + score parts 49152*32*4=6291456 (F = 2048: 32 chunks of 64 columns)
  EXPECT_EQ(p.backward_scratch_bytes, 2423915008);
  EXPECT_EQ(p.scratch_bytes, 2425245696);   // 1320576 + 10112 + 2423915008
  EXPECT_EQ(p.peer_table_bytes, 384);       // 3 * A(8*8)
  EXPECT_EQ(p.arena_bytes, 3534063616);     // 1108817920 + 2425245696
  EXPECT_EQ(p.total_bytes, 4062808960);     // 3534063616 + 528744576 + 128 + 384 + 256
  // 4,062,808,960 / 2^30 = 3.7837...
  expect_contains(p.explain(), "3.784 GiB (4,062,808,960 bytes)");
}

TEST(MemoryPlan, ExplainPrintsEveryTerm) {
  ConfigFields f = small();
  f.slots.num_slots = 2;
  const MemoryPlan p = plan_memory(Config(f), 2);
  const std::string text = p.explain();
  for (const char* part : {
           "balanced 8 (T*K) / capacity 8 / topology max 16",
           "capacity factor: 1",
           "symmetric buffers per rank: 0.000 GiB (3,456 bytes)",
           "routing (header + ids + scores [T,K]): 0.000 GiB (384 bytes)",
           "dispatch x / grad_y [T,D] bf16: 0.000 GiB (1,024 bytes)",
           "combine [T,K,D] bf16: 0.000 GiB (2,048 bytes)",
           "metadata (planner record + layout at capacity rows): 0.000 GiB (1,024 bytes); layout "
           "0.000 GiB (896 bytes)",
           "packing granule lcm(128, 2D): 256 bytes",
           "of which pulls (one read per source token, 8 x (source + K rows)): 0.000 GiB (256 bytes)",
           "input only (recompute) x [T,D]: 0.000 GiB (1,024 bytes)",
           "full save (x_gathered, h13) at balanced rows: 0.000 GiB (6,144 bytes)",
           "full save at capacity rows: 0.000 GiB (6,144 bytes)",
           // 2 slots x 14,336 = 28,672
           "activation slots: 2 x 0.000 GiB (14,336 bytes) = 0.000 GiB (28,672 bytes); 2 layer(s)",
           "slot metadata (L layers): 0.000 GiB (2,048 bytes); planner state: 0.000 GiB (256 bytes)",
           "minimum/balanced full-save/maximum useful: 0.000 GiB (4,096 bytes) / 0.000 GiB (14,336 "
           "bytes) / 0.000 GiB (14,336 bytes)",
           "scratch: 0.000 GiB (16,384 bytes) = route 0.000 GiB (768 bytes) + pad 0.000 GiB "
           "(128 bytes) + call 0.000 GiB (15,488 bytes)",
           "pad: puts the call scratch's x_gathered (after its layout) on the packing granule: "
           "0.000 GiB (128 bytes)",
           "route: of which pull numbering 0.000 GiB (256 bytes), dispatch arrival counters (per 128 "
           "rows) 0.000 GiB (128 bytes)",
           "forward (recompute mode): 0.000 GiB (9,088 bytes)",
           "status word: 0.000 GiB (128 bytes)",
           "peer tables (3 x [R] pointers): 0.000 GiB (384 bytes)",
           "arena (slots + scratch): 0.000 GiB (45,056 bytes)",  // 28672 + 16384
           // + 3456 + 128 + 384 + 256
           "total (arena + symmetric + status + peer tables + planner state): 0.000 GiB (49,280 "
           "bytes)",
           "every layer saves everything (no recompute)",
       }) {
    expect_contains(text, part);
  }
  EXPECT_EQ(p.total_bytes, 49280);  // 45056 + 3456 + 128 + 384 + 256
}

TEST(MemoryPlan, SourceIdsMustFitInt32) {
  // R*T*K = 1 * 268435456 * 8 = 2^31: one past the int32 src encoding.
  ConfigFields f = fields(268435456, 1, 1, 8, 8);
  expect_plan_error(f, 1, "Config.max_tokens_per_rank", "268435456");
  // At R=2 the bound halves: T <= (2^31 - 1) / 16 = 134217727.
  f.max_tokens_per_rank = 134217728;
  expect_plan_error(f, 2, "Config.max_tokens_per_rank", "134217728");
}

TEST(MemoryPlan, ByteTermsMustFitInt64) {
  ConfigFields f = fields(1, int64_t{1} << 60, 1, 1, 1);
  expect_plan_error(f, 1, "Config.hidden_dim", "1152921504606846976");
  f = fields(1, 1, int64_t{1} << 60, 1, 1);
  expect_plan_error(f, 1, "Config.intermediate_dim", "1152921504606846976");
  f = fields(16, 128, 128, 8, 2);
  // 2^30 layers x (metadata 128 + layout(32) 640 + pulls (16) 128 + 128 + input 4,096)
  //   = 2^30 * 5120: fine
  f.slots.max_layers_per_slot = 1 << 30;
  EXPECT_EQ(plan_memory(Config(f), 1).minimum_slot_bytes, int64_t{5120} << 30);
  f.slots.num_slots = 1 << 30;  // N * slot bytes overflows the 2^56 bound
  expect_plan_error(f, 1, "Config.slots.num_slots", "");
}

TEST(MemoryPlan, EpSizeMustDivideExperts) {
  expect_plan_error(ci_tiny(), 3, "Config.num_experts", "8");
  expect_plan_error(ci_tiny(), 0, "ep_size", "0");
}

// FP8 (Config.precision = fp8_block) at T=16, D=32, F=24, 8 experts, K=2, R=2: E=4, M=32 rows.
//   dispatch: max(bf16 A(16*32*2)=1024, codes A(512)=512 + scales A(16*1*4)=128) = 1024
//   operands: h rows A(32*24 + 1*32*4)=896, grad_h3 rows A(32*32 + 128)=1152, grad_h13 rows
//             A(32*48 + 128)=1664, WGRAD columns (Bc = ceil(32/128) + 4 = 5 blocks, codes
//             transposed [L, 128 Bc]): a A(48*640)=30720 + A(5*48*4)=1024, b A(32*640)=20480
//             + A(5*32*4)=640   -> 56576
//   weights per call: w13 A(4*48*32)=6144 + A(4*1*1*4)=128, w2 A(4*32*24)=3072 + 128 -> 9472
//   transposed weight (training; W13's size, shared with W2's): A(4*32*48)=6144 + A(4*1*1*4)=128
//             -> 6272; weight scratch 9472 + 6272 = 15744; prepared weights (with their transposed
//             copies, the caller's): 0
TEST(MemoryPlan, IsPure) {
  const Config c(small());
  const MemoryPlan a = plan_memory(c, 2);
  const MemoryPlan other = plan_memory(Config(ci_tiny()), 1);  // interleaved: no hidden state
  const MemoryPlan b = plan_memory(c, 2);
  EXPECT_NE(other.total_bytes, a.total_bytes);
#define EPMOE_SAME(field) EXPECT_EQ(a.field, b.field) << #field
  EPMOE_SAME(ep_size);
  EPMOE_SAME(tokens);
  EPMOE_SAME(hidden);
  EPMOE_SAME(intermediate);
  EPMOE_SAME(top_k);
  EPMOE_SAME(experts_global);
  EPMOE_SAME(experts_local);
  EPMOE_SAME(balanced_recv_rows);
  EPMOE_SAME(max_recv_rows);
  EPMOE_SAME(requested_capacity_factor);
  EPMOE_SAME(capacity_factor);
  EPMOE_SAME(recv_capacity_rows);
  EPMOE_SAME(routing_buffer_bytes);
  EPMOE_SAME(dispatch_buffer_bytes);
  EPMOE_SAME(combine_buffer_bytes);
  EPMOE_SAME(symmetric_bytes);
  EPMOE_SAME(packing_granule_bytes);
  EPMOE_SAME(routing_metadata_bytes);
  EPMOE_SAME(layer_metadata_bytes);
  EPMOE_SAME(saved_input_bytes_per_layer);
  EPMOE_SAME(saved_full_bytes_balanced);
  EPMOE_SAME(saved_full_bytes_capacity);
  EPMOE_SAME(num_slots);
  EPMOE_SAME(layers_per_slot);
  EPMOE_SAME(slot_metadata_bytes);
  EPMOE_SAME(minimum_slot_bytes);
  EPMOE_SAME(balanced_full_save_slot_bytes);
  EPMOE_SAME(maximum_useful_slot_bytes);
  EPMOE_SAME(slot_sizing);
  EPMOE_SAME(slot_capacity_factor);
  EPMOE_SAME(slot_bytes);
  EPMOE_SAME(activation_bytes);
  EPMOE_SAME(planner_state_bytes);
  EPMOE_SAME(route_scratch_bytes);
  EPMOE_SAME(call_scratch_pad_bytes);
  EPMOE_SAME(forward_scratch_bytes);
  EPMOE_SAME(backward_scratch_bytes);
  EPMOE_SAME(scratch_bytes);
  EPMOE_SAME(status_bytes);
  EPMOE_SAME(peer_table_bytes);
  EPMOE_SAME(arena_bytes);
  EPMOE_SAME(total_bytes);
  EPMOE_SAME(host_backed_scratch);
  EPMOE_SAME(scratch_device_minimum_bytes);
  EPMOE_SAME(scratch_device_bytes);
  EPMOE_SAME(arena_device_bytes);
  EPMOE_SAME(arena_host_bytes);
  EPMOE_SAME(device_total_bytes);
  EPMOE_SAME(inference);
#undef EPMOE_SAME
  EXPECT_EQ(a.explain(), b.explain());
}

}  // namespace
}  // namespace epmoe
