// Grouped-GEMM benchmark, FP8 block-scaled vs bf16: the expert GEMMs W13 (N = 2F, K = D) and W2
// (N = D, K = F) of the MEASURE.md shapes at EP = 1 with balanced routing (T * K rows split evenly
// over the E experts), each timed with CUDA events (3 warm-up launches, then --iters, median and
// min-max). FP8: cuda::fp8_grouped_gemm (E4M3 operands, 1x128 / 128x128 fp32 scales, bf16 rows
// out). bf16: the library's forward GEMM launchers with their plain row epilogues (w13_fprop
// without SwiGLU, w2_fprop without scatter) and the schedule the build selects. Inputs are random
// (hash-filled on the device; finite E4M3 codes, scales in [0.5, 1.5), bf16 in [-1, 1)), never zeros.
//
//   bench_gemm_fp8 [--shape NAME|all] [--iters N] [--fp8-tile 128x128|192x128|64x256|64x256-spread|all]
//                  [--overlap env|0|1|both] [--trim-rows env|0|1|both] [--rows even|routed]
//
// --fp8-tile picks the FP8 kernel's tile (cuda::Fp8Tile; default: what EPMOE_FP8_TILE selects);
// --overlap its main loop (Fp8GroupedGemmArgs::overlap: env as EPMOE_FP8_OVERLAP says, 0 one block
// accumulator, 1 two, the next k-block's MMA during the promotion). all / both time every
// combination one after the other on the same inputs and count the output elements where each
// differs from the first (bitwise; expected 0). --trim-rows: the cooperative tiles' row trimming
// (Fp8GroupedGemmArgs::trim_rows). --rows routed: rows per expert as a balanced routing draws them
// (each token K distinct experts, uniformly, seeded) instead of T * K / E each: the expert sizes
// the training step's GEMMs see, whose last m-tiles are partly empty.
//
// Prints one line per GEMM and, per run, one JSON object in MEASURE.md's row format
// (phase "grouped-gemm-w13" / "grouped-gemm-w2", precision "fp8" / "bf16"; FP8 rows name their
// tile in "fp8_tile" and their main loop in "fp8_loop").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/numeric.h"
#include "core/step.h"
#include "cuda/gemm/expert_gemm.h"
#include "cuda/gemm/fp8_gemm.h"

#include "bench_common.cuh"

namespace {

using namespace epmoe::bench;

__global__ void fill_scales(float* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = 0.5f + static_cast<float>(mix(static_cast<uint64_t>(i), seed) >> 8) * 0x1p-24f;
  }
}

__global__ void fill_bf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(mix(static_cast<uint64_t>(i), seed) >> 8) * 0x1p-23f - 1.0f;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    p[i] = static_cast<uint16_t>(bits >> 16);
  }
}

struct Fp8Variant {
  epmoe::cuda::Fp8Tile tile;
  int overlap;  // Fp8GroupedGemmArgs::overlap
  int trim_rows;  // Fp8GroupedGemmArgs::trim_rows
};

bool g_routed_rows = false;  // --rows routed

const char* loop_name(int overlap) {
  return epmoe::cuda::fp8_overlap_selected(overlap) ? "overlap" : "one-accumulator";
}

const char* tile_name(epmoe::cuda::Fp8Tile t) {
  switch (t) {
    case epmoe::cuda::Fp8Tile::m64_n256: return "64x256";
    case epmoe::cuda::Fp8Tile::m64_n256_spread: return "64x256-spread";
    case epmoe::cuda::Fp8Tile::m192_n128: return "192x128";
    default: return "128x128";
  }
}

void report(const ModelShape& s, const char* gemm, const char* precision, int64_t M, int64_t N, int64_t K,
            const Timing& t, double ratio_to_bf16, const char* fp8_tile = nullptr,
            const char* fp8_loop = nullptr, int trim_rows = -1) {
  const double tflops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) /
                        (t.median_ms * 1e-3) / 1e12;
  std::printf("%-14s %-4s %-5s M %6lld N %6lld K %6lld  median %8.3f ms (%.3f-%.3f)  %7.1f TFLOP/s", s.name,
              gemm, precision, static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
              t.median_ms, t.min_ms, t.max_ms, tflops);
  if (ratio_to_bf16 > 0) std::printf("  fp8/bf16 %.2fx", ratio_to_bf16);
  const bool trimmed = epmoe::cuda::fp8_trim_rows_selected(trim_rows);
  if (fp8_tile != nullptr) std::printf("  tile %s, %s%s", fp8_tile, fp8_loop, trimmed ? ", trimmed" : "");
  std::printf("%s\n", g_routed_rows ? "  (routed rows)" : "");
  std::printf("JSON {\"impl\": \"epmoe\", \"shape\": \"%s\", \"ep\": 1, \"routing\": \"balanced\", "
              "\"precision\": \"%s\", \"phase\": \"grouped-gemm-%s\", \"tokens_per_rank\": %lld, "
              "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"useful_tflops\": %.2f, "
              "\"GBps\": null, \"busiest_rank_rows\": %lld, \"balanced_rows\": %lld, \"peak_mem_bytes\": null, \"expert_rows\": \"%s\"%s%s%s%s%s%s}\n",
              s.name, precision, gemm, static_cast<long long>(s.T), t.median_ms, t.min_ms, t.max_ms, tflops,
              static_cast<long long>(M), static_cast<long long>(M), g_routed_rows ? "routed" : "even",
              fp8_tile != nullptr ? ", \"fp8_tile\": \"" : "", fp8_tile != nullptr ? fp8_tile : "",
              fp8_tile != nullptr ? "\", \"fp8_loop\": \"" : "", fp8_loop != nullptr ? fp8_loop : "",
              fp8_tile != nullptr ? "\"" : "",
              fp8_tile != nullptr ? (trimmed ? ", \"fp8_trim_rows\": true" : ", \"fp8_trim_rows\": false") : "");
}

void run_shape(const ModelShape& s, int iters, const std::vector<Fp8Variant>& variants) {
  const int E = s.E;
  const int64_t M = s.T * s.K, rows = M / E, D = s.D, F = s.F;
  std::vector<int32_t> offsets(static_cast<size_t>(E) + 1);
  for (int e = 0; e <= E; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(rows * e);
  offsets[static_cast<size_t>(E)] = static_cast<int32_t>(M);  // remainder rows to the last expert
  if (g_routed_rows) {  // each token K distinct experts (a partial Fisher-Yates shuffle), seeded
    std::vector<int32_t> count(static_cast<size_t>(E), 0), ids(static_cast<size_t>(E));
    uint64_t state = 0x9E3779B97F4A7C15ull;
    for (int64_t t = 0; t < s.T; ++t) {
      for (int e = 0; e < E; ++e) ids[static_cast<size_t>(e)] = e;
      for (int k = 0; k < s.K; ++k) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        const int j = k + static_cast<int>((state >> 33) % static_cast<uint64_t>(E - k));
        std::swap(ids[static_cast<size_t>(k)], ids[static_cast<size_t>(j)]);
        ++count[static_cast<size_t>(ids[static_cast<size_t>(k)])];
      }
    }
    int tiles = 0;
    for (int e = 0; e < E; ++e) {
      offsets[static_cast<size_t>(e) + 1] = offsets[static_cast<size_t>(e)] + count[static_cast<size_t>(e)];
      tiles += (count[static_cast<size_t>(e)] + 127) / 128;
    }
    std::printf("%-14s routed rows: %lld in all, %d 128-row m-tiles (even split: %lld)\n", s.name,
                static_cast<long long>(offsets.back()), tiles,
                static_cast<long long>(E) * ((rows + 127) / 128));
  }
  int32_t* offsets_E1 = alloc<int32_t>(E + 1);
  int32_t* header = alloc<int32_t>(epmoe::kLayoutHeaderInts);
  BENCH_CHECK(cudaMemcpy(offsets_E1, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemset(header, 0, epmoe::kLayoutHeaderInts * 4));
  const unsigned grid = 1024, block = 256;

  struct Gemm {
    const char* name;
    int64_t N, K;
  };
  for (const Gemm& g : {Gemm{"w13", 2 * F, D}, Gemm{"w2", D, F}}) {
    // bf16: the library's launchers through a Step holding only what they read.
    Timing bf16_ms{};
    {
      uint16_t* a = alloc<uint16_t>(M * g.K);
      uint16_t* w = alloc<uint16_t>(E * g.N * g.K);
      uint16_t* out = alloc<uint16_t>(M * g.N);
      fill_bf16<<<grid, block>>>(a, M * g.K, 1);
      fill_bf16<<<grid, block>>>(w, E * g.N * g.K, 2);
      BENCH_CHECK(cudaGetLastError());
      epmoe::Step st;
      st.dims.T = s.T;
      st.dims.D = D;
      st.dims.F = F;
      st.dims.K = s.K;
      st.dims.E = E;
      st.dims.R = 1;
      st.capacity_rows = M;
      st.layout.header = header;
      st.layout.expert_offsets_E1 = offsets_E1;
      auto* a16 = reinterpret_cast<epmoe::bf16_t*>(a);
      auto* w16 = reinterpret_cast<epmoe::bf16_t*>(w);
      auto* o16 = reinterpret_cast<epmoe::bf16_t*>(out);
      const bool w13 = std::strcmp(g.name, "w13") == 0;
      if (w13) {
        st.x_gathered_MD = a16;
        st.w13_EFD = w16;
        st.h13_M2F = o16;
      } else {
        st.h_MF = a16;
        st.w2_EDF = w16;
        st.rows_MD = o16;
      }
      bf16_ms = time_launches([&] {
        if (w13) epmoe::cuda::w13_fprop(st, false);
        else epmoe::cuda::w2_fprop(st, false);
      }, iters);
      report(s, g.name, "bf16", M, g.N, g.K, bf16_ms, 0.0);
      BENCH_CHECK(cudaFree(a));
      BENCH_CHECK(cudaFree(w));
      BENCH_CHECK(cudaFree(out));
    }
    // FP8 block-scaled.
    {
      const int64_t S = (g.K + 127) / 128, B = (g.N + 127) / 128, ld_sa = (M + 3) / 4 * 4;
      uint8_t* a = alloc<uint8_t>(M * g.K);
      uint8_t* w = alloc<uint8_t>(E * g.N * g.K);
      float* sa = alloc<float>(S * ld_sa);
      float* sb = alloc<float>(E * B * S);
      std::vector<uint16_t*> out;  // one per variant
      for (size_t i = 0; i < variants.size(); ++i) out.push_back(alloc<uint16_t>(M * g.N));
      fill_e4m3<<<grid, block>>>(a, M * g.K, 3);
      fill_e4m3<<<grid, block>>>(w, E * g.N * g.K, 4);
      fill_scales<<<grid, block>>>(sa, S * ld_sa, 5);
      fill_scales<<<grid, block>>>(sb, E * B * S, 6);
      BENCH_CHECK(cudaGetLastError());
      epmoe::cuda::Fp8GroupedGemmArgs args;
      args.a_MK = a;
      args.a_scales_SM = sa;
      args.ld_a_scales = ld_sa;
      args.b_ENK = w;
      args.b_scales_EBS = sb;
      args.offsets_E1 = offsets_E1;
      args.skip = header + epmoe::kLayoutSkip;
      args.E = E;
      args.M = M;
      args.N = g.N;
      args.K = g.K;
      args.ld_out = g.N;
      for (size_t i = 0; i < variants.size(); ++i) {
        args.tile = variants[i].tile;
        args.overlap = variants[i].overlap;
        args.trim_rows = variants[i].trim_rows;
        args.out_MN = reinterpret_cast<epmoe::bf16_t*>(out[i]);
        const Timing t = time_launches([&] { epmoe::cuda::fp8_grouped_gemm(args, nullptr); }, iters);
        report(s, g.name, "fp8", M, g.N, g.K, t, bf16_ms.median_ms / t.median_ms, tile_name(variants[i].tile),
               loop_name(variants[i].overlap), variants[i].trim_rows);
      }
      for (size_t i = 1; i < variants.size(); ++i) {
        unsigned long long* count = alloc<unsigned long long>(1);
        BENCH_CHECK(cudaMemset(count, 0, sizeof(unsigned long long)));
        count_differences<<<grid, block>>>(out[0], out[i], M * g.N, count);
        BENCH_CHECK(cudaGetLastError());
        unsigned long long differ = 0;
        BENCH_CHECK(cudaMemcpy(&differ, count, sizeof(differ), cudaMemcpyDeviceToHost));
        std::printf("%-14s %-4s fp8 %s %s trim %d vs %s %s trim %d: %llu of %lld outputs differ\n", s.name,
                    g.name, tile_name(variants[0].tile), loop_name(variants[0].overlap),
                    epmoe::cuda::fp8_trim_rows_selected(variants[0].trim_rows) ? 1 : 0,
                    tile_name(variants[i].tile), loop_name(variants[i].overlap),
                    epmoe::cuda::fp8_trim_rows_selected(variants[i].trim_rows) ? 1 : 0, differ,
                    static_cast<long long>(M * g.N));
        BENCH_CHECK(cudaFree(count));
      }
      BENCH_CHECK(cudaFree(a));
      BENCH_CHECK(cudaFree(w));
      BENCH_CHECK(cudaFree(sa));
      BENCH_CHECK(cudaFree(sb));
      for (uint16_t* o : out) BENCH_CHECK(cudaFree(o));
    }
  }
  BENCH_CHECK(cudaFree(offsets_E1));
  BENCH_CHECK(cudaFree(header));
}

// A run-time switch's values: env (-1, the environment decides), 0, 1, or both.
bool switch_values(const std::string& v, std::vector<int>& out) {
  if (v == "env") out = {-1};
  else if (v == "0") out = {0};
  else if (v == "1") out = {1};
  else if (v == "both") out = {0, 1};
  else return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "all";
  int iters = 20;
  std::string tile = "";
  std::vector<int> overlaps = {-1}, trims = {-1};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      shape = argv[++i];
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--fp8-tile") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "128x128") == 0 || std::strcmp(argv[i + 1], "192x128") == 0 ||
                std::strcmp(argv[i + 1], "64x256") == 0 ||
                std::strcmp(argv[i + 1], "64x256-spread") == 0 || std::strcmp(argv[i + 1], "all") == 0)) {
      tile = argv[++i];
    } else if ((std::strcmp(argv[i], "--overlap") == 0 || std::strcmp(argv[i], "--trim-rows") == 0) &&
               i + 1 < argc) {
      const bool overlap = std::strcmp(argv[i], "--overlap") == 0;
      std::vector<int> values;
      if (!switch_values(argv[++i], values)) {
        std::fprintf(stderr, "%s: env, 0, 1 or both, not %s\n", argv[i - 1], argv[i]);
        return 2;
      }
      (overlap ? overlaps : trims) = values;
    } else if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "even") == 0 || std::strcmp(argv[i + 1], "routed") == 0)) {
      g_routed_rows = std::strcmp(argv[++i], "routed") == 0;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--shape qwen3-30b-a3b|deepseek-v3|gpt-oss-120b|mixtral-8x7b|all] [--iters N] "
                   "[--fp8-tile 128x128|192x128|64x256|64x256-spread|all] [--overlap env|0|1|both] [--trim-rows env|0|1|both] [--rows even|routed]\n",
                   argv[0]);
      return 2;
    }
  }
  using epmoe::cuda::Fp8Tile;
  std::vector<Fp8Tile> tiles;
  if (tile == "all") tiles = {Fp8Tile::m128_n128, Fp8Tile::m192_n128, Fp8Tile::m64_n256, Fp8Tile::m64_n256_spread};
  else if (tile == "192x128") tiles = {Fp8Tile::m192_n128};
  else if (tile == "64x256") tiles = {Fp8Tile::m64_n256};
  else if (tile == "64x256-spread") tiles = {Fp8Tile::m64_n256_spread};
  else if (tile == "128x128") tiles = {Fp8Tile::m128_n128};
  else tiles = {epmoe::cuda::fp8_tile_from_env()};
  std::vector<Fp8Variant> variants;
  for (const Fp8Tile t : tiles) {
    // The other tiles have one main loop; the overlap switch is the 128 x 128 kernel's, row trimming
    // the cooperative tiles'.
    const bool coop = t == Fp8Tile::m128_n128 || t == Fp8Tile::m192_n128;
    for (const int r : coop ? trims : std::vector<int>{-1}) {
      if (t != Fp8Tile::m128_n128) variants.push_back({t, 0, r});
      else for (const int o : overlaps) variants.push_back({t, o, r});
    }
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool ran = false;
  for (const ModelShape& s : kShapes) {
    if (shape == "all" || shape == s.name) {
      run_shape(s, iters, variants);
      ran = true;
    }
  }
  if (!ran) {
    std::fprintf(stderr, "unknown shape %s\n", shape.c_str());
    return 2;
  }
  return 0;
}
