// Grouped-GEMM benchmark, MXFP8: the decode kernel (cuda::mxfp8_grouped_gemm, mma.sync) against
// the wgmma kernel (cuda::mxfp8_grouped_gemm_wgmma) on the expert GEMMs W13 (N = 2F, K = D) and
// W2 (N = D, K = F) of the MEASURE.md shapes at EP = 1, balanced routing (T * K rows split evenly
// over the E experts), plain bf16 rows out; each timed with CUDA events (3 warm-up launches, then
// --iters, median and min-max). Inputs are hash-filled on the device: finite E4M3 codes
// (|x| < 1), E8M0 scales 120 .. 134, never zeros. Also counts the outputs where the two kernels
// differ (the wgmma kernel's tensor cores sum a block's products their own way: a few expected).
//
//   bench_gemm_mxfp8 [--shape NAME|all] [--iters N] [--tokens T]
//
// --tokens overrides the shapes' T (e.g. 128 for decode sizes). Prints one line per GEMM and
// kernel and one JSON object per run in MEASURE.md's row format (phase "grouped-gemm-w13" /
// "grouped-gemm-w2", precision "mxfp8", "mxfp8_kernel": "decode" / "wgmma").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/numeric.h"
#include "cuda/gemm/mxfp8_gemm.h"
#include "cuda/gemm/mxfp8_wgmma_gemm.h"

#include "bench_common.cuh"

namespace {

using namespace epmoe::bench;

__global__ void fill_e8m0(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>(120u + mix(static_cast<uint64_t>(i), seed) % 15u);
  }
}

void report(const ModelShape& s, int64_t T, const char* gemm, const char* kernel, int64_t M,
            int64_t N, int64_t K, const Timing& t, double ratio_to_decode) {
  const double tflops = 2.0 * static_cast<double>(M) * static_cast<double>(N) *
                        static_cast<double>(K) / (t.median_ms * 1e-3) / 1e12;
  std::printf("%-14s %-4s %-6s M %6lld N %6lld K %6lld  median %8.3f ms (%.3f-%.3f)  %7.1f TFLOP/s",
              s.name, gemm, kernel, static_cast<long long>(M), static_cast<long long>(N),
              static_cast<long long>(K), t.median_ms, t.min_ms, t.max_ms, tflops);
  if (ratio_to_decode > 0) std::printf("  x%.2f vs decode", ratio_to_decode);
  std::printf("\n");
  std::printf(
      "JSON {\"impl\": \"epmoe\", \"shape\": \"%s\", \"ep\": 1, \"routing\": \"balanced\", "
      "\"precision\": \"mxfp8\", \"phase\": \"grouped-gemm-%s\", \"tokens_per_rank\": %lld, "
      "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"useful_tflops\": %.2f, "
      "\"GBps\": null, \"busiest_rank_rows\": %lld, \"balanced_rows\": %lld, \"peak_mem_bytes\": "
      "null, "
      "\"mxfp8_kernel\": \"%s\"}\n",
      s.name, gemm, static_cast<long long>(T), t.median_ms, t.min_ms, t.max_ms, tflops,
      static_cast<long long>(M), static_cast<long long>(M), kernel);
}

void run_shape(const ModelShape& s, int64_t T, int iters) {
  const int E = s.E;
  const int64_t M = T * s.K, rows = M / E, D = s.D, F = s.F;
  std::vector<int32_t> offsets(static_cast<size_t>(E) + 1);
  for (int e = 0; e <= E; ++e) offsets[static_cast<size_t>(e)] = static_cast<int32_t>(rows * e);
  offsets[static_cast<size_t>(E)] = static_cast<int32_t>(M);  // remainder rows to the last expert
  int32_t* offsets_E1 = upload(offsets);
  const unsigned grid = 1024, block = 256;
  struct Gemm {
    const char* name;
    int64_t N, K;
  };
  for (const Gemm& g : {Gemm{"w13", 2 * F, D}, Gemm{"w2", D, F}}) {
    const int64_t S = g.K / 32;
    uint8_t* a = alloc<uint8_t>(M * g.K);
    uint8_t* sa = alloc<uint8_t>(M * S);
    uint8_t* w = alloc<uint8_t>(E * g.N * g.K);
    uint8_t* sw = alloc<uint8_t>(E * g.N * S);
    uint16_t* out[2] = {alloc<uint16_t>(M * g.N), alloc<uint16_t>(M * g.N)};
    fill_e4m3<<<grid, block>>>(a, M * g.K, 1);
    fill_e8m0<<<grid, block>>>(sa, M * S, 2);
    fill_e4m3<<<grid, block>>>(w, E * g.N * g.K, 3);
    fill_e8m0<<<grid, block>>>(sw, E * g.N * S, 4);
    BENCH_CHECK(cudaGetLastError());
    epmoe::cuda::Mxfp8GroupedGemmArgs args;
    args.a_codes_MK = a;
    args.a_scales_MS = sa;
    args.b_codes_ENK = w;
    args.b_scales_ENS = sw;
    args.offsets_E1 = offsets_E1;
    args.E = E;
    args.M = M;
    args.N = g.N;
    args.K = g.K;
    args.ld_out = g.N;
    args.out_MN = reinterpret_cast<epmoe::bf16_t*>(out[0]);
    const Timing decode =
        time_launches([&] { epmoe::cuda::mxfp8_grouped_gemm(args, nullptr); }, iters);
    report(s, T, g.name, "decode", M, g.N, g.K, decode, 0.0);
    args.out_MN = reinterpret_cast<epmoe::bf16_t*>(out[1]);
    const Timing wgmma =
        time_launches([&] { epmoe::cuda::mxfp8_grouped_gemm_wgmma(args, nullptr); }, iters);
    report(s, T, g.name, "wgmma", M, g.N, g.K, wgmma, decode.median_ms / wgmma.median_ms);
    unsigned long long* count = alloc<unsigned long long>(1);
    BENCH_CHECK(cudaMemset(count, 0, sizeof(unsigned long long)));
    count_differences<<<grid, block>>>(out[0], out[1], M * g.N, count);
    BENCH_CHECK(cudaGetLastError());
    unsigned long long differ = 0;
    BENCH_CHECK(cudaMemcpy(&differ, count, sizeof(differ), cudaMemcpyDeviceToHost));
    std::printf("%-14s %-4s wgmma vs decode: %llu of %lld outputs differ\n", s.name, g.name, differ,
                static_cast<long long>(M * g.N));
    BENCH_CHECK(cudaFree(count));
    for (void* p :
         {static_cast<void*>(a), static_cast<void*>(sa), static_cast<void*>(w),
          static_cast<void*>(sw), static_cast<void*>(out[0]), static_cast<void*>(out[1])}) {
      BENCH_CHECK(cudaFree(p));
    }
  }
  BENCH_CHECK(cudaFree(offsets_E1));
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "all";
  int iters = 20;
  int64_t tokens = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      shape = argv[++i];
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      tokens = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--shape qwen3-30b-a3b|deepseek-v3|gpt-oss-120b|mixtral-8x7b|all] [--iters N] "
          "[--tokens T]\n",
          argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool ran = false;
  for (const ModelShape& s : kShapes) {
    if (shape == "all" || shape == s.name) {
      run_shape(s, tokens > 0 ? tokens : s.T, iters);
      ran = true;
    }
  }
  if (!ran) {
    std::fprintf(stderr, "unknown shape %s\n", shape.c_str());
    return 2;
  }
  return 0;
}
