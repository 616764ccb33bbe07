// Arrival gate of the W13 producer (Config.arrival_gated_w13). W13 is launched with programmatic
// dependent launch while dispatch still runs; dispatch releases, per 128-row block of the received
// rows, the number of rows it has stored (red.release.gpu after its stores). Before the TMA loads
// of a tile's A rows, the producer thread acquires the counters of the blocks the tile's valid rows
// touch until each holds its full count (1 or 2 loads per tile once everything has arrived).
//
// No deadlock: the dependent launch starts only after every dispatch CTA has executed
// griddepcontrol.launch_dependents (or exited), so every dispatch CTA is resident or done before any
// W13 CTA spins. TMA reads through the async proxy what other CTAs wrote through the generic proxy:
// after the acquire, fence.proxy.async orders those writes before this thread's later TMA loads.
// A wait past the budget records arrival_timeout in the status word and stops waiting (the step's
// results are then undefined and Context::check() reports it); it never hangs.
#pragma once

#include <cstdint>

#include "epmoe/status.h"

namespace epmoe::cuda::gemm {

constexpr int kArrivalGateBlockRows = 128;  // = kArrivalBlockRows (core/plan_terms.h)

struct ArrivalGate {
  const uint32_t* arrivals_B = nullptr;  // [ceil(capacity / 128)]; nullptr: no wait (staged)
  Status* status = nullptr;              // [1] status word
  uint64_t budget_ns = 0;
  int rank = 0;
};

__device__ __forceinline__ uint32_t load_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until rows [row0, row0 + rows) of the `total_rows` received rows have arrived. One thread.
// gave_up: set after a timeout, so that later tiles of this CTA do not wait again.
__device__ __forceinline__ void wait_for_rows(const ArrivalGate& g, int row0, int rows, int total_rows,
                                           bool& gave_up) {
  if (g.arrivals_B == nullptr || gave_up || rows <= 0) return;
  const int first = row0 / kArrivalGateBlockRows;
  const int last = (row0 + rows - 1) / kArrivalGateBlockRows;
  uint64_t start = 0;
  for (int b = first; b <= last; ++b) {
    const int left = total_rows - b * kArrivalGateBlockRows;
    const uint32_t want = static_cast<uint32_t>(left < kArrivalGateBlockRows ? left : kArrivalGateBlockRows);
    uint32_t seen = load_acquire_gpu(g.arrivals_B + b);
    while (seen < want) {
      const uint64_t now = globaltimer_ns();
      if (start == 0) start = now;
      if (now - start > g.budget_ns) {
        gave_up = true;
        if (atomicCAS(&g.status->code, 0, static_cast<int32_t>(StatusCode::arrival_timeout)) == 0) {
          g.status->rank = g.rank;
          g.status->arg = static_cast<int32_t>(StatusArg::none);
          g.status->reserved = 0;
          g.status->required = want;
          g.status->available = seen;
          g.status->index = b;
        }
        return;
      }
      __nanosleep(64);
      seen = load_acquire_gpu(g.arrivals_B + b);
    }
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace epmoe::cuda::gemm
