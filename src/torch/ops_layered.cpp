// Layered ops (include/epmoe/layered.h): dispatch, grouped GEMM, combine and their backward. The
// layout from dispatch is an int32 tensor the caller keeps and passes on, so several layers'
// layouts can wait for their backward at once. [capacity, *] outputs are zero-filled: rows past
// the received count are then defined (tracing compares outputs).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "torch/errors.h"
#include "torch/registry.h"
#include "torch/tensors.h"

namespace epmoe::torch_binding {

namespace {

at::ScalarType wgrad_type(const Config& c) {
  return c.fields().wgrad_dtype == DType::f32 ? at::kFloat : at::kBFloat16;
}

std::tuple<at::Tensor, at::Tensor> dispatch(const at::Tensor& x_TD, const at::Tensor& ids_TK,
                                            const at::Tensor& scores_TK,
                                            const c10::optional<at::Tensor>& num_tokens_1,
                                            int64_t context) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    at::Tensor recv_x_MD = at::zeros({api.capacity_rows(), x_TD.size(1)}, x_TD.options());
    at::Tensor layout = at::zeros({api.layout_bytes() / 4}, x_TD.options().dtype(at::kInt));
    DispatchArgs a;
    a.x_TD = ref(x_TD, "x_TD");
    a.num_tokens_1 = ref(num_tokens_1, "num_tokens_1");
    a.topk_ids_TK = ref(ids_TK, "topk_ids_TK");
    a.topk_scores_TK = ref(scores_TK, "topk_scores_TK");
    a.recv_x_MD = ref(recv_x_MD, "recv_x_MD");
    a.layout = ref(layout, "layout");
    a.stream = current_stream(a.x_TD.device);
    api.dispatch(a);
    return std::make_tuple(recv_x_MD, layout);
  });
}

at::Tensor grouped_gemm(const at::Tensor& a_MX, const at::Tensor& w_ENX, const at::Tensor& layout,
                        int64_t context) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    EPMOE_CHECK_ARG(w_ENX.dim() == 3, "w_ENX", "3 dimensions [E, N, X]", w_ENX.dim());
    at::Tensor out_MN = at::zeros({a_MX.size(0), w_ENX.size(1)}, a_MX.options());
    GroupedGemmArgs a;
    a.a_MX = ref(a_MX, "a_MX");
    a.w_ENX = ref(w_ENX, "w_ENX");
    a.layout = ref(layout, "layout");
    a.out_MN = ref(out_MN, "out_MN");
    a.stream = current_stream(a.a_MX.device);
    api.grouped_gemm(a);
    return out_MN;
  });
}

std::tuple<at::Tensor, at::Tensor> grouped_gemm_backward(const at::Tensor& grad_out_MN,
                                                         const at::Tensor& a_MX,
                                                         const at::Tensor& w_ENX,
                                                         const at::Tensor& layout, int64_t context) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    at::Tensor grad_a_MX = at::zeros_like(a_MX);
    at::Tensor grad_w_ENX =
        at::empty(w_ENX.sizes(), w_ENX.options().dtype(wgrad_type(e->context->config())));
    GroupedGemmBackwardArgs a;
    a.grad_out_MN = ref(grad_out_MN, "grad_out_MN");
    a.a_MX = ref(a_MX, "a_MX");
    a.w_ENX = ref(w_ENX, "w_ENX");
    a.layout = ref(layout, "layout");
    a.grad_a_MX = ref(grad_a_MX, "grad_a_MX");
    a.grad_w_ENX = ref(grad_w_ENX, "grad_w_ENX");
    a.stream = current_stream(a.a_MX.device);
    api.grouped_gemm_backward(a);
    return std::make_tuple(grad_a_MX, grad_w_ENX);
  });
}

std::tuple<at::Tensor, at::Tensor> combine(const at::Tensor& rows_MD, const at::Tensor& layout,
                                           const at::Tensor& ids_TK, const at::Tensor& scores_TK,
                                           int64_t context, bool save) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    (void)scores_TK;  // the values published by dispatch are the ones combined (layered.h)
    const int64_t T = ids_TK.size(0), K = ids_TK.size(1), D = rows_MD.size(1);
    at::Tensor y_TD = at::empty({T, D}, rows_MD.options());
    at::Tensor rows_TKD = save ? at::zeros({T, K, D}, rows_MD.options()) : at::empty({0}, rows_MD.options());
    CombineArgs a;
    a.rows_MD = ref(rows_MD, "rows_MD");
    a.layout = ref(layout, "layout");
    a.y_TD = ref(y_TD, "y_TD");
    if (save) a.rows_TKD = ref(rows_TKD, "rows_TKD");
    a.stream = current_stream(a.rows_MD.device);
    api.combine(a);
    return std::make_tuple(y_TD, rows_TKD);
  });
}

std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& grad_y_TD,
                                                    const at::Tensor& layout,
                                                    const at::Tensor& ids_TK,
                                                    const at::Tensor& scores_TK,
                                                    const at::Tensor& rows_TKD, int64_t context) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    at::Tensor grad_rows_MD = at::zeros({api.capacity_rows(), grad_y_TD.size(1)}, grad_y_TD.options());
    at::Tensor grad_scores_TK = at::empty(ids_TK.sizes(), grad_y_TD.options().dtype(at::kFloat));
    CombineBackwardArgs a;
    a.grad_y_TD = ref(grad_y_TD, "grad_y_TD");
    a.topk_ids_TK = ref(ids_TK, "topk_ids_TK");
    a.topk_scores_TK = ref(scores_TK, "topk_scores_TK");
    a.rows_TKD = ref(rows_TKD, "rows_TKD");
    a.layout = ref(layout, "layout");
    a.grad_rows_MD = ref(grad_rows_MD, "grad_rows_MD");
    a.grad_scores_TK = ref(grad_scores_TK, "grad_scores_TK");
    a.stream = current_stream(a.grad_y_TD.device);
    api.combine_backward(a);
    return std::make_tuple(grad_rows_MD, grad_scores_TK);
  });
}

at::Tensor dispatch_backward(const at::Tensor& grad_recv_MD, const at::Tensor& layout,
                             const at::Tensor& ids_TK, int64_t context) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(context);
    std::lock_guard<std::mutex> lock(e->mu);
    Layered& api = e->layered_api();
    at::Tensor grad_x_TD = at::empty({ids_TK.size(0), grad_recv_MD.size(1)}, grad_recv_MD.options());
    DispatchBackwardArgs a;
    a.grad_recv_MD = ref(grad_recv_MD, "grad_recv_MD");
    a.layout = ref(layout, "layout");
    a.grad_x_TD = ref(grad_x_TD, "grad_x_TD");
    a.stream = current_stream(a.grad_recv_MD.device);
    api.dispatch_backward(a);
    return grad_x_TD;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(epmoe, m) {
  m.def("dispatch(Tensor x_TD, Tensor topk_ids_TK, Tensor topk_scores_TK, Tensor? num_tokens_1, "
        "int context) -> (Tensor, Tensor)");
  m.def("grouped_gemm(Tensor a_MX, Tensor w_ENX, Tensor layout, int context) -> Tensor");
  m.def("grouped_gemm_backward(Tensor grad_out_MN, Tensor a_MX, Tensor w_ENX, Tensor layout, "
        "int context) -> (Tensor, Tensor)");
  m.def("combine(Tensor rows_MD, Tensor layout, Tensor topk_ids_TK, Tensor topk_scores_TK, "
        "int context, bool save) -> (Tensor, Tensor)");
  m.def("combine_backward(Tensor grad_y_TD, Tensor layout, Tensor topk_ids_TK, "
        "Tensor topk_scores_TK, Tensor rows_TKD, int context) -> (Tensor, Tensor)");
  m.def("dispatch_backward(Tensor grad_recv_MD, Tensor layout, Tensor topk_ids_TK, int context) "
        "-> Tensor");
}

#define EPMOE_LAYERED_IMPL(m)                                 \
  m.impl("dispatch", &dispatch);                              \
  m.impl("grouped_gemm", &grouped_gemm);                      \
  m.impl("grouped_gemm_backward", &grouped_gemm_backward);    \
  m.impl("combine", &combine);                                \
  m.impl("combine_backward", &combine_backward);              \
  m.impl("dispatch_backward", &dispatch_backward)

TORCH_LIBRARY_IMPL(epmoe, CPU, m) { EPMOE_LAYERED_IMPL(m); }
TORCH_LIBRARY_IMPL(epmoe, CUDA, m) { EPMOE_LAYERED_IMPL(m); }

}  // namespace epmoe::torch_binding
