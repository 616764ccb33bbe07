// Context: one per EP group and device, created collectively; runs the routed experts of every
// MoE layer that shares its Config. forward/backward are collective: every rank calls them in the
// same order. On CUDA they enqueue work on the given stream and never synchronise with the host;
// on the CPU they run to completion on the calling thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "epmoe/config.h"
#include "epmoe/memory_plan.h"
#include "epmoe/prepared_weights.h"
#include "epmoe/status.h"
#include "epmoe/tensor.h"
#include "epmoe/transport.h"

namespace epmoe {

// Inputs of one routed-experts call on one rank (DESIGN.md §1).
struct ForwardArgs {
  TensorRef x_TD;            // bf16 [T', D], T' <= Config T, the same T' on every rank
  TensorRef num_tokens_1;    // int32 [1] on the compute device: live rows (<= T'); data == nullptr: all
  TensorRef topk_ids_TK;     // int32 or int64 [T', K], global expert ids in [0, E*R); -1 = inactive
  TensorRef topk_scores_TK;  // f32 or bf16 [T', K]: combine weights, used as given
  TensorRef w13_EFD;         // bf16 [E, 2F, D]: rows [0, F) gate, [F, 2F) up
  TensorRef w2_EDF;          // bf16 [E, D, F]
  TensorRef y_TD;            // out: bf16 [T', D]; rows past the live count are zero
  // Config.prepared_weights: copies of w13_EFD ([E, 2F, D]) and w2_EDF ([E, D, F]) made by
  // prepare_weights, read instead of the bf16 weights; format fp8_block_fp32 (precision
  // fp8_block), nvfp4 (precision nvfp4, weight-only inference) or mxfp8 (precision mxfp8,
  // inference); with nvfp4 and mxfp8, w13_EFD and w2_EDF may be left empty. nullptr otherwise.
  const PreparedWeights* w13_prepared = nullptr;
  const PreparedWeights* w2_prepared = nullptr;
  bool save_for_backward = true;  // false: nothing is saved, no slot is touched
  int slot = 0;              // activation slot that keeps this call's saved state
  void* stream = nullptr;    // cudaStream_t on CUDA; ignored on the CPU
};

// What forward hands to its backward: an immutable snapshot of where its saved state lives.
struct SavedLayer {
  int slot = -1;
  int layer = -1;      // position in the slot's LIFO
  int64_t step = -1;   // the forward's sequence number on this context (checked by backward)
  int64_t tokens = 0;  // T' of the forward
};

struct BackwardArgs {
  SavedLayer saved;
  TensorRef grad_y_TD;       // bf16 [T', D]
  TensorRef num_tokens_1;    // as in forward
  TensorRef topk_ids_TK;     // as in forward
  TensorRef topk_scores_TK;  // as in forward
  TensorRef w13_EFD;
  TensorRef w2_EDF;
  TensorRef grad_x_TD;       // out: bf16 [T', D]
  TensorRef grad_scores_TK;  // out: f32 [T', K] (0 for inactive routes and padding rows)
  TensorRef grad_w13_EFD;    // out: Config.wgrad_dtype [E, 2F, D]
  TensorRef grad_w2_EDF;     // out: Config.wgrad_dtype [E, D, F]
  const PreparedWeights* w13_prepared = nullptr;  // as in forward (the same weights)
  const PreparedWeights* w2_prepared = nullptr;
  bool accumulate_wgrad = false;  // add into grad_w13/grad_w2 instead of overwriting
  void* stream = nullptr;
};

class Backend;

// Where a context's arena (slots, then scratch) lives: `device_bytes` of device memory from
// `base`, then `host_bytes` of pinned host memory right behind them in the same virtual range
// (MemoryPlan::arena_device_bytes / arena_host_bytes; Config.scratch_device_bytes).
struct ArenaMemory {
  const void* base = nullptr;
  int64_t device_bytes = 0;       // planned; the host part starts at base + device_bytes
  int64_t host_bytes = 0;         // planned; 0: one plain device allocation (cudaMalloc)
  int64_t device_held_bytes = 0;  // physical bytes held for each part (CUDA host-backed arena:
  int64_t host_held_bytes = 0;    // rounded up to the VMM allocation granularity)
};

class Context {
 public:
  // Collective over the transport's ranks. Allocates everything plan_memory(config, R) lists.
  static std::unique_ptr<Context> create(const Config& config, std::shared_ptr<Transport> transport);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  SavedLayer forward(const ForwardArgs& args);
  void backward(const BackwardArgs& args);

  // Reads the status word (synchronising with the device on CUDA), clears it, and throws the
  // recorded error if there is one. The context stays usable either way.
  void check();
  // Same, without throwing.
  Status take_status();

  // The planner's decision for a saved layer: true when its forward saved only its input and its
  // backward replays the forward (synchronises with the device; diagnostics and tests). Valid
  // until a later forward reuses the layer's place in the slot.
  bool recomputes(const SavedLayer& saved);
  // High-water mark of the packed bytes of `slot` (max over ranks) since the context was created.
  int64_t slot_peak_bytes(int slot);

  const Config& config() const;
  const MemoryPlan& plan() const;
  int rank() const;
  int ep_size() const;
  Backend& backend();  // stage-level access (tests, layered API)
  ArenaMemory arena_memory() const;

  // Stage timing for breakdowns (main job, benchmarks): when on, every stage is bracketed by a
  // device synchronisation and timed on the host, which serialises the stages. Off by default.
  void set_stage_timing(bool on);
  struct StageTime {
    const char* stage;
    double ms;
  };
  // Times of the stages of the last forward and the last backward, in launch order.
  const std::vector<StageTime>& stage_times() const;

  // Collective; releases symmetric memory. Idempotent; the destructor calls it.
  void close();

  struct Impl;

 private:
  explicit Context(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe
