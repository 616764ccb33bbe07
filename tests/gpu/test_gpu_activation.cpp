// swiglu_backward_and_forward (core/activation.h: one sigmoid for the SwiGLU backward and the h it
// recomputes) returns the bits of swiglu_forward, and its gradients those of swiglu_backward (its
// wrapper): on the host, and on the GPU compiled as the library's kernels are
// (activation_hw_check.cu). Plain and clamped SwiGLU, on random values and the edges (the clamp
// bounds, exp overflow, zeros, infinities).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "activation_hw_check.h"
#include "require_gpu.h"

namespace epmoe::test {
namespace {

struct Inputs {
  std::vector<float> gate, up, dh;
};

Inputs make_inputs(const ActivationParams& p) {
  Inputs in;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> edges = {0.0f, -0.0f, 1.0f, -1.0f, p.limit, -p.limit, std::nextafter(p.limit, 0.0f),
                                    std::nextafter(p.limit, 100.0f), 20.0f, -20.0f, 88.0f, -88.0f, 104.0f,
                                    -104.0f, 1e30f, -1e30f, inf, -inf, 1e-40f, -1e-40f};
  for (float g : edges) {
    for (float u : edges) {
      in.gate.push_back(g);
      in.up.push_back(u);
      in.dh.push_back(0.75f);
    }
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> wide(0.0f, 4.0f), unit(0.0f, 1.0f);
  for (int i = 0; i < 1 << 20; ++i) {
    in.gate.push_back(wide(rng));
    in.up.push_back(wide(rng));
    in.dh.push_back(unit(rng));
  }
  return in;
}

ActivationParams plain() { return ActivationParams{}; }
ActivationParams clamped() {
  ActivationParams p;
  p.clamped = 1;
  p.alpha = 1.702f;
  p.limit = 7.0f;
  return p;
}

bool same_bits(float a, float b) {
  uint32_t x = 0, y = 0;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return (std::isnan(a) && std::isnan(b)) || x == y;
}

TEST(Activation, BackwardAndForwardEqualsTheTwoCallsOnTheHost) {
  for (const ActivationParams& p : {plain(), clamped()}) {
    SCOPED_TRACE(p.clamped ? "clamped" : "plain");
    const Inputs in = make_inputs(p);
    for (size_t i = 0; i < in.gate.size(); ++i) {
      float d_gate, d_up, d_gate1, d_up1;
      swiglu_backward(in.gate[i], in.up[i], in.dh[i], p, d_gate, d_up);
      const float h = swiglu_forward(in.gate[i], in.up[i], p);
      const float h1 = swiglu_backward_and_forward(in.gate[i], in.up[i], in.dh[i], p, d_gate1, d_up1);
      ASSERT_TRUE(same_bits(h, h1) && same_bits(d_gate, d_gate1) && same_bits(d_up, d_up1))
          << "gate " << in.gate[i] << " up " << in.up[i] << " dh " << in.dh[i];
    }
  }
}

TEST(GpuActivation, BackwardAndForwardEqualsTheTwoCallsOnTheDevice) {
  EPMOE_REQUIRE_GPU();
  for (const ActivationParams& p : {plain(), clamped()}) {
    SCOPED_TRACE(p.clamped ? "clamped" : "plain");
    const Inputs in = make_inputs(p);
    const ActivationMismatch m = swiglu_both_ways_on_device(in.gate, in.up, in.dh, p);
    ASSERT_TRUE(m.error.empty()) << m.error;
    EXPECT_EQ(m.count, 0u) << "first at gate " << in.gate[static_cast<size_t>(m.first < 0 ? 0 : m.first)]
                           << " up " << in.up[static_cast<size_t>(m.first < 0 ? 0 : m.first)];
  }
}

}  // namespace
}  // namespace epmoe::test
