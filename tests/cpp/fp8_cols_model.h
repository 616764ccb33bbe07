// A host model of the CUDA 128x1 column quantizer (src/cuda/formats/fp8_cols.cu), thread by
// thread: every CTA of the launch grid, every thread's index math, the shared tile, the partial
// amaxes, the per-column scales and encode bounds, the swizzled staging of codes, the divide pass
// and the line-wide stores of qt, run as the kernel's phases between its barriers (a phase runs
// threads 0 .. 255 in turn; a warp shuffle splits a phase into a pass before and one after it).
// Global loads are bounds-checked, shared accesses alignment-checked, and a shared byte that two
// threads touch between two barriers, one of them writing, is a race, as is a qt or scale element
// that two CTAs write. The model follows the kernel line for line: change them together.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/numeric.h"

namespace epmoe::test {

struct ColsModelInput {
  // bf16 rows: x_buf[x_offset + m * L + l] (x_offset in elements; the buffer starts 256-byte
  // aligned, as a cudaMalloc'ed one), or E4M3 rows (fp8_rows_bytes layout) at rows_buf +
  // rows_offset with the device row count rows_count.
  const std::vector<bf16_t>* x_buf = nullptr;
  int64_t x_offset = 0;
  const std::vector<char>* rows_buf = nullptr;
  int64_t rows_offset = 0;
  int32_t rows_count = 0;
  int64_t M = 0, L = 0;
  std::vector<int32_t> offsets_E1;
  int32_t skip = 0;
  int64_t max_blocks = 0;
  // true: rows past a block's end are masked to +0 at the encode (the kernel); false: they are
  // encoded from the tile's zeros under the column's scale, as the first version of the kernel
  // did (0x7F where the column's scale is NaN).
  bool mask_padding_rows = true;
};

struct ColsModelOutput {
  std::vector<uint8_t> qt_LK;    // [L, 128 * max_blocks], 0xA5 where not written
  std::vector<float> scales_BL;  // [max_blocks, L], 0xA5 bytes where not written
  int64_t shared_races = 0;      // shared bytes touched by two threads between barriers
  int64_t global_races = 0;      // output elements written by two CTAs
  std::string first_race;        // what the first race was
};

ColsModelOutput run_cols_model(const ColsModelInput& in);

}  // namespace epmoe::test
