// The CUDA backend's host side: device count, the single-GPU transport, memory functions,
// config limits, and errors that name the argument.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/config.h"
#include "epmoe/error.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

TEST(GpuBackend, SingleGpuTransport) {
  EPMOE_REQUIRE_GPU();
  std::shared_ptr<Transport> t = make_single_gpu_transport(0);
  EXPECT_EQ(t->rank(), 0);
  EXPECT_EQ(t->size(), 1);
  EXPECT_EQ(t->device(), Device::cuda(0));
  SymmetricBuffer b = t->allocate_symmetric(1000, "test");
  ASSERT_NE(b.local, nullptr);
  ASSERT_EQ(b.peers.size(), 1u);
  EXPECT_EQ(b.peers[0], b.local);
  EXPECT_EQ(b.bytes, 1000u);
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  std::vector<uint8_t> host(1000, 0xab);
  backend->copy_to_host(host.data(), b.local, host.size());
  EXPECT_EQ(host, std::vector<uint8_t>(1000, 0)) << "symmetric memory is zero-filled";
  t->barrier("test", std::chrono::milliseconds(10));
  t->barrier_on_stream(nullptr, 0, std::chrono::milliseconds(10));
  const int64_t mine = 42;
  int64_t all = 0;
  t->all_gather(&mine, &all, sizeof(mine), std::chrono::milliseconds(10));
  EXPECT_EQ(all, 42);
  t->release_symmetric(b);
  EXPECT_EQ(b.local, nullptr);
}

TEST(GpuBackend, MemoryRoundTrip) {
  EPMOE_REQUIRE_GPU();
  std::unique_ptr<Backend> b = make_cuda_backend(0);
  EXPECT_EQ(b->device(), Device::cuda(0));
  EXPECT_STREQ(b->name(), "cuda");
  void* p = b->allocate(4096);
  std::vector<int32_t> zeros(1024, 7);
  b->copy_to_host(zeros.data(), p, 4096);
  EXPECT_EQ(zeros, std::vector<int32_t>(1024, 0)) << "allocate zero-fills";
  std::vector<int32_t> v(1024);
  for (int i = 0; i < 1024; ++i) v[static_cast<size_t>(i)] = i * 3 - 5;
  b->copy_to_device(p, v.data(), 4096);
  std::vector<int32_t> back(1024);
  b->copy_to_host(back.data(), p, 4096);
  EXPECT_EQ(v, back);
  b->synchronize(nullptr);
  b->release(p);
  b->release(nullptr);
}

TEST(GpuBackend, BadOrdinalsNameTheDevice) {
  EPMOE_REQUIRE_GPU();
  const int n = cuda_device_count();
  try {
    make_cuda_backend(n);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::backend);
    EXPECT_EQ(e.argument(), "Device");
  }
  try {
    make_single_gpu_transport(-1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::backend);
    EXPECT_EQ(e.argument(), "device");
  }
}

ConfigFields fields(int64_t D, int64_t F, int experts) {
  ConfigFields f;
  f.max_tokens_per_rank = 64;
  f.hidden_dim = D;
  f.intermediate_dim = F;
  f.top_k = 2;
  f.num_experts = experts;
  return f;
}

std::string validate_error(const ConfigFields& f, int ep_size) {
  std::unique_ptr<Backend> b = make_cuda_backend(0);
  try {
    b->validate(Config(f), ep_size);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    return e.argument();
  }
  return "";
}

TEST(GpuBackend, ValidateNamesTheConfigField) {
  EPMOE_REQUIRE_GPU();
  EXPECT_EQ(validate_error(fields(64, 32, 8), 1), "");
  EXPECT_EQ(validate_error(fields(111, 32, 8), 1), "Config.hidden_dim");
  EXPECT_EQ(validate_error(fields(64, 36, 8), 1), "Config.intermediate_dim");
  EXPECT_EQ(validate_error(fields(64, 32, 8192), 1), "Config.num_experts");
}

}  // namespace
}  // namespace epmoe::test
