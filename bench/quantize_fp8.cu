// FP8 quantizer benchmark: the operands the FP8 training backward quantizes, on the MEASURE.md
// shapes at EP = 1 with balanced routing (M = T * K rows split evenly over the E experts), each
// timed with CUDA events (3 warm-up launches, then --iters, median and min-max).
//   column quantizer (128x1 blocks per expert, codes transposed for the FP8 WGRAD):
//     cuda::fp8_quantize_cols_transposed on bf16 grad_h3 [M, D], h [M, F], grad_h13 [M, 2F];
//     cuda::fp8_quantize_cols_transposed_from_rows on the E4M3 x rows [M, D] (1x128 scales);
//   row quantizer (1x128, for reference): cuda::fp8_quantize_rows_counted on the three bf16
//     operands, scales S-major as the backward writes them.
// Bytes are what the kernel must move: the input (codes and scales) read once, the codes and
// scales written once. The ceiling is a cudaMemcpy device-to-device of the same number of bytes
// (half read, half written), timed the same way in the same run; "% copy" is their ratio.
// Inputs are hash-filled on the device: bf16 uniform in [-1, 1), never all zero.
//
//   bench_quantize_fp8 [--shape NAME|all] [--iters N]
//
// Prints one line per kernel and one JSON object in MEASURE.md's row format (precision "fp8",
// phase "quantize-cols-<operand>" / "quantize-rows-<operand>", GBps the kernel's bytes per second;
// extra keys "copy_GBps" and "pct_of_copy").
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "core/numeric.h"
#include "cuda/formats/formats.h"

#include "bench_common.cuh"

namespace {

using namespace epmoe::bench;

__global__ void fill_bf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(mix(static_cast<uint64_t>(i), seed) >> 8) * 0x1p-23f - 1.0f;
    p[i] = epmoe::float_to_bf16(v);
  }
}

// Device buffers of one shape, sized for its largest operand.
struct Buffers {
  uint16_t* x = nullptr;     // bf16 [M, A], A = max(D, 2F, F)
  char* rows = nullptr;      // E4M3 x rows [M, D], fp8_rows_bytes layout
  uint8_t* q = nullptr;      // codes: [A, 128 max_blocks] or [M, A]
  float* scales = nullptr;   // [max_blocks, A] or S-major [S_A, ld]
  char* copy_src = nullptr;  // the copy ceiling
  char* copy_dst = nullptr;
  int64_t copy_bytes = 0;
  int32_t* offsets_E1 = nullptr;
  int32_t* count_1 = nullptr;   // M
  int32_t* skip_1 = nullptr;    // 0
  int64_t* offset_1 = nullptr;  // 0
};

struct Row {
  const char* name;  // the operand
  int64_t L;
  bool e4m3;  // the column quantizer from E4M3 rows
};

void report(const ModelShape& s, const char* kind, const Row& op, int64_t M, const Timing& t,
            double bytes, const Timing& copy) {
  const double gbps = bytes / (t.median_ms * 1e-3) / 1e9;
  const double copy_gbps = bytes / (copy.median_ms * 1e-3) / 1e9;
  const std::string phase = std::string("quantize-") + kind + "-" + op.name;
  std::printf("%-14s %-24s M %6lld L %6lld  median %7.3f ms (%.3f-%.3f)  %7.1f GB/s  copy %7.1f GB/s  "
              "%5.1f%% of copy\n",
              s.name, phase.c_str(), static_cast<long long>(M), static_cast<long long>(op.L), t.median_ms,
              t.min_ms, t.max_ms, gbps, copy_gbps, 100.0 * gbps / copy_gbps);
  std::printf("JSON {\"impl\": \"epmoe\", \"shape\": \"%s\", \"ep\": 1, \"routing\": \"balanced\", "
              "\"precision\": \"fp8\", \"phase\": \"%s\", \"tokens_per_rank\": %lld, \"median_ms\": %.5f, "
              "\"min_ms\": %.5f, \"max_ms\": %.5f, \"useful_tflops\": null, \"GBps\": %.1f, "
              "\"busiest_rank_rows\": %lld, \"balanced_rows\": %lld, \"peak_mem_bytes\": null, "
              "\"L\": %lld, \"copy_GBps\": %.1f, \"pct_of_copy\": %.1f}\n",
              s.name, phase.c_str(), static_cast<long long>(s.T), t.median_ms, t.min_ms, t.max_ms, gbps,
              static_cast<long long>(M), static_cast<long long>(M), static_cast<long long>(op.L), copy_gbps,
              100.0 * gbps / copy_gbps);
}

// A device-to-device copy moving `bytes` in all (bytes / 2 read, bytes / 2 written).
Timing time_copy(const Buffers& b, double bytes, int iters) {
  const size_t half = static_cast<size_t>(bytes / 2);
  if (static_cast<int64_t>(half) > b.copy_bytes) {
    std::fprintf(stderr, "copy buffers too small\n");
    std::exit(1);
  }
  return time_launches([&] { BENCH_CHECK(cudaMemcpyAsync(b.copy_dst, b.copy_src, half, cudaMemcpyDeviceToDevice)); },
                       iters);
}

void run_shape(const ModelShape& s, int iters) {
  const int E = s.E;
  const int64_t M = s.T * s.K, D = s.D, F = s.F;
  const int64_t A = std::max(D, 2 * F);
  const int64_t max_blocks = epmoe::fp8_col_blocks(M, E);
  const int64_t K = epmoe::fp8_col_k(M, E);
  std::vector<int32_t> offsets(static_cast<size_t>(E) + 1, 0);
  int64_t used_blocks = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t rows = M / E + (e < M % E ? 1 : 0);
    offsets[static_cast<size_t>(e) + 1] = offsets[static_cast<size_t>(e)] + static_cast<int32_t>(rows);
    used_blocks += epmoe::fp8_blocks(rows);
  }
  Buffers b;
  b.x = alloc<uint16_t>(M * A);
  fill_bf16<<<1024, 256>>>(b.x, M * A, 17u);
  BENCH_CHECK(cudaGetLastError());
  b.q = alloc<uint8_t>(std::max(A * K, M * A));
  b.scales = alloc<float>(std::max(max_blocks * A, epmoe::fp8_blocks(A) * epmoe::fp8_rows_ld(M)));
  b.rows = alloc<char>(epmoe::fp8_rows_bytes(M, D));
  b.offsets_E1 = upload(offsets);
  b.count_1 = upload(std::vector<int32_t>{static_cast<int32_t>(M)});
  b.skip_1 = upload(std::vector<int32_t>{0});
  b.offset_1 = upload(std::vector<int64_t>{0});
  // Copy buffers for the largest byte count below (a bf16 operand of the widest L = A).
  b.copy_bytes = (M * A * 2 + used_blocks * 128 * A + used_blocks * A * 4 + epmoe::fp8_blocks(A) * M * 4) / 2 +
                 4096;
  b.copy_src = alloc<char>(b.copy_bytes);
  b.copy_dst = alloc<char>(b.copy_bytes);
  BENCH_CHECK(cudaMemset(b.copy_src, 1, static_cast<size_t>(b.copy_bytes)));
  // The E4M3 x rows, as the forward's dispatch leaves them.
  const int64_t ld = epmoe::fp8_rows_ld(M);
  epmoe::cuda::fp8_quantize_rows_counted(b.x, M, D, b.count_1, nullptr, reinterpret_cast<uint8_t*>(b.rows),
                                         reinterpret_cast<float*>(b.rows + epmoe::fp8_rows_scales_offset(M, D)),
                                         ld, nullptr);
  BENCH_CHECK(cudaDeviceSynchronize());

  const Row ops[] = {{"grad_h3", D, false}, {"h", F, false}, {"grad_h13", 2 * F, false}, {"x", D, true}};
  for (const Row& op : ops) {
    const int64_t L = op.L;
    const double read = op.e4m3 ? static_cast<double>(M * L + epmoe::fp8_blocks(L) * M * 4)
                                : static_cast<double>(M * L * 2);
    const double written = static_cast<double>(used_blocks * 128 * L + used_blocks * L * 4);
    const Timing t = time_launches(
        [&] {
          if (op.e4m3) {
            epmoe::cuda::fp8_quantize_cols_transposed_from_rows(b.rows, b.offset_1, b.count_1, M, L, b.offsets_E1,
                                                                E, b.skip_1, b.q, b.scales, max_blocks, nullptr);
          } else {
            epmoe::cuda::fp8_quantize_cols_transposed(b.x, M, L, b.offsets_E1, E, b.skip_1, b.q, b.scales,
                                                      max_blocks, nullptr);
          }
        },
        iters);
    report(s, "cols", op, M, t, read + written, time_copy(b, read + written, iters));
  }
  for (const Row& op : ops) {
    if (op.e4m3) continue;
    const int64_t L = op.L;
    const double bytes = static_cast<double>(M * L * 2 + M * L + epmoe::fp8_blocks(L) * M * 4);
    const Timing t = time_launches(
        [&] {
          epmoe::cuda::fp8_quantize_rows_counted(b.x, M, L, b.count_1, b.skip_1, b.q, b.scales, ld, nullptr);
        },
        iters);
    report(s, "rows", op, M, t, bytes, time_copy(b, bytes, iters));
  }
  for (void* p : {static_cast<void*>(b.x), static_cast<void*>(b.rows), static_cast<void*>(b.q),
                  static_cast<void*>(b.scales), static_cast<void*>(b.copy_src), static_cast<void*>(b.copy_dst),
                  static_cast<void*>(b.offsets_E1), static_cast<void*>(b.count_1), static_cast<void*>(b.skip_1),
                  static_cast<void*>(b.offset_1)}) {
    BENCH_CHECK(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape = "all";
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--shape" && i + 1 < argc) {
      shape = argv[++i];
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: bench_quantize_fp8 [--shape NAME|all] [--iters N]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool ran = false;
  try {
    for (const ModelShape& s : kShapes) {
      if (shape == "all" || shape == s.name) {
        run_shape(s, iters);
        ran = true;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  if (!ran) {
    std::fprintf(stderr, "unknown shape %s\n", shape.c_str());
    return 2;
  }
  return 0;
}
