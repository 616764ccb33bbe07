// The fused routed-experts op pair. Forward and backward are functional in their schemas; the
// context state they touch (sequence numbers, activation slots, symmetric buffers) is declared
// to torch.compile as an ordered effect from Python (python/epmoe/_ops.py), so tracing keeps
// every call, in program order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <vector>

#include "epmoe/error.h"
#include "torch/errors.h"
#include "torch/registry.h"
#include "torch/tensors.h"

namespace epmoe::torch_binding {

namespace {

at::ScalarType wgrad_type(const Config& c) {
  return c.fields().wgrad_dtype == DType::f32 ? at::kFloat : at::kBFloat16;
}

at::Tensor routed_experts_fwd(const at::Tensor& x_TD, const at::Tensor& ids_TK,
                              const at::Tensor& scores_TK, const at::Tensor& w13_EFD,
                              const at::Tensor& w2_EDF, const c10::optional<at::Tensor>& num_tokens_1,
                              int64_t context, bool save, int64_t slot) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    at::Tensor y_TD = at::empty_like(x_TD);
    ForwardArgs a;
    a.x_TD = ref(x_TD, "x_TD");
    a.num_tokens_1 = ref(num_tokens_1, "num_tokens_1");
    a.topk_ids_TK = ref(ids_TK, "topk_ids_TK");
    a.topk_scores_TK = ref(scores_TK, "topk_scores_TK");
    a.w13_EFD = ref(w13_EFD, "w13_EFD");
    a.w2_EDF = ref(w2_EDF, "w2_EDF");
    a.y_TD = ref(y_TD, "y_TD");
    a.save_for_backward = save;
    a.slot = static_cast<int>(slot);
    a.stream = current_stream(a.x_TD.device);
    const SavedLayer saved = e->context->forward(a);
    if (save) e->saved[static_cast<size_t>(slot)].push_back(saved);
    return y_TD;
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> routed_experts_bwd(
    const at::Tensor& grad_y_TD, const at::Tensor& ids_TK, const at::Tensor& scores_TK,
    const at::Tensor& w13_EFD, const at::Tensor& w2_EDF,
    const c10::optional<at::Tensor>& num_tokens_1, int64_t context, int64_t slot) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    EPMOE_CHECK_ARG(slot >= 0 && slot < static_cast<int64_t>(e->saved.size()), "slot",
                    "a slot in [0, " + std::to_string(e->saved.size()) + ")", slot);
    auto& stack = e->saved[static_cast<size_t>(slot)];
    EPMOE_CHECK_ARG(!stack.empty(), "slot",
                    "a forward awaiting its backward in slot " + std::to_string(slot),
                    "none (backward without forward, or twice)");
    const at::ScalarType wg = wgrad_type(e->context->config());
    at::Tensor grad_x_TD = at::empty_like(grad_y_TD);
    at::Tensor grad_scores_TK = at::empty(ids_TK.sizes(), grad_y_TD.options().dtype(at::kFloat));
    at::Tensor grad_w13_EFD = at::empty(w13_EFD.sizes(), w13_EFD.options().dtype(wg));
    at::Tensor grad_w2_EDF = at::empty(w2_EDF.sizes(), w2_EDF.options().dtype(wg));
    BackwardArgs a;
    a.saved = stack.back();
    a.grad_y_TD = ref(grad_y_TD, "grad_y_TD");
    a.num_tokens_1 = ref(num_tokens_1, "num_tokens_1");
    a.topk_ids_TK = ref(ids_TK, "topk_ids_TK");
    a.topk_scores_TK = ref(scores_TK, "topk_scores_TK");
    a.w13_EFD = ref(w13_EFD, "w13_EFD");
    a.w2_EDF = ref(w2_EDF, "w2_EDF");
    a.grad_x_TD = ref(grad_x_TD, "grad_x_TD");
    a.grad_scores_TK = ref(grad_scores_TK, "grad_scores_TK");
    a.grad_w13_EFD = ref(grad_w13_EFD, "grad_w13_EFD");
    a.grad_w2_EDF = ref(grad_w2_EDF, "grad_w2_EDF");
    a.stream = current_stream(a.grad_y_TD.device);
    // The Context consumes the saved layer once the arguments are valid, even when the step
    // then fails; invalid arguments leave it in place.
    try {
      e->context->backward(a);
    } catch (const Error& err) {
      if (err.kind() != ErrorKind::invalid_argument) stack.pop_back();
      throw;
    }
    stack.pop_back();
    return std::make_tuple(grad_x_TD, grad_scores_TK, grad_w13_EFD, grad_w2_EDF);
  });
}

// Benchmark support (bench/bench_python_overhead.py): `iters` forwards straight through
// Context::forward with what routed_experts_fwd does around it (output allocation, refs, stream),
// timed on the host. Returns [seconds for all iterations] (enqueue time on CUDA; the caller
// synchronises and times the total).
std::vector<double> bench_forward(const at::Tensor& x_TD, const at::Tensor& ids_TK,
                                  const at::Tensor& scores_TK, const at::Tensor& w13_EFD,
                                  const at::Tensor& w2_EDF, int64_t context, int64_t iters) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      std::lock_guard<std::mutex> lock(e->mu);
      at::Tensor y_TD = at::empty_like(x_TD);
      ForwardArgs a;
      a.x_TD = ref(x_TD, "x_TD");
      a.topk_ids_TK = ref(ids_TK, "topk_ids_TK");
      a.topk_scores_TK = ref(scores_TK, "topk_scores_TK");
      a.w13_EFD = ref(w13_EFD, "w13_EFD");
      a.w2_EDF = ref(w2_EDF, "w2_EDF");
      a.y_TD = ref(y_TD, "y_TD");
      a.save_for_backward = false;
      a.stream = current_stream(a.x_TD.device);
      e->context->forward(a);
    }
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    return std::vector<double>{dt.count()};
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(epmoe, m) {
  m.def("_bench_forward(Tensor x_TD, Tensor topk_ids_TK, Tensor topk_scores_TK, Tensor w13_EFD, "
        "Tensor w2_EDF, int context, int iters) -> float[]", &bench_forward);
  m.def("routed_experts_fwd(Tensor x_TD, Tensor topk_ids_TK, Tensor topk_scores_TK, Tensor w13_EFD, "
        "Tensor w2_EDF, Tensor? num_tokens_1, int context, bool save, int slot) -> Tensor");
  m.def("routed_experts_bwd(Tensor grad_y_TD, Tensor topk_ids_TK, Tensor topk_scores_TK, "
        "Tensor w13_EFD, Tensor w2_EDF, Tensor? num_tokens_1, int context, int slot) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(epmoe, CPU, m) {
  m.impl("routed_experts_fwd", &routed_experts_fwd);
  m.impl("routed_experts_bwd", &routed_experts_bwd);
}

TORCH_LIBRARY_IMPL(epmoe, CUDA, m) {
  m.impl("routed_experts_fwd", &routed_experts_fwd);
  m.impl("routed_experts_bwd", &routed_experts_bwd);
}

}  // namespace epmoe::torch_binding
