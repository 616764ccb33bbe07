// epmoe_run: the main job. Builds one MoE layer of a named shape, runs forward + backward on every
// rank for a few iterations, prints the memory plan, wall times, a per-stage breakdown and the
// error of every output against the float64 whole-layer reference. Exits nonzero when an error
// exceeds its bound, so a run is a check as well as a measurement.
//
//   epmoe_run [--shape NAME] [--ranks R] [--routing balanced|skew|one-expert|empty-rank]
//             [--tokens T|train|decode] [--iters N] [--device auto|cpu|cuda]
//             [--activation swiglu|swiglu_clamped] [--seed S] [--capacity F]
//             [--check auto|always|never] [--force]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "epmoe/config.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "epmoe/tensor.h"
#include "epmoe/transport.h"
#include "device_mirror.h"
#include "rank_data.h"
#include "run_inputs.h"
#include "moe_reference.h"
#ifdef EPMOE_RUN_WITH_NCCL
#include "epmoe/nccl.h"
#endif

namespace {

using epmoe::DType;
using epmoe::TensorRef;

// ---- CUDA ---------------------------------------------------------------------------------------
// A GPU is used when epmoe has its CUDA backend and a device is visible. EP > 1 on GPUs needs the
// NCCL transport (epmoe_nccl): rank r runs on cuda:r, one thread per GPU.
bool cuda_available() { return epmoe::cuda_device_count() > 0; }
#ifdef EPMOE_RUN_WITH_NCCL
constexpr bool kHaveNccl = true;
#else
constexpr bool kHaveNccl = false;
#endif

// ---- shapes (MEASURE.md) ----------------------------------------------------------------------
struct Shape {
  const char* name;
  int64_t D, F;
  int E;  // global experts
  int K;
  int64_t T_train, T_decode;
};
constexpr Shape kShapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 8192, 128},
    {"deepseek-v3", 7168, 2048, 256, 8, 4096, 128},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 8192, 128},
    {"mixtral-8x7b", 4096, 14336, 8, 2, 8192, 128},
    {"ci-tiny", 128, 96, 8, 2, 64, 8},
};

// Bound on the relative L2 error of every output against the float64 reference.
constexpr double kMaxRelL2 = 2e-2;
// A run on the CPU that would take longer than this per forward + backward is refused.
constexpr double kCpuBudgetSeconds = 60.0;
// CPU cost model of one rank's forward + backward, for the refusal estimate only: GEMM FLOPs at
// this rate plus a fixed time per weight element (the weight passes dominate when experts get few
// rows). Measured on the CPU backend, rounded towards slower.
constexpr double kCpuFlopsPerRank = 3e9;
constexpr double kCpuSecondsPerWeight = 20e-9;
// Throughput of the float64 reference (one thread), for the --check auto policy only.
constexpr double kReferenceFlops = 1e9;

enum class CheckPolicy { auto_, always, never };

struct Options {
  std::string shape = "ci-tiny";
  int ranks = 0;  // 0: 2 CPU thread ranks, or one rank per usable GPU
  Routing routing = Routing::balanced;
  std::string tokens;  // empty: the shape's training T
  int iters = 5;
  std::string device = "auto";
  epmoe::Activation activation = epmoe::Activation::swiglu();
  uint64_t seed = 1;
  double capacity = 0;  // 0: R (no overflow for any routing)
  CheckPolicy check = CheckPolicy::auto_;
  bool force = false;
  epmoe::CombineMode combine = epmoe::CombineMode::per_route;
};

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::balanced:
      return "balanced";
    case Routing::skew:
      return "skew";
    case Routing::one_expert:
      return "one-expert";
    case Routing::empty_rank:
      return "empty-rank";
  }
  return "?";
}

constexpr const char* kUsage =
    "usage: epmoe_run [options]\n"
    "  --shape NAME          qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | mixtral-8x7b |\n"
    "                        ci-tiny (default ci-tiny)\n"
    "  --ranks R             EP ranks (default: 1 per usable GPU, else 2 CPU ranks); on\n"
    "                        GPUs, R > 1 runs rank r on cuda:r through the NCCL transport\n"
    "  --routing KIND        balanced | skew | one-expert | empty-rank (default balanced)\n"
    "  --tokens T            tokens per rank: a number, train or decode (default train)\n"
    "  --iters N             timed iterations of forward + backward (default 5)\n"
    "  --device KIND         auto | cpu | cuda (default auto: cuda when available, else cpu)\n"
    "  --activation KIND     swiglu | swiglu_clamped (default swiglu)\n"
    "  --seed S              input seed (default 1)\n"
    "  --capacity F          receive capacity factor (default R: no routing can overflow)\n"
    "  --check POLICY        auto | always | never: float64 reference check (default auto:\n"
    "                        skipped when the reference would take over a minute)\n"
    "  --combine MODE        per_route | per_rank: one combine row per route, or per token\n"
    "                        and rank (default per_route)\n"
    "  --force               run on the CPU even when one step would take over a minute\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "epmoe_run: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

long long parse_int(std::string_view flag, const std::string& v, long long lo) {
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo) {
    usage_error(std::string(flag) + " expects an integer >= " + std::to_string(lo) + ", got '" + v +
                "'");
  }
  return x;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--force") {
      o.force = true;
      continue;
    }
    if (i + 1 >= argc) usage_error(std::string(flag) + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--shape") {
      o.shape = v;
    } else if (flag == "--ranks") {
      o.ranks = static_cast<int>(parse_int(flag, v, 1));
    } else if (flag == "--routing") {
      if (v == "balanced")
        o.routing = Routing::balanced;
      else if (v == "skew")
        o.routing = Routing::skew;
      else if (v == "one-expert")
        o.routing = Routing::one_expert;
      else if (v == "empty-rank")
        o.routing = Routing::empty_rank;
      else
        usage_error("unknown routing '" + v + "'");
    } else if (flag == "--tokens") {
      o.tokens = v;
    } else if (flag == "--iters") {
      o.iters = static_cast<int>(parse_int(flag, v, 1));
    } else if (flag == "--device") {
      if (v != "auto" && v != "cpu" && v != "cuda") usage_error("unknown device '" + v + "'");
      o.device = v;
    } else if (flag == "--activation") {
      if (v == "swiglu")
        o.activation = epmoe::Activation::swiglu();
      else if (v == "swiglu_clamped")
        o.activation = epmoe::Activation::swiglu_clamped();
      else
        usage_error("unknown activation '" + v + "'");
    } else if (flag == "--seed") {
      o.seed = static_cast<uint64_t>(parse_int(flag, v, 0));
    } else if (flag == "--capacity") {
      char* end = nullptr;
      o.capacity = std::strtod(v.c_str(), &end);
      if (*end != '\0' || !(o.capacity > 0)) usage_error("--capacity expects a number > 0");
    } else if (flag == "--combine") {
      if (v == "per_route")
        o.combine = epmoe::CombineMode::per_route;
      else if (v == "per_rank")
        o.combine = epmoe::CombineMode::per_rank;
      else
        usage_error("unknown combine mode '" + v + "'");
    } else if (flag == "--check") {
      if (v == "auto")
        o.check = CheckPolicy::auto_;
      else if (v == "always")
        o.check = CheckPolicy::always;
      else if (v == "never")
        o.check = CheckPolicy::never;
      else
        usage_error("unknown check policy '" + v + "'");
    } else {
      usage_error("unknown option '" + std::string(flag) + "'");
    }
  }
  return o;
}

// ---- running the ranks ------------------------------------------------------------------------
struct Timings {
  std::vector<double> forward_ms, step_ms;  // per iteration, max over ranks
  // Stage breakdown of one timed iteration on rank 0: name, forward ms, backward ms.
  struct Stage {
    std::string name;
    double forward_ms = 0, backward_ms = 0;
  };
  std::vector<Stage> stages;
};

void add_stage(std::vector<Timings::Stage>& table, const char* name, double ms, bool forward) {
  auto it = std::find_if(table.begin(), table.end(),
                         [&](const Timings::Stage& s) { return s.name == name; });
  if (it == table.end()) it = table.insert(table.end(), Timings::Stage{name, 0, 0});
  (forward ? it->forward_ms : it->backward_ms) += ms;
}

// One rank: create the context, one warm-up step, `iters` timed steps, one step with stage timing.
void run_rank(const epmoe::Config& config, const std::shared_ptr<epmoe::Transport>& transport,
              const Problem& p, const RankPtrs& d, int iters, std::vector<double>& fwd_ms,
              std::vector<double>& step_ms, std::vector<Timings::Stage>* stages) {
  using clock = std::chrono::steady_clock;
  const epmoe::Device dev = transport->device();
  auto context = epmoe::Context::create(config, transport);

  epmoe::ForwardArgs fa;
  fa.x_TD = TensorRef::contiguous(d.x_TD, DType::bf16, {p.T, p.D}, dev);
  fa.num_tokens_1 = TensorRef::contiguous(nullptr, DType::i32, {1}, dev);  // every token is live
  fa.topk_ids_TK = TensorRef::contiguous(d.ids_TK, DType::i32, {p.T, p.K}, dev);
  fa.topk_scores_TK = TensorRef::contiguous(d.scores_TK, DType::f32, {p.T, p.K}, dev);
  fa.w13_EFD = TensorRef::contiguous(d.w13_EFD, DType::bf16, {p.E, 2 * p.F, p.D}, dev);
  fa.w2_EDF = TensorRef::contiguous(d.w2_EDF, DType::bf16, {p.E, p.D, p.F}, dev);
  fa.y_TD = TensorRef::contiguous(d.y_TD, DType::bf16, {p.T, p.D}, dev);

  epmoe::BackwardArgs ba;
  ba.grad_y_TD = TensorRef::contiguous(d.grad_y_TD, DType::bf16, {p.T, p.D}, dev);
  ba.num_tokens_1 = fa.num_tokens_1;
  ba.topk_ids_TK = fa.topk_ids_TK;
  ba.topk_scores_TK = fa.topk_scores_TK;
  ba.w13_EFD = fa.w13_EFD;
  ba.w2_EDF = fa.w2_EDF;
  ba.grad_x_TD = TensorRef::contiguous(d.grad_x_TD, DType::bf16, {p.T, p.D}, dev);
  ba.grad_scores_TK = TensorRef::contiguous(d.grad_scores_TK, DType::f32, {p.T, p.K}, dev);
  ba.grad_w13_EFD =
      TensorRef::contiguous(d.grad_w13_EFD, DType::bf16, {p.E, 2 * p.F, p.D}, dev);
  ba.grad_w2_EDF = TensorRef::contiguous(d.grad_w2_EDF, DType::bf16, {p.E, p.D, p.F}, dev);

  const std::chrono::milliseconds budget(config.fields().barrier_timeout_ms);
  auto step = [&](double* forward, double* total) {
    transport->barrier("epmoe_run.iteration", budget);
    const auto t0 = clock::now();
    ba.saved = context->forward(fa);
    context->check();
    const auto t1 = clock::now();
    context->backward(ba);
    context->check();
    const auto t2 = clock::now();
    *forward = std::chrono::duration<double, std::milli>(t1 - t0).count();
    *total = std::chrono::duration<double, std::milli>(t2 - t0).count();
  };

  double f = 0, t = 0;
  step(&f, &t);  // warm-up
  for (int i = 0; i < iters; ++i) {
    step(&f, &t);
    fwd_ms.push_back(f);
    step_ms.push_back(t);
  }
  // One more step with per-stage timing (serialises the stages; not part of the wall times).
  context->set_stage_timing(true);
  transport->barrier("epmoe_run.stages", budget);
  ba.saved = context->forward(fa);
  const size_t num_forward = context->stage_times().size();
  context->backward(ba);
  context->check();
  if (stages != nullptr) {
    const auto& times = context->stage_times();
    for (size_t i = 0; i < times.size(); ++i)
      add_stage(*stages, times[i].stage, times[i].ms, i < num_forward);
  }
  context->close();
}

// body(r, forward ms, step ms, stages or nullptr) on one thread per rank; wall times are the max
// over ranks, the stage table rank 0's.
using RankBody = std::function<void(int rank, std::vector<double>& fwd_ms,
                                    std::vector<double>& step_ms, std::vector<Timings::Stage>*)>;
Timings run_threads(const Problem& p, int iters, const RankBody& body) {
  std::vector<std::vector<double>> fwd(p.R), step(p.R);
  std::vector<std::exception_ptr> errors(p.R);
  Timings timings;
  std::vector<std::thread> threads;
  for (int r = 0; r < p.R; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, fwd[r], step[r], r == 0 ? &timings.stages : nullptr);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (int i = 0; i < iters; ++i) {
    double f = 0, s = 0;
    for (int r = 0; r < p.R; ++r) {
      f = std::max(f, fwd[r][i]);
      s = std::max(s, step[r][i]);
    }
    timings.forward_ms.push_back(f);
    timings.step_ms.push_back(s);
  }
  return timings;
}

Timings run_cpu(const epmoe::Config& config, const Problem& p, std::vector<RankData>& ranks,
                int iters) {
  epmoe::ThreadTransportGroup group(p.R);
  return run_threads(p, iters, [&](int r, std::vector<double>& fwd, std::vector<double>& step,
                                   std::vector<Timings::Stage>* stages) {
    run_rank(config, group.transport(r), p, host_ptrs(ranks[r]), iters, fwd, step, stages);
  });
}

// R GPUs through the NCCL transport, one thread per GPU (rank r on cuda:r): each rank's tensors
// mirrored to its device, outputs copied back for the reference check.
Timings run_gpu_ep(const epmoe::Config& config, const Problem& p, std::vector<RankData>& ranks,
                   int iters) {
#ifdef EPMOE_RUN_WITH_NCCL
  // NVLink multicast stays off unless the caller chose otherwise.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const epmoe::NcclUniqueId id = epmoe::nccl_unique_id();
  return run_threads(p, iters, [&](int r, std::vector<double>& fwd, std::vector<double>& step,
                                   std::vector<Timings::Stage>* stages) {
    use_device(r);
    DeviceMirror mirror(ranks[r]);
    auto transport = epmoe::make_nccl_transport(id.data(), id.size(), r, p.R, r);
    if (r == 0) {
      std::printf("NCCL transport: %d ranks on cuda:0..%d, peers through %s\n\n", p.R, p.R - 1,
                  epmoe::nccl_peer_access(*transport).c_str());
    }
    run_rank(config, transport, p, mirror.ptrs(), iters, fwd, step, stages);
    mirror.copy_outputs_back(ranks[r]);
  });
#else
  (void)config;
  (void)ranks;
  (void)iters;
  throw std::runtime_error("--ranks " + std::to_string(p.R) +
                           " on GPUs needs the NCCL transport (epmoe_nccl), not in this build; "
                           "use --ranks 1 or --device cpu");
#endif
}

// One GPU (EP = 1) on the single-GPU transport; R > 1 through NCCL.
Timings run_gpu(const epmoe::Config& config, const Problem& p, std::vector<RankData>& ranks,
                int iters) {
  const int gpus = epmoe::cuda_device_count();
  if (p.R > gpus) {
    throw std::runtime_error("--ranks " + std::to_string(p.R) + " on GPUs needs " +
                             std::to_string(p.R) + " CUDA devices, found " + std::to_string(gpus) +
                             "; use fewer --ranks or --device cpu");
  }
  if (p.R > 1) return run_gpu_ep(config, p, ranks, iters);
  DeviceMirror mirror(ranks[0]);
  Timings timings;
  run_rank(config, epmoe::make_single_gpu_transport(0), p, mirror.ptrs(), iters, timings.forward_ms,
           timings.step_ms, &timings.stages);
  mirror.copy_outputs_back(ranks[0]);
  return timings;
}

// ---- reporting --------------------------------------------------------------------------------
struct Summary {
  double median, min, max;
};
Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  const double median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return {median, v.front(), v.back()};
}

struct ErrorStat {
  const char* name;
  double max_abs = 0, rel_l2 = 0;
};

// Error of one output over all ranks (the tensors of every rank taken as one).
class ErrorAccumulator {
 public:
  explicit ErrorAccumulator(const char* name) : name_(name) {}
  template <class T>
  void add(const std::vector<T>& got, const std::vector<double>& want) {
    for (size_t i = 0; i < want.size(); ++i) {
      double g;
      if constexpr (std::is_same_v<T, uint16_t>) {
        g = epmoe::reference::bf16_to_double(got[i]);
      } else {
        g = static_cast<double>(got[i]);
      }
      const double d = g - want[i];
      max_abs_ = std::isnan(d) ? NAN : std::max(max_abs_, std::abs(d));
      diff2_ += d * d;
      ref2_ += want[i] * want[i];
    }
  }
  ErrorStat result() const {
    const double rel = ref2_ > 0 ? std::sqrt(diff2_ / ref2_) : (diff2_ > 0 ? INFINITY : diff2_);
    return {name_, max_abs_, rel};
  }

 private:
  const char* name_;
  double max_abs_ = 0, diff2_ = 0, ref2_ = 0;
};

std::vector<ErrorStat> check_against_reference(const Problem& p, const epmoe::Activation& act,
                                               const std::vector<RankData>& ranks) {
  namespace ref = epmoe::reference;
  const ref::LayerShape shape{p.R, p.E, p.T, p.D, p.F, p.K};
  const ref::ActivationSpec spec{act.kind == epmoe::ActivationKind::swiglu_clamped, act.alpha,
                                 act.limit};
  std::vector<ref::RankInputs> inputs(p.R);
  for (size_t r = 0; r < inputs.size(); ++r) {
    const RankData& d = ranks[r];
    ref::RankInputs& in = inputs[r];
    in.x_TD = ref::widen_bf16(d.x_TD.data(), d.x_TD.size());
    in.topk_ids_TK.assign(d.ids_TK.begin(), d.ids_TK.end());
    in.topk_scores_TK.assign(d.scores_TK.begin(), d.scores_TK.end());
    in.w13_EFD = ref::widen_bf16(d.w13_EFD.data(), d.w13_EFD.size());
    in.w2_EDF = ref::widen_bf16(d.w2_EDF.data(), d.w2_EDF.size());
    in.grad_y_TD = ref::widen_bf16(d.grad_y_TD.data(), d.grad_y_TD.size());
  }
  const std::vector<ref::RankOutputs> want = ref::routed_experts(shape, spec, inputs);
  ErrorAccumulator y("y"), grad_x("grad_x"), grad_scores("grad_scores"), grad_w13("grad_w13"),
      grad_w2("grad_w2");
  for (size_t r = 0; r < inputs.size(); ++r) {
    y.add(ranks[r].y_TD, want[r].y_TD);
    grad_x.add(ranks[r].grad_x_TD, want[r].grad_x_TD);
    grad_scores.add(ranks[r].grad_scores_TK, want[r].grad_scores_TK);
    grad_w13.add(ranks[r].grad_w13_EFD, want[r].grad_w13_EFD);
    grad_w2.add(ranks[r].grad_w2_EDF, want[r].grad_w2_EDF);
  }
  return {y.result(), grad_x.result(), grad_scores.result(), grad_w13.result(), grad_w2.result()};
}

// Wall times of forward and of forward + backward, with useful throughput per rank (MEASURE.md:
// forward 6*N*D*F, forward + backward 18*N*D*F FLOPs, N = live routes of the rank's tokens).
void print_timings(const Timings& timings, const Problem& p, int iters) {
  const double nDF = static_cast<double>(p.T * p.K) * static_cast<double>(p.D * p.F);
  const Summary fwd = summarize(timings.forward_ms), step = summarize(timings.step_ms);
  std::printf("wall time over %d iterations (max over ranks; ms)\n", iters);
  std::printf("  %-18s %10s %10s %10s %16s\n", "phase", "median", "min", "max", "useful GFLOP/s");
  std::printf("  %-18s %10.3f %10.3f %10.3f %16.2f\n", "forward", fwd.median, fwd.min, fwd.max,
              6 * nDF / (fwd.median * 1e6));
  std::printf("  %-18s %10.3f %10.3f %10.3f %16.2f\n\n", "forward+backward", step.median, step.min,
              step.max, 18 * nDF / (step.median * 1e6));

  std::printf("stages of one timed iteration on rank 0 (serialised; ms)\n");
  std::printf("  %-20s %10s %10s %10s\n", "stage", "forward", "backward", "total");
  double sum_f = 0, sum_b = 0;
  for (const Timings::Stage& s : timings.stages) {
    std::printf("  %-20s %10.3f %10.3f %10.3f\n", s.name.c_str(), s.forward_ms, s.backward_ms,
                s.forward_ms + s.backward_ms);
    sum_f += s.forward_ms;
    sum_b += s.backward_ms;
  }
  std::printf("  %-20s %10.3f %10.3f %10.3f\n\n", "sum", sum_f, sum_b, sum_f + sum_b);
}

// Prints the error table; true when every output is within its bound.
bool report_errors(const std::vector<ErrorStat>& errors) {
  std::printf("error against the float64 reference (bound: rel-L2 <= %.0e)\n", kMaxRelL2);
  std::printf("  %-12s %12s %12s\n", "output", "max abs", "rel-L2");
  bool ok = true;
  for (const ErrorStat& e : errors) {
    const bool pass = e.rel_l2 <= kMaxRelL2;  // false for NaN
    ok = ok && pass;
    std::printf("  %-12s %12.3e %12.3e%s\n", e.name, e.max_abs, e.rel_l2, pass ? "" : "  FAIL");
  }
  std::printf("\n%s\n", ok ? "PASS" : "FAIL: an error exceeds its bound");
  return ok;
}

const Shape* find_shape(const std::string& name) {
  for (const Shape& s : kShapes) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

// The problem of one run; refuses (usage error) what the shape and rank count cannot express.
Problem make_problem(const Options& o, const Shape& shape) {
  Problem p;
  p.R = o.ranks;
  p.D = shape.D;
  p.F = shape.F;
  p.K = shape.K;
  p.E_global = shape.E;
  if (o.tokens.empty() || o.tokens == "train")
    p.T = shape.T_train;
  else if (o.tokens == "decode")
    p.T = shape.T_decode;
  else
    p.T = parse_int("--tokens", o.tokens, 1);
  if (p.E_global % p.R != 0) {
    usage_error(std::string(shape.name) + " has " + std::to_string(p.E_global) +
                " experts, which " + std::to_string(p.R) + " ranks do not divide");
  }
  p.E = p.E_global / p.R;
  if (o.routing == Routing::empty_rank && (p.R < 2 || p.E_global - p.E < p.K)) {
    usage_error("empty-rank routing needs R >= 2 and at least K experts outside the last rank");
  }
  return p;
}

// What a run costs on this host, for refusing runs that would not finish or fit.
struct Cost {
  double step_flops = 0;    // useful FLOPs of one forward + backward, all ranks (18*N*D*F each)
  double step_seconds = 0;  // CPU estimate of one forward + backward
  double ref_seconds = 0;   // float64 reference estimate
  double run_bytes = 0;     // host memory of inputs, outputs and the contexts
  double ref_bytes = 0;     // extra host memory of the reference check
  double host_bytes = 0;    // physical memory of this host
};

Cost estimate_cost(const Problem& p, const epmoe::MemoryPlan& plan) {
  const double R = p.R, T = static_cast<double>(p.T), D = static_cast<double>(p.D);
  const double TK = T * p.K;
  const double weights = static_cast<double>(p.E) * 3 * static_cast<double>(p.F) * D;  // per rank
  Cost c;
  c.step_flops = 18 * TK * D * static_cast<double>(p.F) * R;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  c.step_seconds = (c.step_flops / R / kCpuFlopsPerRank + weights * kCpuSecondsPerWeight) * R /
                   std::min(R, cores);
  c.ref_seconds = c.step_flops / kReferenceFlops;
  // bf16 x, grad_y, y, grad_x; weights and their gradients; ids, scores, grad_scores; the arena.
  c.run_bytes =
      R * (4 * T * D * 2 + 2 * weights * 2 + 3 * TK * 4 + static_cast<double>(plan.total_bytes));
  // float64 inputs and outputs of the reference (route outputs [T, K, D] included).
  c.ref_bytes = R * 8 * (4 * T * D + TK * D + 2 * weights + 3 * TK);
  c.host_bytes =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  return c;
}

int run(const Options& o) {
  const Shape* shape = find_shape(o.shape);
  if (shape == nullptr) {
    std::string names;
    for (const Shape& s : kShapes) names += std::string(names.empty() ? "" : ", ") + s.name;
    usage_error("unknown shape '" + o.shape + "' (known: " + names + ")");
  }
  bool use_cuda = false;
  if (o.device == "cuda") {
    if (!cuda_available()) {
      std::fprintf(stderr,
                   "epmoe_run: --device cuda: this build of epmoe_run has no CUDA path or no "
                   "GPU is visible; use --device cpu\n");
      return 2;
    }
    use_cuda = true;
  } else if (o.device == "auto") {
    use_cuda = cuda_available();
  }

  // One rank per usable GPU (as many as divide the experts; 1 without the NCCL transport), else
  // 2 CPU thread ranks.
  Options resolved = o;
  if (resolved.ranks == 0) {
    resolved.ranks = 2;
    if (use_cuda) {
      resolved.ranks = kHaveNccl ? epmoe::cuda_device_count() : 1;
      while (shape->E % resolved.ranks != 0) --resolved.ranks;
    }
  }
  const Problem p = make_problem(resolved, *shape);

  epmoe::ConfigFields f;
  f.max_tokens_per_rank = p.T;
  f.hidden_dim = p.D;
  f.intermediate_dim = p.F;
  f.top_k = p.K;
  f.num_experts = p.E_global;
  f.activation = o.activation;
  f.capacity_factor = o.capacity > 0 ? o.capacity : p.R;
  f.combine = o.combine;
  const epmoe::Config config(f);
  const epmoe::MemoryPlan plan = epmoe::plan_memory(config, p.R);

  const Cost cost = estimate_cost(p, plan);
  constexpr double GiB = 1024.0 * 1024 * 1024;
  if (!use_cuda && !o.force) {
    std::string why;
    if (cost.step_seconds > kCpuBudgetSeconds) {
      why = "one forward + backward would take about " + std::to_string(int(cost.step_seconds)) +
            " s on the CPU";
    } else if (cost.run_bytes > 0.8 * cost.host_bytes) {
      why = "it needs about " + std::to_string(int(cost.run_bytes / GiB)) + " GiB of the " +
            std::to_string(int(cost.host_bytes / GiB)) + " GiB of memory";
    }
    if (!why.empty()) {
      std::fprintf(stderr,
                   "epmoe_run: %s with T=%lld on %d CPU ranks: %s; refusing. Use fewer --tokens "
                   "(e.g. --tokens decode), a smaller shape, a GPU, or --force.\n",
                   shape->name, static_cast<long long>(p.T), p.R, why.c_str());
      return 2;
    }
  }

  std::printf(
      "epmoe_run: shape %s  T=%lld K=%d D=%lld F=%lld experts=%d (E=%d per rank)  R=%d  "
      "routing %s  activation %s  capacity %g  combine %s  device %s  iters %d  seed %llu\n\n",
      shape->name, static_cast<long long>(p.T), p.K, static_cast<long long>(p.D),
      static_cast<long long>(p.F), p.E_global, p.E, p.R, routing_name(o.routing),
      o.activation.kind == epmoe::ActivationKind::swiglu ? "swiglu" : "swiglu_clamped",
      f.capacity_factor, epmoe::to_string(f.combine), use_cuda ? "cuda" : "cpu (thread ranks)",
      o.iters,
      static_cast<unsigned long long>(o.seed));
  std::printf("%s\n", plan.explain().c_str());
  if (use_cuda) std::printf("%s\n", epmoe::explain_cuda_kernels(config, p.R).c_str());

  std::vector<RankData> ranks = make_inputs(p, o.routing, o.seed);
  const std::vector<int64_t> rows = received_rows(p, ranks);
  std::printf("received rows per rank (balanced T*K = %lld):", static_cast<long long>(p.T * p.K));
  for (int64_t n : rows) std::printf(" %lld", static_cast<long long>(n));
  std::printf("\n\n");

  print_timings(use_cuda ? run_gpu(config, p, ranks, o.iters) : run_cpu(config, p, ranks, o.iters),
                p, o.iters);

  std::string skip;
  if (o.check == CheckPolicy::never) {
    skip = "--check never";
  } else if (o.check == CheckPolicy::auto_ && cost.ref_seconds > kCpuBudgetSeconds) {
    skip = "the float64 reference would take about " + std::to_string(int(cost.ref_seconds)) +
           " s; --check always runs it";
  } else if (o.check == CheckPolicy::auto_ &&
             cost.run_bytes + cost.ref_bytes > 0.8 * cost.host_bytes) {
    skip = "the float64 reference would need about " +
           std::to_string(int((cost.run_bytes + cost.ref_bytes) / GiB)) +
           " GiB in all; --check always runs it";
  }
  if (!skip.empty()) {
    std::printf("reference check: skipped (%s)\n", skip.c_str());
    return 0;
  }
  if (cost.ref_seconds > 5) {
    std::printf("checking against the float64 reference (about %.0f s)\n", cost.ref_seconds);
    std::fflush(stdout);
  }
  return report_errors(check_against_reference(p, o.activation, ranks)) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  try {
    return run(options);
  } catch (const epmoe::Error& e) {
    std::fprintf(stderr, "epmoe_run: epmoe error (%s): %s\n", epmoe::to_string(e.kind()), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_run: %s\n", e.what());
  }
  return 1;
}
