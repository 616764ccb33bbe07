// Format codecs on the GPU (src/cuda/formats) against the host codecs (core/formats/codecs.h):
// every code, scale and dequantized value bitwise, on random tensors with awkward sizes, fp32 and
// bf16 inputs, exact rounding ties, zero / NaN / Inf / denormal blocks. Also the element codecs
// against CUDA's own conversions (cuda_fp8.h, cuda_fp4.h): their host paths here (no GPU needed),
// and every fp32 bit pattern through the device paths (on sm_90 the fp8 one is the hardware cvt).
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/formats/codecs.h"
#include "core/numeric.h"
#include "cuda/formats/formats.h"
#include "device_buffer.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "formats_hw_check.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

float fbits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
uint32_t bitsf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// ================= element codecs vs CUDA's conversions (host paths; no GPU) =================

float cuda_half_to_float(__half_raw h) { return __half2float(__half(h)); }

// Every midpoint between neighbouring codes (both signs) and its fp32 neighbours, plus a stride
// through all fp32 bit patterns (the device test covers every pattern).
template <class Ours, class Theirs>
void expect_encoder_matches(const std::vector<float>& grid, Ours ours, Theirs theirs, const char* what) {
  std::vector<float> inputs;
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float mid = 0.5f * (grid[i] + grid[i + 1]);  // exact: neighbours differ by one step
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), grid[i]}) {
      inputs.push_back(v);
      inputs.push_back(-v);
    }
  }
  for (uint64_t u = 0; u < (1ull << 32); u += 257) inputs.push_back(fbits(static_cast<uint32_t>(u)));
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {inf, -inf, std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f}) inputs.push_back(v);
  int shown = 0;
  for (float x : inputs) {
    const unsigned a = ours(x), b = theirs(x);
    if (a != b && shown++ < 10) {
      ADD_FAILURE() << what << ": x = " << x << " (bits " << std::hex << bitsf(x) << "): ours " << a
                    << ", CUDA " << b << std::dec;
    }
  }
}

std::vector<float> e4m3_grid() {
  std::vector<float> g;
  for (unsigned c = 0; c <= 0x7E; ++c) g.push_back(e4m3_to_float(static_cast<uint8_t>(c)));
  return g;
}

TEST(CudaFormatsHost, E4m3EncodeMatchesCudaSatfinite) {
  expect_encoder_matches(
      e4m3_grid(), [](float x) { return static_cast<unsigned>(e4m3_from_float(x)); },
      [](float x) { return static_cast<unsigned>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); }, "E4M3");
}

TEST(CudaFormatsHost, E2m1EncodeMatchesCuda) {
  std::vector<float> grid;
  for (unsigned c = 0; c <= 7; ++c) grid.push_back(e2m1_to_float(static_cast<uint8_t>(c)));
  expect_encoder_matches(
      grid, [](float x) { return static_cast<unsigned>(e2m1_from_float(x)); },
      [](float x) { return static_cast<unsigned>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)); },
      "E2M1");
}

TEST(CudaFormatsHost, DecodeMatchesCuda) {
  for (unsigned c = 0; c < 256; ++c) {
    const float ours = e4m3_to_float(static_cast<uint8_t>(c));
    const float theirs = cuda_half_to_float(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3));
    if (std::isnan(ours) || std::isnan(theirs)) {
      EXPECT_TRUE(std::isnan(ours) && std::isnan(theirs)) << "E4M3 code " << c;
    } else {
      EXPECT_EQ(bitsf(ours), bitsf(theirs)) << "E4M3 code " << c;
    }
  }
  for (unsigned c = 0; c < 16; ++c) {
    const float ours = e2m1_to_float(static_cast<uint8_t>(c));
    const float theirs = cuda_half_to_float(__nv_cvt_fp4_to_halfraw(static_cast<__nv_fp4_storage_t>(c), __NV_E2M1));
    EXPECT_EQ(bitsf(ours), bitsf(theirs)) << "E2M1 code " << c;
  }
}

// The launchers check their arguments on the host before touching the device.
TEST(CudaFormatsHost, LauncherArgumentErrors) {
  auto argument_of = [](const auto& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.argument();
    }
    return "(no error)";
  };
  float f = 0.0f;
  uint8_t b = 0;
  EXPECT_EQ(argument_of([&] { cuda::fp8_quantize_rows(&f, -1, 4, &b, &f, nullptr); }), "N");
  EXPECT_EQ(argument_of([&] { cuda::fp8_quantize_rows(&f, 1, 4, &b, static_cast<float*>(nullptr), nullptr); }),
            "scales_NS");
  EXPECT_EQ(argument_of([&] { cuda::fp8_quantize_weights(&f, -1, 1, 1, &b, &b, nullptr); }), "G");
  EXPECT_EQ(argument_of([&] { cuda::mxfp8_quantize_rows(static_cast<const float*>(nullptr), 2, 3, &b, &b, nullptr); }),
            "x_NL");
  EXPECT_EQ(argument_of([&] { cuda::nvfp4_global_scales(&f, 3, 4, 1, &f, nullptr); }), "groups");
  EXPECT_EQ(argument_of([&] { cuda::nvfp4_quantize_rows(&f, 1, 1, 4, &f, nullptr, &b, nullptr); }), "q_NP");
  // Empty tensors enqueue nothing (and need no device).
  EXPECT_EQ(argument_of([&] { cuda::mxfp8_quantize_rows(static_cast<const float*>(nullptr), 0, 3, nullptr, nullptr,
                                                        nullptr); }),
            "(no error)");
}

// ================================ GPU vs CPU, bitwise ================================

#define ASSERT_CUDA(call)                                                        \
  do {                                                                           \
    const cudaError_t err_ = (call);                                             \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_);   \
  } while (0)

template <class T>
void expect_bitwise(const std::vector<T>& cpu, const std::vector<T>& gpu, const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  int shown = 0;
  size_t differ = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::memcmp(&cpu[i], &gpu[i], sizeof(T)) != 0) {
      ++differ;
      if (shown++ < 5) {
        ADD_FAILURE() << what << "[" << i << "]: cpu " << +cpu[i] << ", gpu " << +gpu[i];
      }
    }
  }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << cpu.size() << " differ";
}

// Rows of four kinds, cycling: (0) normal data at a random power-of-two magnitude in
// [2^-30, 2^30]; (1) exact E4M3 / E2M1 rounding ties at a power-of-two scale (ties survive a
// power-of-two scale exactly) under an amax of 448 * 2^k; (2) specials: a zero block, -0, NaN,
// +-Inf, fp32 denormals, huge values; (3) normal data with 100x outliers.
std::vector<float> make_input(int64_t N, int64_t L, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-30, 30), pick(0, 63);
  const std::vector<float> grid = e4m3_grid();
  std::vector<float> x(static_cast<size_t>(N * L));
  for (int64_t n = 0; n < N; ++n) {
    float* row = x.data() + n * L;
    const float scale = std::ldexp(1.0f, exp(rng));
    for (int64_t l = 0; l < L; ++l) {
      float v = normal(rng) * scale;
      switch (n % 4) {
        case 1: {
          const size_t i = static_cast<size_t>(rng() % (grid.size() - 1));
          const float tie = l % 2 == 0 ? 0.5f * (grid[i] + grid[i + 1]) : 0.5f * static_cast<float>(rng() % 13);
          v = (l % 64 == 0 ? 448.0f : tie) * scale * (rng() % 2 == 0 ? 1.0f : -1.0f);
          break;
        }
        case 2: {
          const int64_t k = l % 160;
          if (k < 48) v = 0.0f;                                                  // zero blocks
          else if (k == 50) v = -0.0f;
          else if (k == 60) v = std::numeric_limits<float>::quiet_NaN();
          else if (k == 70) v = std::numeric_limits<float>::infinity();
          else if (k == 90) v = -std::numeric_limits<float>::infinity();
          else if (k >= 96 && k < 112) v = fbits(static_cast<uint32_t>(rng() % 0x7fffff));  // denormals
          else if (k == 130) v = 3.0e38f;
          break;
        }
        case 3:
          if (pick(rng) == 0) v *= 100.0f;
          break;
        default:
          break;
      }
      row[l] = v;
    }
    // Every eighth row starts with a zero 1x128 block (zero blocks of every format).
    if (n % 8 == 6) {
      for (int64_t l = 0; l < std::min<int64_t>(L, 128); ++l) row[l] = 0.0f;
    }
  }
  return x;
}

// bf16 copy of x (round to nearest even) and its exact fp32 widening, the CPU's input.
struct Bf16Input {
  std::vector<bf16_t> bf16;
  std::vector<float> widened;
};
Bf16Input to_bf16(const std::vector<float>& x) {
  Bf16Input r;
  for (float v : x) {
    r.bf16.push_back(float_to_bf16(v));
    r.widened.push_back(bf16_to_float(r.bf16.back()));
  }
  return r;
}

struct RowShape {
  int64_t N, L;
};
const RowShape kRowShapes[] = {{1, 1}, {19, 111}, {8, 128}, {33, 300}, {64, 1000}, {5, 4096}};

// Runs `body(x_cpu, x_device_ptr, tag)` for fp32 and bf16 inputs of one shape; `edit` may change
// the input first.
template <class Body>
void for_each_input(int64_t N, int64_t L, uint32_t seed, const Body& body,
                    const std::function<void(std::vector<float>&)>& edit = {}) {
  std::vector<float> x = make_input(N, L, seed);
  if (edit) edit(x);
  {
    Dev<float> dx(x);
    body(x, static_cast<const float*>(dx.ptr), "fp32");
  }
  const Bf16Input b = to_bf16(x);
  Dev<bf16_t> db(b.bf16);
  body(b.widened, static_cast<const bf16_t*>(db.ptr), "bf16");
}

TEST(GpuFormats, EncodersMatchCudaConversionsOnEveryFloat) {
  EPMOE_REQUIRE_GPU();
  for (const auto& [name, r] : {std::pair{"E4M3 encode", e4m3_encode_vs_cuda_all_floats()},
                                std::pair{"E2M1 encode", e2m1_encode_vs_cuda_all_floats()},
                                std::pair{"E4M3/E2M1 decode", e4m3_e2m1_decode_vs_cuda()}}) {
    EXPECT_EQ(r.count, 0u) << name << ": first differing input " << std::hex << r.first_input << " ours " << r.ours
                           << " CUDA " << r.theirs << std::dec;
  }
}

TEST(GpuFormats, Fp8RowsBitwiseVsCpu) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 1;
  for (const RowShape& sh : kRowShapes) {
    const int64_t N = sh.N, L = sh.L, S = scale_blocks(L, kFp8RowBlock);
    const size_t NL = static_cast<size_t>(N * L), NS = static_cast<size_t>(N * S);
    for_each_input(N, L, seed++, [&](const std::vector<float>& x, const auto* dx, const char* tag) {
      const std::string what = std::string("fp8 rows ") + tag + " N=" + std::to_string(N) + " L=" + std::to_string(L);
      std::vector<uint8_t> q(NL), s8(NS);
      std::vector<float> s32(NS), y(NL);
      // fp32 scales
      fp8_quantize_rows(x.data(), N, L, q.data(), s32.data());
      Dev<uint8_t> dq(NL);
      Dev<float> ds32(NS), dy(NL);
      cuda::fp8_quantize_rows(dx, N, L, dq.ptr, ds32.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " fp32 q");
      expect_bitwise(s32, ds32.get(), what + " fp32 scales");
      fp8_dequantize_rows(q.data(), s32.data(), N, L, y.data());
      cuda::fp8_dequantize_rows(dq.ptr, ds32.ptr, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " fp32 dequantized");
      // UE8M0 scales
      fp8_quantize_rows(x.data(), N, L, q.data(), s8.data());
      Dev<uint8_t> ds8(NS);
      cuda::fp8_quantize_rows(dx, N, L, dq.ptr, ds8.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " ue8m0 q");
      expect_bitwise(s8, ds8.get(), what + " ue8m0 scales");
      fp8_dequantize_rows(q.data(), s8.data(), N, L, y.data());
      cuda::fp8_dequantize_rows(dq.ptr, ds8.ptr, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " ue8m0 dequantized");
    });
  }
}

TEST(GpuFormats, Fp8WeightsBitwiseVsCpu) {
  EPMOE_REQUIRE_GPU();
  struct Shape3 {
    int64_t G, N, L;
  };
  uint32_t seed = 100;
  for (const Shape3& sh : {Shape3{1, 1, 1}, Shape3{2, 130, 129}, Shape3{3, 256, 384}, Shape3{1, 300, 1000}}) {
    const int64_t G = sh.G, N = sh.N, L = sh.L;
    const size_t n = static_cast<size_t>(G * N * L);
    const size_t ns = static_cast<size_t>(G * scale_blocks(N, kFp8WeightBlock) * scale_blocks(L, kFp8WeightBlock));
    for_each_input(G * N, L, seed++, [&](const std::vector<float>& w, const auto* dw, const char* tag) {
      const std::string what = std::string("fp8 weights ") + tag + " G=" + std::to_string(G) + " N=" +
                               std::to_string(N) + " L=" + std::to_string(L);
      std::vector<uint8_t> q(n), s8(ns);
      std::vector<float> s32(ns), y(n);
      Dev<uint8_t> dq(n), ds8(ns);
      Dev<float> ds32(ns), dy(n);
      fp8_quantize_weights(w.data(), G, N, L, q.data(), s32.data());
      cuda::fp8_quantize_weights(dw, G, N, L, dq.ptr, ds32.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " fp32 q");
      expect_bitwise(s32, ds32.get(), what + " fp32 scales");
      fp8_dequantize_weights(q.data(), s32.data(), G, N, L, y.data());
      cuda::fp8_dequantize_weights(dq.ptr, ds32.ptr, G, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " fp32 dequantized");
      fp8_quantize_weights(w.data(), G, N, L, q.data(), s8.data());
      cuda::fp8_quantize_weights(dw, G, N, L, dq.ptr, ds8.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " ue8m0 q");
      expect_bitwise(s8, ds8.get(), what + " ue8m0 scales");
      fp8_dequantize_weights(q.data(), s8.data(), G, N, L, y.data());
      cuda::fp8_dequantize_weights(dq.ptr, ds8.ptr, G, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " ue8m0 dequantized");
    }, [&](std::vector<float>& w) {
      // The last matrix's last block (partial where N or L is) is all zeros.
      for (int64_t r = (N - 1) / 128 * 128; r < N; ++r) {
        for (int64_t l = (L - 1) / 128 * 128; l < L; ++l) w[static_cast<size_t>(((G - 1) * N + r) * L + l)] = 0.0f;
      }
    });
  }
}

TEST(GpuFormats, Mxfp8RowsBitwiseVsCpu) {
  EPMOE_REQUIRE_GPU();
  uint32_t seed = 200;
  for (const RowShape& sh : kRowShapes) {
    const int64_t N = sh.N, L = sh.L;
    const size_t NL = static_cast<size_t>(N * L), NS = static_cast<size_t>(N * scale_blocks(L, kMxBlock));
    for_each_input(N, L, seed++, [&](const std::vector<float>& x, const auto* dx, const char* tag) {
      const std::string what = std::string("mxfp8 ") + tag + " N=" + std::to_string(N) + " L=" + std::to_string(L);
      std::vector<uint8_t> q(NL), s(NS);
      std::vector<float> y(NL);
      Dev<uint8_t> dq(NL), ds(NS);
      Dev<float> dy(NL);
      mxfp8_quantize_rows(x.data(), N, L, q.data(), s.data());
      cuda::mxfp8_quantize_rows(dx, N, L, dq.ptr, ds.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " q");
      expect_bitwise(s, ds.get(), what + " scales");
      mxfp8_dequantize_rows(q.data(), s.data(), N, L, y.data());
      cuda::mxfp8_dequantize_rows(dq.ptr, ds.ptr, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " dequantized");
    });
  }
}

TEST(GpuFormats, Nvfp4BitwiseVsCpu) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    int64_t groups, N, L;
  };
  uint32_t seed = 300;
  for (const Case& c : {Case{1, 1, 1}, Case{1, 19, 111}, Case{3, 33, 300}, Case{64, 64, 1000}, Case{2, 6, 4096}}) {
    const int64_t G = c.groups, N = c.N, L = c.L;
    const size_t NL = static_cast<size_t>(N * L), NP = static_cast<size_t>(N * nvfp4_packed_bytes(L));
    const size_t NS = static_cast<size_t>(N * scale_blocks(L, kNvfp4Block));
    for_each_input(N, L, seed++, [&](const std::vector<float>& x, const auto* dx, const char* tag) {
      const std::string what = std::string("nvfp4 ") + tag + " groups=" + std::to_string(G) + " N=" +
                               std::to_string(N) + " L=" + std::to_string(L);
      std::vector<float> global(static_cast<size_t>(G)), y(NL);
      std::vector<uint8_t> q(NP), s(NS);
      Dev<float> dglobal(static_cast<size_t>(G)), dy(NL);
      Dev<uint8_t> dq(NP), ds(NS);
      nvfp4_global_scales(x.data(), G, N, L, global.data());
      cuda::nvfp4_global_scales(dx, G, N, L, dglobal.ptr, nullptr);
      expect_bitwise(global, dglobal.get(), what + " global scales");
      nvfp4_quantize_rows(x.data(), G, N, L, global.data(), q.data(), s.data());
      cuda::nvfp4_quantize_rows(dx, G, N, L, dglobal.ptr, dq.ptr, ds.ptr, nullptr);
      expect_bitwise(q, dq.get(), what + " q");
      expect_bitwise(s, ds.get(), what + " scales");
      nvfp4_dequantize_rows(q.data(), s.data(), global.data(), G, N, L, y.data());
      cuda::nvfp4_dequantize_rows(dq.ptr, ds.ptr, dglobal.ptr, G, N, L, dy.ptr, nullptr);
      expect_bitwise(y, dy.get(), what + " dequantized");
    });
  }
}

// A graph-captured quantizer replays the eager bits (no host sync, no allocation in a launch;
// the NVFP4 global-scale memset is a capturable memset node).
TEST(GpuFormats, CapturedQuantizersReplayBitwise) {
  EPMOE_REQUIRE_GPU();
  const int64_t N = 33, L = 300;
  const std::vector<float> x = make_input(N, L, 7);
  const size_t NL = static_cast<size_t>(N * L), NP = static_cast<size_t>(N * nvfp4_packed_bytes(L));
  Dev<float> dx(x), dglobal(3);
  Dev<uint8_t> dq(NL), ds(static_cast<size_t>(N * scale_blocks(L, kMxBlock))), dq4(NP),
      ds4(static_cast<size_t>(N * scale_blocks(L, kNvfp4Block)));
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue = [&] {
    cuda::mxfp8_quantize_rows(static_cast<const float*>(dx.ptr), N, L, dq.ptr, ds.ptr, stream);
    cuda::nvfp4_global_scales(static_cast<const float*>(dx.ptr), 3, N, L, dglobal.ptr, stream);
    cuda::nvfp4_quantize_rows(static_cast<const float*>(dx.ptr), 3, N, L, dglobal.ptr, dq4.ptr, ds4.ptr, stream);
  };
  enqueue();
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  const auto q = dq.get(), s = ds.get(), q4 = dq4.get(), s4 = ds4.get();
  const auto g = dglobal.get();
  ASSERT_CUDA(cudaMemset(dq.ptr, 0, NL));
  ASSERT_CUDA(cudaMemset(dq4.ptr, 0, NP));
  ASSERT_CUDA(cudaMemset(dglobal.ptr, 0, 3 * sizeof(float)));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue();
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  expect_bitwise(q, dq.get(), "mxfp8 q replay");
  expect_bitwise(s, ds.get(), "mxfp8 scales replay");
  expect_bitwise(g, dglobal.get(), "nvfp4 global replay");
  expect_bitwise(q4, dq4.get(), "nvfp4 q replay");
  expect_bitwise(s4, ds4.get(), "nvfp4 scales replay");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace epmoe::test
