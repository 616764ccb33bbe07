// Host ops: context lifecycle and the memory plan. Called eagerly from python/epmoe (never
// traced): they create or destroy state, or only read the config.
#include <torch/library.h>

#include <iomanip>
#include <limits>
#include <sstream>

#include "core/layout.h"
#include "epmoe/cuda.h"
#include "epmoe/memory_plan.h"
#include "epmoe/shm_transport.h"
#include "torch/errors.h"
#include "torch/registry.h"
#include "torch/tensors.h"

#ifdef EPMOE_TORCH_WITH_NCCL
#include "epmoe/nccl.h"
#endif

namespace epmoe::torch_binding {

namespace {

#ifdef EPMOE_TORCH_WITH_NCCL
std::string to_hex(const unsigned char* p, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

NcclUniqueId from_hex(const std::string& s) {
  NcclUniqueId id{};
  EPMOE_CHECK_ARG(s.size() == 2 * id.size(), "session",
                  std::to_string(2 * id.size()) + " hex digits (an NCCL unique id)", s.size());
  auto nibble = [&](char c) -> unsigned {
    if (c >= '0' && c <= '9') return static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<unsigned>(c - 'a' + 10);
    EPMOE_CHECK_ARG(false, "session", "hex digits", std::string(1, c));
  };
  for (std::size_t i = 0; i < id.size(); ++i) {
    id[i] = static_cast<unsigned char>(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1]));
  }
  return id;
}
#endif

// A fresh NCCL unique id as hex (rank 0 makes it; create_context broadcasts it over the group).
std::string nccl_id() {
  return guarded([&]() -> std::string {
#ifdef EPMOE_TORCH_WITH_NCCL
    const NcclUniqueId id = nccl_unique_id();
    return to_hex(id.data(), id.size());
#else
    EPMOE_EXPECT(false, backend, "transport", "epmoe built with the NCCL transport (epmoe_nccl)",
                 "a build without it");
#endif
  });
}

bool has_nccl() {
#ifdef EPMOE_TORCH_WITH_NCCL
  return true;
#else
  return false;
#endif
}

// transport: "local" (one CPU rank), "shm" (CPU ranks as processes), "cuda" (one GPU, EP = 1).
int64_t context_create(const std::string& config_text, const std::string& transport,
                       const std::string& session, int64_t rank, int64_t size, c10::Device device) {
  return guarded([&] {
    const Config config = parse_config(config_text);
    auto e = std::make_unique<Entry>();
    if (transport == "local") {
      e->group = std::make_shared<ThreadTransportGroup>(1);
      e->transport = e->group->transport(0);
    } else if (transport == "shm") {
      e->transport = make_shm_transport(session, static_cast<int>(rank), static_cast<int>(size));
    } else if (transport == "cuda") {
      e->transport = make_single_gpu_transport(device.index() < 0 ? 0 : device.index());
#ifdef EPMOE_TORCH_WITH_NCCL
    } else if (transport == "nccl") {  // session = the NCCL unique id, hex
      const NcclUniqueId id = from_hex(session);
      e->transport = make_nccl_transport(id.data(), id.size(), static_cast<int>(rank),
                                         static_cast<int>(size), device.index() < 0 ? 0 : device.index());
#endif
    } else {
      EPMOE_CHECK_ARG(false, "transport", has_nccl() ? "local, shm, cuda or nccl" : "local, shm or cuda",
                      "'" + transport + "'");
    }
    e->context = Context::create(config, e->transport);
    const MemoryPlan& plan = e->context->plan();
    e->saved.resize(static_cast<size_t>(plan.num_slots));
    return register_context(std::move(e));
  });
}

void context_close(int64_t id) {
  guarded([&] {
    std::shared_ptr<Entry> e = take_context(id);
    if (!e) return 0;
    std::lock_guard<std::mutex> lock(e->mu);
    if (e->layered) e->layered->close();
    e->context->close();
    return 0;
  });
}

void context_check(int64_t id) {
  guarded([&] {
    std::shared_ptr<Entry> e = find_context(id);
    std::lock_guard<std::mutex> lock(e->mu);
    if (e->layered) e->layered->check();
    e->context->check();
    return 0;
  });
}

// [capacity rows, layout int32 elements, offsets index, rows index, local experts, rank, ep size]
std::vector<int64_t> context_info(int64_t id) {
  return guarded([&] {
    std::shared_ptr<Entry> e = find_context(id);
    const MemoryPlan& p = e->context->plan();
    const LayoutBytes b = layout_bytes(p.recv_capacity_rows, p.tokens, p.top_k, p.experts_local,
                                       p.ep_size);
    return std::vector<int64_t>{p.recv_capacity_rows, b.total / 4, b.header / 4,
                                kLayoutRows, p.experts_local, e->context->rank(), p.ep_size};
  });
}

std::string plan_explain(const std::string& config_text, int64_t ep_size) {
  return guarded([&] { return plan_memory(parse_config(config_text), static_cast<int>(ep_size)).explain(); });
}

// explain_cuda_kernels (epmoe/cuda.h): the kernel each grouped GEMM runs on the CUDA backend.
std::string kernels_explain(const std::string& config_text, int64_t ep_size) {
  return guarded([&] { return explain_cuda_kernels(parse_config(config_text), static_cast<int>(ep_size)); });
}

const char* slot_sizing_name(SlotSizing s) {
  switch (s) {
    case SlotSizing::none: return "none";
    case SlotSizing::maximum_useful: return "maximum_useful";
    case SlotSizing::exact: return "exact";
    case SlotSizing::factor: return "factor";
  }
  return "unknown";
}

// Every field of the plan, in memory_plan.h's order, as "name=value" lines (python/epmoe/plan.py
// builds MemoryPlan from them). Doubles with max_digits10 digits, so Python reads the same double.
std::string plan_fields(const std::string& config_text, int64_t ep_size) {
  return guarded([&] {
    const MemoryPlan p = plan_memory(parse_config(config_text), static_cast<int>(ep_size));
    std::ostringstream os;
    os << std::setprecision(std::numeric_limits<double>::max_digits10) << std::boolalpha;
#define EPMOE_FIELD(name) os << #name << '=' << p.name << '\n'
    EPMOE_FIELD(ep_size); EPMOE_FIELD(tokens); EPMOE_FIELD(hidden); EPMOE_FIELD(intermediate);
    EPMOE_FIELD(top_k); EPMOE_FIELD(experts_global); EPMOE_FIELD(experts_local);
    EPMOE_FIELD(balanced_recv_rows); EPMOE_FIELD(max_recv_rows); EPMOE_FIELD(requested_capacity_factor);
    EPMOE_FIELD(capacity_factor); EPMOE_FIELD(recv_capacity_rows);
    EPMOE_FIELD(routing_buffer_bytes); EPMOE_FIELD(dispatch_buffer_bytes); EPMOE_FIELD(combine_buffer_bytes);
    EPMOE_FIELD(symmetric_bytes);
    EPMOE_FIELD(packing_granule_bytes); EPMOE_FIELD(routing_metadata_bytes); EPMOE_FIELD(layer_metadata_bytes);
    EPMOE_FIELD(saved_input_bytes_per_layer); EPMOE_FIELD(saved_full_bytes_balanced);
    EPMOE_FIELD(saved_full_bytes_capacity);
    EPMOE_FIELD(num_slots); EPMOE_FIELD(layers_per_slot); EPMOE_FIELD(slot_metadata_bytes);
    EPMOE_FIELD(minimum_slot_bytes); EPMOE_FIELD(balanced_full_save_slot_bytes);
    EPMOE_FIELD(maximum_useful_slot_bytes);
    os << "slot_sizing=" << slot_sizing_name(p.slot_sizing) << '\n';
    EPMOE_FIELD(slot_capacity_factor); EPMOE_FIELD(slot_bytes); EPMOE_FIELD(activation_bytes);
    EPMOE_FIELD(planner_state_bytes);
    EPMOE_FIELD(route_scratch_bytes); EPMOE_FIELD(call_scratch_pad_bytes);
    EPMOE_FIELD(forward_scratch_bytes); EPMOE_FIELD(backward_scratch_bytes);
    EPMOE_FIELD(fp8_scratch_bytes); EPMOE_FIELD(fp8_weight_scratch_bytes);
    EPMOE_FIELD(mxfp8_scratch_bytes); EPMOE_FIELD(scratch_bytes);
    EPMOE_FIELD(status_bytes); EPMOE_FIELD(peer_table_bytes); EPMOE_FIELD(arena_bytes); EPMOE_FIELD(total_bytes);
    EPMOE_FIELD(host_backed_scratch); EPMOE_FIELD(scratch_device_minimum_bytes);
    EPMOE_FIELD(scratch_device_bytes); EPMOE_FIELD(arena_device_bytes); EPMOE_FIELD(arena_host_bytes);
    EPMOE_FIELD(device_total_bytes);
    EPMOE_FIELD(inference);
    os << "precision=" << epmoe::to_string(p.precision) << '\n';
    os << "combine=" << epmoe::to_string(p.combine) << '\n';
    // Resolved (fp8 or bf16), then as requested (by_shape where the planner chose) and why:
    // every MemoryPlan field, in header order (tests/python/test_plan.py).
    os << "fp8_wgrad=" << epmoe::to_string(p.fp8_wgrad) << '\n';
    os << "fp8_wgrad_requested=" << epmoe::to_string(p.fp8_wgrad_requested) << '\n';
    os << "fp8_wgrad_reason=" << p.fp8_wgrad_reason << '\n';
#undef EPMOE_FIELD
    return os.str();
  });
}

int64_t cuda_devices() { return cuda_device_count(); }

}  // namespace

TORCH_LIBRARY(epmoe, m) {
  m.def("_context_create(str config, str transport, str session, int rank, int size, Device device) -> int",
        &context_create);
  m.def("_context_close(int context) -> ()", &context_close);
  m.def("_context_check(int context) -> ()", &context_check);
  m.def("_context_info(int context) -> int[]", &context_info);
  m.def("_plan_explain(str config, int ep_size) -> str", &plan_explain);
  m.def("_plan_fields(str config, int ep_size) -> str", &plan_fields);
  m.def("_kernels_explain(str config, int ep_size) -> str", &kernels_explain);
  m.def("_cuda_device_count() -> int", &cuda_devices);
  m.def("_nccl_unique_id() -> str", &nccl_id);
  m.def("_has_nccl() -> bool", &has_nccl);
}

}  // namespace epmoe::torch_binding
