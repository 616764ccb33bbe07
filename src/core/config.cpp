// Config validation and printing. Every check names the ConfigFields member it is about and gives
// the expected and the actual value, so a bad config fails at construction, not inside a kernel.
#include "epmoe/config.h"

#include <charconv>
#include <cmath>
#include <string>

#include "epmoe/error.h"

namespace epmoe {

namespace {

// Shortest text that reads back to the same value ("1.1", not "1.1000000000000001").
template <class Float>
std::string number(Float v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

const char* activation_name(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::swiglu: return "swiglu";
    case ActivationKind::swiglu_clamped: return "swiglu_clamped";
  }
  return "invalid";
}

const char* overflow_name(OverflowPolicy policy) {
  switch (policy) {
    case OverflowPolicy::report: return "report";
    case OverflowPolicy::trap: return "trap";
  }
  return "invalid";
}

// Enum values can arrive as arbitrary integers through bindings; print them as numbers then.
template <class Enum>
std::string enum_value(Enum value) {
  return std::to_string(static_cast<int>(value));
}

void validate_activation(const Activation& a) {
  EPMOE_CHECK_ARG(a.kind == ActivationKind::swiglu || a.kind == ActivationKind::swiglu_clamped,
                  "Config.activation.kind", "swiglu or swiglu_clamped", enum_value(a.kind));
  if (a.kind != ActivationKind::swiglu_clamped) return;  // alpha / limit are unused by swiglu
  EPMOE_CHECK_ARG(std::isfinite(a.alpha) && a.alpha > 0.0f, "Config.activation.alpha",
                  "a finite value > 0", number(a.alpha));
  EPMOE_CHECK_ARG(std::isfinite(a.limit) && a.limit > 0.0f, "Config.activation.limit",
                  "a finite value > 0", number(a.limit));
}

void validate_precision(Precision p) {
  const bool known = p == Precision::bf16 || p == Precision::fp8_block || p == Precision::mxfp8 ||
                     p == Precision::nvfp4;
  EPMOE_CHECK_ARG(known, "Config.precision", "bf16, fp8_block, mxfp8 or nvfp4", enum_value(p));
}

void validate_slots(const ActivationSlots& s, bool inference) {
  if (inference) {
    // An inference context saves nothing, so a slot budget would be silently ignored.
    EPMOE_CHECK_ARG(!s.slot_bytes.has_value(), "Config.slots.slot_bytes",
                    "unset for an inference context (no activation slots)", *s.slot_bytes);
    EPMOE_CHECK_ARG(!s.slot_capacity_factor.has_value(), "Config.slots.slot_capacity_factor",
                    "unset for an inference context (no activation slots)",
                    number(*s.slot_capacity_factor));
    EPMOE_CHECK_ARG(s.num_slots >= 0, "Config.slots.num_slots",
                    ">= 0 (ignored by an inference context)", s.num_slots);
  } else {
    EPMOE_CHECK_ARG(s.num_slots >= 1, "Config.slots.num_slots",
                    ">= 1 (one per pipeline micro-batch in flight)", s.num_slots);
  }
  EPMOE_CHECK_ARG(s.max_layers_per_slot >= 1, "Config.slots.max_layers_per_slot", ">= 1",
                  s.max_layers_per_slot);
  EPMOE_CHECK_ARG(!(s.slot_bytes.has_value() && s.slot_capacity_factor.has_value()),
                  "Config.slots.slot_bytes",
                  "at most one of slot_bytes and slot_capacity_factor",
                  "both (slot_bytes = " + std::to_string(s.slot_bytes.value_or(0)) +
                      ", slot_capacity_factor = " + number(s.slot_capacity_factor.value_or(0)) +
                      ")");
  if (s.slot_bytes) {
    EPMOE_CHECK_ARG(*s.slot_bytes >= 0, "Config.slots.slot_bytes", ">= 0", *s.slot_bytes);
  }
  if (s.slot_capacity_factor) {
    const double f = *s.slot_capacity_factor;
    EPMOE_CHECK_ARG(std::isfinite(f) && f >= 0.0, "Config.slots.slot_capacity_factor",
                    "a finite value >= 0", number(f));
  }
}

}  // namespace

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp8_block: return "fp8_block";
    case Precision::mxfp8: return "mxfp8";
    case Precision::nvfp4: return "nvfp4";
  }
  return "invalid";
}

const char* to_string(Fp8Wgrad wgrad) {
  switch (wgrad) {
    case Fp8Wgrad::fp8: return "fp8";
    case Fp8Wgrad::bf16: return "bf16";
    case Fp8Wgrad::by_shape: return "by_shape";
  }
  return "invalid";
}

const char* to_string(CombineMode mode) {
  switch (mode) {
    case CombineMode::per_route: return "per_route";
    case CombineMode::per_rank: return "per_rank";
  }
  return "invalid";
}

Config::Config(const ConfigFields& fields) : f_(fields) {
  EPMOE_CHECK_ARG(f_.max_tokens_per_rank >= 1, "Config.max_tokens_per_rank", ">= 1",
                  f_.max_tokens_per_rank);
  EPMOE_CHECK_ARG(f_.hidden_dim >= 1, "Config.hidden_dim", ">= 1", f_.hidden_dim);
  EPMOE_CHECK_ARG(f_.intermediate_dim >= 1, "Config.intermediate_dim", ">= 1", f_.intermediate_dim);
  EPMOE_CHECK_ARG(f_.num_experts >= 1, "Config.num_experts", ">= 1", f_.num_experts);
  EPMOE_CHECK_ARG(f_.top_k >= 1 && f_.top_k <= f_.num_experts, "Config.top_k",
                  "a value in [1, " + std::to_string(f_.num_experts) + "] (Config.num_experts)",
                  f_.top_k);
  validate_activation(f_.activation);
  validate_precision(f_.precision);
  if (f_.precision == Precision::fp8_block) {
    // The received E4M3 rows and their scales live in the bf16 x_gathered space, which holds
    // them (alignment included) for every row count when D >= 4 (core/fp8_terms.h).
    EPMOE_CHECK_ARG(f_.hidden_dim >= 4, "Config.hidden_dim", ">= 4 with precision fp8_block",
                    f_.hidden_dim);
  }
  if (f_.precision == Precision::nvfp4) {
    // Weight-only NVFP4 inference: the caller's prepared weights, bf16 activations, no backward.
    EPMOE_CHECK_ARG(f_.inference, "Config.inference",
                    "true with precision nvfp4 (weight-only inference)", "false");
    EPMOE_CHECK_ARG(f_.prepared_weights, "Config.prepared_weights",
                    "true with precision nvfp4 (the caller prepares the NVFP4 weights)", "false");
  }
  if (f_.precision == Precision::mxfp8) {
    // MXFP8 inference (both backends): the caller's prepared weights, activations quantized 1x32.
    EPMOE_CHECK_ARG(f_.inference, "Config.inference",
                    "true with precision mxfp8 (inference only)", "false");
    EPMOE_CHECK_ARG(f_.prepared_weights, "Config.prepared_weights",
                    "true with precision mxfp8 (the caller prepares the MXFP8 weights)", "false");
  }
  EPMOE_CHECK_ARG(!f_.prepared_weights || f_.precision != Precision::bf16,
                  "Config.prepared_weights", "false with precision bf16 (bf16 weights are used as "
                  "given)", "true");
  EPMOE_CHECK_ARG(std::isfinite(f_.capacity_factor) && f_.capacity_factor > 0.0,
                  "Config.capacity_factor", "a finite value > 0", number(f_.capacity_factor));
  validate_slots(f_.slots, f_.inference);
  EPMOE_CHECK_ARG(f_.overflow == OverflowPolicy::report || f_.overflow == OverflowPolicy::trap,
                  "Config.overflow", "report or trap", enum_value(f_.overflow));
  const bool wgrad_ok = f_.wgrad_dtype == DType::bf16 || f_.wgrad_dtype == DType::f32;
  EPMOE_CHECK_ARG(wgrad_ok, "Config.wgrad_dtype", "bf16 or f32", epmoe::to_string(f_.wgrad_dtype));
  EPMOE_CHECK_ARG(f_.barrier_timeout_ms > 0, "Config.barrier_timeout_ms", "> 0",
                  f_.barrier_timeout_ms);
  const bool combine_ok =
      f_.combine == CombineMode::per_route || f_.combine == CombineMode::per_rank;
  EPMOE_CHECK_ARG(combine_ok, "Config.combine", "per_route or per_rank", enum_value(f_.combine));
  // The per-rank send sums bf16 rows, which the bf16 and FP8 GEMMs write; the weight-only formats
  // (nvfp4, mxfp8) have no per-rank tests and stay refused.
  if (f_.combine == CombineMode::per_rank) {
    const bool per_rank_ok =
        f_.precision == Precision::bf16 || f_.precision == Precision::fp8_block;
    EPMOE_CHECK_ARG(per_rank_ok, "Config.precision", "bf16 or fp8_block with combine per_rank",
                    epmoe::to_string(f_.precision));
  }
  const bool fp8_wgrad_ok = f_.fp8_wgrad == Fp8Wgrad::fp8 || f_.fp8_wgrad == Fp8Wgrad::bf16 ||
                            f_.fp8_wgrad == Fp8Wgrad::by_shape;
  EPMOE_CHECK_ARG(fp8_wgrad_ok, "Config.fp8_wgrad", "fp8, bf16 or by_shape",
                  enum_value(f_.fp8_wgrad));
  EPMOE_CHECK_ARG(f_.fp8_wgrad == kDefaultFp8Wgrad || f_.precision == Precision::fp8_block,
                  "Config.fp8_wgrad",
                  std::string(epmoe::to_string(kDefaultFp8Wgrad)) + " (the default) with precision " +
                      epmoe::to_string(f_.precision) + " (it chooses fp8_block's weight gradients)",
                  epmoe::to_string(f_.fp8_wgrad));
  if (f_.scratch_device_bytes) {
    EPMOE_CHECK_ARG(*f_.scratch_device_bytes >= 0, "Config.scratch_device_bytes",
                    ">= 0 (or unset: all scratch in device memory)", *f_.scratch_device_bytes);
  }
}

int Config::local_experts(int ep_size) const {
  EPMOE_CHECK_ARG(ep_size >= 1, "ep_size", ">= 1 rank", ep_size);
  EPMOE_CHECK_ARG(f_.num_experts % ep_size == 0, "Config.num_experts",
                  "a multiple of the EP size " + std::to_string(ep_size) +
                      " (every rank owns the same number of experts)",
                  f_.num_experts);
  return f_.num_experts / ep_size;
}

std::string Config::to_string() const {
  const ActivationSlots& s = f_.slots;
  std::string activation = activation_name(f_.activation.kind);
  if (f_.activation.kind == ActivationKind::swiglu_clamped) {
    activation += "(alpha=" + number(f_.activation.alpha) + ", limit=" + number(f_.activation.limit) +
                  ")";
  }
  return detail::concat(
      "Config{max_tokens_per_rank=", f_.max_tokens_per_rank, ", hidden_dim=", f_.hidden_dim,
      ", intermediate_dim=", f_.intermediate_dim, ", top_k=", f_.top_k,
      ", num_experts=", f_.num_experts, ", activation=", activation,
      ", precision=", epmoe::to_string(f_.precision),
      ", capacity_factor=", number(f_.capacity_factor),
      ", slots={num_slots=", s.num_slots, ", max_layers_per_slot=", s.max_layers_per_slot,
      ", slot_bytes=", s.slot_bytes ? std::to_string(*s.slot_bytes) : "unset",
      ", slot_capacity_factor=", s.slot_capacity_factor ? number(*s.slot_capacity_factor) : "unset",
      "}, overflow=", overflow_name(f_.overflow),
      ", wgrad_dtype=", epmoe::to_string(f_.wgrad_dtype),
      ", inference=", f_.inference ? "true" : "false",
      ", check_inputs=", f_.check_inputs ? "true" : "false",
      ", barrier_timeout_ms=", f_.barrier_timeout_ms,
      ", fuse_epilogues=", f_.fuse_epilogues ? "true" : "false",
      ", arrival_gated_w13=", f_.arrival_gated_w13 ? "true" : "false",
      ", prepared_weights=", f_.prepared_weights ? "true" : "false",
      ", scratch_device_bytes=",
      f_.scratch_device_bytes ? std::to_string(*f_.scratch_device_bytes) : "unset",
      ", combine=", epmoe::to_string(f_.combine),
      ", fp8_wgrad=", epmoe::to_string(f_.fp8_wgrad), "}");
}

}  // namespace epmoe
