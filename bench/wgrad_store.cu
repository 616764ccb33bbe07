// wgrad_store: the HBM write rate of the bf16 WGRAD's output pattern, without the GEMM. The WGRAD
// writes grad_w [E, m_out, n_out] bf16 as 128 x 256 tiles (one 64 KiB tile per ~128 rows of
// contraction at deepseek-v3, EP = 1), and runs at 55 % of the write-only stream
// (bench/RESULTS.md 328c52a). This separates the pattern from the kernel: a persistent grid (one
// 256-thread CTA per SM, as the WGRAD's) writes the same bytes
//   tile     the WGRAD's order: tile -> (expert, m-tile, n-tile), n fastest; each tile as 128 rows
//            of 512 bytes, a warp's 32 16-byte stores per row piece (the direct-store epilogue)
//   tile-m   the same tiles, m fastest (a column of tiles at a time)
//   linear   each tile as one contiguous 64 KiB piece (the same tile count and bytes per CTA)
//   tma<B>   the WGRAD's own stores: TMA bulk-tensor stores of 64 x 64 boxes (128-byte swizzle) from
//            shared memory, one thread per CTA issuing a tile's 8 boxes, with B tiles (64 KiB each)
//            in flight per SM before it waits for the oldest to be read. The TMA-store epilogue has
//            one tile in flight (tma1) and an MMA between tiles; tma2 / tma3 say whether more bytes
//            in flight per SM would write faster (Little's law) before any kernel is changed.
// against cudaMemsetAsync of the whole buffer, for W13's [2F, D] and W2's [D, F] gradients of the
// MEASURE.md shapes. GB/s = bytes written / median time.
//
//   wgrad_store [--shape NAME|all] [--iters N] [--json PATH]
#include <cuda.h>  // CUtensorMap (the driver entry point comes through the runtime)
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

// TMA stores: B tiles of 8 boxes (64 x 64 bf16, 8 KiB each) in flight per CTA. The shared buffers
// hold whatever they hold: only the bytes' rate is measured.
constexpr int kBoxBytes = 64 * 64 * 2;
constexpr int kBoxesPerTile = kTileM / 64 * (kTileN / 64);

template <int kInFlight>
__global__ void __launch_bounds__(128) store_tiles_tma(const __grid_constant__ CUtensorMap map, Grad g) {
  extern __shared__ uint8_t raw[];
  // 128-byte swizzle: boxes at 1024-byte aligned addresses.
  const auto base = (static_cast<uint32_t>(__cvta_generic_to_shared(raw)) + 1023u) & ~1023u;
  if (threadIdx.x != 0) return;
  const int64_t m_tiles = g.m_tiles(), n_tiles = g.n_tiles(), per_group = m_tiles * n_tiles;
  int sequence = 0;
  for (int64_t tile = blockIdx.x; tile < g.tiles(); tile += gridDim.x, ++sequence) {
    // The buffer this tile reuses was last stored kInFlight tiles ago: wait until it has been read.
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kInFlight - 1) : "memory");
    const uint32_t buffer = base + static_cast<uint32_t>(sequence % kInFlight) * kBoxesPerTile * kBoxBytes;
    const int64_t group = tile / per_group, local = tile % per_group;
    const int m0 = static_cast<int>(local / n_tiles) * kTileM, n0 = static_cast<int>(local % n_tiles) * kTileN;
    for (int b = 0; b < kBoxesPerTile; ++b) {
      const int x = n0 + 64 * (b % (kTileN / 64)), y = m0 + 64 * (b / (kTileN / 64));
      if (x >= g.n_out || y >= g.m_out) continue;  // boxes past the edge: TMA clips partial ones
      asm volatile(
          "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(&map),
          "r"(buffer + b * kBoxBytes), "r"(x), "r"(y), "r"(static_cast<int>(group))
          : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// grad_w [groups, m_out, n_out] bf16 as a TMA tensor in 64 x 64 boxes, 128-byte swizzle (as
// make_wgrad_store in src/cuda/gemm/expert_gemm_wgrad.cu).
CUtensorMap wgrad_tensor_map(void* grad, const Grad& g) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                              CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                              CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  BENCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                               &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::fprintf(stderr, "wgrad_store: cuTensorMapEncodeTiled not found in the driver\n");
    std::exit(1);
  }
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(g.n_out), static_cast<cuuint64_t>(g.m_out),
                              static_cast<cuuint64_t>(g.groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(g.n_out) * 2,
                                 static_cast<cuuint64_t>(g.m_out * g.n_out) * 2};
  const cuuint32_t box[3] = {64, 64, 1}, element_strides[3] = {1, 1, 1};
  const CUresult r = reinterpret_cast<Encode>(fn)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, grad, dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "wgrad_store: cuTensorMapEncodeTiled returned %d (n_out %lld, m_out %lld)\n",
                 static_cast<int>(r), static_cast<long long>(g.n_out), static_cast<long long>(g.m_out));
    std::exit(1);
  }
  return map;
}

template <int kInFlight>
void launch_tma(const CUtensorMap& map, const Grad& g, int sms) {
  const int bytes = kInFlight * kBoxesPerTile * kBoxBytes + 1024;
  BENCH_CHECK(cudaFuncSetAttribute(store_tiles_tma<kInFlight>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  store_tiles_tma<kInFlight><<<sms, 128, bytes>>>(map, g);
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
      const CUtensorMap map = wgrad_tensor_map(grad, g);
      const auto tma1 = epmoe::bench::time_launches([&] { launch_tma<1>(map, g, sms); }, iters);
      rows.push_back({s.name, gemm, "tma1", tma1.median_ms, bytes / tma1.median_ms / 1e6});
      const auto tma2 = epmoe::bench::time_launches([&] { launch_tma<2>(map, g, sms); }, iters);
      rows.push_back({s.name, gemm, "tma2", tma2.median_ms, bytes / tma2.median_ms / 1e6});
      const auto tma3 = epmoe::bench::time_launches([&] { launch_tma<3>(map, g, sms); }, iters);
      rows.push_back({s.name, gemm, "tma3", tma3.median_ms, bytes / tma3.median_ms / 1e6});
      BENCH_CHECK(cudaFree(grad));
      for (size_t i = rows.size() - 7; i < rows.size(); ++i) {
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
