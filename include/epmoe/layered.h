// Layered API: the stages of a Context run one piece at a time, for frameworks that keep their own
// expert compute between dispatch and combine (TorchTitan token dispatchers, vLLM
// prepare/finalize). Per rank:
//
//   dispatch:      x_TD, topk_ids_TK, topk_scores_TK -> recv_x_MD [capacity, D] (rows grouped by
//                  local expert: rows [off[e], off[e+1]) belong to expert e) + layout
//   grouped_gemm:  out_MN[m] = a_MX[m] @ w[e]^T for the rows of expert e, over the dispatch's layout;
//                  w is [E, 2F, D] (a is [capacity, D]) or [E, D, F] (a is [capacity, F])
//   combine:       rows_MD (one output row per received row) -> y_TD[t] = sum_k score[t,k] * row
//
// and the backward of each. Contract:
//   - Collective like Context::forward: every rank calls the same layered functions in the same
//     order. dispatch, dispatch_backward, combine and combine_backward communicate; grouped_gemm
//     and its backward are local.
//   - The layout is a caller-owned buffer of layout_bytes() bytes on the compute device, filled by
//     dispatch and read by everything after it. Expert offsets are int32 at layout_offsets_index()
//     (int32 elements from the start), E + 1 of them. Rows past off[E] of every [capacity, *]
//     output are left untouched (callers zero them when they need defined values).
//   - combine uses the scores published by the dispatch of its layout, and must come before the
//     next dispatch; the same holds for combine_backward / dispatch_backward in backward. These
//     buffers are the Layered object's own (not the Context's), so fused Context calls may
//     interleave freely with layered ones.
//   - Data-dependent errors (capacity overflow, ids out of range, non-finite inputs) skip the rest
//     of the step on every rank and are reported by check() (CPU: thrown on return), as for the
//     Context. Outputs of a skipped step are zeros.
//   - On CUDA, every call enqueues on `stream` and never synchronises with the host.
#pragma once

#include <cstdint>
#include <memory>

#include "epmoe/context.h"
#include "epmoe/status.h"
#include "epmoe/tensor.h"
#include "epmoe/transport.h"

namespace epmoe {

struct DispatchArgs {
  TensorRef x_TD;            // bf16 [T', D]
  TensorRef num_tokens_1;    // int32 [1] or empty: all rows live
  TensorRef topk_ids_TK;     // int32 / int64 [T', K]; -1 = inactive route
  TensorRef topk_scores_TK;  // f32 / bf16 [T', K]: published for combine
  TensorRef recv_x_MD;       // out: bf16 [capacity, D]
  TensorRef layout;          // out: u8 or i32, layout_bytes() bytes
  void* stream = nullptr;
};

struct GroupedGemmArgs {
  TensorRef a_MX;      // bf16 [capacity, X]
  TensorRef w_ENX;     // bf16 [E, 2F, D] (X = D, N = 2F) or [E, D, F] (X = F, N = D)
  TensorRef layout;    // from dispatch
  TensorRef out_MN;    // out: bf16 [capacity, N]
  void* stream = nullptr;
};

struct GroupedGemmBackwardArgs {
  TensorRef grad_out_MN;  // bf16 [capacity, N]
  TensorRef a_MX;         // as in forward
  TensorRef w_ENX;        // as in forward
  TensorRef layout;
  TensorRef grad_a_MX;    // out: bf16 [capacity, X]; empty: not computed
  TensorRef grad_w_ENX;   // out: Config.wgrad_dtype [E, N, X]; empty: not computed
  bool accumulate_wgrad = false;
  void* stream = nullptr;
};

struct CombineArgs {
  TensorRef rows_MD;    // bf16 [capacity, D]: one output row per received row
  TensorRef layout;
  TensorRef y_TD;       // out: bf16 [T', D]
  TensorRef rows_TKD;   // out (optional, for combine_backward): bf16 [T', K, D], the rows as combined
  void* stream = nullptr;
};

struct CombineBackwardArgs {
  TensorRef grad_y_TD;       // bf16 [T', D]
  TensorRef topk_ids_TK;     // as given to dispatch
  TensorRef topk_scores_TK;  // as given to dispatch
  TensorRef rows_TKD;        // from combine
  TensorRef layout;
  TensorRef grad_rows_MD;    // out: bf16 [capacity, D] = score * grad_y of the row's token
  TensorRef grad_scores_TK;  // out: f32 [T', K]
  void* stream = nullptr;
};

struct DispatchBackwardArgs {
  TensorRef grad_recv_MD;  // bf16 [capacity, D]
  TensorRef layout;
  TensorRef grad_x_TD;     // out: bf16 [T', D] = sum over the token's active routes
  void* stream = nullptr;
};

class Layered {
 public:
  // Collective over the context's ranks; `transport` must be the one the context was created with.
  // Allocates this object's own symmetric buffers (routing, dispatch [T, D], combine [T, K, D]), a
  // route scratch and a status word. The context must outlive the Layered object.
  static std::unique_ptr<Layered> create(Context& context, std::shared_ptr<Transport> transport);
  ~Layered();
  Layered(const Layered&) = delete;
  Layered& operator=(const Layered&) = delete;

  int64_t capacity_rows() const;         // rows of every [capacity, *] tensor
  int64_t layout_bytes() const;          // bytes of the layout buffer
  int64_t layout_offsets_index() const;  // int32 index of the E + 1 expert offsets in the layout
  int64_t layout_rows_index() const;     // int32 index of M (rows received) in the layout

  void dispatch(const DispatchArgs& args);
  void grouped_gemm(const GroupedGemmArgs& args);
  void grouped_gemm_backward(const GroupedGemmBackwardArgs& args);
  void combine(const CombineArgs& args);
  void combine_backward(const CombineBackwardArgs& args);
  void dispatch_backward(const DispatchBackwardArgs& args);

  // As Context::check / take_status, for the layered calls.
  void check();
  Status take_status();
  // Collective; idempotent; the destructor calls it.
  void close();

  struct Impl;

 private:
  explicit Layered(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe
