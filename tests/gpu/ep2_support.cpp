#include "ep2_support.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <thread>

#include "epmoe/context.h"
#include "epmoe/error.h"
#include "output_compare.h"
#include "tolerances.h"

namespace epmoe::test {

const bool kNvlsOff = [] { return setenv("NCCL_NVLS_ENABLE", "0", 0) == 0; }();

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void run_on_gpus(const std::function<void(int rank, std::shared_ptr<Transport>)>& fn,
                 const NcclTransportOptions& options) {
  const NcclUniqueId id = nccl_unique_id();
  std::vector<std::exception_ptr> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
        std::shared_ptr<Transport> t =
            make_nccl_transport(id.data(), id.size(), r, kRanks, r, options);
        fn(r, t);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}


void wait_for(const std::atomic<bool>& flag) {
  while (!flag.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

std::vector<RankOutputs> run_gpu_layer(const Problem& p, const std::vector<RankInputs>& in,
                                       const NcclTransportOptions& options) {
  std::vector<RankOutputs> out(kRanks);
  run_on_gpus(
      [&](int r, std::shared_ptr<Transport> t) {
        auto ctx = Context::create(p.config(), t);
        DeviceCall call(p, in[r], r);
        out[r] = run_once(*ctx, call, nullptr);
        ctx->close();
      },
      options);
  return out;
}

void expect_matches_cpu(const Problem& p, const std::vector<RankInputs>& in,
                        const std::vector<RankOutputs>& gpu, const std::string& what) {
  const auto cpu = run_layer(p, in);
  const OutputErrors vs_cpu = compare(gpu, cpu);
  const OutputErrors vs_ref = measure(gpu, reference_layer(p, in), in);
  report_errors(what + " ep2 gpu vs cpu", vs_cpu);
  report_errors(what + " ep2 gpu vs float64", vs_ref);
  for (int o = 0; o < kNumOutputs; ++o) {
    const Output out = static_cast<Output>(o);
    EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::bf16, out))
        << what << ": " << to_string(out) << " EP=2 CUDA vs CPU backend (" << vs_cpu.to_string()
        << ")";
  }
  expect_within_tolerance(vs_ref, what + " (EP=2 CUDA vs float64)");
}

Problem problem(int64_t T, int64_t D, int64_t F, int experts, int K) {
  return make_problem(kRanks, T, D, F, K, experts);
}

void expect_timeout_naming(const std::function<void()>& fn, const std::string& rank_text,
                           const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": no timeout was reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::timeout) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(rank_text), std::string::npos)
        << what << ": the error does not name " << rank_text << ": " << e.what();
  }
}
}  // namespace epmoe::test
