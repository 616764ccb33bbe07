// The C ABI on the CPU backend: the slot budget fields of epmoe_config reach the planner, the
// plan's slot terms and a context's held memory read back, and a 4-layer stack in one slot
// reports the planner's decisions (every layer recomputes at the minimum budget, none at the
// balanced full save) with bitwise equal results (bench/bench_slots.py drives the same calls).
#include "epmoe/c_api.h"

#include <gtest/gtest.h>

#include <memory>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "epmoe/config.h"
#include "epmoe/context.h"
#include "epmoe/prepared_weights.h"
#include "epmoe/transport.h"

namespace {

constexpr int64_t kT = 16, kD = 64, kF = 32;
constexpr int32_t kK = 2, kExperts = 8;
constexpr int kLayers = 4;

epmoe_config stack_config(double factor) {
  epmoe_config c = epmoe_config_default(kT, kD, kF, kK, kExperts);
  c.layers_per_slot = kLayers;
  c.slot_capacity_factor = factor;
  return c;
}

epmoe_slot_plan plan_of(const epmoe_config& c) {
  epmoe_slot_plan p{};
  EXPECT_EQ(epmoe_plan_slots(&c, 1, &p), 0) << epmoe_last_error();
  return p;
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Random {
  uint64_t state;
  float uniform() {  // [0, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(state >> 40) / static_cast<float>(1ull << 24);
  }
};

std::vector<uint16_t> random_bf16(size_t n, float scale, Random& rng) {
  std::vector<uint16_t> v(n);
  for (auto& e : v) e = to_bf16(scale * (2.0f * rng.uniform() - 1.0f));
  return v;
}

// One layer's weights and routing (K distinct experts per token, scores in (0, 1)).
struct LayerInputs {
  std::vector<uint16_t> w13, w2;
  std::vector<int32_t> ids;
  std::vector<float> scores;
};

LayerInputs make_layer(uint64_t seed) {
  Random rng{seed};
  LayerInputs in;
  in.w13 = random_bf16(static_cast<size_t>(kExperts * 2 * kF * kD), 0.15f, rng);
  in.w2 = random_bf16(static_cast<size_t>(kExperts * kD * kF), 0.2f, rng);
  for (int64_t t = 0; t < kT; ++t) {
    const int32_t first = static_cast<int32_t>(rng.uniform() * kExperts) % kExperts;
    for (int32_t k = 0; k < kK; ++k) {
      in.ids.push_back((first + k * 3) % kExperts);
      in.scores.push_back(0.05f + 0.9f * rng.uniform());
    }
  }
  return in;
}

struct StackResult {
  std::vector<std::vector<uint16_t>> y, grad_x, grad_w13, grad_w2;  // [layer]
  std::vector<std::vector<float>> grad_scores;
  std::vector<int32_t> recomputed_before, recomputed_after;  // after forward / after backward
  int64_t slot_peak = 0;
  epmoe_context_memory memory{};
};

// Forward layers 0..3 (x_{l+1} = y_l), then backward 3..0 (the slot is LIFO).
StackResult run_stack(const epmoe_config& config) {
  StackResult r;
  epmoe_context* ctx = nullptr;
  EXPECT_EQ(epmoe_context_create_cpu(&config, &ctx), 0) << epmoe_last_error();
  if (ctx == nullptr) return r;
  std::vector<LayerInputs> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back(make_layer(11 + static_cast<uint64_t>(l)));
  Random rng{7};
  std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kT * kD), 1.0f, rng);
  const std::vector<uint16_t> grad_y_top = random_bf16(static_cast<size_t>(kT * kD), 1.0f, rng);
  r.y.assign(kLayers, std::vector<uint16_t>(static_cast<size_t>(kT * kD)));
  std::vector<epmoe_saved> saved(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    const LayerInputs& in = layers[static_cast<size_t>(l)];
    const void* x_l = l == 0 ? x.data() : r.y[static_cast<size_t>(l) - 1].data();
    epmoe_forward_args a{};
    a.x_TD = x_l;
    a.tokens = kT;
    a.topk_ids_TK = in.ids.data();
    a.topk_scores_TK = in.scores.data();
    a.w13_EFD = in.w13.data();
    a.w2_EDF = in.w2.data();
    a.y_TD = r.y[static_cast<size_t>(l)].data();
    a.save_for_backward = 1;
    EXPECT_EQ(epmoe_forward(ctx, &a, &saved[static_cast<size_t>(l)]), 0) << epmoe_last_error();
    int32_t rc = -1;
    EXPECT_EQ(epmoe_recomputes(ctx, &saved[static_cast<size_t>(l)], &rc), 0) << epmoe_last_error();
    r.recomputed_before.push_back(rc);
  }
  r.grad_x.assign(kLayers, std::vector<uint16_t>(static_cast<size_t>(kT * kD)));
  r.grad_w13.assign(kLayers, std::vector<uint16_t>(static_cast<size_t>(kExperts * 2 * kF * kD)));
  r.grad_w2.assign(kLayers, std::vector<uint16_t>(static_cast<size_t>(kExperts * kD * kF)));
  r.grad_scores.assign(kLayers, std::vector<float>(static_cast<size_t>(kT * kK)));
  for (int l = kLayers - 1; l >= 0; --l) {
    const size_t i = static_cast<size_t>(l);
    const LayerInputs& in = layers[i];
    epmoe_backward_args b{};
    b.saved = saved[i];
    b.grad_y_TD = l == kLayers - 1 ? grad_y_top.data() : r.grad_x[i + 1].data();
    b.topk_ids_TK = in.ids.data();
    b.topk_scores_TK = in.scores.data();
    b.w13_EFD = in.w13.data();
    b.w2_EDF = in.w2.data();
    b.grad_x_TD = r.grad_x[i].data();
    b.grad_scores_TK = r.grad_scores[i].data();
    b.grad_w13_EFD = r.grad_w13[i].data();
    b.grad_w2_EDF = r.grad_w2[i].data();
    EXPECT_EQ(epmoe_backward(ctx, &b), 0) << epmoe_last_error();
  }
  EXPECT_EQ(epmoe_check(ctx), 0) << epmoe_last_error();
  for (int l = 0; l < kLayers; ++l) {
    int32_t rc = -1;
    EXPECT_EQ(epmoe_recomputes(ctx, &saved[static_cast<size_t>(l)], &rc), 0) << epmoe_last_error();
    r.recomputed_after.push_back(rc);
  }
  EXPECT_EQ(epmoe_slot_peak_bytes(ctx, 0, &r.slot_peak), 0) << epmoe_last_error();
  EXPECT_EQ(epmoe_context_memory_held(ctx, &r.memory), 0) << epmoe_last_error();
  epmoe_context_destroy(ctx);
  return r;
}

TEST(CApi, DefaultLeavesTheSlotBudgetUnset) {
  const epmoe_config c = epmoe_config_default(kT, kD, kF, kK, kExperts);
  EXPECT_LT(c.slot_capacity_factor, 0.0);
  EXPECT_LT(c.slot_bytes, 0);
  const epmoe_slot_plan p = plan_of(c);
  EXPECT_EQ(p.slot_bytes, p.maximum_useful_slot_bytes);
  EXPECT_LT(p.minimum_slot_bytes, p.balanced_full_save_slot_bytes);
  EXPECT_LE(p.balanced_full_save_slot_bytes, p.maximum_useful_slot_bytes);
  EXPECT_EQ(p.activation_bytes, p.slot_bytes);  // one slot
  EXPECT_EQ(p.arena_bytes, p.activation_bytes + p.scratch_bytes);
  EXPECT_EQ(p.device_total_bytes, p.total_bytes);
}

TEST(CApi, SlotBudgetFieldsReachThePlan) {
  const epmoe_slot_plan minimum = plan_of(stack_config(0.0));
  EXPECT_EQ(minimum.slot_bytes, minimum.minimum_slot_bytes);
  const epmoe_slot_plan full = plan_of(stack_config(1.0));
  EXPECT_EQ(full.slot_bytes, full.balanced_full_save_slot_bytes);
  const epmoe_slot_plan half = plan_of(stack_config(0.5));
  EXPECT_GT(half.slot_bytes, half.minimum_slot_bytes);
  EXPECT_LT(half.slot_bytes, half.balanced_full_save_slot_bytes);
  epmoe_config exact = stack_config(-1.0);
  exact.slot_bytes = full.balanced_full_save_slot_bytes;  // a multiple of the packing granule
  EXPECT_EQ(plan_of(exact).slot_bytes, full.balanced_full_save_slot_bytes);
}

TEST(CApi, SlotBudgetErrorsNameTheField) {
  epmoe_config both = stack_config(0.5);
  both.slot_bytes = 1 << 20;
  epmoe_slot_plan p{};
  ASSERT_NE(epmoe_plan_slots(&both, 1, &p), 0);
  EXPECT_NE(std::string(epmoe_last_error()).find("Config.slots.slot_bytes"), std::string::npos)
      << epmoe_last_error();
  epmoe_config below = stack_config(-1.0);
  below.slot_bytes = 0;
  ASSERT_NE(epmoe_plan_slots(&below, 1, &p), 0);
  EXPECT_NE(std::string(epmoe_last_error()).find("slot_bytes"), std::string::npos)
      << epmoe_last_error();
  const epmoe_config nan = stack_config(std::nan(""));
  ASSERT_NE(epmoe_plan_slots(&nan, 1, &p), 0);
  EXPECT_NE(std::string(epmoe_last_error()).find("Config.slots.slot_capacity_factor"),
            std::string::npos)
      << epmoe_last_error();
  epmoe_context* ctx = nullptr;
  EXPECT_NE(epmoe_context_create_cpu(&both, &ctx), 0);
  EXPECT_EQ(ctx, nullptr);
}

TEST(CApi, StackRecomputesAtTheMinimumBudgetAndMatchesFullSaveBitwise) {
  const epmoe_config full_config = stack_config(1.0), minimum_config = stack_config(0.0);
  const StackResult full = run_stack(full_config), minimum = run_stack(minimum_config);
  EXPECT_EQ(full.recomputed_before, std::vector<int32_t>(kLayers, 0));
  EXPECT_EQ(full.recomputed_after, std::vector<int32_t>(kLayers, 0));
  EXPECT_EQ(minimum.recomputed_before, std::vector<int32_t>(kLayers, 1));
  EXPECT_EQ(minimum.recomputed_after, std::vector<int32_t>(kLayers, 1));
  for (int l = 0; l < kLayers; ++l) {
    const size_t i = static_cast<size_t>(l);
    EXPECT_EQ(full.y[i], minimum.y[i]) << "y of layer " << l;
    EXPECT_EQ(full.grad_x[i], minimum.grad_x[i]) << "grad_x of layer " << l;
    EXPECT_EQ(full.grad_scores[i], minimum.grad_scores[i]) << "grad_scores of layer " << l;
    EXPECT_EQ(full.grad_w13[i], minimum.grad_w13[i]) << "grad_w13 of layer " << l;
    EXPECT_EQ(full.grad_w2[i], minimum.grad_w2[i]) << "grad_w2 of layer " << l;
  }
  // Every route is live and EP = 1 receives all T*K of them: the balanced full save is exactly
  // what the full-save slot packs, and the minimum slot packs the four inputs.
  const epmoe_slot_plan pf = plan_of(full_config), pm = plan_of(minimum_config);
  EXPECT_EQ(full.slot_peak - minimum.slot_peak,
            pf.balanced_full_save_slot_bytes - pm.minimum_slot_bytes);
  for (const auto& [r, p] : {std::pair{&full, &pf}, std::pair{&minimum, &pm}}) {
    EXPECT_EQ(r->memory.device_bytes, p->arena_bytes);
    EXPECT_EQ(r->memory.device_held_bytes, p->arena_bytes);
    EXPECT_EQ(r->memory.host_bytes, 0);
    EXPECT_EQ(r->memory.host_held_bytes, 0);
    EXPECT_EQ(r->memory.other_device_bytes, p->total_bytes - p->arena_bytes);
  }
}

TEST(CApi, HalfBudgetRecomputesTheLaterLayers) {
  // Factor 0.5 leaves room for two full saves next to two inputs: the look-ahead saves layers 0
  // and 1 in full and recomputes 2 and 3.
  const StackResult half = run_stack(stack_config(0.5));
  EXPECT_EQ(half.recomputed_before, (std::vector<int32_t>{0, 0, 1, 1}));
}

// NVFP4 weight-only inference through the C ABI (precision 3, the prepared weights' codes, block
// scales and globals in epmoe_forward_args, no bf16 weights) equals the C++ API's forward on the
// same prepared weights, bitwise.
TEST(CApi, Nvfp4InferenceEqualsTheCppApi) {
  const LayerInputs in = make_layer(31);
  Random rng{9};
  const std::vector<uint16_t> x = random_bf16(static_cast<size_t>(kT * kD), 1.0f, rng);
  struct Nvfp4 {
    std::vector<uint8_t> q, scales;
    std::vector<float> global;
    epmoe::PreparedWeights view;
  };
  const auto prepare = [](const std::vector<uint16_t>& w, int64_t N, int64_t L) {
    auto p = std::make_unique<Nvfp4>();
    const epmoe::PreparedWeightShapes sh =
        epmoe::prepared_weight_shapes(epmoe::WeightFormat::nvfp4, kExperts, N, L);
    p->q.assign(static_cast<size_t>(sh.data.numel()), 0);
    p->scales.assign(static_cast<size_t>(sh.scales.numel()), 0);
    p->global.assign(static_cast<size_t>(kExperts), 0.0f);
    p->view = epmoe::PreparedWeights{epmoe::WeightFormat::nvfp4, kExperts, N, L, sh.data,
                                     sh.scales, sh.global_scale, {}, {}};
    p->view.data.data = p->q.data();
    p->view.scales.data = p->scales.data();
    p->view.global_scale.data = p->global.data();
    std::vector<uint16_t> copy = w;
    epmoe::prepare_weights(
        epmoe::TensorRef::contiguous(copy.data(), epmoe::DType::bf16, {kExperts, N, L}),
        p->view);
    return p;
  };
  const auto w13 = prepare(in.w13, 2 * kF, kD), w2 = prepare(in.w2, kD, kF);

  epmoe_config c = epmoe_config_default(kT, kD, kF, kK, kExperts);
  c.precision = 3;
  c.inference = 1;
  c.prepared_weights = 1;
  epmoe_context* ctx = nullptr;
  ASSERT_EQ(epmoe_context_create_cpu(&c, &ctx), 0) << epmoe_last_error();
  std::vector<uint16_t> y_c(static_cast<size_t>(kT * kD));
  epmoe_forward_args a{};
  a.x_TD = x.data();
  a.tokens = kT;
  a.topk_ids_TK = in.ids.data();
  a.topk_scores_TK = in.scores.data();
  a.y_TD = y_c.data();
  a.w13_q = w13->q.data();
  a.w13_block_scales = w13->scales.data();
  a.w13_global = w13->global.data();
  a.w2_q = w2->q.data();
  a.w2_block_scales = w2->scales.data();
  a.w2_global = w2->global.data();
  EXPECT_EQ(epmoe_forward(ctx, &a, nullptr), 0) << epmoe_last_error();
  EXPECT_EQ(epmoe_check(ctx), 0) << epmoe_last_error();
  epmoe_context_destroy(ctx);

  epmoe::ConfigFields f;
  f.max_tokens_per_rank = kT;
  f.hidden_dim = kD;
  f.intermediate_dim = kF;
  f.top_k = kK;
  f.num_experts = kExperts;
  f.precision = epmoe::Precision::nvfp4;
  f.inference = true;
  f.prepared_weights = true;
  epmoe::ThreadTransportGroup group(1);
  auto cpp = epmoe::Context::create(epmoe::Config(f), group.transport(0));
  std::vector<uint16_t> y_cpp(static_cast<size_t>(kT * kD));
  std::vector<int32_t> ids = in.ids;
  std::vector<float> scores = in.scores;
  std::vector<uint16_t> x_copy = x;
  epmoe::ForwardArgs fa;
  fa.x_TD = epmoe::TensorRef::contiguous(x_copy.data(), epmoe::DType::bf16, {kT, kD});
  fa.topk_ids_TK = epmoe::TensorRef::contiguous(ids.data(), epmoe::DType::i32, {kT, kK});
  fa.topk_scores_TK = epmoe::TensorRef::contiguous(scores.data(), epmoe::DType::f32, {kT, kK});
  fa.y_TD = epmoe::TensorRef::contiguous(y_cpp.data(), epmoe::DType::bf16, {kT, kD});
  fa.save_for_backward = false;
  fa.w13_prepared = &w13->view;
  fa.w2_prepared = &w2->view;
  cpp->forward(fa);
  cpp->close();
  EXPECT_EQ(y_c, y_cpp);
  bool nonzero = false;
  for (uint16_t v : y_c) nonzero = nonzero || (v & 0x7fffu) != 0;
  EXPECT_TRUE(nonzero) << "y is all zeros";
}

}  // namespace
