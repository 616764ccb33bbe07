#include "torch/registry.h"

#include <cstdlib>
#include <map>
#include <sstream>

#include "epmoe/error.h"

namespace epmoe::torch_binding {

namespace {

std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<Entry>> registry;
int64_t next_id = 1;

double number(const std::string& key, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  EPMOE_CHECK_ARG(end != v.c_str() && *end == '\0', "Config." + key, "a number", "'" + v + "'");
  return x;
}

}  // namespace

Layered& Entry::layered_api() {
  if (!layered) layered = Layered::create(*context, transport);
  return *layered;
}

Config parse_config(const std::string& text) {
  ConfigFields f;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (item.empty()) continue;
    const auto eq = item.find('=');
    EPMOE_CHECK_ARG(eq != std::string::npos, "config", "key=value", "'" + item + "'");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "activation") {
      EPMOE_CHECK_ARG(v == "swiglu" || v == "swiglu_clamped", "Config.activation",
                      "'swiglu' or 'swiglu_clamped'", "'" + v + "'");
      f.activation.kind = v == "swiglu" ? ActivationKind::swiglu : ActivationKind::swiglu_clamped;
    } else if (k == "wgrad_dtype") {
      EPMOE_CHECK_ARG(v == "bf16" || v == "f32", "Config.wgrad_dtype", "bf16 or f32", v);
      f.wgrad_dtype = v == "bf16" ? DType::bf16 : DType::f32;
    } else if (k == "precision") {
      EPMOE_CHECK_ARG(v == "bf16" || v == "fp8_block", "Config.precision",
                      "'bf16' or 'fp8_block' (nvfp4 needs prepared weights, not exposed to Python yet)",
                      "'" + v + "'");
      f.precision = v == "bf16" ? Precision::bf16 : Precision::fp8_block;
    } else if (k == "fp8_wgrad") {
      EPMOE_CHECK_ARG(v == "fp8" || v == "bf16" || v == "by_shape", "Config.fp8_wgrad",
                      "'fp8', 'bf16' or 'by_shape'", "'" + v + "'");
      f.fp8_wgrad = v == "fp8"    ? Fp8Wgrad::fp8
                    : v == "bf16" ? Fp8Wgrad::bf16
                                  : Fp8Wgrad::by_shape;
    } else if (k == "combine") {
      EPMOE_CHECK_ARG(v == "per_route" || v == "per_rank", "Config.combine",
                      "'per_route' or 'per_rank'", "'" + v + "'");
      f.combine = v == "per_route" ? CombineMode::per_route : CombineMode::per_rank;
    } else if (k == "overflow") {
      EPMOE_CHECK_ARG(v == "report" || v == "trap", "Config.overflow", "report or trap", v);
      f.overflow = v == "report" ? OverflowPolicy::report : OverflowPolicy::trap;
    } else {
      const double x = number(k, v);
      if (k == "max_tokens_per_rank") f.max_tokens_per_rank = static_cast<int64_t>(x);
      else if (k == "hidden_dim") f.hidden_dim = static_cast<int64_t>(x);
      else if (k == "intermediate_dim") f.intermediate_dim = static_cast<int64_t>(x);
      else if (k == "top_k") f.top_k = static_cast<int>(x);
      else if (k == "num_experts") f.num_experts = static_cast<int>(x);
      else if (k == "swiglu_alpha") f.activation.alpha = static_cast<float>(x);
      else if (k == "swiglu_limit") f.activation.limit = static_cast<float>(x);
      else if (k == "capacity_factor") f.capacity_factor = x;
      else if (k == "num_activation_slots") f.slots.num_slots = static_cast<int>(x);
      else if (k == "max_layers_per_slot") f.slots.max_layers_per_slot = static_cast<int>(x);
      else if (k == "activation_slot_bytes") f.slots.slot_bytes = static_cast<int64_t>(x);
      else if (k == "activation_slot_capacity_factor") f.slots.slot_capacity_factor = x;
      else if (k == "inference") f.inference = x != 0;
      else if (k == "check_inputs") f.check_inputs = x != 0;
      else if (k == "barrier_timeout_ms") f.barrier_timeout_ms = static_cast<int>(x);
      else if (k == "fuse_epilogues") f.fuse_epilogues = x != 0;
      else if (k == "arrival_gated_w13") f.arrival_gated_w13 = x != 0;
      else if (k == "scratch_device_bytes") f.scratch_device_bytes = static_cast<int64_t>(x);
      else EPMOE_CHECK_ARG(false, "config", "a known Config field", "'" + k + "'");
    }
  }
  return Config(f);
}

int64_t register_context(std::unique_ptr<Entry> entry) {
  std::lock_guard<std::mutex> lock(registry_mu);
  const int64_t id = next_id++;
  registry.emplace(id, std::shared_ptr<Entry>(std::move(entry)));
  return id;
}

std::shared_ptr<Entry> find_context(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(id);
  EPMOE_CHECK_ARG(it != registry.end(), "context",
                  "an open context (create_context)", "id " + std::to_string(id) + " (closed or unknown)");
  return it->second;
}

std::shared_ptr<Entry> take_context(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(id);
  if (it == registry.end()) return nullptr;
  std::shared_ptr<Entry> e = std::move(it->second);
  registry.erase(it);
  return e;
}

}  // namespace epmoe::torch_binding
