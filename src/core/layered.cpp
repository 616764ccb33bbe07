// Layered API (include/epmoe/layered.h): each call builds a Step over this object's own symmetric
// buffers and the caller's tensors, and runs a slice of the Context's stage sequence on the
// Context's backend. Nothing here computes; the stages do.
#include "epmoe/layered.h"

#include <string>
#include <vector>

#include "core/activation.h"
#include "core/backend.h"
#include "core/status_word.h"
#include "core/validate.h"
#include "core/plan_terms.h"
#include "core/step.h"
#include "epmoe/error.h"

namespace epmoe {

namespace {

// Communicating calls come in two phases: "gather" calls (dispatch, combine_backward) write this
// rank's dispatch/routing buffers and read the peers'; "scatter" calls (combine,
// dispatch_backward) write the peers' combine buffers and read this rank's. Alternating phases
// are ordered by the barrier inside each call; two calls of one phase in a row need one more
// barrier first, or a fast rank would overwrite what a slow one still reads.
enum class Phase { none, gather, scatter };

std::string shape_of(std::initializer_list<int64_t> shape) {
  TensorRef t;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t v : shape) t.shape[i++] = v;
  return t.shape_string();
}

// The grouped GEMM's weight: W13 [E, 2F, D] or W2 [E, D, F] (which one follows from its shape).
struct WeightShape {
  bool w13;
  int64_t N, X;  // output and reduction columns of the rows' GEMM
};
WeightShape weight_shape(const TensorRef& w_ENX, const Dims& d, const Device& dev) {
  check_tensor(w_ENX, "w_ENX", {DType::bf16}, {d.E, w_ENX.shape[1], w_ENX.shape[2]}, dev);
  const bool w13 = w_ENX.shape[1] == 2 * d.F && w_ENX.shape[2] == d.D;
  const bool w2 = w_ENX.shape[1] == d.D && w_ENX.shape[2] == d.F;
  EPMOE_CHECK_ARG(w13 || w2, "w_ENX",
                  "shape " + shape_of({d.E, 2 * d.F, d.D}) + " or " + shape_of({d.E, d.D, d.F}),
                  w_ENX.shape_string());
  return {w13, w_ENX.shape[1], w_ENX.shape[2]};
}

int64_t rows_of(const TensorRef& t, const char* name, int64_t T) {
  EPMOE_CHECK_ARG(t.ndim >= 1 && t.shape[0] >= 1 && t.shape[0] <= T, name,
                  "T' in [1, " + std::to_string(T) + "] rows (Config.max_tokens_per_rank)",
                  t.shape_string());
  return t.shape[0];
}

}  // namespace

struct Layered::Impl {
  Context* context = nullptr;
  std::shared_ptr<Transport> transport;
  Backend* backend = nullptr;
  Dims dims;
  int64_t capacity = 0;
  int64_t layout_bytes = 0;
  std::chrono::milliseconds budget{0};
  SymmetricBuffer routing, dispatch, combine;
  void* routing_R = nullptr;  // peer tables on the compute device
  void* dispatch_R = nullptr;
  void* combine_R = nullptr;
  void* route_scratch = nullptr;
  Status* status = nullptr;
  int64_t sequence = 0;
  Phase last_phase = Phase::none;
  bool closed = false;

  void* peer_table(const SymmetricBuffer& b) {
    const std::size_t bytes = b.peers.size() * sizeof(void*);
    void* dev = backend->allocate(static_cast<std::size_t>(align_bytes(static_cast<int64_t>(bytes))));
    backend->copy_to_device(dev, b.peers.data(), bytes);
    return dev;
  }

  void check_layout(const TensorRef& t) const {
    EPMOE_CHECK_ARG(t.data != nullptr, "layout", "a non-null data pointer", "nullptr");
    EPMOE_CHECK_ARG(t.dtype == DType::u8 || t.dtype == DType::i32, "layout", "dtype u8 or i32",
                    to_string(t.dtype));
    EPMOE_CHECK_ARG(t.ndim == 1 && t.is_contiguous() &&
                        static_cast<int64_t>(t.nbytes()) >= layout_bytes,
                    "layout", "a contiguous 1-D buffer of at least " +
                                  std::to_string(layout_bytes) + " bytes (Layered::layout_bytes)",
                    t.shape_string() + " " + to_string(t.dtype));
    EPMOE_CHECK_ARG(t.device == backend->device(), "layout",
                    "device " + to_string(backend->device()), to_string(t.device));
  }

  Step step(int64_t tokens, const TensorRef& layout, void* stream) {
    check_layout(layout);
    const Config& c = context->config();
    Step s;
    s.dims = dims;
    s.tokens = tokens;
    s.rank = transport->rank();
    s.capacity_rows = capacity;
    s.act = activation_params(c.fields().activation);
    s.sequence = sequence;
    s.check_inputs = c.fields().check_inputs;
    s.trap_on_overflow = c.fields().overflow == OverflowPolicy::trap;
    s.barrier_timeout_ms = c.fields().barrier_timeout_ms;
    s.stream = stream;
    s.routing_R = static_cast<char* const*>(routing_R);
    s.dispatch_R = static_cast<bf16_t* const*>(dispatch_R);
    s.combine_R = static_cast<bf16_t* const*>(combine_R);
    s.status = status;
    s.route_scratch = static_cast<char*>(route_scratch);
    s.layout = carve_layout(layout.data, capacity, dims.T, dims.K, dims.E, dims.R);
    s.wgrad_dtype = c.fields().wgrad_dtype;
    return s;
  }

  // Orders this call after every rank's previous call of the same phase (see Phase).
  void enter(Phase phase, void* stream, int channel) {
    EPMOE_CHECK_ARG(!closed, "Layered", "an open object", "a closed one");
    if (last_phase == phase) transport->barrier_on_stream(stream, channel, budget, status);
    last_phase = phase;
    ++sequence;
  }

  void check_if_synchronous() {
    if (backend->device().type != DeviceType::cpu) return;
    const Status st = take_status();
    if (!st.ok()) throw_status(st);
  }

  Status take_status() { return take_status_word(*backend, status); }

};

std::unique_ptr<Layered> Layered::create(Context& context, std::shared_ptr<Transport> transport) {
  EPMOE_CHECK_ARG(transport != nullptr, "transport", "a transport", "nullptr");
  EPMOE_CHECK_ARG(transport->size() == context.ep_size() && transport->rank() == context.rank(),
                  "transport", "the context's transport (rank " + std::to_string(context.rank()) +
                      " of " + std::to_string(context.ep_size()) + ")",
                  "rank " + std::to_string(transport->rank()) + " of " +
                      std::to_string(transport->size()));
  // The layered stages exchange bf16 rows; the FP8 path exists only inside Context's fused call.
  EPMOE_CHECK_ARG(context.config().fields().precision == Precision::bf16, "Config.precision",
                  "bf16 for the layered API", to_string(context.config().fields().precision));
  // The layered combine sends one row per route into [T, K, D] buffers.
  EPMOE_CHECK_ARG(context.config().fields().combine == CombineMode::per_route, "Config.combine",
                  "per_route for the layered API", to_string(context.config().fields().combine));
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  const Config& c = context.config();
  const MemoryPlan& plan = context.plan();
  const int R = transport->size();
  m.context = &context;
  m.transport = std::move(transport);
  m.backend = &context.backend();
  m.dims = Dims{c.T(), c.D(), c.F(), c.K(), c.local_experts(R), R};
  m.capacity = plan.recv_capacity_rows;
  m.layout_bytes = epmoe::layout_bytes(m.capacity, c.T(), c.K(), m.dims.E, R).total;
  m.budget = std::chrono::milliseconds(c.fields().barrier_timeout_ms);
  m.routing = m.transport->allocate_symmetric(plan.routing_buffer_bytes, "layered.routing");
  m.dispatch = m.transport->allocate_symmetric(plan.dispatch_buffer_bytes, "layered.dispatch");
  m.combine = m.transport->allocate_symmetric(plan.combine_buffer_bytes, "layered.combine");
  m.routing_R = m.peer_table(m.routing);
  m.dispatch_R = m.peer_table(m.dispatch);
  m.combine_R = m.peer_table(m.combine);
  m.route_scratch = m.backend->allocate(route_scratch_layout(m.dims, m.capacity).total);
  m.status = static_cast<Status*>(m.backend->allocate(plan.status_bytes));
  m.transport->barrier("layered.create", m.budget);
  return std::unique_ptr<Layered>(new Layered(std::move(impl)));
}

Layered::Layered(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Layered::~Layered() {
  try {
    close();
  } catch (...) {
    // A destructor cannot report; close() explicitly to see errors.
  }
}

int64_t Layered::capacity_rows() const { return impl_->capacity; }
int64_t Layered::layout_bytes() const { return impl_->layout_bytes; }
int64_t Layered::layout_offsets_index() const {
  return epmoe::layout_bytes(impl_->capacity, impl_->dims.T, impl_->dims.K, impl_->dims.E,
                             impl_->dims.R).header / 4;
}
int64_t Layered::layout_rows_index() const { return kLayoutRows; }

void Layered::dispatch(const DispatchArgs& a) {
  Impl& m = *impl_;
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const int64_t T = rows_of(a.x_TD, "x_TD", d.T);
  check_tensor(a.x_TD, "x_TD", {DType::bf16}, {T, d.D}, dev);
  if (a.num_tokens_1.data != nullptr) check_tensor(a.num_tokens_1, "num_tokens_1", {DType::i32}, {1}, dev);
  check_tensor(a.topk_ids_TK, "topk_ids_TK", {DType::i32, DType::i64}, {T, d.K}, dev);
  check_tensor(a.topk_scores_TK, "topk_scores_TK", {DType::f32, DType::bf16}, {T, d.K}, dev);
  check_tensor(a.recv_x_MD, "recv_x_MD", {DType::bf16}, {m.capacity, d.D}, dev);
  m.enter(Phase::gather, a.stream, 0);
  Step s = m.step(T, a.layout, a.stream);
  s.x_TD = a.x_TD.as<bf16_t>();
  s.num_tokens_1 = a.num_tokens_1.as<int32_t>();
  s.ids_TK = a.topk_ids_TK.data;
  s.ids_dtype = a.topk_ids_TK.dtype;
  s.scores_TK = a.topk_scores_TK.data;
  s.scores_dtype = a.topk_scores_TK.dtype;
  s.x_gathered_MD = a.recv_x_MD.as<bf16_t>();
  Backend& b = *m.backend;
  b.publish_forward(s);
  m.transport->barrier_on_stream(a.stream, 0, m.budget, m.status);
  b.route(s);
  b.dispatch(s);
  m.check_if_synchronous();
}

void Layered::grouped_gemm(const GroupedGemmArgs& a) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(!m.closed, "Layered", "an open object", "a closed one");
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const WeightShape ws = weight_shape(a.w_ENX, d, dev);
  const bool w13 = ws.w13;
  const int64_t X = ws.X, N = ws.N;
  check_tensor(a.a_MX, "a_MX", {DType::bf16}, {m.capacity, X}, dev);
  check_tensor(a.out_MN, "out_MN", {DType::bf16}, {m.capacity, N}, dev);
  Step s = m.step(d.T, a.layout, a.stream);
  if (w13) {
    s.x_gathered_MD = a.a_MX.as<bf16_t>();
    s.w13_EFD = a.w_ENX.as<bf16_t>();
    s.h13_M2F = a.out_MN.as<bf16_t>();
    m.backend->w13_gemm(s);
  } else {
    s.h_MF = a.a_MX.as<bf16_t>();
    s.w2_EDF = a.w_ENX.as<bf16_t>();
    s.rows_MD = a.out_MN.as<bf16_t>();
    m.backend->w2_gemm(s);
  }
}

void Layered::grouped_gemm_backward(const GroupedGemmBackwardArgs& a) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(!m.closed, "Layered", "an open object", "a closed one");
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const WeightShape ws = weight_shape(a.w_ENX, d, dev);
  const bool w13 = ws.w13;
  const int64_t X = ws.X, N = ws.N;
  check_tensor(a.grad_out_MN, "grad_out_MN", {DType::bf16}, {m.capacity, N}, dev);
  check_tensor(a.a_MX, "a_MX", {DType::bf16}, {m.capacity, X}, dev);
  const DType wg = m.context->config().fields().wgrad_dtype;
  if (a.grad_a_MX.data != nullptr) check_tensor(a.grad_a_MX, "grad_a_MX", {DType::bf16}, {m.capacity, X}, dev);
  if (a.grad_w_ENX.data != nullptr) check_tensor(a.grad_w_ENX, "grad_w_ENX", {wg}, {d.E, N, X}, dev);
  Step s = m.step(d.T, a.layout, a.stream);
  s.accumulate_wgrad = a.accumulate_wgrad;
  Backend& b = *m.backend;
  if (w13) {
    s.grad_h13_M2F = a.grad_out_MN.as<bf16_t>();
    s.w13_EFD = a.w_ENX.as<bf16_t>();
    s.x_gathered_MD = a.a_MX.as<bf16_t>();
    s.rows_MD = a.grad_a_MX.as<bf16_t>();
    s.grad_w13_EFD = a.grad_w_ENX.data;
    if (a.grad_a_MX.data != nullptr) b.w13_dgrad(s);
    if (a.grad_w_ENX.data != nullptr) b.w13_wgrad(s);
  } else {
    s.grad_h3_MD = a.grad_out_MN.as<bf16_t>();
    s.w2_EDF = a.w_ENX.as<bf16_t>();
    s.h_MF = a.a_MX.as<bf16_t>();
    s.grad_h_MF = a.grad_a_MX.as<bf16_t>();
    s.grad_w2_EDF = a.grad_w_ENX.data;
    if (a.grad_a_MX.data != nullptr) b.w2_dgrad(s);
    if (a.grad_w_ENX.data != nullptr) b.w2_wgrad(s);
  }
}

void Layered::combine(const CombineArgs& a) {
  Impl& m = *impl_;
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const int64_t T = rows_of(a.y_TD, "y_TD", d.T);
  check_tensor(a.rows_MD, "rows_MD", {DType::bf16}, {m.capacity, d.D}, dev);
  check_tensor(a.y_TD, "y_TD", {DType::bf16}, {T, d.D}, dev);
  if (a.rows_TKD.data != nullptr) check_tensor(a.rows_TKD, "rows_TKD", {DType::bf16}, {T, d.K, d.D}, dev);
  m.enter(Phase::scatter, a.stream, 1);
  Step s = m.step(T, a.layout, a.stream);
  s.rows_MD = a.rows_MD.as<bf16_t>();
  s.y_TD = a.y_TD.as<bf16_t>();
  s.h3_TKD = a.rows_TKD.as<bf16_t>();
  m.backend->scatter_rows(s);
  m.transport->barrier_on_stream(a.stream, 1, m.budget, m.status);
  m.backend->reduce_forward(s);
  m.check_if_synchronous();
}

void Layered::combine_backward(const CombineBackwardArgs& a) {
  Impl& m = *impl_;
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const int64_t T = rows_of(a.grad_y_TD, "grad_y_TD", d.T);
  check_tensor(a.grad_y_TD, "grad_y_TD", {DType::bf16}, {T, d.D}, dev);
  check_tensor(a.topk_ids_TK, "topk_ids_TK", {DType::i32, DType::i64}, {T, d.K}, dev);
  check_tensor(a.topk_scores_TK, "topk_scores_TK", {DType::f32, DType::bf16}, {T, d.K}, dev);
  check_tensor(a.rows_TKD, "rows_TKD", {DType::bf16}, {T, d.K, d.D}, dev);
  check_tensor(a.grad_rows_MD, "grad_rows_MD", {DType::bf16}, {m.capacity, d.D}, dev);
  check_tensor(a.grad_scores_TK, "grad_scores_TK", {DType::f32}, {T, d.K}, dev);
  m.enter(Phase::gather, a.stream, 2);
  Step s = m.step(T, a.layout, a.stream);
  s.grad_y_TD = a.grad_y_TD.as<bf16_t>();
  s.ids_TK = a.topk_ids_TK.data;
  s.ids_dtype = a.topk_ids_TK.dtype;
  s.scores_TK = a.topk_scores_TK.data;
  s.scores_dtype = a.topk_scores_TK.dtype;
  s.h3_TKD = a.rows_TKD.as<bf16_t>();
  s.grad_scores_TK = a.grad_scores_TK.as<float>();
  s.grad_h3_MD = a.grad_rows_MD.as<bf16_t>();
  Backend& b = *m.backend;
  b.publish_backward(s);
  b.grad_scores(s);
  m.transport->barrier_on_stream(a.stream, 2, m.budget, m.status);
  b.gather_grad(s);
  m.check_if_synchronous();
}

void Layered::dispatch_backward(const DispatchBackwardArgs& a) {
  Impl& m = *impl_;
  const Dims& d = m.dims;
  const Device dev = m.backend->device();
  const int64_t T = rows_of(a.grad_x_TD, "grad_x_TD", d.T);
  check_tensor(a.grad_recv_MD, "grad_recv_MD", {DType::bf16}, {m.capacity, d.D}, dev);
  check_tensor(a.grad_x_TD, "grad_x_TD", {DType::bf16}, {T, d.D}, dev);
  m.enter(Phase::scatter, a.stream, 3);
  Step s = m.step(T, a.layout, a.stream);
  s.rows_MD = a.grad_recv_MD.as<bf16_t>();
  s.grad_x_TD = a.grad_x_TD.as<bf16_t>();
  m.backend->scatter_rows(s);
  m.transport->barrier_on_stream(a.stream, 3, m.budget, m.status);
  m.backend->reduce_backward(s);
  m.check_if_synchronous();
}

void Layered::check() {
  const Status st = impl_->take_status();
  if (!st.ok()) throw_status(st);
}

Status Layered::take_status() { return impl_->take_status(); }

void Layered::close() {
  if (!impl_ || impl_->closed) return;
  Impl& m = *impl_;
  m.closed = true;
  m.backend->synchronize(nullptr);
  m.transport->barrier("layered.close", m.budget);
  m.backend->release(m.routing_R);
  m.backend->release(m.dispatch_R);
  m.backend->release(m.combine_R);
  m.backend->release(m.route_scratch);
  m.backend->release(m.status);
  m.transport->release_symmetric(m.combine);
  m.transport->release_symmetric(m.dispatch);
  m.transport->release_symmetric(m.routing);
}

}  // namespace epmoe
