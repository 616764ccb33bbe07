// The shared-memory stage of the NVFP4 decode GEMM (grouped_gemm_nvfp4.cu) as host/device
// functions: which thread copies which bytes of a 128-element chunk of K to which offset, and
// where each lane reads them back. The kernel calls these; the host model
// (tests/cpp/test_nvfp4_stage_layout.cpp) runs the copies and the reads thread by thread and
// checks that every byte is written once and read by the lane whose mma fragment needs it.
//
// Lane = 4 g + t (mma groupID g, quad position t). Tile i of a warp: weight rows g (r = 0) and
// g + 8 (r = 1); a lane owns elements [32 t, 32 t + 32) of each of its rows and of each
// activation row in a chunk, half h (block 2t + h) feeding mma steps 4h .. 4h + 3. A lane copies
// its 16 code bytes of a row in one 16-byte cp.async and reads them back half by half (8 bytes at
// code_offset + 8 h: 4 wavefronts per warp, 2-way conflicted, the wavefronts of reading all 16
// bytes twice, with 2 registers held instead of 4).
#pragma once

#include "core/hd.h"

namespace epmoe::cuda::nvfp4_stage {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTiles = 4;                        // m16 weight tiles per warp
constexpr int kRowsPerWarp = 16 * kTiles;        // weight rows (outputs' columns n) per warp
constexpr int kSlab = kWarps * kRowsPerWarp;     // weight rows per CTA
constexpr int kChunk = 128;                      // K elements per chunk (64 code bytes a row)

// One stage: per warp its tiles' codes [tile][r][lane][16 B] and scales [tile][row 8 r + g][8
// blocks]; then per group the activation units [u = 2 h + j][lane][16 B].
constexpr int kWarpCodeBytes = kTiles * 2 * 32 * 16;
constexpr int kWarpScaleBytes = kTiles * 16 * 8;
constexpr int kWarpStageBytes = kWarpCodeBytes + kWarpScaleBytes;
constexpr int kGroupActBytes = 4 * 32 * 16;      // 8 rows x 128 bf16
EPMOE_HD constexpr int stage_bytes(int groups) {
  return kWarps * kWarpStageBytes + groups * kGroupActBytes;
}

// Code bytes [16 t, 16 t + 16) of the chunk of tile `tile`'s row r: copied and read by the lane.
EPMOE_HD constexpr int code_offset(int warp, int tile, int r, int lane) {
  return warp * kWarpStageBytes + ((tile * 2 + r) * 32 + lane) * 16;
}

// Scale byte of block `block` (0 .. 7) of the chunk of tile `tile`'s row 8 r + g. A lane reads
// blocks 2t and 2t + 1 of its rows (one 2-byte read per row) and copies 4 bytes: row
// scale_copy_r(lane) of each tile, blocks scale_copy_block(lane) .. + 3.
EPMOE_HD constexpr int scale_offset(int warp, int tile, int r, int g, int block) {
  return warp * kWarpStageBytes + kWarpCodeBytes + tile * 128 + (r * 8 + g) * 8 + block;
}
EPMOE_HD constexpr int scale_copy_r(int lane) { return (lane % 4) / 2; }
EPMOE_HD constexpr int scale_copy_block(int lane) { return 4 * (lane % 2); }

// Activation unit u = 2 h + j of group q for a lane: the group's row g, elements 32 t + 16 h +
// 8 j .. + 7 of the chunk (the B fragments of steps 4h + 2j, 4h + 2j + 1).
EPMOE_HD constexpr int act_offset(int q, int u, int lane) {
  return kWarps * kWarpStageBytes + q * kGroupActBytes + (u * 32 + lane) * 16;
}
// The unit thread tid copies for each group: row act_copy_row(tid), elements
// act_copy_element(tid) .. + 7 (a half-warp reads a row's 256 contiguous bytes).
EPMOE_HD constexpr int act_copy_row(int tid) { return tid / 16; }
EPMOE_HD constexpr int act_copy_element(int tid) { return 8 * (tid % 16); }
EPMOE_HD constexpr int act_copy_offset(int q, int tid) {
  // element 8 p = 32 t + 16 h + 8 j: u = p % 4, t = p / 4.
  return act_offset(q, (tid % 16) % 4, 4 * act_copy_row(tid) + (tid % 16) / 4);
}

}  // namespace epmoe::cuda::nvfp4_stage
