// Config validation: every invalid field throws epmoe::Error naming the field, with the expected
// and the actual value in the message; valid configs construct and print every field.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "epmoe/config.h"
#include "epmoe/error.h"

namespace epmoe {
namespace {

// ci-tiny: T=64, D=128, F=96, 8 experts, top-2.
ConfigFields tiny() {
  ConfigFields f;
  f.max_tokens_per_rank = 64;
  f.hidden_dim = 128;
  f.intermediate_dim = 96;
  f.num_experts = 8;
  f.top_k = 2;
  return f;
}

// Runs fn, which must throw an invalid_argument Error about `field` whose message holds `got`.
void expect_field_error(const std::function<void()>& fn, const std::string& field,
                        const std::string& got) {
  try {
    fn();
    ADD_FAILURE() << "no error for " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), field) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("expected "), std::string::npos) << what;
    EXPECT_NE(what.find(", got " + got), std::string::npos) << what;
  }
}

void expect_config_error(const ConfigFields& f, const std::string& field, const std::string& got) {
  expect_field_error([&] { Config c(f); }, field, got);
}

TEST(Config, ValidConfigKeepsItsFields) {
  Config c(tiny());
  EXPECT_EQ(c.T(), 64);
  EXPECT_EQ(c.D(), 128);
  EXPECT_EQ(c.F(), 96);
  EXPECT_EQ(c.K(), 2);
  EXPECT_EQ(c.num_experts(), 8);
  EXPECT_EQ(c.fields().capacity_factor, 1.0);
}

TEST(Config, RejectsNonPositiveSizes) {
  ConfigFields f = tiny();
  f.max_tokens_per_rank = 0;
  expect_config_error(f, "Config.max_tokens_per_rank", "0");
  f = tiny();
  f.max_tokens_per_rank = -5;
  expect_config_error(f, "Config.max_tokens_per_rank", "-5");
  f = tiny();
  f.hidden_dim = 0;
  expect_config_error(f, "Config.hidden_dim", "0");
  f = tiny();
  f.intermediate_dim = -1;
  expect_config_error(f, "Config.intermediate_dim", "-1");
  f = tiny();
  f.num_experts = 0;
  expect_config_error(f, "Config.num_experts", "0");
}

TEST(Config, TopKMustBeWithinTheExperts) {
  ConfigFields f = tiny();
  f.top_k = 0;
  expect_config_error(f, "Config.top_k", "0");
  f.top_k = 9;
  expect_config_error(f, "Config.top_k", "9");
  try {
    Config c(f);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[1, 8]"), std::string::npos) << e.what();
  }
  f.top_k = 8;  // every expert: allowed
  EXPECT_NO_THROW(Config c(f));
}

TEST(Config, ClampedActivationNeedsFinitePositiveAlphaAndLimit) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ConfigFields f = tiny();
  f.activation = Activation::swiglu_clamped(0.0f, 7.0f);
  expect_config_error(f, "Config.activation.alpha", "0");
  f.activation = Activation::swiglu_clamped(nan, 7.0f);
  expect_config_error(f, "Config.activation.alpha", "nan");
  f.activation = Activation::swiglu_clamped(1.702f, -1.0f);
  expect_config_error(f, "Config.activation.limit", "-1");
  f.activation = Activation::swiglu_clamped(1.702f, inf);
  expect_config_error(f, "Config.activation.limit", "inf");
  f.activation = Activation::swiglu_clamped();
  EXPECT_NO_THROW(Config c(f));
  // Plain SwiGLU ignores alpha and limit.
  f.activation = Activation{ActivationKind::swiglu, nan, -1.0f};
  EXPECT_NO_THROW(Config c(f));
  f.activation.kind = static_cast<ActivationKind>(5);
  expect_config_error(f, "Config.activation.kind", "5");
}

TEST(Config, Bf16Fp8BlockMxfp8AndNvfp4AreAvailable) {
  ConfigFields f = tiny();
  f.precision = Precision::fp8_block;
  EXPECT_NO_THROW(Config c(f));
  f.precision = static_cast<Precision>(9);
  expect_config_error(f, "Config.precision", "9");
}

// NVFP4 is weight-only inference from the caller's prepared weights.
TEST(Config, Nvfp4NeedsInferenceAndPreparedWeights) {
  ConfigFields f = tiny();
  f.precision = Precision::nvfp4;
  f.prepared_weights = true;
  expect_config_error(f, "Config.inference", "false");
  f.inference = true;
  EXPECT_NO_THROW(Config c(f));
  f.prepared_weights = false;
  expect_config_error(f, "Config.prepared_weights", "false");
}

// MXFP8 is inference from the caller's prepared weights; any D (partial last blocks).
TEST(Config, Mxfp8NeedsInferenceAndPreparedWeights) {
  ConfigFields f = tiny();
  f.precision = Precision::mxfp8;
  f.prepared_weights = true;
  expect_config_error(f, "Config.inference", "false");
  f.inference = true;
  EXPECT_NO_THROW(Config c(f));
  f.hidden_dim = 33;
  EXPECT_NO_THROW(Config c(f));
  f.prepared_weights = false;
  expect_config_error(f, "Config.prepared_weights", "false");
}

TEST(Config, Fp8BlockLimits) {
  ConfigFields f = tiny();
  f.precision = Precision::fp8_block;
  f.hidden_dim = 3;  // the received rows (D codes + 4-byte scales) must fit the bf16 row space
  expect_config_error(f, "Config.hidden_dim", "3");
  f.hidden_dim = 4;
  EXPECT_NO_THROW(Config c(f));
  f.inference = true;  // the FP8 forward alone (inference contexts)
  EXPECT_NO_THROW(Config c(f));
  f.inference = false;
  f.prepared_weights = true;
  EXPECT_NO_THROW(Config c(f));
  f.precision = Precision::bf16;
  expect_config_error(f, "Config.prepared_weights", "true");
}

// The per-rank combine runs with bf16 and fp8_block (training and inference, prepared weights or
// not); the weight-only formats refuse it naming Config.precision.
TEST(Config, PerRankCombineWithBf16AndFp8Block) {
  ConfigFields f = tiny();
  f.combine = CombineMode::per_rank;
  EXPECT_NO_THROW(Config c(f));
  f.precision = Precision::fp8_block;
  for (bool inference : {false, true}) {
    for (bool prepared : {false, true}) {
      f.inference = inference;
      f.prepared_weights = prepared;
      EXPECT_NO_THROW(Config c(f)) << "inference " << inference << " prepared " << prepared;
    }
  }
  f.inference = true;
  f.prepared_weights = true;
  f.precision = Precision::nvfp4;
  expect_config_error(f, "Config.precision", "nvfp4");
  f.precision = Precision::mxfp8;
  expect_config_error(f, "Config.precision", "mxfp8");
  f.combine = CombineMode::per_route;
  EXPECT_NO_THROW(Config c(f));
}

// Config.fp8_wgrad chooses fp8_block training's weight gradients: fp8 or bf16 with fp8_block
// (training or inference, prepared weights or not); any precision with the default, by_shape; a
// value outside the enum, or fp8 / bf16 with another precision, refused naming the field.
TEST(Config, Fp8WgradOnlyWithFp8Block) {
  ConfigFields f = tiny();
  EXPECT_EQ(f.fp8_wgrad, Fp8Wgrad::by_shape);
  EXPECT_EQ(kDefaultFp8Wgrad, Fp8Wgrad::by_shape);
  EXPECT_NO_THROW(Config c(f));
  for (Fp8Wgrad explicit_wgrad : {Fp8Wgrad::fp8, Fp8Wgrad::bf16}) {
    f.precision = Precision::bf16;
    f.inference = f.prepared_weights = false;
    f.fp8_wgrad = explicit_wgrad;
    expect_config_error(f, "Config.fp8_wgrad", to_string(explicit_wgrad));
    f.precision = Precision::fp8_block;
    for (bool inference : {false, true}) {
      for (bool prepared : {false, true}) {
        f.inference = inference;
        f.prepared_weights = prepared;
        EXPECT_NO_THROW(Config c(f)) << to_string(explicit_wgrad) << " inference " << inference
                                     << " prepared " << prepared;
      }
    }
    f.precision = Precision::mxfp8;
    expect_config_error(f, "Config.fp8_wgrad", to_string(explicit_wgrad));
    f.precision = Precision::nvfp4;
    expect_config_error(f, "Config.fp8_wgrad", to_string(explicit_wgrad));
  }
  f.fp8_wgrad = Fp8Wgrad::by_shape;
  EXPECT_NO_THROW(Config c(f));  // nvfp4 inference with the default
  f.precision = Precision::fp8_block;
  f.fp8_wgrad = static_cast<Fp8Wgrad>(7);
  expect_config_error(f, "Config.fp8_wgrad", "7");
  f.fp8_wgrad = Fp8Wgrad::bf16;
  EXPECT_NE(Config(f).to_string().find("fp8_wgrad=bf16"), std::string::npos);
  EXPECT_STREQ(to_string(Fp8Wgrad::fp8), "fp8");
  EXPECT_STREQ(to_string(Fp8Wgrad::bf16), "bf16");
  EXPECT_STREQ(to_string(Fp8Wgrad::by_shape), "by_shape");
}

TEST(Config, PrecisionNames) {
  EXPECT_STREQ(to_string(Precision::bf16), "bf16");
  EXPECT_STREQ(to_string(Precision::fp8_block), "fp8_block");
  EXPECT_STREQ(to_string(Precision::mxfp8), "mxfp8");
  EXPECT_STREQ(to_string(Precision::nvfp4), "nvfp4");
}

TEST(Config, CapacityFactorFinitePositive) {
  ConfigFields f = tiny();
  f.capacity_factor = 0.0;
  expect_config_error(f, "Config.capacity_factor", "0");
  f.capacity_factor = -1.5;
  expect_config_error(f, "Config.capacity_factor", "-1.5");
  f.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  expect_config_error(f, "Config.capacity_factor", "nan");
  f.capacity_factor = std::numeric_limits<double>::infinity();
  expect_config_error(f, "Config.capacity_factor", "inf");
  f.capacity_factor = 100.0;  // clamped later by the planner, not an error
  EXPECT_NO_THROW(Config c(f));
}

TEST(Config, SlotControls) {
  ConfigFields f = tiny();
  f.slots.num_slots = 0;
  expect_config_error(f, "Config.slots.num_slots", "0");
  f = tiny();
  f.slots.max_layers_per_slot = 0;
  expect_config_error(f, "Config.slots.max_layers_per_slot", "0");
  f = tiny();
  f.slots.slot_bytes = 4096;
  f.slots.slot_capacity_factor = 0.5;
  expect_config_error(f, "Config.slots.slot_bytes", "both");
  f = tiny();
  f.slots.slot_bytes = -1;
  expect_config_error(f, "Config.slots.slot_bytes", "-1");
  f.slots.slot_bytes = 0;  // allowed here; the planner checks it against the minimum
  EXPECT_NO_THROW(Config c(f));
  f = tiny();
  f.slots.slot_capacity_factor = -0.25;
  expect_config_error(f, "Config.slots.slot_capacity_factor", "-0.25");
  f.slots.slot_capacity_factor = std::numeric_limits<double>::infinity();
  expect_config_error(f, "Config.slots.slot_capacity_factor", "inf");
  f.slots.slot_capacity_factor = 0.0;
  EXPECT_NO_THROW(Config c(f));
  f.slots.slot_capacity_factor = 2.5;  // above balanced: allowed
  EXPECT_NO_THROW(Config c(f));
}

TEST(Config, InferenceMustNotSetSlotControls) {
  ConfigFields f = tiny();
  f.inference = true;
  f.slots.num_slots = 0;  // no slots: fine for inference
  EXPECT_NO_THROW(Config c(f));
  f.slots.slot_bytes = 1 << 20;
  expect_config_error(f, "Config.slots.slot_bytes", "1048576");
  f.slots.slot_bytes.reset();
  f.slots.slot_capacity_factor = 1.0;
  expect_config_error(f, "Config.slots.slot_capacity_factor", "1");
  f.slots.slot_capacity_factor.reset();
  f.slots.num_slots = -1;
  expect_config_error(f, "Config.slots.num_slots", "-1");
}

TEST(Config, WgradDtype) {
  ConfigFields f = tiny();
  f.wgrad_dtype = DType::f32;
  EXPECT_NO_THROW(Config c(f));
  f.wgrad_dtype = DType::f16;
  expect_config_error(f, "Config.wgrad_dtype", "f16");
  f.wgrad_dtype = DType::f64;
  expect_config_error(f, "Config.wgrad_dtype", "f64");
}

TEST(Config, OverflowPolicyAndBarrierTimeout) {
  ConfigFields f = tiny();
  f.overflow = static_cast<OverflowPolicy>(3);
  expect_config_error(f, "Config.overflow", "3");
  f = tiny();
  f.barrier_timeout_ms = 0;
  expect_config_error(f, "Config.barrier_timeout_ms", "0");
  f.barrier_timeout_ms = -100;
  expect_config_error(f, "Config.barrier_timeout_ms", "-100");
}

TEST(Config, ScratchDeviceBytes) {
  ConfigFields f = tiny();
  EXPECT_FALSE(Config(f).fields().scratch_device_bytes.has_value());  // default: all device
  f.scratch_device_bytes = 0;
  EXPECT_EQ(Config(f).fields().scratch_device_bytes, 0);
  f.scratch_device_bytes = 4096;
  EXPECT_NE(Config(f).to_string().find("scratch_device_bytes=4096"), std::string::npos);
  f.scratch_device_bytes = -1;
  expect_config_error(f, "Config.scratch_device_bytes", "-1");
}

TEST(Config, LocalExperts) {
  Config c(tiny());
  EXPECT_EQ(c.local_experts(1), 8);
  EXPECT_EQ(c.local_experts(2), 4);
  EXPECT_EQ(c.local_experts(8), 1);
  expect_field_error([&] { (void)c.local_experts(3); }, "Config.num_experts", "8");
  expect_field_error([&] { (void)c.local_experts(16); }, "Config.num_experts", "8");
  expect_field_error([&] { (void)c.local_experts(0); }, "ep_size", "0");
}

TEST(Config, ToStringListsEveryField) {
  ConfigFields f = tiny();
  f.activation = Activation::swiglu_clamped(1.702f, 7.0f);
  f.capacity_factor = 1.25;
  f.slots.num_slots = 3;
  f.slots.max_layers_per_slot = 4;
  f.slots.slot_capacity_factor = 0.5;
  f.wgrad_dtype = DType::f32;
  f.overflow = OverflowPolicy::trap;
  f.fuse_epilogues = false;
  f.arrival_gated_w13 = true;
  const std::string s = Config(f).to_string();
  EXPECT_EQ(s.find('\n'), std::string::npos) << s;
  for (const char* part :
       {"max_tokens_per_rank=64", "hidden_dim=128", "intermediate_dim=96", "top_k=2",
        "num_experts=8", "activation=swiglu_clamped(alpha=1.702, limit=7)", "precision=bf16",
        "capacity_factor=1.25", "num_slots=3", "max_layers_per_slot=4", "slot_bytes=unset",
        "slot_capacity_factor=0.5", "overflow=trap", "wgrad_dtype=f32", "inference=false",
        "check_inputs=true", "barrier_timeout_ms=30000", "fuse_epilogues=false",
        "arrival_gated_w13=true", "prepared_weights=false", "scratch_device_bytes=unset",
        "fp8_wgrad=by_shape"}) {
    EXPECT_NE(s.find(part), std::string::npos) << part << " missing in " << s;
  }
}

}  // namespace
}  // namespace epmoe
