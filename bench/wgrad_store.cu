// wgrad_store: the HBM write rate of the bf16 WGRAD's output pattern, without the GEMM. The WGRAD
// writes grad_w [E, m_out, n_out] bf16 as 128 x 256 tiles (one 64 KiB tile per ~128 rows of
// contraction at deepseek-v3, EP = 1), and runs at 55 % of the write-only stream
// (bench/RESULTS.md 328c52a). This separates the pattern from the kernel: a persistent grid (one
// 256-thread CTA per SM, as the WGRAD's) writes the same bytes
//   tile     the WGRAD's order: tile -> (expert, m-tile, n-tile), n fastest; each tile as 128 rows
//            of 512 bytes, a warp's 32 16-byte stores per row piece (the direct-store epilogue)
//   tile-m   the same tiles, m fastest (a column of tiles at a time)
//   linear   each tile as one contiguous 64 KiB piece (the same tile count and bytes per CTA)
// against cudaMemsetAsync of the whole buffer, for W13's [2F, D] and W2's [D, F] gradients of the
// MEASURE.md shapes. GB/s = bytes written / median time.
//
//   wgrad_store [--shape NAME|all] [--iters N] [--json PATH]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_common.cuh"

namespace {

using epmoe::bench::kShapes;
using epmoe::bench::ModelShape;

constexpr int kTileM = 128, kTileN = 256;  // the bf16 WGRAD's cooperative tile
constexpr int kThreads = 256;

enum class Pattern { tile, tile_m, linear };
const char* name(Pattern p) {
  return p == Pattern::tile ? "tile" : (p == Pattern::tile_m ? "tile-m" : "linear");
}

struct Grad {
  int64_t groups, m_out, n_out;
  __host__ __device__ int64_t m_tiles() const { return (m_out + kTileM - 1) / kTileM; }
  __host__ __device__ int64_t n_tiles() const { return (n_out + kTileN - 1) / kTileN; }
  __host__ __device__ int64_t tiles() const { return groups * m_tiles() * n_tiles(); }
  __host__ __device__ int64_t elements() const { return groups * m_out * n_out; }
};

// grad_w_GMN written tile by tile; n_out % 8 == 0 (16-byte row pieces). A warp writes one row
// piece of a tile per step (32 lanes x 8 bf16 = 256 columns), so every store instruction is 512
// contiguous bytes, as the direct-store epilogue's.
template <Pattern kPattern>
__global__ void __launch_bounds__(kThreads) store_tiles(uint16_t* grad_w_GMN, Grad g) {
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t m_tiles = g.m_tiles(), n_tiles = g.n_tiles(), per_group = m_tiles * n_tiles;
  const uint4 value = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);  // 1.0
  for (int64_t tile = blockIdx.x; tile < g.tiles(); tile += gridDim.x) {
    if constexpr (kPattern == Pattern::linear) {
      // Tile i's 64 KiB (kTileM x kTileN bf16) as one contiguous piece of the buffer.
      const int64_t begin = tile * kTileM * kTileN, end = min(begin + kTileM * kTileN, g.elements());
      for (int64_t i = begin + threadIdx.x * 8; i + 8 <= end; i += kThreads * 8) {
        *reinterpret_cast<uint4*>(grad_w_GMN + i) = value;
      }
      continue;
    }
    const int64_t group = tile / per_group, local = tile % per_group;
    const int64_t m_tile = kPattern == Pattern::tile ? local / n_tiles : local % m_tiles;
    const int64_t n_tile = kPattern == Pattern::tile ? local % n_tiles : local / m_tiles;
    const int64_t col = n_tile * kTileN + lane * 8;
    if (col >= g.n_out) continue;  // n_out % 8 == 0: a lane's piece is whole or outside
    uint16_t* base = grad_w_GMN + group * g.m_out * g.n_out + col;
    for (int r = warp; r < kTileM; r += kThreads / 32) {
      const int64_t row = m_tile * kTileM + r;
      if (row < g.m_out) *reinterpret_cast<uint4*>(base + row * g.n_out) = value;
    }
  }
}

struct Row {
  std::string shape, gemm, pattern;
  double ms, gbps;
};

}  // namespace

int main(int argc, char** argv) {
  std::string only = "all", json;
  int iters = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--shape" && i + 1 < argc) {
      only = argv[++i];
    } else if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: wgrad_store [--shape NAME|all] [--iters N] [--json PATH]\n");
      return 2;
    }
  }
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<Row> rows;
  for (const ModelShape& s : kShapes) {
    if (only != "all" && only != s.name) continue;
    const struct {
      const char* gemm;
      Grad g;
    } grads[] = {{"w13_wgrad", {s.E, 2 * s.F, s.D}}, {"w2_wgrad", {s.E, s.D, s.F}}};
    for (const auto& grad_shape : grads) {
      const char* gemm = grad_shape.gemm;
      const Grad g = grad_shape.g;
      const int64_t bytes = g.elements() * 2;
      uint16_t* grad = epmoe::bench::alloc<uint16_t>(g.elements());
      const auto fill = epmoe::bench::time_launches(
          [&] { BENCH_CHECK(cudaMemsetAsync(grad, 0, static_cast<size_t>(bytes))); }, iters);
      rows.push_back({s.name, gemm, "memset", fill.median_ms, bytes / fill.median_ms / 1e6});
      for (const Pattern p : {Pattern::tile, Pattern::tile_m, Pattern::linear}) {
        const auto t = epmoe::bench::time_launches(
            [&] {
              if (p == Pattern::tile) store_tiles<Pattern::tile><<<sms, kThreads>>>(grad, g);
              if (p == Pattern::tile_m) store_tiles<Pattern::tile_m><<<sms, kThreads>>>(grad, g);
              if (p == Pattern::linear) store_tiles<Pattern::linear><<<sms, kThreads>>>(grad, g);
            },
            iters);
        rows.push_back({s.name, gemm, name(p), t.median_ms, bytes / t.median_ms / 1e6});
      }
      BENCH_CHECK(cudaFree(grad));
      for (size_t i = rows.size() - 4; i < rows.size(); ++i) {
        std::printf("%-14s %-10s %-7s %8.3f ms %7.0f GB/s (%.2f GB, %lld tiles)\n",
                    rows[i].shape.c_str(), rows[i].gemm.c_str(), rows[i].pattern.c_str(),
                    rows[i].ms, rows[i].gbps, bytes / 1e9, static_cast<long long>(g.tiles()));
      }
    }
  }
  if (rows.empty()) {
    std::fprintf(stderr, "wgrad_store: --shape %s is none of the MEASURE.md shapes\n", only.c_str());
    return 2;
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "wgrad_store: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "{\"tool\": \"wgrad_store\", \"ctas\": %d, \"threads\": %d, \"rows\": [\n", sms,
                 kThreads);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, "  {\"shape\": \"%s\", \"gemm\": \"%s\", \"pattern\": \"%s\", \"median_ms\": %.4f, "
                      "\"GBps\": %.1f}%s\n",
                   rows[i].shape.c_str(), rows[i].gemm.c_str(), rows[i].pattern.c_str(), rows[i].ms,
                   rows[i].gbps, i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
