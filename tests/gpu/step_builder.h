// GPU test support: R simulated ranks of one EP group in one backend's memory (CPU host memory or
// one GPU), carved as core/context.cpp carves them, so that the same stage calls run on the CPU
// reference and on the CUDA backend from identical inputs. Peers live in the same memory, so the
// peer tables are real and a stage of rank r reads and writes the other ranks' buffers; running
// the ranks one after the other on one stream stands in for the barriers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backend.h"
#include "core/layout.h"
#include "core/numeric.h"
#include "core/plan_terms.h"
#include "core/step.h"
#include "epmoe/cuda.h"
#include "require_gpu.h"

namespace epmoe::test {

struct Shape {
  int64_t T = 1;         // Config T
  int64_t D = 8;
  int64_t F = 8;
  int K = 1;
  int E = 1;             // local experts
  int R = 1;
  int64_t capacity = 0;  // receive rows per rank; 0: the topology bound T*R*min(K, E)
  Dims dims() const { return Dims{T, D, F, K, E, R}; }
  int64_t cap() const { return capacity > 0 ? capacity : T * R * std::min(K, E); }
  int experts() const { return E * R; }
};

// One rank's call inputs (host).
struct RankInput {
  int64_t tokens = 1;                 // T'
  std::optional<int32_t> live;        // nullopt: num_tokens_1 == nullptr (all live)
  DType ids_dtype = DType::i32;
  std::vector<int64_t> ids;           // [T', K]
  DType scores_dtype = DType::f32;
  std::vector<float> scores;          // [T', K] (rounded to bf16 when scores_dtype is bf16)
  std::vector<bf16_t> x;              // [T', D]
  std::vector<bf16_t> grad_y;         // [T', D]
  int64_t live_rows() const {
    const int64_t l = live.has_value() ? *live : tokens;
    return l < 0 ? 0 : (l > tokens ? tokens : l);
  }
};

inline bf16_t bf16(float f) { return float_to_bf16(f); }

// Random, never-zero test data.
class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
  }
  // Nonzero values of either sign in [0.25, 2) * 2^[-2, 2].
  float value() {
    const float mag = uniform(0.25f, 2.0f) * std::ldexp(1.0f, static_cast<int>(integer(-2, 2)));
    return integer(0, 1) ? mag : -mag;
  }
  std::vector<bf16_t> bf16s(int64_t n) {
    std::vector<bf16_t> v(static_cast<size_t>(n));
    for (auto& e : v) e = bf16(value());
    return v;
  }
  std::vector<float> floats(int64_t n, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& e : v) e = uniform(lo, hi);
    return v;
  }

 private:
  std::mt19937 gen_;
};

// Rank-coded rows: element 0 = rank, element 1 = t % 256 (both exact in bf16), the rest random.
inline std::vector<bf16_t> rank_coded_rows(Rng& rng, int rank, int64_t rows, int64_t D) {
  std::vector<bf16_t> v = rng.bf16s(rows * D);
  for (int64_t t = 0; t < rows; ++t) {
    v[static_cast<size_t>(t * D)] = bf16(static_cast<float>(rank + 1));
    if (D > 1) v[static_cast<size_t>(t * D + 1)] = bf16(static_cast<float>(t % 256 + 1));
  }
  return v;
}

// Expert-id patterns of the routing tests.
enum class Pattern {
  distinct,      // K distinct experts per token (uniform), ~1/8 of the routes inactive (-1)
  duplicates,    // uniform with replacement: a token may pick one expert twice
  one_expert,    // every route to the same expert
  sparse,        // only every third expert receives routes (zero-token experts)
  inactive,      // every route -1
};

inline std::vector<int64_t> make_ids(Rng& rng, Pattern pattern, int64_t tokens, int K, int experts) {
  std::vector<int64_t> ids(static_cast<size_t>(tokens * K), -1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < K; ++k) {
      int64_t& id = ids[static_cast<size_t>(t * K + k)];
      switch (pattern) {
        case Pattern::distinct: {
          if (K > experts || rng.integer(0, 7) == 0) break;  // -1
          bool fresh = false;
          while (!fresh) {
            id = rng.integer(0, experts - 1);
            fresh = true;
            for (int j = 0; j < k; ++j) fresh = fresh && ids[static_cast<size_t>(t * K + j)] != id;
          }
          break;
        }
        case Pattern::duplicates: id = rng.integer(0, experts - 1); break;
        case Pattern::one_expert: id = experts / 2; break;
        case Pattern::sparse: id = 3 * rng.integer(0, (experts - 1) / 3); break;
        case Pattern::inactive: break;
      }
    }
  }
  return ids;
}

// Random inputs of one rank: rank-coded x, scores in [0.05, 1), grad_y random.
inline RankInput make_input(Rng& rng, const Shape& shape, int rank, int64_t tokens,
                            std::optional<int32_t> live, Pattern pattern) {
  RankInput in;
  in.tokens = tokens;
  in.live = live;
  in.ids = make_ids(rng, pattern, tokens, shape.K, shape.experts());
  in.scores = rng.floats(tokens * shape.K, 0.05f, 1.0f);
  in.x = rank_coded_rows(rng, rank, tokens, shape.D);
  in.grad_y = rng.bf16s(tokens * shape.D);
  return in;
}

// R simulated ranks in one backend's memory.
class World {
 public:
  World(Backend& backend, const Shape& shape, bool with_h3 = true)
      : b_(backend), shape_(shape), dims_(shape.dims()), with_h3_(with_h3) {
    const int R = shape.R;
    const int64_t cap = shape.cap();
    const int64_t T = shape.T, K = shape.K, D = shape.D;
    const RoutingBufferLayout rl = routing_buffer_layout(T, shape.K);
    for (int r = 0; r < R; ++r) {
      routing_.push_back(static_cast<char*>(alloc(static_cast<size_t>(rl.bytes))));
      dispatch_.push_back(static_cast<bf16_t*>(alloc(static_cast<size_t>(align_bytes(T * D * 2)))));
      combine_.push_back(static_cast<bf16_t*>(alloc(static_cast<size_t>(align_bytes(T * K * D * 2)))));
    }
    routing_R_ = static_cast<char**>(table(routing_));
    dispatch_R_ = static_cast<bf16_t**>(table(dispatch_));
    combine_R_ = static_cast<bf16_t**>(table(combine_));
    const SavedFullLayout sl = saved_full_layout(dims_, cap);
    const int64_t scratch_bytes =
        route_scratch_layout(dims_, cap).total + call_scratch_layout(dims_, cap, true).total;
    ranks_.resize(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      RankState& st = ranks_[static_cast<size_t>(r)];
      st.saved = static_cast<char*>(alloc(static_cast<size_t>(sl.total)));
      st.scratch = static_cast<char*>(alloc(static_cast<size_t>(scratch_bytes)));
      st.status = static_cast<Status*>(alloc(sizeof(Status)));
    }
  }
  ~World() {
    for (void* p : allocations_) b_.release(p);
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  Backend& backend() { return b_; }
  const Shape& shape() const { return shape_; }

  // ---- inputs ----
  void set_input(int r, const RankInput& in) {
    RankState& st = ranks_[static_cast<size_t>(r)];
    const int64_t n = in.tokens * shape_.K;
    const int64_t rows = in.tokens * shape_.D;
    st.tokens = in.tokens;
    st.ids_dtype = in.ids_dtype;
    st.scores_dtype = in.scores_dtype;
    if (in.ids_dtype == DType::i64) {
      st.ids_TK = upload(in.ids);
    } else {
      std::vector<int32_t> v(in.ids.begin(), in.ids.end());
      st.ids_TK = upload(v);
    }
    if (in.scores_dtype == DType::bf16) {
      std::vector<bf16_t> v;
      for (float f : in.scores) v.push_back(bf16(f));
      st.scores_TK = upload(v);
    } else {
      st.scores_TK = upload(in.scores);
    }
    EXPECT_EQ(static_cast<int64_t>(in.ids.size()), n);
    EXPECT_EQ(static_cast<int64_t>(in.scores.size()), n);
    EXPECT_EQ(static_cast<int64_t>(in.x.size()), rows);
    st.x_TD = static_cast<bf16_t*>(upload(in.x));
    st.grad_y_TD = in.grad_y.empty() ? nullptr : static_cast<bf16_t*>(upload(in.grad_y));
    st.num_tokens_1 = nullptr;
    if (in.live.has_value()) {
      std::vector<int32_t> live{*in.live};
      st.num_tokens_1 = static_cast<int32_t*>(upload(live));
    }
    st.y_TD = static_cast<bf16_t*>(alloc(static_cast<size_t>(rows * 2)));
    st.grad_x_TD = static_cast<bf16_t*>(alloc(static_cast<size_t>(rows * 2)));
    st.grad_scores_TK = static_cast<float*>(alloc(static_cast<size_t>(n * 4)));
    // Outputs start as garbage (not zero), so "zeros written" is observable.
    fill(st.y_TD, std::vector<bf16_t>(static_cast<size_t>(rows), bf16(-3.0f)));
    fill(st.grad_x_TD, std::vector<bf16_t>(static_cast<size_t>(rows), bf16(-3.0f)));
    fill(st.grad_scores_TK, std::vector<float>(static_cast<size_t>(n), -3.0f));
  }

  // The Step of rank r, carved as context.cpp does (saved-layer state + unfused scratch).
  Step step(int r) const {
    const RankState& st = ranks_[static_cast<size_t>(r)];
    const int64_t cap = shape_.cap();
    Step s;
    s.dims = dims_;
    s.tokens = st.tokens;
    s.rank = r;
    s.capacity_rows = cap;
    s.act = act;
    s.sequence = sequence;
    s.check_inputs = check_inputs;
    s.arrival_gated_w13 = arrival_gated_w13;
    s.trap_on_overflow = false;
    s.stream = stream;
    s.x_TD = st.x_TD;
    s.num_tokens_1 = st.num_tokens_1;
    s.ids_TK = st.ids_TK;
    s.ids_dtype = st.ids_dtype;
    s.scores_TK = st.scores_TK;
    s.scores_dtype = st.scores_dtype;
    s.grad_y_TD = st.grad_y_TD;
    s.y_TD = st.y_TD;
    s.grad_x_TD = st.grad_x_TD;
    s.grad_scores_TK = st.grad_scores_TK;
    s.routing_R = routing_R_;
    s.dispatch_R = dispatch_R_;
    s.combine_R = combine_R_;
    const SavedFullLayout l = saved_full_layout(dims_, cap);
    s.layout = carve_layout(st.saved + l.layout, cap, dims_.T, dims_.K, dims_.E, dims_.R);
    s.x_gathered_MD = reinterpret_cast<bf16_t*>(st.saved + l.x_gathered);
    s.h13_M2F = reinterpret_cast<bf16_t*>(st.saved + l.h13);
    s.h3_TKD = with_h3_ ? reinterpret_cast<bf16_t*>(st.saved + l.h3) : nullptr;
    const RouteScratchLayout rl = route_scratch_layout(dims_, cap);
    s.route_scratch = st.scratch;
    char* call = st.scratch + rl.total;
    const CallScratchLayout cl = call_scratch_layout(dims_, cap, true);
    s.h_MF = reinterpret_cast<bf16_t*>(call + cl.h);
    s.grad_h3_MD = reinterpret_cast<bf16_t*>(call + cl.grad_h3);
    s.grad_h13_M2F = reinterpret_cast<bf16_t*>(call + cl.grad_h13);
    s.rows_MD = reinterpret_cast<bf16_t*>(call + cl.rows_MD);
    s.grad_h_MF = reinterpret_cast<bf16_t*>(call + cl.grad_h);
    if (score_after_w2_dgrad) {
      s.row_scores_M = reinterpret_cast<float*>(call + cl.row_scores);
      s.score_parts_MC = reinterpret_cast<float*>(call + cl.score_parts);
    }
    s.status = st.status;
    return s;
  }

  // Runs `stage` for every rank in order (one "collective" stage of the group).
  void all(const std::function<void(Backend&, const Step&)>& stage) {
    for (int r = 0; r < shape_.R; ++r) stage(b_, step(r));
    b_.synchronize(stream);
  }

  // ---- host views ----
  template <class V>
  std::vector<V> read(const void* p, int64_t n) {
    std::vector<V> v(static_cast<size_t>(n));
    if (n > 0) b_.copy_to_host(v.data(), p, static_cast<size_t>(n) * sizeof(V));
    return v;
  }
  template <class V>
  void fill(void* p, const std::vector<V>& v) {
    if (!v.empty()) b_.copy_to_device(p, v.data(), v.size() * sizeof(V));
  }

  char* routing(int r) const { return routing_[static_cast<size_t>(r)]; }
  bf16_t* dispatch(int r) const { return dispatch_[static_cast<size_t>(r)]; }
  bf16_t* combine(int r) const { return combine_[static_cast<size_t>(r)]; }
  Status status(int r) { return read<Status>(ranks_[static_cast<size_t>(r)].status, 1)[0]; }
  void set_status(int r, const Status& st) { fill(ranks_[static_cast<size_t>(r)].status, std::vector<Status>{st}); }
  std::vector<int32_t> layout_header(int r) { return read<int32_t>(step(r).layout.header, kLayoutHeaderInts); }
  int64_t rows(int r) { return layout_header(r)[kLayoutRows]; }

  ActivationParams act{};      // plain SwiGLU
  bool score_after_w2_dgrad = false;  // the Context's backward (Step::row_scores_M)
  int64_t sequence = 1;
  bool check_inputs = true;
  bool arrival_gated_w13 = false;  // dispatch counts arrivals only for a gated W13
  void* stream = nullptr;      // cudaStream_t of the stages (nullptr: the default stream)

 private:
  struct RankState {
    char* saved = nullptr;
    char* scratch = nullptr;
    Status* status = nullptr;
    int64_t tokens = 0;
    DType ids_dtype = DType::i32, scores_dtype = DType::f32;
    void* ids_TK = nullptr;
    void* scores_TK = nullptr;
    int32_t* num_tokens_1 = nullptr;
    bf16_t* x_TD = nullptr;
    bf16_t* grad_y_TD = nullptr;
    bf16_t* y_TD = nullptr;
    bf16_t* grad_x_TD = nullptr;
    float* grad_scores_TK = nullptr;
  };

  void* alloc(size_t bytes) {
    void* p = b_.allocate(bytes > 0 ? bytes : 1);
    allocations_.push_back(p);
    return p;
  }
  template <class V>
  void* upload(const std::vector<V>& v) {
    void* p = alloc(std::max<size_t>(v.size() * sizeof(V), 16));
    fill(p, v);
    return p;
  }
  template <class P>
  void* table(const std::vector<P*>& ptrs) {
    std::vector<void*> t(ptrs.begin(), ptrs.end());
    void* p = alloc(t.size() * sizeof(void*));
    fill(p, t);
    return p;
  }

  Backend& b_;
  Shape shape_;
  Dims dims_;
  bool with_h3_;
  std::vector<void*> allocations_;
  std::vector<char*> routing_;
  std::vector<bf16_t*> dispatch_, combine_;
  char** routing_R_ = nullptr;
  bf16_t** dispatch_R_ = nullptr;
  bf16_t** combine_R_ = nullptr;
  std::vector<RankState> ranks_;
};

// For tests of the backward stages: routes every rank's random inputs (make_input; publish_forward,
// route) and publishes their grad_y (publish_backward).
inline void route_and_publish(World& w, uint32_t seed, std::optional<int32_t> live, Pattern pattern) {
  const Shape& sh = w.shape();
  Rng rng(seed);
  for (int r = 0; r < sh.R; ++r) w.set_input(r, make_input(rng, sh, r, sh.T, live, pattern));
  w.all([](Backend& b, const Step& s) { b.publish_forward(s); });
  w.all([](Backend& b, const Step& s) { b.route(s); });
  w.all([](Backend& b, const Step& s) { b.publish_backward(s); });
}

// The CPU reference and the CUDA backend side by side, on identical inputs.
struct Pair {
  explicit Pair(const Shape& shape, bool with_h3 = true)
      : cpu_backend(make_cpu_backend()),
        gpu_backend(make_cuda_backend(0)),
        cpu(*cpu_backend, shape, with_h3),
        gpu(*gpu_backend, shape, with_h3) {}
  std::unique_ptr<Backend> cpu_backend, gpu_backend;
  World cpu, gpu;

  void set_input(int r, const RankInput& in) {
    cpu.set_input(r, in);
    gpu.set_input(r, in);
  }
  void all(const std::function<void(Backend&, const Step&)>& stage) {
    cpu.all(stage);
    gpu.all(stage);
  }
  void set_flags(const ActivationParams& act, bool check_inputs) {
    cpu.act = gpu.act = act;
    cpu.check_inputs = gpu.check_inputs = check_inputs;
  }
};

// ---- comparisons ----

// Bitwise equality of two arrays; reports the first differing element.
template <class V>
::testing::AssertionResult same_bits(const std::vector<V>& want, const std::vector<V>& got) {
  if (want.size() != got.size()) {
    return ::testing::AssertionFailure() << "sizes differ: " << want.size() << " vs " << got.size();
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&want[i], &got[i], sizeof(V)) != 0) {
      size_t count = 0;
      for (size_t j = i; j < want.size(); ++j) count += std::memcmp(&want[j], &got[j], sizeof(V)) != 0;
      auto res = ::testing::AssertionFailure();
      res << count << " of " << want.size() << " elements differ; first at " << i << ": cpu ";
      if constexpr (std::is_same_v<V, bf16_t>) {
        res << bf16_to_float(want[i]) << " gpu " << bf16_to_float(got[i]);
      } else if constexpr (std::is_same_v<V, Status>) {
        res << want[i].to_string() << " | gpu " << got[i].to_string();
      } else {
        res << +want[i] << " gpu " << +got[i];
      }
      return res;
    }
  }
  return ::testing::AssertionSuccess();
}

// bf16 tensors computed with expf / FMA contraction that may differ between the host libm and
// the device (SwiGLU): equal within one bf16 ulp of the larger magnitude, or within 2^-10 of the
// tensor's largest magnitude (cancellation near the derivative's zero crossings).
inline ::testing::AssertionResult close_bf16(const std::vector<bf16_t>& want,
                                             const std::vector<bf16_t>& got) {
  if (want.size() != got.size()) return ::testing::AssertionFailure() << "sizes differ";
  float scale = 0.0f;
  for (bf16_t v : want) scale = std::max(scale, std::fabs(bf16_to_float(v)));
  size_t differ = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float a = bf16_to_float(want[i]), b = bf16_to_float(got[i]);
    if (want[i] == got[i]) continue;
    ++differ;
    const float tol = std::max(std::ldexp(std::max(std::fabs(a), std::fabs(b)), -7),
                               std::ldexp(scale, -10));
    if (!(std::fabs(a - b) <= tol)) {
      return ::testing::AssertionFailure() << "element " << i << ": cpu " << a << " gpu " << b
                                           << " (tolerance " << tol << ")";
    }
  }
  if (differ * 50 > want.size() + 50) {  // more than ~2% off by an ulp: not rounding noise
    return ::testing::AssertionFailure() << differ << " of " << want.size() << " elements differ";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace epmoe::test
