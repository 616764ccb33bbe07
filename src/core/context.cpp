// Context: owns the plan, the symmetric buffers, the arena and the slot stacks, and runs the
// fixed stage sequence of DESIGN.md §3 on its backend. Backend-neutral.
#include "epmoe/context.h"

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/fp8_terms.h"
#include "core/status_word.h"
#include "core/plan_terms.h"
#include "core/slot_plan.h"
#include "core/validate.h"
#include "epmoe/error.h"

namespace epmoe {

namespace {

// Fields every rank must agree on; gathered at create().
struct ConfigFingerprint {
  int64_t T, D, F;
  int32_t K, experts, activation, precision;
  float alpha, limit;
  double capacity_factor;
  int32_t num_slots, layers_per_slot, inference, fuse_epilogues;
  int32_t arrival_gated_w13, prepared_weights, combine, fp8_wgrad;
  int64_t slot_bytes;
};

ConfigFingerprint fingerprint(const Config& c, int64_t slot_bytes) {
  ConfigFingerprint f{};
  const ConfigFields& x = c.fields();
  f.T = x.max_tokens_per_rank;
  f.D = x.hidden_dim;
  f.F = x.intermediate_dim;
  f.K = x.top_k;
  f.experts = x.num_experts;
  f.activation = static_cast<int32_t>(x.activation.kind);
  f.precision = static_cast<int32_t>(x.precision);
  f.alpha = x.activation.alpha;
  f.limit = x.activation.limit;
  f.capacity_factor = x.capacity_factor;
  f.num_slots = x.slots.num_slots;
  f.layers_per_slot = x.slots.max_layers_per_slot;
  f.inference = x.inference;
  f.fuse_epilogues = x.fuse_epilogues;
  f.arrival_gated_w13 = x.arrival_gated_w13;
  f.prepared_weights = x.prepared_weights;
  f.combine = static_cast<int32_t>(x.combine);
  f.fp8_wgrad = static_cast<int32_t>(x.fp8_wgrad);
  f.slot_bytes = slot_bytes;
  return f;
}

}  // namespace

struct Context::Impl {
  Config config;
  MemoryPlan plan;
  std::shared_ptr<Transport> transport;
  std::unique_ptr<Backend> backend;
  Dims dims;
  std::chrono::milliseconds budget{0};

  SymmetricBuffer routing, dispatch, combine;
  // Peer tables as the backend reads them (device memory on CUDA).
  char** routing_R = nullptr;
  bf16_t** dispatch_R = nullptr;
  bf16_t** combine_R = nullptr;

  char* arena = nullptr;
  ArenaMemory arena_memory;  // arena_memory.host_bytes > 0: from allocate_host_backed
  Status* status = nullptr;
  char* planner_state = nullptr;  // SlotState [N] | saved bytes [N, R] (planner_state_layout)
  SlotLayout slot_geometry_bytes{};
  bool places_saved_state = false;  // the backend reads saved offsets from the layer plans
  bool may_recompute = false;       // the slot budget can make a layer save only its input
  int64_t sequence = 0;
  std::vector<std::vector<int64_t>> slot_stack;  // per slot: sequence numbers of saved layers
  bool closed = false;
  bool stage_timing = false;
  std::vector<Context::StageTime> stage_times;  // last forward's, then last backward's
  std::size_t forward_stage_count = 0;

  template <class Fn>
  void stage(const char* name, void* stream, Fn&& fn) {
    if (!stage_timing) {
      fn();
      return;
    }
    backend->synchronize(stream);
    auto t0 = std::chrono::steady_clock::now();
    fn();
    backend->synchronize(stream);
    std::chrono::duration<double, std::milli> dt = std::chrono::steady_clock::now() - t0;
    stage_times.push_back({name, dt.count()});
  }

  explicit Impl(const Config& c) : config(c) {}

  // One [R] pointer table, allocated at A(R * 8) bytes as MemoryPlan::peer_table_bytes counts it.
  template <class T>
  T** peer_table(const SymmetricBuffer& b) {
    std::vector<void*> table(b.peers.begin(), b.peers.end());
    const int64_t bytes = static_cast<int64_t>(table.size() * sizeof(void*));
    void* dev = backend->allocate(static_cast<std::size_t>(align_bytes(bytes)));
    backend->copy_to_device(dev, table.data(), table.size() * sizeof(void*));
    return static_cast<T**>(dev);
  }

  // Layer `layer` of `slot`: its LayerPlan, then its layout (host-known addresses).
  char* layer_metadata(int slot, int layer) const {
    return arena + static_cast<int64_t>(slot) * plan.slot_bytes +
           layer * slot_geometry_bytes.layer_metadata;
  }
  // Scratch (MemoryPlan order): route scratch, the pad that puts the call scratch's x_gathered on
  // the granule (plan_terms.h), the call scratch, then the FP8 regions. The route scratch and the
  // call scratch's layout lead: with Config.scratch_device_bytes they are the device prefix.
  char* scratch_base() const { return arena + plan.activation_bytes; }
  char* route_scratch() const { return scratch_base(); }
  char* call_scratch() const {
    return route_scratch() + plan.route_scratch_bytes + plan.call_scratch_pad_bytes;
  }
  // FP8 operands, then the per-call weights, after the call scratch (MemoryPlan order).
  char* fp8_scratch() const { return call_scratch() + plan.backward_scratch_bytes; }
  char* fp8_weights() const { return fp8_scratch() + plan.fp8_scratch_bytes; }
  bool fp8() const { return config.fields().precision == Precision::fp8_block; }
  bool per_rank() const { return config.fields().combine == CombineMode::per_rank; }

  // The E4M3 weights a call reads: the caller's prepared ones, or the bf16 ones quantized into
  // the context's scratch by a quantize_weights stage (the same codec, so the same bits).
  void bind_weights(Step& s, const TensorRef& w13_EFD, const TensorRef& w2_EDF,
                    const PreparedWeights* w13_prepared, const PreparedWeights* w2_prepared) {
    if (config.fields().precision == Precision::nvfp4) {
      // Weight-only NVFP4 (validated: both prepared, format nvfp4); activations stay bf16.
      s.nvfp4 = true;
      s.w13_nvfp4_EFP = w13_prepared->data.as<uint8_t>();
      s.w13_nvfp4_scales = w13_prepared->scales.as<uint8_t>();
      s.w13_nvfp4_global_E = w13_prepared->global_scale.as<float>();
      s.w2_nvfp4_EDP = w2_prepared->data.as<uint8_t>();
      s.w2_nvfp4_scales = w2_prepared->scales.as<uint8_t>();
      s.w2_nvfp4_global_E = w2_prepared->global_scale.as<float>();
      // The split-K partials: grad_h3 .. rows_MD of the call scratch (backward's; nvfp4 contexts
      // are inference only), so the plan counts them already.
      const CallScratchLayout cl = call_scratch_layout(dims, plan.recv_capacity_rows,
                                                       !config.fields().fuse_epilogues, per_rank());
      s.nvfp4_splitk_SMN = reinterpret_cast<float*>(call_scratch() + cl.grad_h3);
      s.nvfp4_splitk_bytes = cl.rows_MD - cl.grad_h3;
      return;
    }
    if (config.fields().precision == Precision::mxfp8) {
      // MXFP8 inference (validated: both prepared, format mxfp8).
      s.mxfp8 = true;
      s.w13_mx_EFD = w13_prepared->data.as<uint8_t>();
      s.w13_mx_scales_EFS = w13_prepared->scales.as<uint8_t>();
      s.w2_mx_EDF = w2_prepared->data.as<uint8_t>();
      s.w2_mx_scales_EDS = w2_prepared->scales.as<uint8_t>();
      // The CUDA GEMMs' quantized rows: grad_h3 .. rows_MD of the call scratch (backward's; mxfp8
      // contexts are inference only), so the plan counts them already.
      const CallScratchLayout cl = call_scratch_layout(dims, plan.recv_capacity_rows,
                                                       !config.fields().fuse_epilogues, per_rank());
      EPMOE_EXPECT(mxfp8_scratch_fits(cl, dims, plan.recv_capacity_rows), internal,
                   "mxfp8 scratch", "within the call scratch's backward rows",
                   std::to_string(mxfp8_scratch_layout(dims, plan.recv_capacity_rows).total) +
                       " bytes > " + std::to_string(cl.rows_MD - cl.grad_h3));
      s.mxfp8_scratch = call_scratch() + cl.grad_h3;
      return;
    }
    if (!fp8()) return;
    s.fp8 = true;
    s.fp8_scratch = fp8_scratch();
    s.fp8_wgrad = plan.fp8_wgrad;  // resolved (Config.fp8_wgrad by_shape: the plan's choice)
    if (w13_prepared != nullptr) {
      s.w13_q_EFD = w13_prepared->data.as<uint8_t>();
      s.w13_scales_EBS = w13_prepared->scales.as<float>();
      s.w2_q_EDF = w2_prepared->data.as<uint8_t>();
      s.w2_scales_EBS = w2_prepared->scales.as<float>();
      // Required by backward (validate.cpp); a forward may leave them null.
      s.w13_qt_EDF = w13_prepared->data_t.as<uint8_t>();
      s.w13_scales_t_EBS = w13_prepared->scales_t.as<float>();
      s.w2_qt_EFD = w2_prepared->data_t.as<uint8_t>();
      s.w2_scales_t_EBS = w2_prepared->scales_t.as<float>();
      return;
    }
    if (!config.fields().inference) {  // after the per-call weights (MemoryPlan order)
      s.fp8_transposed = fp8_weights() + fp8_weight_layout(dims).total;
    }
    const Fp8WeightLayout l = fp8_weight_layout(dims);
    const Device dev = backend->device();
    const PreparedWeightShapes s13 = prepared_weight_shapes(WeightFormat::fp8_block_fp32, dims.E,
                                                            2 * dims.F, dims.D);
    const PreparedWeightShapes s2 =
        prepared_weight_shapes(WeightFormat::fp8_block_fp32, dims.E, dims.D, dims.F);
    char* base = fp8_weights();
    PreparedWeights p13{WeightFormat::fp8_block_fp32, dims.E, 2 * dims.F, dims.D, s13.data,
                        s13.scales, {}, {}, {}};
    PreparedWeights p2{WeightFormat::fp8_block_fp32, dims.E, dims.D, dims.F, s2.data, s2.scales, {},
                       {}, {}};
    p13.data.data = base + l.w13_q;
    p13.scales.data = base + l.w13_scales;
    p2.data.data = base + l.w2_q;
    p2.scales.data = base + l.w2_scales;
    for (TensorRef* t : {&p13.data, &p13.scales, &p2.data, &p2.scales}) t->device = dev;
    stage("quantize_weights", s.stream, [&] {
      prepare_weights(w13_EFD, p13, s.stream);
      prepare_weights(w2_EDF, p2, s.stream);
    });
    s.w13_q_EFD = p13.data.as<uint8_t>();
    s.w13_scales_EBS = p13.scales.as<float>();
    s.w2_q_EDF = p2.data.as<uint8_t>();
    s.w2_scales_EBS = p2.scales.as<float>();
  }

  SlotGeometry geometry(int slot) const {
    SlotGeometry g;
    g.T = dims.T;
    g.D = dims.D;
    g.F = dims.F;
    g.K = dims.K;
    g.R = dims.R;
    g.layers_per_slot = plan.layers_per_slot;
    g.granule = plan.packing_granule_bytes;
    g.packed_bytes = plan.slot_bytes - slot_geometry_bytes.packed;
    g.packed_base = static_cast<int64_t>(slot) * plan.slot_bytes + slot_geometry_bytes.packed;
    const CallScratchLayout cl = call_scratch_layout(dims, plan.recv_capacity_rows,
                                                     !config.fields().fuse_epilogues, per_rank());
    const int64_t call = call_scratch() - arena;
    g.scratch_x_gathered = call + cl.x_gathered;
    g.scratch_h13 = call + cl.h13;
    g.scratch_rows = call + cl.rows_MD;
    g.h3_rows = per_rank() ? 1 : 0;
    // Whole rows of D bf16 wherever x_gathered lives (CUDA reads it through one arena descriptor).
    EPMOE_ASSERT(g.packed_base % g.granule == 0 && g.scratch_x_gathered % g.granule == 0);
    return g;
  }

  Step base_step(int64_t tokens, void* stream) const {
    Step s;
    s.dims = dims;
    s.tokens = tokens;
    s.rank = transport->rank();
    s.capacity_rows = plan.recv_capacity_rows;
    s.act = activation_params(config.fields().activation);
    s.sequence = sequence;
    s.check_inputs = config.fields().check_inputs;
    s.trap_on_overflow = config.fields().overflow == OverflowPolicy::trap;
    s.arrival_gated_w13 = config.fields().arrival_gated_w13;
    s.combine_per_rank = per_rank();
    s.barrier_timeout_ms = config.fields().barrier_timeout_ms;
    s.stream = stream;
    s.routing_R = routing_R;
    s.dispatch_R = dispatch_R;
    s.combine_R = combine_R;
    s.dispatch_local = static_cast<char*>(dispatch.local);
    s.status = status;
    const bool unfused = !config.fields().fuse_epilogues;
    s.route_scratch = route_scratch();
    char* call = call_scratch();
    const CallScratchLayout cl =
        call_scratch_layout(dims, plan.recv_capacity_rows, unfused, per_rank());
    s.h_MF = reinterpret_cast<bf16_t*>(call + cl.h);
    s.grad_h3_MD = reinterpret_cast<bf16_t*>(call + cl.grad_h3);
    s.grad_h13_M2F = reinterpret_cast<bf16_t*>(call + cl.grad_h13);
    s.rows_MD = unfused || per_rank() ? reinterpret_cast<bf16_t*>(call + cl.rows_MD) : nullptr;
    s.h3_MD = per_rank() ? s.rows_MD : nullptr;  // the W2 rows the per-rank send reads
    s.grad_h_MF = unfused ? reinterpret_cast<bf16_t*>(call + cl.grad_h) : nullptr;
    return s;
  }

  // Backward: the row scores and grad_scores partials of the call scratch (Step::row_scores_M).
  void bind_score_after_w2_dgrad(Step& s) const {
    char* call = call_scratch();
    const CallScratchLayout cl = call_scratch_layout(dims, plan.recv_capacity_rows,
                                                     !config.fields().fuse_epilogues, per_rank());
    s.row_scores_M = reinterpret_cast<float*>(call + cl.row_scores);
    s.score_parts_MC = reinterpret_cast<float*>(call + cl.score_parts);
  }

  // Layer state: in the call scratch when nothing is saved (slot < 0); else the layout in the
  // slot's metadata and the planner's record, from which the stages place x_gathered and h13.
  void bind_layer_state(Step& s, int slot, int layer) const {
    const int64_t M = plan.recv_capacity_rows;
    char* call = call_scratch();
    const CallScratchLayout cl =
        call_scratch_layout(dims, M, !config.fields().fuse_epilogues, per_rank());
    s.x_gathered_MD = reinterpret_cast<bf16_t*>(call + cl.x_gathered);
    s.h13_M2F = reinterpret_cast<bf16_t*>(call + cl.h13);
    s.h3_TKD = nullptr;
    if (slot < 0) {
      s.layout = carve_layout(call + cl.layout, M, dims.T, dims.K, dims.E, dims.R);
      return;
    }
    char* meta = layer_metadata(slot, layer);
    s.layout = carve_layout(meta + kAlignment, M, dims.T, dims.K, dims.E, dims.R);
    s.arena = arena;
    s.arena_bytes = plan.arena_bytes;
    s.layer_plan = reinterpret_cast<LayerPlan*>(meta);
    const PlannerStateLayout pl = planner_state_layout(plan.num_slots, dims.R);
    s.slot_state = reinterpret_cast<SlotState*>(planner_state + pl.states) + slot;
    s.slot_saved_R = reinterpret_cast<int64_t*>(planner_state + pl.saved_NR) + slot * dims.R;
    s.slot_geometry = geometry(slot);
    s.slot = slot;
    if (!places_saved_state) {
      // A backend that does not read the plans yet: every layer saves everything at capacity
      // rows, at host-known offsets (Context::create demands the maximum useful budget).
      const int64_t full = saved_full_bytes(dims, M);
      const FullSaveLayout l = full_save_layout(M, dims.D, dims.F, plan.packing_granule_bytes);
      char* base = arena + s.slot_geometry.packed_base + layer * full;
      s.x_gathered_MD = reinterpret_cast<bf16_t*>(base + l.x_gathered);
      s.h13_M2F = reinterpret_cast<bf16_t*>(base + l.h13);
    }
  }

  // Forward of W13, SwiGLU, W2 and the scatter to the owners (fused or not), as in forward.
  // Per-rank combine: W2 stores its rows locally and the send stage stores one summed row per
  // pull into the owner's [T, R, D] buffer. The replay in backward runs the same W13 stages and
  // stops there: backward needs x_gathered and h13 (grad_scores come from the W2 DGRAD's output
  // and h, not from the W2 rows), so it runs no W2 and sends nothing.
  void expert_stages(Backend& b, const Step& s) {
    if (config.fields().fuse_epilogues) {
      stage("w13_swiglu", s.stream, [&] { b.w13_swiglu(s); });
    } else {
      stage("w13_gemm", s.stream, [&] { b.w13_gemm(s); });
      stage("swiglu_forward", s.stream, [&] { b.swiglu_forward(s); });
    }
    if (s.replay) return;
    if (per_rank()) {
      stage("w2_gemm", s.stream, [&] { b.w2_gemm(s); });
      stage("combine_send", s.stream, [&] { b.combine_send_forward(s); });
    } else if (config.fields().fuse_epilogues) {
      stage("w2_scatter", s.stream, [&] { b.w2_scatter(s); });
    } else {
      stage("w2_gemm", s.stream, [&] { b.w2_gemm(s); });
      stage("scatter_rows", s.stream, [&] { b.scatter_rows(s); });
    }
  }

  void barrier(void* stream, int channel) {
    stage("barrier", stream, [&] { transport->barrier_on_stream(stream, channel, budget, status); });
  }

  // On the CPU every stage has finished when the call returns: report errors right away.
  void check_if_synchronous() {
    if (backend->device().type != DeviceType::cpu) return;
    Status st = take_status();
    if (!st.ok()) throw_status(st);
  }

  Status take_status() { return take_status_word(*backend, status); }

};

std::unique_ptr<Context> Context::create(const Config& config, std::shared_ptr<Transport> transport) {
  EPMOE_CHECK_ARG(transport != nullptr, "transport", "a transport", "nullptr");
  auto impl = std::make_unique<Impl>(config);
  Impl& m = *impl;
  const int R = transport->size();
  m.plan = plan_memory(config, R);
  m.transport = std::move(transport);
  m.budget = std::chrono::milliseconds(config.fields().barrier_timeout_ms);
  m.dims = Dims{config.T(), config.D(), config.F(), config.K(), config.local_experts(R), R,
                config.fields().combine == CombineMode::per_rank};

  // Every rank must hold the same config.
  ConfigFingerprint mine = fingerprint(config, m.plan.slot_bytes);
  std::vector<ConfigFingerprint> all(R);
  m.transport->all_gather(&mine, all.data(), sizeof(mine), m.budget);
  for (int r = 0; r < R; ++r) {
    EPMOE_CHECK_ARG(std::memcmp(&all[r], &mine, sizeof(mine)) == 0, "Config",
                    "the same config on every rank (rank " + std::to_string(m.transport->rank()) +
                        ")", "a different config on rank " + std::to_string(r));
  }
  m.slot_geometry_bytes = slot_layout(m.dims, m.plan.recv_capacity_rows, m.plan.layers_per_slot);

  const Device device = m.transport->device();
  m.backend = device.type == DeviceType::cpu ? make_cpu_backend() : make_cuda_backend(device.index);
  m.backend->validate(config, R);
  m.places_saved_state = m.backend->places_saved_state();
  // plan_memory() already refused budgets below the minimum (every layer saves its input).
  EPMOE_CHECK_ARG(m.plan.inference || m.places_saved_state ||
                      m.plan.slot_bytes >= m.plan.maximum_useful_slot_bytes,
                  "Config.slots.slot_bytes",
                  ">= " + std::to_string(m.plan.maximum_useful_slot_bytes) + " on the " +
                      m.backend->name() + " backend (every layer saves everything)",
                  m.plan.slot_bytes);
  // At the maximum useful budget no layer can need a replay: the host leaves its stages out.
  m.may_recompute = !m.plan.inference && m.plan.slot_bytes < m.plan.maximum_useful_slot_bytes;

  m.routing = m.transport->allocate_symmetric(m.plan.routing_buffer_bytes, "routing");
  m.dispatch = m.transport->allocate_symmetric(m.plan.dispatch_buffer_bytes, "dispatch");
  m.combine = m.transport->allocate_symmetric(m.plan.combine_buffer_bytes, "combine");
  m.routing_R = m.peer_table<char>(m.routing);
  m.dispatch_R = m.peer_table<bf16_t>(m.dispatch);
  m.combine_R = m.peer_table<bf16_t>(m.combine);
  m.arena_memory.device_bytes = m.plan.arena_device_bytes;
  m.arena_memory.host_bytes = m.plan.arena_host_bytes;
  if (m.plan.host_backed_scratch) {
    const Backend::HostBacked a =
        m.backend->allocate_host_backed(static_cast<std::size_t>(m.plan.arena_device_bytes),
                                        static_cast<std::size_t>(m.plan.arena_host_bytes));
    m.arena = static_cast<char*>(a.ptr);
    m.arena_memory.device_held_bytes = static_cast<int64_t>(a.device_held_bytes);
    m.arena_memory.host_held_bytes = static_cast<int64_t>(a.host_held_bytes);
  } else {
    m.arena = static_cast<char*>(m.backend->allocate(m.plan.arena_bytes));
    m.arena_memory.device_held_bytes = m.plan.arena_bytes;
  }
  m.arena_memory.base = m.arena;
  m.status = static_cast<Status*>(m.backend->allocate(m.plan.status_bytes));
  if (m.plan.planner_state_bytes > 0) {  // zero-filled: every slot empty
    m.planner_state = static_cast<char*>(
        m.backend->allocate(static_cast<std::size_t>(m.plan.planner_state_bytes)));
  }
  m.slot_stack.resize(m.plan.num_slots);
  m.transport->barrier("context.create", m.budget);
  return std::unique_ptr<Context>(new Context(std::move(impl)));
}

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Context::~Context() {
  try {
    close();
  } catch (...) {
    // A destructor cannot report; close() explicitly to see errors.
  }
}

SavedLayer Context::forward(const ForwardArgs& a) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(!m.closed, "Context", "an open context", "a closed one");
  const int64_t tokens = validate_forward(a, m.config, m.plan.ep_size, m.backend->device());
  ++m.sequence;

  SavedLayer saved;
  if (a.save_for_backward) {
    std::vector<int64_t>& stack = m.slot_stack[a.slot];
    EPMOE_CHECK_ARG(static_cast<int>(stack.size()) < m.plan.layers_per_slot, "ForwardArgs.slot",
                    "a slot with room (Config.slots.max_layers_per_slot = " +
                        std::to_string(m.plan.layers_per_slot) + " layers)",
                    "slot " + std::to_string(a.slot) + " holding " + std::to_string(stack.size()));
    saved = SavedLayer{a.slot, static_cast<int>(stack.size()), m.sequence, tokens};
    stack.push_back(m.sequence);
  }

  Step s = m.base_step(tokens, a.stream);
  m.bind_layer_state(s, saved.slot, saved.layer);
  s.x_TD = a.x_TD.as<bf16_t>();
  s.num_tokens_1 = a.num_tokens_1.as<int32_t>();
  s.ids_TK = a.topk_ids_TK.data;
  s.ids_dtype = a.topk_ids_TK.dtype;
  s.scores_TK = a.topk_scores_TK.data;
  s.scores_dtype = a.topk_scores_TK.dtype;
  s.w13_EFD = a.w13_EFD.as<bf16_t>();
  s.w2_EDF = a.w2_EDF.as<bf16_t>();
  s.y_TD = a.y_TD.as<bf16_t>();

  Backend& b = *m.backend;
  const bool planned = a.save_for_backward && m.places_saved_state;
  bool slot_advanced = false;
  m.stage_times.clear();
  try {
    m.bind_weights(s, a.w13_EFD, a.w2_EDF, a.w13_prepared, a.w2_prepared);
    m.stage("publish_forward", s.stream, [&] { b.publish_forward(s); });
    m.barrier(a.stream, 0);
    m.stage("route", s.stream, [&] { b.route(s); });
    if (planned) {
      m.stage("plan_forward", s.stream, [&] { b.plan_forward(s); });
      slot_advanced = true;
      if (m.may_recompute) m.stage("save_input", s.stream, [&] { b.save_input(s); });
    }
    m.stage("dispatch", s.stream, [&] { b.dispatch(s); });
    m.expert_stages(b, s);
    m.barrier(a.stream, 1);
    m.stage("reduce_forward", s.stream, [&] { b.reduce_forward(s); });
    m.forward_stage_count = m.stage_times.size();
    m.check_if_synchronous();
  } catch (...) {
    if (a.save_for_backward) {
      m.slot_stack[a.slot].pop_back();
      if (slot_advanced) b.plan_backward(s);  // the layer never reaches its backward
    }
    throw;
  }
  return saved;
}

void Context::backward(const BackwardArgs& a) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(!m.closed, "Context", "an open context", "a closed one");
  validate_backward(a, m.config, m.plan.ep_size, m.backend->device());
  const SavedLayer& sv = a.saved;
  EPMOE_CHECK_ARG(sv.slot >= 0 && sv.slot < m.plan.num_slots, "BackwardArgs.saved.slot",
                  "a slot in [0, " + std::to_string(m.plan.num_slots) + ")", sv.slot);
  std::vector<int64_t>& stack = m.slot_stack[sv.slot];
  EPMOE_CHECK_ARG(!stack.empty() && sv.layer == static_cast<int>(stack.size()) - 1 &&
                      stack.back() == sv.step,
                  "BackwardArgs.saved",
                  "the most recent unfinished forward of slot " + std::to_string(sv.slot) +
                      " (backward runs layers in reverse)",
                  "layer " + std::to_string(sv.layer) + " of step " + std::to_string(sv.step));
  ++m.sequence;

  Step s = m.base_step(sv.tokens, a.stream);
  m.bind_layer_state(s, sv.slot, sv.layer);
  s.num_tokens_1 = a.num_tokens_1.as<int32_t>();
  s.ids_TK = a.topk_ids_TK.data;
  s.ids_dtype = a.topk_ids_TK.dtype;
  s.scores_TK = a.topk_scores_TK.data;
  s.scores_dtype = a.topk_scores_TK.dtype;
  s.w13_EFD = a.w13_EFD.as<bf16_t>();
  s.w2_EDF = a.w2_EDF.as<bf16_t>();
  s.grad_y_TD = a.grad_y_TD.as<bf16_t>();
  s.grad_x_TD = a.grad_x_TD.as<bf16_t>();
  s.grad_scores_TK = a.grad_scores_TK.as<float>();
  s.grad_w13_EFD = a.grad_w13_EFD.data;
  s.grad_w2_EDF = a.grad_w2_EDF.data;
  s.wgrad_dtype = m.config.fields().wgrad_dtype;
  s.accumulate_wgrad = a.accumulate_wgrad;
  m.bind_score_after_w2_dgrad(s);

  Backend& b = *m.backend;
  const bool fused = m.config.fields().fuse_epilogues;
  stack.pop_back();  // the layer is consumed whether or not the step was skipped
  m.stage_times.resize(m.forward_stage_count);
  m.bind_weights(s, a.w13_EFD, a.w2_EDF, a.w13_prepared, a.w2_prepared);
  if (m.places_saved_state) {
    m.stage("plan_backward", s.stream, [&] { b.plan_backward(s); });
  }
  if (m.places_saved_state && m.may_recompute) {
    // Replay of the forward for a layer that saved only its input: every launch is present
    // whatever the decision; replay_skip (the same on every rank) makes them no-ops otherwise.
    Step r = s;
    r.replay = true;
    m.stage("restore_input", r.stream, [&] { b.restore_input(r); });
    m.barrier(a.stream, 4);
    m.stage("replay_dispatch", r.stream, [&] { b.dispatch(r); });
    m.expert_stages(b, r);
    m.barrier(a.stream, 5);
  }
  m.stage("publish_backward", s.stream, [&] { b.publish_backward(s); });
  m.barrier(a.stream, 2);
  // The score enters after the W2 DGRAD (Step::row_scores_M): grad_h3 holds grad_y rows
  // unscaled, and grad_scores = <grad_y @ w2, h> is summed on the expert side from the DGRAD's
  // partials, into the owner's routing buffer, which reduce_backward copies into grad_scores.
  m.stage("gather_grad", s.stream, [&] { b.gather_grad(s); });
  if (fused) {
    m.stage("w2_dgrad_swiglu", s.stream, [&] { b.w2_dgrad_swiglu(s); });
  } else {
    m.stage("w2_dgrad", s.stream, [&] { b.w2_dgrad(s); });
    m.stage("swiglu_backward", s.stream, [&] { b.swiglu_backward(s); });
  }
  m.stage("grad_scores", s.stream, [&] { b.grad_scores(s); });
  m.stage("w2_wgrad", s.stream, [&] { b.w2_wgrad(s); });
  if (m.per_rank()) {
    m.stage("w13_dgrad", s.stream, [&] { b.w13_dgrad(s); });
    m.stage("combine_send", s.stream, [&] { b.combine_send_backward(s); });
  } else if (fused) {
    m.stage("w13_dgrad_scatter", s.stream, [&] { b.w13_dgrad_scatter(s); });
  } else {
    m.stage("w13_dgrad", s.stream, [&] { b.w13_dgrad(s); });
    m.stage("scatter_rows", s.stream, [&] { b.scatter_rows(s); });
  }
  m.stage("w13_wgrad", s.stream, [&] { b.w13_wgrad(s); });
  m.barrier(a.stream, 3);
  m.stage("reduce_backward", s.stream, [&] { b.reduce_backward(s); });
  m.check_if_synchronous();
}

bool Context::recomputes(const SavedLayer& saved) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(saved.slot >= 0 && saved.slot < m.plan.num_slots, "saved.slot",
                  "a slot in [0, " + std::to_string(m.plan.num_slots) + ")", saved.slot);
  EPMOE_CHECK_ARG(saved.layer >= 0 && saved.layer < m.plan.layers_per_slot, "saved.layer",
                  "a layer in [0, " + std::to_string(m.plan.layers_per_slot) + ")", saved.layer);
  if (!m.places_saved_state) return false;
  LayerPlan p;
  m.backend->synchronize(nullptr);
  m.backend->copy_to_host(&p, m.layer_metadata(saved.slot, saved.layer), sizeof(p));
  return p.recompute != 0;
}

int64_t Context::slot_peak_bytes(int slot) {
  Impl& m = *impl_;
  EPMOE_CHECK_ARG(slot >= 0 && slot < m.plan.num_slots, "slot",
                  "a slot in [0, " + std::to_string(m.plan.num_slots) + ")", slot);
  if (!m.places_saved_state) return m.plan.slot_bytes - m.slot_geometry_bytes.packed;
  SlotState st;
  m.backend->synchronize(nullptr);
  const PlannerStateLayout pl = planner_state_layout(m.plan.num_slots, m.dims.R);
  m.backend->copy_to_host(&st, m.planner_state + pl.states + slot * static_cast<int64_t>(sizeof(st)),
                          sizeof(st));
  return st.peak_bytes;
}

void Context::check() {
  Status st = impl_->take_status();
  if (!st.ok()) throw_status(st);
}

Status Context::take_status() { return impl_->take_status(); }

const Config& Context::config() const { return impl_->config; }
const MemoryPlan& Context::plan() const { return impl_->plan; }
int Context::rank() const { return impl_->transport->rank(); }
int Context::ep_size() const { return impl_->transport->size(); }
Backend& Context::backend() { return *impl_->backend; }
ArenaMemory Context::arena_memory() const { return impl_->arena_memory; }
void Context::set_stage_timing(bool on) { impl_->stage_timing = on; }
const std::vector<Context::StageTime>& Context::stage_times() const { return impl_->stage_times; }

void Context::close() {
  if (!impl_ || impl_->closed) return;
  Impl& m = *impl_;
  m.closed = true;
  m.backend->synchronize(nullptr);
  m.transport->barrier("context.close", m.budget);
  m.backend->release(m.routing_R);
  m.backend->release(m.dispatch_R);
  m.backend->release(m.combine_R);
  if (m.arena_memory.host_bytes > 0) {
    m.backend->release_host_backed(m.arena);
  } else {
    m.backend->release(m.arena);
  }
  m.backend->release(m.status);
  if (m.planner_state != nullptr) m.backend->release(m.planner_state);
  m.transport->release_symmetric(m.combine);
  m.transport->release_symmetric(m.dispatch);
  m.transport->release_symmetric(m.routing);
}

}  // namespace epmoe
