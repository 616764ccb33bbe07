// Tiles claimed in order from a device counter, instead of a fixed stride per CTA.
//
// With a fixed stride, CTA c runs tiles c, c + grid, c + 2 grid, ...: the m-tiles that share one
// weight slice (adjacent tile numbers) start together only while every CTA has spent the same
// time so far. They drift apart over the waves, and a slice of a few MB read by two CTAs a few
// microseconds apart is read from HBM twice (gpt-oss-120b W13 DGRAD read 1.52x its operands' bytes
// under Nsight Compute, bench/RESULTS.md). Claimed in order, tile i starts when the i-th CTA to
// become free takes it, so neighbouring tiles start within a fraction of a tile of each other
// whatever each CTA's history.
//
// One producer thread per CTA claims (one claim in flight ahead of the tile it loads) and
// publishes each tile number in a shared-memory ring that every consumer thread reads in order.
// The counter pair lives in the layout header (core/layout.h, zeroed by route each step): the last
// CTA to finish claiming puts both back to zero, so the next launch of the same kind (a recompute,
// the next step) starts from tile 0.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace epmoe::cuda::gemm {

// [2] ints of device memory: the next tile to claim, and the CTAs done claiming.
struct TileClaims {
  int* counters = nullptr;  // nullptr: the fixed stride
  __device__ int claim() const { return atomicAdd(counters, 1); }
  // After this CTA's last claim (one past the last tile): the last CTA resets the pair.
  __device__ void finish() const {
    __threadfence();
    if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(counters, 0);
      atomicExch(counters + 1, 0);
    }
  }
};

// Tile numbers from the producer thread to every consumer thread, in claim order.
template <int kDepth>
struct TileRing {
  cutlass::arch::ClusterBarrier full[kDepth];   // the producer published slot i of this round
  cutlass::arch::ClusterBarrier empty[kDepth];  // every consumer thread read it
  int tile[kDepth];

  __device__ void init(int consumer_threads) {
    for (int i = 0; i < kDepth; ++i) {
      full[i].init(1);
      empty[i].init(static_cast<uint32_t>(consumer_threads));
    }
    cutlass::arch::fence_barrier_init();
  }
  // Producer: the tile of claim number `sequence` (the arrive releases the store).
  __device__ void publish(int sequence, int value) {
    const int slot = sequence % kDepth;
    empty[slot].wait(static_cast<uint32_t>(((sequence / kDepth) & 1) ^ 1));
    asm volatile("" ::: "memory");  // CUTLASS's barrier asm has no memory clobber
    *static_cast<volatile int*>(&tile[slot]) = value;
    asm volatile("" ::: "memory");
    full[slot].arrive();
  }
  // Consumer thread: the tile of claim number `sequence`, its slot released once read.
  __device__ int take(int sequence) {
    const int slot = sequence % kDepth;
    full[slot].wait(static_cast<uint32_t>((sequence / kDepth) & 1));
    asm volatile("" ::: "memory");
    const int value = *static_cast<volatile int*>(&tile[slot]);
    asm volatile("" ::: "memory");
    empty[slot].arrive();
    return value;
  }
};

}  // namespace epmoe::cuda::gemm
