// Float64 reference of the routed experts: for each token and route, the expert MLP and its
// backward written out directly in double precision.
#include "moe_reference.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace epmoe::reference {

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double act_forward(double gate, double up, const ActivationSpec& a) {
  if (a.clamped) {
    const double g = std::fmin(gate, a.limit);
    const double u = std::fmin(std::fmax(up, -a.limit), a.limit);
    return g * sigmoid(a.alpha * g) * (u + 1.0);
  }
  return gate * sigmoid(gate) * up;
}

void act_backward(double gate, double up, double dh, const ActivationSpec& a, double& d_gate,
                  double& d_up) {
  if (a.clamped) {
    const double g = std::fmin(gate, a.limit);
    const double u = std::fmin(std::fmax(up, -a.limit), a.limit);
    const double s = sigmoid(a.alpha * g);
    d_gate = gate <= a.limit ? dh * (u + 1.0) * (s + a.alpha * g * s * (1.0 - s)) : 0.0;
    d_up = (up >= -a.limit && up <= a.limit) ? dh * g * s : 0.0;
    return;
  }
  const double s = sigmoid(gate);
  d_gate = dh * up * (s + gate * s * (1.0 - s));
  d_up = dh * gate * s;
}

void require(bool cond, const std::string& what) {
  if (!cond) throw std::invalid_argument("moe_reference: " + what);
}

}  // namespace

std::vector<RankOutputs> routed_experts(const LayerShape& sh, const ActivationSpec& act,
                                        const std::vector<RankInputs>& in) {
  const int R = sh.ranks, E = sh.local_experts, K = sh.top_k;
  const int64_t T = sh.tokens, D = sh.hidden, F = sh.intermediate;
  const auto n = [](int64_t v) { return static_cast<std::size_t>(v); };
  require(static_cast<int>(in.size()) == R, "one RankInputs per rank");
  const bool backward = !in[0].grad_y_TD.empty();
  for (const RankInputs& r : in) {
    require(r.x_TD.size() == n(T * D), "x_TD has T*D values");
    require(r.topk_ids_TK.size() == n(T * K), "topk_ids_TK has T*K values");
    require(r.topk_scores_TK.size() == n(T * K), "topk_scores_TK has T*K values");
    require(r.w13_EFD.size() == n(E * 2 * F * D), "w13_EFD has E*2F*D values");
    require(r.w2_EDF.size() == n(E * D * F), "w2_EDF has E*D*F values");
    require(r.grad_y_TD.size() == (backward ? n(T * D) : 0), "grad_y_TD empty or T*D values");
    require(r.live >= -1 && r.live <= T, "live in [-1, T]");
  }

  std::vector<RankOutputs> out(R);
  for (RankOutputs& o : out) {
    o.y_TD.assign(n(T * D), 0.0);
    o.route_out_TKD.assign(n(T * K * D), 0.0);
    if (!backward) continue;
    o.grad_x_TD.assign(n(T * D), 0.0);
    o.grad_scores_TK.assign(n(T * K), 0.0);
    o.grad_w13_EFD.assign(n(E * 2 * F * D), 0.0);
    o.grad_w2_EDF.assign(n(E * D * F), 0.0);
  }

  std::vector<double> h13(n(2 * F)), h(n(F)), o3(n(D)), grad_o(n(D)), grad_h(n(F)),
      grad_h13(n(2 * F));
  for (int s = 0; s < R; ++s) {
    const RankInputs& src = in[s];
    const int64_t live = src.live < 0 ? T : src.live;
    for (int64_t t = 0; t < live; ++t) {
      const double* x = src.x_TD.data() + t * D;
      for (int k = 0; k < K; ++k) {
        const int64_t id = src.topk_ids_TK[n(t * K + k)];
        if (id == -1) continue;
        require(id >= 0 && id < static_cast<int64_t>(E) * R, "ids in [-1, E*R)");
        const int q = static_cast<int>(id / E);
        const int64_t e = id % E;
        const double* w13 = in[q].w13_EFD.data() + e * 2 * F * D;  // [2F, D]
        const double* w2 = in[q].w2_EDF.data() + e * D * F;        // [D, F]
        const double score = src.topk_scores_TK[n(t * K + k)];

        for (int64_t j = 0; j < 2 * F; ++j) {
          double acc = 0.0;
          for (int64_t d = 0; d < D; ++d) acc += w13[j * D + d] * x[d];
          h13[j] = acc;
        }
        for (int64_t f = 0; f < F; ++f) h[f] = act_forward(h13[f], h13[F + f], act);
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t f = 0; f < F; ++f) acc += w2[d * F + f] * h[f];
          o3[d] = acc;
          out[s].route_out_TKD[n((t * K + k) * D + d)] = acc;
          out[s].y_TD[n(t * D + d)] += score * acc;
        }
        if (!backward) continue;

        const double* g = src.grad_y_TD.data() + t * D;
        double gs = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          gs += g[d] * o3[d];
          grad_o[d] = score * g[d];
        }
        out[s].grad_scores_TK[n(t * K + k)] = gs;
        double* gw2 = out[q].grad_w2_EDF.data() + e * D * F;
        for (int64_t f = 0; f < F; ++f) {
          double acc = 0.0;
          for (int64_t d = 0; d < D; ++d) acc += w2[d * F + f] * grad_o[d];
          grad_h[f] = acc;
        }
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t f = 0; f < F; ++f) gw2[d * F + f] += grad_o[d] * h[f];
        }
        for (int64_t f = 0; f < F; ++f) {
          act_backward(h13[f], h13[F + f], grad_h[f], act, grad_h13[f], grad_h13[F + f]);
        }
        double* gw13 = out[q].grad_w13_EFD.data() + e * 2 * F * D;
        double* gx = out[s].grad_x_TD.data() + t * D;
        for (int64_t j = 0; j < 2 * F; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            gw13[j * D + d] += grad_h13[j] * x[d];
            gx[d] += grad_h13[j] * w13[j * D + d];
          }
        }
      }
    }
  }
  return out;
}

double bf16_to_double(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f = 0.0f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

std::vector<double> widen_bf16(const uint16_t* data, std::size_t n) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = bf16_to_double(data[i]);
  return v;
}

double rel_l2(const std::vector<double>& ref, const std::vector<double>& got) {
  if (ref.size() != got.size()) throw std::invalid_argument("rel_l2: sizes differ");
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double diff = got[i] - ref[i];
    num += diff * diff;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace epmoe::reference
