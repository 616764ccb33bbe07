// The non-GEMM stages are CUDA-graph capturable (no host synchronisation, no allocation, every
// launch on Step::stream) and a replayed graph gives the eager results bit for bit.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "step_builder.h"

namespace epmoe::test {
namespace {

#define ASSERT_CUDA(call)                                                        \
  do {                                                                           \
    const cudaError_t err_ = (call);                                             \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_);   \
  } while (0)

// Forward and backward stage sequence of R simulated ranks (the GEMM stand-ins are preloaded).
void enqueue_step(World& w) {
  Backend& b = w.backend();
  const int R = w.shape().R;
  auto each = [&](void (Backend::*stage)(const Step&)) {
    for (int r = 0; r < R; ++r) (b.*stage)(w.step(r));
  };
  each(&Backend::publish_forward);
  each(&Backend::route);
  each(&Backend::dispatch);
  each(&Backend::swiglu_forward);
  each(&Backend::scatter_rows);
  each(&Backend::reduce_forward);
  each(&Backend::publish_backward);
  each(&Backend::grad_scores);
  each(&Backend::gather_grad);
  each(&Backend::swiglu_backward);
  each(&Backend::scatter_rows);
  each(&Backend::reduce_backward);
}

struct Outputs {
  std::vector<bf16_t> y, grad_x, x_gathered, grad_h13;
  std::vector<float> grad_scores;
  std::vector<int32_t> header;
};

Outputs outputs(World& w, int r, int64_t tokens) {
  const Shape& sh = w.shape();
  const Step s = w.step(r);
  Outputs o;
  o.y = w.read<bf16_t>(s.y_TD, tokens * sh.D);
  o.grad_x = w.read<bf16_t>(s.grad_x_TD, tokens * sh.D);
  o.grad_scores = w.read<float>(s.grad_scores_TK, tokens * sh.K);
  o.header = w.layout_header(r);
  o.x_gathered = w.read<bf16_t>(s.x_gathered_MD, w.rows(r) * sh.D);
  o.grad_h13 = w.read<bf16_t>(s.grad_h13_M2F, w.rows(r) * 2 * sh.F);
  return o;
}

void clobber(World& w, int r, int64_t tokens) {
  const Shape& sh = w.shape();
  const Step s = w.step(r);
  w.fill(s.y_TD, std::vector<bf16_t>(static_cast<size_t>(tokens * sh.D), bf16(-5.0f)));
  w.fill(s.grad_x_TD, std::vector<bf16_t>(static_cast<size_t>(tokens * sh.D), bf16(-5.0f)));
  w.fill(s.grad_scores_TK, std::vector<float>(static_cast<size_t>(tokens * sh.K), -5.0f));
  w.fill(s.x_gathered_MD, std::vector<bf16_t>(static_cast<size_t>(sh.cap() * sh.D), bf16(-5.0f)));
}

TEST(GpuGraph, CapturedStepEqualsEagerStep) {
  EPMOE_REQUIRE_GPU();
  const Shape sh{57, 40, 24, 4, 3, 2, 0};
  const int64_t tokens = 50;
  std::unique_ptr<Backend> backend = make_cuda_backend(0);
  World w(*backend, sh);
  Rng rng(40);
  for (int r = 0; r < sh.R; ++r) {
    w.set_input(r, make_input(rng, sh, r, tokens, r == 1 ? std::optional<int32_t>(31) : std::nullopt,
                              Pattern::distinct));
    const Step s = w.step(r);
    w.fill(s.h13_M2F, rng.bf16s(sh.cap() * 2 * sh.F));
    w.fill(s.rows_MD, rng.bf16s(sh.cap() * sh.D));
    w.fill(s.grad_h_MF, rng.bf16s(sh.cap() * sh.F));
  }
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  w.stream = stream;

  enqueue_step(w);
  backend->synchronize(stream);
  std::vector<Outputs> eager;
  for (int r = 0; r < sh.R; ++r) {
    eager.push_back(outputs(w, r, tokens));
    ASSERT_EQ(w.status(r).code, 0) << w.status(r).to_string();
    ASSERT_EQ(eager.back().header[kLayoutSkip], 0);
    clobber(w, r, tokens);
  }

  // Global mode: any synchronising or allocating call made during the capture fails it.
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue_step(w);
  cudaGraph_t graph = nullptr;
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    for (int r = 0; r < sh.R; ++r) {
      SCOPED_TRACE("replay " + std::to_string(replay) + ", rank " + std::to_string(r));
      const Outputs g = outputs(w, r, tokens);
      const Outputs& e = eager[static_cast<size_t>(r)];
      EXPECT_TRUE(same_bits(e.header, g.header));
      EXPECT_TRUE(same_bits(e.y, g.y));
      EXPECT_TRUE(same_bits(e.grad_x, g.grad_x));
      EXPECT_TRUE(same_bits(e.grad_scores, g.grad_scores));
      EXPECT_TRUE(same_bits(e.x_gathered, g.x_gathered));
      EXPECT_TRUE(same_bits(e.grad_h13, g.grad_h13));
      clobber(w, r, tokens);
    }
  }
  ASSERT_CUDA(cudaGraphExecDestroy(exec));
  ASSERT_CUDA(cudaGraphDestroy(graph));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace epmoe::test
