// Reproducible random inputs of epmoe_run (run_inputs.h).
#include "run_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>

namespace {

// ---- random inputs ----------------------------------------------------------------------------
// Counter-based generator: element i of stream (seed, tensor, rank) is a pure function of its
// coordinates, so fills are reproducible and independent of thread count.
uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t stream_key(uint64_t seed, uint64_t tensor, uint64_t rank) {
  return mix64(mix64(mix64(seed) ^ tensor) ^ rank);
}
// Uniform in (0, 1).
double uniform01(uint64_t key, uint64_t i) {
  return (static_cast<double>(mix64(key ^ mix64(i)) >> 11) + 0.5) * 0x1.0p-53;
}

uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Runs fn(begin, end) over [0, n) on up to hardware_concurrency threads.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t workers =
      std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, std::max<int64_t>(1, n / 65536));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] { fn(n * w / workers, n * (w + 1) / workers); });
  }
  for (auto& t : pool) t.join();
}

// bf16 values uniform with standard deviation `sigma` (never an all-zero tensor).
void fill_bf16(std::vector<uint16_t>& v, double sigma, uint64_t key) {
  const double half_width = sigma * std::sqrt(3.0);
  parallel_for(static_cast<int64_t>(v.size()), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const double u = uniform01(key, static_cast<uint64_t>(i));
      v[i] = to_bf16(static_cast<float>((2 * u - 1) * half_width));
    }
  });
}

// ---- the problem ------------------------------------------------------------------------------

// One rank's inputs and outputs, host memory, row-major as the contract names them.
enum TensorId : uint64_t { kX = 1, kW13, kW2, kGradY, kRoute, kScores };

// Routes of global token g (= rank * T + t) per MEASURE.md; scores are a softmax over the chosen
// logits (skew) or uniform in (0, 1).
void make_routes(const Problem& p, Routing routing, uint64_t seed, int64_t g, int32_t* ids_K,
                 float* scores_K, std::vector<double>& logits, std::vector<int32_t>& order) {
  const uint64_t key = stream_key(seed, kRoute, static_cast<uint64_t>(g));
  const uint64_t score_key = stream_key(seed, kScores, static_cast<uint64_t>(g));
  const int K = p.K;
  for (int k = 0; k < K; ++k) scores_K[k] = static_cast<float>(uniform01(score_key, k));
  switch (routing) {
    case Routing::one_expert:
      std::fill(ids_K, ids_K + K, 0);
      return;
    case Routing::balanced:
    case Routing::empty_rank: {
      // K distinct experts, uniform; empty-rank leaves out the last rank's experts.
      const int pool = routing == Routing::balanced ? p.E_global : p.E_global - p.E;
      order.resize(pool);
      for (int e = 0; e < pool; ++e) order[e] = e;
      for (int k = 0; k < K; ++k) {
        const int j = k + static_cast<int>(uniform01(key, k) * (pool - k));
        std::swap(order[k], order[j]);
        ids_K[k] = order[k];
      }
      return;
    }
    case Routing::skew: {
      // logits = uniform[0, 1) + s * linspace(1, 0, E), s = 4; top-k of the logits.
      constexpr double s = 4.0;
      const int E = p.E_global;
      logits.resize(E);
      order.resize(E);
      for (int e = 0; e < E; ++e) {
        const double ramp = E > 1 ? 1.0 - static_cast<double>(e) / (E - 1) : 1.0;
        logits[e] = uniform01(key, static_cast<uint64_t>(e)) + s * ramp;
        order[e] = e;
      }
      std::partial_sort(order.begin(), order.begin() + K, order.end(),
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      double top = logits[order[0]], sum = 0;
      for (int k = 0; k < K; ++k) sum += std::exp(logits[order[k]] - top);
      for (int k = 0; k < K; ++k) {
        ids_K[k] = order[k];
        scores_K[k] = static_cast<float>(std::exp(logits[ids_K[k]] - top) / sum);
      }
      return;
    }
  }
}

}  // namespace

std::vector<RankData> make_inputs(const Problem& p, Routing routing, uint64_t seed) {
  std::vector<RankData> ranks(p.R);
  for (int r = 0; r < p.R; ++r) {
    RankData& d = ranks[r];
    const auto ru = static_cast<uint64_t>(r);
    // Magnitudes keep every stage O(1): x, grad_y ~ 1; weights ~ 1/sqrt(fan-in).
    d.x_TD.resize(p.T * p.D);
    fill_bf16(d.x_TD, 1.0, stream_key(seed, kX, ru));
    d.w13_EFD.resize(p.E * 2 * p.F * p.D);
    fill_bf16(d.w13_EFD, 1.0 / std::sqrt(static_cast<double>(p.D)), stream_key(seed, kW13, ru));
    d.w2_EDF.resize(p.E * p.D * p.F);
    fill_bf16(d.w2_EDF, 1.0 / std::sqrt(static_cast<double>(p.F)), stream_key(seed, kW2, ru));
    d.grad_y_TD.resize(p.T * p.D);
    fill_bf16(d.grad_y_TD, 1.0, stream_key(seed, kGradY, ru));
    d.ids_TK.resize(p.T * p.K);
    d.scores_TK.resize(p.T * p.K);
    std::vector<double> logits;
    std::vector<int32_t> order;
    for (int64_t t = 0; t < p.T; ++t) {
      make_routes(p, routing, seed, r * p.T + t, &d.ids_TK[t * p.K], &d.scores_TK[t * p.K], logits,
                  order);
    }
    d.y_TD.resize(p.T * p.D);
    d.grad_x_TD.resize(p.T * p.D);
    d.grad_scores_TK.resize(p.T * p.K);
    d.grad_w13_EFD.resize(d.w13_EFD.size());
    d.grad_w2_EDF.resize(d.w2_EDF.size());
  }
  return ranks;
}

// Rows each rank receives (routes to its experts): the imbalance of the routing.
std::vector<int64_t> received_rows(const Problem& p, const std::vector<RankData>& ranks) {
  std::vector<int64_t> rows(p.R, 0);
  for (const RankData& d : ranks) {
    for (int32_t id : d.ids_TK) {
      if (id >= 0) ++rows[id / p.E];
    }
  }
  return rows;
}
