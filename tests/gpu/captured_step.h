// GPU test support: CUDA-graph capture for replay-vs-eager tests.
// - StreamGraph: a stream of its own; warm_up(stream) runs eagerly, then work(stream) is captured
//   (thread-local mode, so other ranks' threads may run CUDA calls meanwhile) and instantiated;
//   launch() replays it and waits for it.
// - CapturedStep: one DeviceCall's forward (+ backward) on a Context, captured that way; replay()
//   writes a new routing, poisons the outputs, replays, check()s and returns the outputs.
// A failed CUDA call is reported as a test failure and skips the later CUDA steps (a launch after
// a failed capture leaves the poisoned outputs, which the caller's comparison then reports).
// The destructor destroys the executable graph, the graph and the stream, in that order.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "device_call.h"
#include "epmoe/context.h"
#include "moe_case.h"

namespace epmoe::test {

class StreamGraph {
 public:
  template <class WarmUp, class Work>
  StreamGraph(WarmUp&& warm_up, Work&& work) {
    if (!ok(cudaStreamCreate(&stream_), "cudaStreamCreate")) return;
    warm_up(stream_);  // outside capture
    if (!ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture")) {
      return;
    }
    work(stream_);
    if (!ok(cudaStreamEndCapture(stream_, &graph_), "cudaStreamEndCapture")) return;
    ok(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate");
  }
  ~StreamGraph() {
    if (exec_ != nullptr) {
      EXPECT_EQ(cudaGraphExecDestroy(exec_), cudaSuccess);
    }
    if (graph_ != nullptr) {
      EXPECT_EQ(cudaGraphDestroy(graph_), cudaSuccess);
    }
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    }
  }
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;

  // Replays the graph and waits for it.
  void launch() {
    if (!ok_) return;
    if (!ok(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch")) return;
    ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  cudaStream_t stream() const { return stream_; }

 private:
  bool ok(cudaError_t err, const char* what) {
    EXPECT_EQ(err, cudaSuccess) << what;
    ok_ = ok_ && err == cudaSuccess;
    return ok_;
  }

  bool ok_ = true;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// What CapturedStep captures: the forward alone (save_for_backward = false; warm-up
// run_forward_once) or forward + backward (warm-up run_once).
enum class Pass { forward, forward_backward };

class CapturedStep {
 public:
  CapturedStep(Context& ctx, DeviceCall& call, Pass pass = Pass::forward_backward)
      : ctx_(ctx),
        call_(call),
        graph_(
            [this, pass](cudaStream_t stream) {
              if (pass == Pass::forward) {
                run_forward_once(ctx_, call_, stream);
              } else {
                run_once(ctx_, call_, stream);
              }
            },
            [this, pass](cudaStream_t stream) { capture(pass, stream); }) {}

  // New routing, poisoned outputs, one replay, check() on the capturing context.
  void launch(const RankInputs& in) {
    call_.set_routing(in);
    call_.poison();
    graph_.launch();
    ctx_.check();
  }
  // launch(), then every output.
  RankOutputs replay(const RankInputs& in) {
    launch(in);
    return call_.outputs();
  }
  // launch(), then y (a forward-only capture).
  std::vector<bf16_t> replay_y(const RankInputs& in) {
    launch(in);
    return download(call_.y, call_.host.y.size());
  }

  // The captured forward's SavedLayer (forward_backward), e.g. for ctx.recomputes().
  const SavedLayer& saved() const { return saved_; }
  cudaStream_t stream() const { return graph_.stream(); }

 private:
  void capture(Pass pass, cudaStream_t stream) {
    if (pass == Pass::forward) {
      ForwardArgs a = call_.forward_args(stream);
      a.save_for_backward = false;
      ctx_.forward(a);
    } else {
      saved_ = ctx_.forward(call_.forward_args(stream));
      ctx_.backward(call_.backward_args(saved_, stream));
    }
  }

  Context& ctx_;
  DeviceCall& call_;
  SavedLayer saved_;  // before graph_: the capture writes it
  StreamGraph graph_;
};

// make_inputs(p, base_seed, tokens) with the ids and scores of make_inputs(p, seed, tokens) and
// live count live_R[r] on ranks r < live_R.size(): the same x, weights and grad_y on every
// replay, a new routing each time.
inline std::vector<RankInputs> rerouted(const Problem& p, uint64_t base_seed, uint64_t seed,
                                        int64_t tokens, const std::vector<int64_t>& live_R) {
  std::vector<RankInputs> in = make_inputs(p, base_seed, tokens);
  const std::vector<RankInputs> fresh = make_inputs(p, seed, tokens);
  for (size_t r = 0; r < live_R.size(); ++r) {
    in.at(r).ids_TK = fresh.at(r).ids_TK;
    in.at(r).scores_TK = fresh.at(r).scores_TK;
    in.at(r).live = live_R[r];
  }
  return in;
}

}  // namespace epmoe::test
