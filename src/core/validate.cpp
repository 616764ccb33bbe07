#include "core/validate.h"

#include <string>

#include "epmoe/error.h"

namespace epmoe {
namespace {

std::string dtypes_string(std::initializer_list<DType> dtypes) {
  std::string s;
  for (DType d : dtypes) s += (s.empty() ? "" : " or ") + std::string(to_string(d));
  return s;
}

void check_live_count(const TensorRef& t, const char* name, const Device& device) {
  if (t.data == nullptr) return;
  check_tensor(t, name, {DType::i32}, {1}, device);
}

int64_t check_rows(const TensorRef& x, const char* name, const Config& c) {
  EPMOE_CHECK_ARG(x.ndim == 2, name, "2 dimensions [T, D]", x.shape_string());
  EPMOE_CHECK_ARG(x.shape[0] >= 1 && x.shape[0] <= c.T(), name,
                  "T in [1, " + std::to_string(c.T()) + "] (Config.max_tokens_per_rank)", x.shape[0]);
  return x.shape[0];
}

// The format of the prepared weights a call reads: fp8_block_fp32 (FP8 training), nvfp4
// (weight-only inference), mxfp8 (MXFP8 inference).
WeightFormat prepared_format(const Config& c) {
  switch (c.fields().precision) {
    case Precision::nvfp4: return WeightFormat::nvfp4;
    case Precision::mxfp8: return WeightFormat::mxfp8;
    default: return WeightFormat::fp8_block_fp32;
  }
}

// Inference precisions that read only the prepared weights.
bool reads_only_prepared(const Config& c) {
  return c.fields().precision == Precision::nvfp4 || c.fields().precision == Precision::mxfp8;
}

// The prepared weights a call reads (Config.prepared_weights), or none. A backward (dgrad) also
// reads their transposed copies: its DGRADs run on them, and the memory plan holds no scratch to
// transpose into.
void check_prepared_args(const PreparedWeights* w13, const PreparedWeights* w2, const char* args,
                         const Config& c, int E, const Device& dev, bool dgrad) {
  const std::string n13 = std::string(args) + ".w13_prepared", n2 = std::string(args) + ".w2_prepared";
  if (!c.fields().prepared_weights) {
    const std::string why = "nullptr (Config.prepared_weights = false)";
    EPMOE_CHECK_ARG(w13 == nullptr, n13, why, "prepared weights");
    EPMOE_CHECK_ARG(w2 == nullptr, n2, why, "prepared weights");
    return;
  }
  const WeightFormat format = prepared_format(c);
  const std::string want =
      std::string(to_string(format)) + " prepared weights (Config.prepared_weights = true)";
  EPMOE_CHECK_ARG(w13 != nullptr, n13, want, "nullptr");
  EPMOE_CHECK_ARG(w2 != nullptr, n2, want, "nullptr");
  auto check = [&](const PreparedWeights& p, const std::string& name, int64_t N, int64_t L) {
    EPMOE_CHECK_ARG(p.format == format, name + ".format", to_string(format), to_string(p.format));
    const std::string shape = detail::concat("[", E, ", ", N, ", ", L, "]");
    const std::string got = detail::concat("[", p.G, ", ", p.N, ", ", p.L, "]");
    EPMOE_CHECK_ARG(p.G == E && p.N == N && p.L == L, name + ".G/N/L", shape, got);
    check_prepared_weights(p, name.c_str(), dev);
    EPMOE_CHECK_ARG(!dgrad || p.has_transposed(), name + ".data_t",
                    "the transposed copy (fp8_block backward with Config.prepared_weights: the "
                    "DGRADs read it; prepare_weights fills it)",
                    "nullptr");
  };
  check(*w13, n13, 2 * c.F(), c.D());
  check(*w2, n2, c.D(), c.F());
}

// The bf16 weights: required, except with nvfp4 and mxfp8, which read only the prepared weights
// (then they may be left empty, data == nullptr; given ones are still checked).
void check_bf16_weights(const TensorRef& w13_EFD, const TensorRef& w2_EDF, const Config& c, int E,
                        const Device& dev) {
  const bool optional = reads_only_prepared(c);
  if (!optional || w13_EFD.data != nullptr) {
    check_tensor(w13_EFD, "w13_EFD", {DType::bf16}, {E, 2 * c.F(), c.D()}, dev);
  }
  if (!optional || w2_EDF.data != nullptr) {
    check_tensor(w2_EDF, "w2_EDF", {DType::bf16}, {E, c.D(), c.F()}, dev);
  }
}

}  // namespace

void check_tensor(const TensorRef& t, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape, const Device& device) {
  EPMOE_CHECK_ARG(t.data != nullptr, name, "a non-null data pointer", "nullptr");
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok |= t.dtype == d;
  EPMOE_CHECK_ARG(dtype_ok, name, "dtype " + dtypes_string(dtypes), to_string(t.dtype));
  TensorRef want;
  want.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t v : shape) want.shape[i++] = v;
  bool shape_ok = t.ndim == want.ndim;
  for (int d = 0; shape_ok && d < t.ndim; ++d) shape_ok = t.shape[d] == want.shape[d];
  EPMOE_CHECK_ARG(shape_ok, name, "shape " + want.shape_string(), t.shape_string());
  EPMOE_CHECK_ARG(t.is_contiguous(), name, "contiguous strides", t.stride_string());
  EPMOE_CHECK_ARG(t.device == device, name, "device " + to_string(device), to_string(t.device));
}

int64_t validate_forward(const ForwardArgs& a, const Config& c, int ep_size, const Device& dev) {
  const int64_t T = check_rows(a.x_TD, "x_TD", c);
  const int E = c.local_experts(ep_size);
  check_tensor(a.x_TD, "x_TD", {DType::bf16}, {T, c.D()}, dev);
  check_live_count(a.num_tokens_1, "num_tokens_1", dev);
  check_tensor(a.topk_ids_TK, "topk_ids_TK", {DType::i32, DType::i64}, {T, c.K()}, dev);
  check_tensor(a.topk_scores_TK, "topk_scores_TK", {DType::f32, DType::bf16}, {T, c.K()}, dev);
  check_bf16_weights(a.w13_EFD, a.w2_EDF, c, E, dev);
  check_tensor(a.y_TD, "y_TD", {DType::bf16}, {T, c.D()}, dev);
  check_prepared_args(a.w13_prepared, a.w2_prepared, "ForwardArgs", c, E, dev, false);
  EPMOE_CHECK_ARG(!(a.save_for_backward && c.fields().inference), "ForwardArgs.save_for_backward",
                  "false for an inference context", "true");
  const int slots = c.fields().inference ? 0 : c.fields().slots.num_slots;
  EPMOE_CHECK_ARG(!a.save_for_backward || (a.slot >= 0 && a.slot < slots), "ForwardArgs.slot",
                  "a slot in [0, " + std::to_string(slots) + ")", a.slot);
  return T;
}

void validate_backward(const BackwardArgs& a, const Config& c, int ep_size, const Device& dev) {
  EPMOE_CHECK_ARG(!reads_only_prepared(c), "Config.precision",
                  "bf16 or fp8_block for backward (nvfp4 and mxfp8 are inference, forward only)",
                  to_string(c.fields().precision));
  EPMOE_CHECK_ARG(!c.fields().inference, "Context", "a training context for backward",
                  "an inference context");
  const int64_t T = check_rows(a.grad_y_TD, "grad_y_TD", c);
  EPMOE_CHECK_ARG(T == a.saved.tokens, "grad_y_TD", "T = " + std::to_string(a.saved.tokens) +
                  " rows (as in the forward)", T);
  const int E = c.local_experts(ep_size);
  const DType wg = c.fields().wgrad_dtype;
  check_tensor(a.grad_y_TD, "grad_y_TD", {DType::bf16}, {T, c.D()}, dev);
  check_live_count(a.num_tokens_1, "num_tokens_1", dev);
  check_tensor(a.topk_ids_TK, "topk_ids_TK", {DType::i32, DType::i64}, {T, c.K()}, dev);
  check_tensor(a.topk_scores_TK, "topk_scores_TK", {DType::f32, DType::bf16}, {T, c.K()}, dev);
  check_tensor(a.w13_EFD, "w13_EFD", {DType::bf16}, {E, 2 * c.F(), c.D()}, dev);
  check_tensor(a.w2_EDF, "w2_EDF", {DType::bf16}, {E, c.D(), c.F()}, dev);
  check_tensor(a.grad_x_TD, "grad_x_TD", {DType::bf16}, {T, c.D()}, dev);
  check_tensor(a.grad_scores_TK, "grad_scores_TK", {DType::f32}, {T, c.K()}, dev);
  check_tensor(a.grad_w13_EFD, "grad_w13_EFD", {wg}, {E, 2 * c.F(), c.D()}, dev);
  check_tensor(a.grad_w2_EDF, "grad_w2_EDF", {wg}, {E, c.D(), c.F()}, dev);
  check_prepared_args(a.w13_prepared, a.w2_prepared, "BackwardArgs", c, E, dev, true);
}

}  // namespace epmoe
