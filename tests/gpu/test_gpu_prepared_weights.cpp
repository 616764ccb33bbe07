// prepare_weights on CUDA tensors (the codec kernels of src/cuda/formats/) against the host path,
// bitwise for every format (fp8_block_fp32 also with its transposed copy, which the host path
// makes with cpu::fp8_transpose_weights), including a refill in place after the weights change;
// and what the CUDA backend accepts of fp8_block (training and inference; D, F multiples of 16)
// and of nvfp4 and mxfp8 (whole blocks along D and F); the C ABI's nvfp4 and mxfp8 preparers.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/numeric.h"
#include "epmoe/c_api.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/prepared_weights.h"

#define EPMOE_REQUIRE_GPU()                                       \
  do {                                                            \
    if (::epmoe::cuda_device_count() == 0) {                      \
      GTEST_SKIP() << "no CUDA device: GPU tests skipped";        \
    }                                                             \
  } while (0)

namespace epmoe {
namespace {

constexpr int64_t G = 3, N = 200, L = 260;

// The tensors of one prepared weight (data, scales, global, with `transposed` data_t, scales_t)
// as byte vectors (host) or device allocations.
struct Buffers {
  PreparedWeights view;
  std::vector<std::vector<uint8_t>> host;
  std::vector<void*> device;
  Buffers(WeightFormat f, Device where, bool transposed = false) {
    const PreparedWeightShapes s = prepared_weight_shapes(f, G, N, L);
    view = PreparedWeights{f, G, N, L, s.data, s.scales, s.global_scale, {}, {}};
    if (transposed) {
      view.data_t = s.data_t;
      view.scales_t = s.scales_t;
    }
    TensorRef* parts[] = {&view.data, &view.scales, &view.global_scale, &view.data_t,
                          &view.scales_t};
    for (TensorRef* t : parts) {
      if (t->ndim == 0) continue;
      t->device = where;
      if (where.type == DeviceType::cuda) {
        void* p = nullptr;
        EXPECT_EQ(cudaMalloc(&p, t->nbytes()), cudaSuccess);
        EXPECT_EQ(cudaMemset(p, 0xAA, t->nbytes()), cudaSuccess);
        device.push_back(p);
        t->data = p;
      } else {
        host.emplace_back(t->nbytes(), 0xAA);
        t->data = host.back().data();
      }
    }
  }
  ~Buffers() {
    for (void* p : device) cudaFree(p);
  }
  std::vector<std::vector<uint8_t>> download() const {
    std::vector<std::vector<uint8_t>> out;
    for (const TensorRef* t :
         {&view.data, &view.scales, &view.global_scale, &view.data_t, &view.scales_t}) {
      if (t->ndim == 0) continue;
      std::vector<uint8_t> h(t->nbytes());
      EXPECT_EQ(cudaMemcpy(h.data(), t->data, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      out.push_back(std::move(h));
    }
    return out;
  }
};

std::vector<bf16_t> normal_bf16(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16_t> v(static_cast<size_t>(G * N * L));
  for (auto& x : v) x = float_to_bf16(d(rng));
  return v;
}

TEST(GpuPreparedWeights, DeviceEqualsHostAndRefillsInPlace) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    WeightFormat format;
    bool transposed;
  };
  for (const Case c :
       {Case{WeightFormat::fp8_block_fp32, false}, Case{WeightFormat::fp8_block_fp32, true},
        Case{WeightFormat::fp8_block_ue8m0, false}, Case{WeightFormat::mxfp8, false},
        Case{WeightFormat::nvfp4, false}}) {
    const WeightFormat f = c.format;
    Buffers on_device(f, Device::cuda(0), c.transposed);
    void* w_dev = nullptr;
    const size_t bytes = static_cast<size_t>(G * N * L) * 2;
    ASSERT_EQ(cudaMalloc(&w_dev, bytes), cudaSuccess);
    for (uint64_t seed : {1u, 2u}) {  // the second call refills the same buffers
      std::vector<bf16_t> w = normal_bf16(seed);
      ASSERT_EQ(cudaMemcpy(w_dev, w.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
      prepare_weights(TensorRef::contiguous(w_dev, DType::bf16, {G, N, L}, Device::cuda(0)),
                      on_device.view, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      Buffers on_host(f, Device::cpu(), c.transposed);
      prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {G, N, L}), on_host.view);
      EXPECT_EQ(on_device.download(), on_host.host)
          << to_string(f) << (c.transposed ? " with the transposed copy" : "") << " seed " << seed;
    }
    cudaFree(w_dev);
  }
}

// The C ABI's epmoe_prepare_weights_fp8 with the transposed copy (qt_GLN, scales_t_GSB) writes the
// host prepare_weights bits; without it (NULL) it writes codes and scales only.
TEST(GpuPreparedWeights, CApiPreparesTheTransposedCopy) {
  EPMOE_REQUIRE_GPU();
  const std::vector<bf16_t> w = normal_bf16(7);
  void* w_dev = nullptr;
  const size_t bytes = w.size() * sizeof(bf16_t);
  ASSERT_EQ(cudaMalloc(&w_dev, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(w_dev, w.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  Buffers on_host(WeightFormat::fp8_block_fp32, Device::cpu(), true);
  prepare_weights(TensorRef::contiguous(const_cast<bf16_t*>(w.data()), DType::bf16, {G, N, L}),
                  on_host.view);
  for (bool transposed : {true, false}) {
    Buffers on_device(WeightFormat::fp8_block_fp32, Device::cuda(0), true);
    const PreparedWeights& v = on_device.view;
    ASSERT_EQ(epmoe_prepare_weights_fp8(w_dev, G, N, L, v.data.data, v.scales.as<float>(),
                                        transposed ? v.data_t.data : nullptr,
                                        transposed ? v.scales_t.as<float>() : nullptr, 0,
                                        nullptr),
              0)
        << epmoe_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<std::vector<uint8_t>> got = on_device.download();  // data, scales, t, t
    ASSERT_EQ(got.size(), 4u);
    EXPECT_EQ(got[0], on_host.host[0]);
    EXPECT_EQ(got[1], on_host.host[1]);
    if (transposed) {
      EXPECT_EQ(got[2], on_host.host[2]);
      EXPECT_EQ(got[3], on_host.host[3]);
    } else {  // untouched: still the 0xAA poison
      EXPECT_EQ(got[2], std::vector<uint8_t>(got[2].size(), 0xAA));
      EXPECT_EQ(got[3], std::vector<uint8_t>(got[3].size(), 0xAA));
    }
  }
  cudaFree(w_dev);
}

// fp8_block runs on CUDA for training and inference contexts; E4M3 rows need D and F multiples
// of 16.
TEST(GpuPreparedWeights, CudaBackendAcceptsFp8BlockTrainingWithRowsOf16) {
  EPMOE_REQUIRE_GPU();
  ConfigFields f;
  f.max_tokens_per_rank = 16;
  f.hidden_dim = 128;
  f.intermediate_dim = 128;
  f.top_k = 2;
  f.num_experts = 4;
  f.precision = Precision::fp8_block;
  EXPECT_NO_THROW(Context::create(Config(f), make_single_gpu_transport(0))->close());
  f.inference = true;
  EXPECT_NO_THROW(Context::create(Config(f), make_single_gpu_transport(0))->close());
  f.hidden_dim = 136;  // a multiple of 8, not of 16
  try {
    Context::create(Config(f), make_single_gpu_transport(0));
    ADD_FAILURE() << "the CUDA backend accepted fp8_block with hidden_dim 136";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "Config.hidden_dim") << e.what();
  }
}

// The C ABI's epmoe_prepare_weights_nvfp4 writes the host prepare_weights bits (codes, block
// scales, globals).
TEST(GpuPreparedWeights, CApiPreparesNvfp4) {
  EPMOE_REQUIRE_GPU();
  const std::vector<bf16_t> w = normal_bf16(8);
  void* w_dev = nullptr;
  const size_t bytes = w.size() * sizeof(bf16_t);
  ASSERT_EQ(cudaMalloc(&w_dev, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(w_dev, w.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  Buffers on_host(WeightFormat::nvfp4, Device::cpu());
  prepare_weights(TensorRef::contiguous(const_cast<bf16_t*>(w.data()), DType::bf16, {G, N, L}),
                  on_host.view);
  Buffers on_device(WeightFormat::nvfp4, Device::cuda(0));
  const PreparedWeights& v = on_device.view;
  ASSERT_EQ(epmoe_prepare_weights_nvfp4(w_dev, G, N, L, v.data.data, v.scales.data,
                                        v.global_scale.as<float>(), 0, nullptr),
            0)
      << epmoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<std::vector<uint8_t>> got = on_device.download();  // data, scales, global
  ASSERT_EQ(got.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[i], on_host.host[i]) << "part " << i;
  cudaFree(w_dev);
}

// NVFP4 weight-only inference runs on CUDA (test_gpu_nvfp4_forward); D and F must be multiples of
// 32 (16-byte code rows for the GEMM's TMA), each refused naming its field.
TEST(GpuPreparedWeights, CudaBackendAcceptsNvfp4With16ByteCodeRows) {
  EPMOE_REQUIRE_GPU();
  ConfigFields f;
  f.max_tokens_per_rank = 16;
  f.hidden_dim = 128;
  f.intermediate_dim = 128;
  f.top_k = 2;
  f.num_experts = 4;
  f.precision = Precision::nvfp4;
  f.inference = true;
  f.prepared_weights = true;
  EXPECT_NO_THROW(Context::create(Config(f), make_single_gpu_transport(0))->close());
  for (const auto& [D, F, field] : {std::tuple<int64_t, int64_t, const char*>{136, 128, "Config.hidden_dim"},
                                    {144, 128, "Config.hidden_dim"},
                                    {128, 120, "Config.intermediate_dim"},
                                    {128, 112, "Config.intermediate_dim"}}) {
    f.hidden_dim = D;
    f.intermediate_dim = F;
    try {
      Context::create(Config(f), make_single_gpu_transport(0));
      ADD_FAILURE() << "the CUDA backend accepted nvfp4 with D " << D << " F " << F;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), field) << e.what();
    }
  }
}

// MXFP8 inference runs on CUDA (test_gpu_mxfp8_forward); whole MX blocks are required along D and
// F, each refused naming its field.
TEST(GpuPreparedWeights, CudaBackendAcceptsMxfp8WithWholeBlocks) {
  EPMOE_REQUIRE_GPU();
  ConfigFields f;
  f.max_tokens_per_rank = 16;
  f.hidden_dim = 96;
  f.intermediate_dim = 160;
  f.top_k = 2;
  f.num_experts = 4;
  f.precision = Precision::mxfp8;
  f.inference = true;
  f.prepared_weights = true;
  EXPECT_NO_THROW(Context::create(Config(f), make_single_gpu_transport(0))->close());
  for (const auto& [D, F, field] : {std::tuple<int64_t, int64_t, const char*>{112, 160, "Config.hidden_dim"},
                                    {96, 144, "Config.intermediate_dim"}}) {
    f.hidden_dim = D;
    f.intermediate_dim = F;
    try {
      Context::create(Config(f), make_single_gpu_transport(0));
      ADD_FAILURE() << "the CUDA backend accepted mxfp8 with D " << D << " F " << F;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), field) << e.what();
    }
  }
}

// The C ABI's epmoe_prepare_weights_mxfp8 writes the host prepare_weights bits (codes, scales).
TEST(GpuPreparedWeights, CApiPreparesMxfp8) {
  EPMOE_REQUIRE_GPU();
  const std::vector<bf16_t> w = normal_bf16(9);
  void* w_dev = nullptr;
  const size_t bytes = w.size() * sizeof(bf16_t);
  ASSERT_EQ(cudaMalloc(&w_dev, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(w_dev, w.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  Buffers on_host(WeightFormat::mxfp8, Device::cpu());
  prepare_weights(TensorRef::contiguous(const_cast<bf16_t*>(w.data()), DType::bf16, {G, N, L}),
                  on_host.view);
  Buffers on_device(WeightFormat::mxfp8, Device::cuda(0));
  const PreparedWeights& v = on_device.view;
  ASSERT_EQ(epmoe_prepare_weights_mxfp8(w_dev, G, N, L, v.data.data, v.scales.data, 0, nullptr), 0)
      << epmoe_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<std::vector<uint8_t>> got = on_device.download();  // data, scales
  ASSERT_EQ(got.size(), on_host.host.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], on_host.host[i]) << "part " << i;
  cudaFree(w_dev);
}

}  // namespace
}  // namespace epmoe
