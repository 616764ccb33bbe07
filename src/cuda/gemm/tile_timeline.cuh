// A build-time probe (-DEPMOE_GEMM_TIMELINE, CMake option EPMOE_GEMM_TIMELINE): SM clock stamps of
// a window of CTA 0's tiles, so a GEMM's per-tile time can be split between waiting for its
// operands, the MMA, the k-tail and the epilogue. The GEMM kernel only stores clock64() values to
// a device buffer (a printf in it would serialize every wgmma, C7510); print_tile_timeline, a
// one-thread kernel the launcher enqueues after the GEMM, prints and clears them. Without the
// macro every call compiles away.
#pragma once

#include <cstdio>

namespace epmoe::cuda::gemm {

enum class Stamp : int {
  tile_start,      // consumer: the tile loop iteration begins
  operands_ready,  // consumer: the first k-block's stage is full
  loop_done,       // consumer: the full k-blocks' MMAs issued (all retired but one batch)
  tail_ready,      // consumer: the partial k-block's stage is full (WGRAD, peeled tail)
  mma_done,        // consumer: every MMA retired, the partial k-block included
  epilogue_done,   // consumer: epilogue.store returned (its TMA stores issued, not complete)
  acquire_first,   // producer: the tile's first stage acquired
  acquire_last,    // producer: the tile's last stage acquired (its loads issued next)
  stage_free,      // epilogue (WgradTmaEpilogue): the previous tile's TMA stores read its stage
  staged,          // epilogue (WgradTmaEpilogue): the tile is in shared memory, stores next
  count
};

constexpr int kTimelineFirst = 8;  // skip the first tiles (pipeline fill)
constexpr int kTimelineTiles = 12;
constexpr int kStamps = static_cast<int>(Stamp::count);

#if defined(EPMOE_GEMM_TIMELINE)
// Per translation unit (no -rdc): the launcher that fills it enqueues the kernel that prints it.
static __device__ long long g_timeline[kTimelineTiles][kStamps];
static __device__ int g_timeline_tile[kTimelineTiles][2];  // k-blocks, rows
static __device__ int g_timeline_current = -1;  // the recording consumer's tile in the window

struct TileTimeline {
  bool on = false;
  __device__ void stamp(int sequence, Stamp s) const {
    const int i = sequence - kTimelineFirst;
    if (!on) return;
    if (s == Stamp::tile_start) g_timeline_current = i;
    if (i >= 0 && i < kTimelineTiles) g_timeline[i][static_cast<int>(s)] = clock64();
  }
  __device__ void tile(int sequence, int k, int rows) const {
    const int i = sequence - kTimelineFirst;
    if (on && i >= 0 && i < kTimelineTiles) {
      g_timeline_tile[i][0] = k;
      g_timeline_tile[i][1] = rows;
    }
  }
};

// A stamp from code that does not know the tile (the epilogue): the recording consumer thread's
// current tile. That thread is CTA 0's first consumer thread (threadIdx.x 128).
__device__ inline void stamp_current_tile(Stamp s) {
  const int i = g_timeline_current;
  if (blockIdx.x == 0 && threadIdx.x == 128 && i >= 0 && i < kTimelineTiles) {
    g_timeline[i][static_cast<int>(s)] = clock64();
  }
}

// One line per tile: clocks relative to the window's first tile start.
static __global__ void print_tile_timeline(int bm, int bn, int num_b, int grouping) {
  const long long t0 = g_timeline[0][0];
  for (int i = 0; i < kTimelineTiles; ++i) {
    printf("timeline %dx%dx%d g%d seq %d k %d rows %d:", bm, bn, num_b, grouping,
           i + kTimelineFirst, g_timeline_tile[i][0], g_timeline_tile[i][1]);
    for (int s = 0; s < kStamps; ++s) {
      printf(" %lld", g_timeline[i][s] == 0 ? -1LL : g_timeline[i][s] - t0);
      g_timeline[i][s] = 0;
    }
    printf("\n");
  }
  g_timeline_current = -1;
}
#else
struct TileTimeline {
  bool on = false;
  __device__ void stamp(int, Stamp) const {}
  __device__ void tile(int, int, int) const {}
};
__device__ inline void stamp_current_tile(Stamp) {}
#endif

}  // namespace epmoe::cuda::gemm
