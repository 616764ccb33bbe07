// Host model of the NVFP4 decode GEMM's shared-memory stage (cuda/gemm/nvfp4_stage_layout.h,
// the functions grouped_gemm_nvfp4.cu calls): the copies of every thread and the reads of every
// lane, run one by one on the host without a GPU.
// - Every byte of a stage is written by exactly one thread, at the alignment its copy needs, and
//   every read (a lane's 8 code bytes of a half, its activation units) is aligned to its width.
// - The model GEMM: per chunk, the stage filled by the CTA's 128 threads as the kernel fills it,
//   then each warp's mma.m16n8k16 fragments gathered lane by lane from the offsets the kernel
//   reads, half by half (A: the 8 code bytes of half h of the tile's rows decoded through the
//   block's byte-permute table, B: the half's activation units), multiplied as matrices and
//   accumulated per (tile, group) in the kernel's order (steps 0 .. 7 of a chunk); outputs stored
//   by the lane mapping of the epilogue. On exact sums it equals the formula bitwise, for 1, 2
//   and 4 groups, several passes, an N tail inside a tile and warps without rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/formats/e2m1.h"
#include "core/formats/e2m1_bf16.h"
#include "core/formats/e4m3.h"
#include "core/numeric.h"
#include "cuda/gemm/nvfp4_stage_layout.h"

namespace epmoe::test {
namespace {

namespace st = cuda::nvfp4_stage;

TEST(Nvfp4StageLayout, EveryByteWrittenOnceAtItsCopysAlignment) {
  for (int groups : {1, 2, 4}) {
    std::vector<int> writer(static_cast<size_t>(st::stage_bytes(groups)), -1);
    const auto write = [&](int offset, int bytes, int tid) {
      ASSERT_EQ(offset % bytes, 0) << "offset " << offset << " of a " << bytes << "-byte copy";
      for (int b = 0; b < bytes; ++b) {
        int& w = writer[static_cast<size_t>(offset + b)];
        ASSERT_EQ(w, -1) << "byte " << offset + b << " written by threads " << w << " and " << tid;
        w = tid;
      }
    };
    for (int tid = 0; tid < st::kThreads; ++tid) {
      const int warp = tid / 32, lane = tid % 32, g = lane / 4;
      for (int i = 0; i < st::kTiles; ++i) {
        for (int r = 0; r < 2; ++r) write(st::code_offset(warp, i, r, lane), 16, tid);
        write(st::scale_offset(warp, i, st::scale_copy_r(lane), g, st::scale_copy_block(lane)), 4,
              tid);
      }
      for (int q = 0; q < groups; ++q) write(st::act_copy_offset(q, tid), 16, tid);
    }
    for (size_t b = 0; b < writer.size(); ++b) ASSERT_NE(writer[b], -1) << "byte " << b;
    // The reads: 8-byte code halves, 1-byte scales, 16-byte activation units, inside the stage.
    for (int warp = 0; warp < st::kWarps; ++warp) {
      for (int lane = 0; lane < 32; ++lane) {
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < st::kTiles; ++i) {
            for (int r = 0; r < 2; ++r) {
              const int code = st::code_offset(warp, i, r, lane) + 8 * h;
              ASSERT_EQ(code % 8, 0) << "code half " << h << " of lane " << lane;
              ASSERT_LE(code + 8, st::stage_bytes(groups));
              ASSERT_LT(st::scale_offset(warp, i, r, lane / 4, 2 * (lane % 4) + h),
                        st::stage_bytes(groups));
            }
          }
          for (int q = 0; q < groups; ++q) {
            for (int j = 0; j < 2; ++j) {
              const int unit = st::act_offset(q, 2 * h + j, lane);
              ASSERT_EQ(unit % 16, 0) << "activation unit " << 2 * h + j << " of lane " << lane;
              ASSERT_LE(unit + 16, st::stage_bytes(groups));
            }
          }
        }
      }
    }
  }
}

// One expert's weights and rows, exact sums: activations -3..3, power-of-two block scales.
struct Problem {
  int64_t rows, N, K;
  std::vector<uint8_t> codes, scales;  // [N, K / 2], [N, K / 16]
  std::vector<bf16_t> a;               // [rows, K]

  Problem(int64_t rows_, int64_t N_, int64_t K_, std::mt19937& rng) : rows(rows_), N(N_), K(K_) {
    const uint8_t kPow2Scales[5] = {0x28, 0x30, 0x38, 0x40, 0x48};  // e4m3 1/4 .. 4
    std::uniform_int_distribution<int> byte(0, 255), pick(0, 4), ints(-3, 3);
    codes.resize(static_cast<size_t>(N * K / 2));
    for (uint8_t& v : codes) v = static_cast<uint8_t>(byte(rng));
    scales.resize(static_cast<size_t>(N * K / 16));
    for (uint8_t& v : scales) v = kPow2Scales[pick(rng)];
    a.resize(static_cast<size_t>(rows * K));
    for (bf16_t& v : a) v = float_to_bf16(static_cast<float>(ints(rng)));
  }

  float weight(int64_t n, int64_t k) const {
    const uint8_t byte = codes[static_cast<size_t>(n * K / 2 + k / 2)];
    const uint8_t code = static_cast<uint8_t>(k % 2 == 0 ? byte & 0xfu : byte >> 4);
    return e2m1_to_float(code) * e4m3_to_float(scales[static_cast<size_t>(n * K / 16 + k / 16)]);
  }

  // out[m, n] = sum_k a[m, k] w[n, k], exact.
  std::vector<float> formula() const {
    std::vector<float> out(static_cast<size_t>(rows * N), 0.0f);
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        float s = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          s += bf16_to_float(a[static_cast<size_t>(m * K + k)]) * weight(n, k);
        }
        out[static_cast<size_t>(m * N + n)] = s;
      }
    }
    return out;
  }
};

uint32_t bf16x2_times(uint32_t v, float s) {
  const float lo = bf16_to_float(static_cast<bf16_t>(v & 0xffffu)) * s;
  const float hi = bf16_to_float(static_cast<bf16_t>(v >> 16)) * s;
  return static_cast<uint32_t>(float_to_bf16(lo)) |
         (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}

float lo_half(uint32_t v) { return bf16_to_float(static_cast<bf16_t>(v & 0xffffu)); }
float hi_half(uint32_t v) { return bf16_to_float(static_cast<bf16_t>(v >> 16)); }

uint32_t word_at(const std::vector<uint8_t>& stage, int offset) {
  uint32_t w;
  std::memcpy(&w, stage.data() + offset, 4);
  return w;
}

// The kernel's chunk loop (K % 128 == 0: no tail) on the host, groups 8-row groups per pass.
std::vector<float> model(const Problem& p, int groups) {
  std::vector<float> out(static_cast<size_t>(p.rows * p.N), -1.0f);
  const int64_t slabs = (p.N + st::kSlab - 1) / st::kSlab, chunks = p.K / st::kChunk;
  for (int64_t x = 0; x < slabs; ++x) {
    // The weight row of (warp, tile i, r, g), clamped as the kernel clamps it.
    const auto row = [&](int warp, int i, int r, int g) {
      const int64_t n = x * st::kSlab + warp * st::kRowsPerWarp + 16 * i + g + 8 * r;
      return std::min(n, p.N - 1);
    };
    for (int64_t m0 = 0; m0 < p.rows; m0 += 8 * groups) {
      const int live = static_cast<int>(std::min<int64_t>((p.rows - m0 + 7) / 8, groups));
      // C[warp][tile][group]: 16 x 8 fp32 accumulators.
      std::vector<float> acc(static_cast<size_t>(st::kWarps * st::kTiles * groups * 128), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        std::vector<uint8_t> stage(static_cast<size_t>(st::stage_bytes(groups)), 0xcd);
        for (int tid = 0; tid < st::kThreads; ++tid) {
          const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
          for (int q = 0; q < groups; ++q) {  // dead groups too: clamped to the last row
            const int64_t m = std::min<int64_t>(m0 + 8 * q + st::act_copy_row(tid), p.rows - 1);
            const bf16_t* src = p.a.data() + m * p.K + c * st::kChunk + st::act_copy_element(tid);
            std::memcpy(stage.data() + st::act_copy_offset(q, tid), src, 16);
          }
          if (x * st::kSlab + warp * st::kRowsPerWarp >= p.N) continue;  // no rows: no copies
          for (int i = 0; i < st::kTiles; ++i) {
            for (int r = 0; r < 2; ++r) {
              std::memcpy(stage.data() + st::code_offset(warp, i, r, lane),
                          p.codes.data() + row(warp, i, r, g) * p.K / 2 + c * 64 + t * 16, 16);
            }
            const int r = st::scale_copy_r(lane), block = st::scale_copy_block(lane);
            std::memcpy(stage.data() + st::scale_offset(warp, i, r, g, block),
                        p.scales.data() + row(warp, i, r, g) * p.K / 16 + c * 8 + block, 4);
          }
        }
        for (int warp = 0; warp < st::kWarps; ++warp) {
          if (x * st::kSlab + warp * st::kRowsPerWarp >= p.N) continue;
          for (int h = 0; h < 2; ++h) {  // the kernel's loop order: halves, then tiles
            for (int i = 0; i < st::kTiles; ++i) {
              for (int s = 0; s < 4; ++s) {  // step 4h + s
                float A[16][16] = {}, B[4][16][8] = {};
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane / 4, t = lane % 4;
                  for (int r = 0; r < 2; ++r) {
                    const int code = st::code_offset(warp, i, r, lane);
                    const uint8_t scale = stage[static_cast<size_t>(
                        st::scale_offset(warp, i, r, g, 2 * t + h))];
                    const float sc = e4m3_to_float(scale);
                    const E2m1Bf16Table table = e2m1_bf16_table(
                        bf16x2_times(kE2m1Bf16x2_01, sc), bf16x2_times(kE2m1Bf16x2_23, sc),
                        bf16x2_times(kE2m1Bf16x2_45, sc), bf16x2_times(kE2m1Bf16x2_67, sc));
                    uint32_t e[4];
                    e2m1x8_to_bf16x2(word_at(stage, code + 8 * h + 4 * (s / 2)), table, e);
                    const uint32_t pair0 = e[s % 2 == 0 ? 0 : 2], pair1 = e[s % 2 == 0 ? 1 : 3];
                    A[g + 8 * r][2 * t] = lo_half(pair0);
                    A[g + 8 * r][2 * t + 1] = hi_half(pair0);
                    A[g + 8 * r][2 * t + 8] = lo_half(pair1);
                    A[g + 8 * r][2 * t + 9] = hi_half(pair1);
                  }
                  for (int q = 0; q < live; ++q) {
                    const int unit = st::act_offset(q, 2 * h + s / 2, lane) + (s % 2) * 8;
                    const uint32_t b0 = word_at(stage, unit), b1 = word_at(stage, unit + 4);
                    B[q][2 * t][g] = lo_half(b0);
                    B[q][2 * t + 1][g] = hi_half(b0);
                    B[q][2 * t + 8][g] = lo_half(b1);
                    B[q][2 * t + 9][g] = hi_half(b1);
                  }
                }
                for (int q = 0; q < live; ++q) {
                  float* C = acc.data() + ((warp * st::kTiles + i) * groups + q) * 128;
                  for (int rr = 0; rr < 16; ++rr) {
                    for (int col = 0; col < 8; ++col) {
                      for (int k = 0; k < 16; ++k) C[rr * 8 + col] += A[rr][k] * B[q][k][col];
                    }
                  }
                }
              }
            }
          }
        }
      }
      // The epilogue: lane (g, t) holds C[g + 8r][2t + j] = out[m0 + 8q + 2t + j, row (i, r, g)].
      for (int warp = 0; warp < st::kWarps; ++warp) {
        for (int i = 0; i < st::kTiles; ++i) {
          for (int q = 0; q < live; ++q) {
            const float* C = acc.data() + ((warp * st::kTiles + i) * groups + q) * 128;
            for (int lane = 0; lane < 32; ++lane) {
              const int g = lane / 4, t = lane % 4;
              for (int j = 0; j < 2; ++j) {
                for (int r = 0; r < 2; ++r) {
                  const int64_t m = m0 + 8 * q + 2 * t + j;
                  const int64_t n = x * st::kSlab + warp * st::kRowsPerWarp + 16 * i + g + 8 * r;
                  if (m < p.rows && n < p.N) {
                    out[static_cast<size_t>(m * p.N + n)] = C[(g + 8 * r) * 8 + 2 * t + j];
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

TEST(Nvfp4StageLayout, ModelGemmEqualsTheFormulaBitwise) {
  std::mt19937 rng(31);
  // N = 300: the second CTA's warp 0 holds 44 rows (tile 2 half past N, tile 3 clamped), its
  // warps 1 .. 3 none; 37 rows: 5, 3 and 2 passes of 1, 2 and 4 groups; 3 chunks.
  const Problem p(37, 300, 384, rng);
  const std::vector<float> want = p.formula();
  for (int groups : {1, 2, 4}) {
    const std::vector<float> got = model(p, groups);
    int shown = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (got[i] != want[i] && shown++ < 8) {
        ADD_FAILURE() << groups << " groups: row " << i / static_cast<size_t>(p.N) << " col "
                      << i % static_cast<size_t>(p.N) << ": model " << got[i] << ", formula "
                      << want[i];
      }
    }
  }
}

}  // namespace
}  // namespace epmoe::test
