// SwiGLU forward and backward, one definition for both backends. Inputs are the bf16 values of
// h13 (gate, up) widened to fp32; arithmetic is fp32; the caller rounds results to bf16 once.
#pragma once

#include <cmath>

#include "core/hd.h"
#include "epmoe/config.h"

namespace epmoe {

struct ActivationParams {
  int clamped = 0;     // ActivationKind::swiglu_clamped
  float alpha = 1.0f;  // sigmoid slope (1 for plain SwiGLU)
  float limit = 0.0f;  // clamp bound (clamped only)
};

inline ActivationParams activation_params(const Activation& a) {
  ActivationParams p;
  p.clamped = a.kind == ActivationKind::swiglu_clamped ? 1 : 0;
  p.alpha = p.clamped ? a.alpha : 1.0f;
  p.limit = p.clamped ? a.limit : 0.0f;
  return p;
}

EPMOE_HD float sigmoidf_ref(float x) { return 1.0f / (1.0f + expf(-x)); }

// h = act(gate, up)
EPMOE_HD float swiglu_forward(float gate, float up, const ActivationParams& p) {
  if (p.clamped) {
    float g = fminf(gate, p.limit);
    float u = fminf(fmaxf(up, -p.limit), p.limit);
    return g * sigmoidf_ref(p.alpha * g) * (u + 1.0f);
  }
  return gate * sigmoidf_ref(gate) * up;
}

// (d gate, d up) from dh, and the h = swiglu_forward(gate, up) that the SwiGLU backward recomputes,
// from one sigmoid: h is swiglu_forward's expression on the same sigmoid, so the same value
// (test_gpu_activation, host and device), with half the exp and division work (the GPU SwiGLU
// backward kernel and epilogues, whose time goes to that arithmetic). Clamps pass the gradient
// where the input lies inside the closed range (as torch.clamp does). Returns h.
EPMOE_HD float swiglu_backward_and_forward(float gate, float up, float dh, const ActivationParams& p,
                                           float& d_gate, float& d_up) {
  if (p.clamped) {
    float g = fminf(gate, p.limit);
    float u = fminf(fmaxf(up, -p.limit), p.limit);
    float s = sigmoidf_ref(p.alpha * g);
    float glu = g * s;
    float d_glu = s + p.alpha * g * s * (1.0f - s);
    d_gate = gate <= p.limit ? dh * (u + 1.0f) * d_glu : 0.0f;
    d_up = (up >= -p.limit && up <= p.limit) ? dh * glu : 0.0f;
    return glu * (u + 1.0f);  // swiglu_forward's g * sigmoid(alpha g) * (u + 1)
  }
  float s = sigmoidf_ref(gate);
  float silu = gate * s;
  d_gate = dh * up * (s + gate * s * (1.0f - s));
  d_up = dh * silu;
  return silu * up;  // swiglu_forward's gate * sigmoid(gate) * up
}

// (d gate, d up) from dh alone (the CPU reference; h is not needed there).
EPMOE_HD void swiglu_backward(float gate, float up, float dh, const ActivationParams& p,
                              float& d_gate, float& d_up) {
  (void)swiglu_backward_and_forward(gate, up, dh, p, d_gate, d_up);
}

}  // namespace epmoe
