// The C ABI's config (include/epmoe/c_api.h) without a device: defaults of the appended fields,
// fp8_block, nvfp4 and mxfp8 inference with prepared weights reaching the planner, and a bad
// precision refused naming the field.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "epmoe/c_api.h"

namespace {

std::string explain(const epmoe_config& c, int ep_size) {
  std::vector<char> buf(1 << 16);
  EXPECT_EQ(epmoe_explain_plan(&c, ep_size, buf.data(), buf.size()), 0) << epmoe_last_error();
  return buf.data();
}

TEST(CapiConfig, Fp8BlockInferenceWithPreparedWeightsReachesThePlanner) {
  epmoe_config c = epmoe_config_default(16, 32, 24, 2, 8);
  EXPECT_EQ(c.precision, 0);
  EXPECT_EQ(c.inference, 0);
  EXPECT_EQ(c.prepared_weights, 0);
  EXPECT_EQ(explain(c, 2).find("fp8"), std::string::npos);
  c.precision = 1;
  c.inference = 1;
  std::string text = explain(c, 2);
  EXPECT_NE(text.find("h rows 0.000 GiB (896 bytes) (inference: forward only)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("fp8 weights quantized per call"), std::string::npos) << text;
  c.prepared_weights = 1;
  text = explain(c, 2);
  EXPECT_NE(text.find("fp8 weights: prepared by the caller"), std::string::npos) << text;
}

TEST(CapiConfig, Nvfp4WeightOnlyInferenceReachesThePlanner) {
  epmoe_config c = epmoe_config_default(16, 32, 24, 2, 8);
  c.precision = 3;
  c.inference = 1;
  c.prepared_weights = 1;
  const std::string text = explain(c, 2);
  EXPECT_NE(text.find("nvfp4 weights: prepared by the caller"), std::string::npos) << text;
  c.inference = 0;  // nvfp4 is forward only
  std::vector<char> buf(256);
  EXPECT_NE(epmoe_explain_plan(&c, 2, buf.data(), buf.size()), 0);
  const std::string error = epmoe_last_error();
  EXPECT_NE(error.find("Config.inference"), std::string::npos) << error;
}

TEST(CapiConfig, Mxfp8InferenceReachesThePlanner) {
  epmoe_config c = epmoe_config_default(16, 32, 24, 2, 8);
  c.precision = 2;
  c.inference = 1;
  c.prepared_weights = 1;
  const std::string text = explain(c, 2);
  EXPECT_NE(text.find("mxfp8 weights: prepared by the caller"), std::string::npos) << text;
  c.inference = 0;  // mxfp8 is forward only
  std::vector<char> buf(256);
  EXPECT_NE(epmoe_explain_plan(&c, 2, buf.data(), buf.size()), 0);
  const std::string error = epmoe_last_error();
  EXPECT_NE(error.find("Config.inference"), std::string::npos) << error;
}

// fp8_wgrad: 2 (by_shape) by default, which this small shape resolves to bf16; 0 (fp8) reaches the
// planner with fp8_block training (the WGRAD columns), 1 (bf16) too (x decoded to bf16 instead),
// and both are refused naming Config.fp8_wgrad with another precision.
TEST(CapiConfig, Fp8WgradReachesThePlanner) {
  epmoe_config c = epmoe_config_default(16, 32, 24, 2, 8);
  EXPECT_EQ(c.fp8_wgrad, 2);
  c.precision = 1;
  int32_t resolved = -1;
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 2, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 1);  // 8 rows per expert < 512
  std::string text = explain(c, 2);
  EXPECT_NE(text.find("weight gradients (Config.fp8_wgrad = by_shape): bf16: 8 rows per expert "
                      "< 512"),
            std::string::npos)
      << text;
  c.fp8_wgrad = 0;
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 2, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 0);
  text = explain(c, 2);
  EXPECT_NE(text.find("WGRAD columns (128 rows per block)"), std::string::npos) << text;
  EXPECT_NE(text.find("fp8: as configured"), std::string::npos) << text;
  c.fp8_wgrad = 1;
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 2, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 1);
  text = explain(c, 2);
  EXPECT_NE(text.find("x decoded to bf16 for the bf16 WGRADs"), std::string::npos) << text;
  EXPECT_EQ(text.find("WGRAD columns (128 rows per block)"), std::string::npos) << text;
  c.precision = 0;
  std::vector<char> buf(256);
  EXPECT_NE(epmoe_explain_plan(&c, 2, buf.data(), buf.size()), 0);
  std::string error = epmoe_last_error();
  EXPECT_NE(error.find("Config.fp8_wgrad"), std::string::npos) << error;
  EXPECT_NE(epmoe_resolved_fp8_wgrad(&c, 2, &resolved), 0);
  error = epmoe_last_error();
  EXPECT_NE(error.find("Config.fp8_wgrad"), std::string::npos) << error;
  c.fp8_wgrad = 3;
  c.precision = 1;
  EXPECT_NE(epmoe_resolved_fp8_wgrad(&c, 2, &resolved), 0);
  error = epmoe_last_error();
  EXPECT_NE(error.find("Config.fp8_wgrad"), std::string::npos) << error;
  EXPECT_NE(epmoe_resolved_fp8_wgrad(nullptr, 2, &resolved), 0);
}

// The default resolves on the bench shapes as the planner does (the rule's own cases:
// tests/cpp/test_fp8_wgrad_choice.cpp): deepseek-v3 at T = 4096 picks bf16 at EP = 1 (128 rows
// per expert) and fp8 at EP = 4 (512 rows).
TEST(CapiConfig, ResolvedFp8WgradFollowsTheShape) {
  epmoe_config c = epmoe_config_default(4096, 7168, 2048, 8, 256);
  c.precision = 1;
  int32_t resolved = -1;
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 1, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 1);
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 4, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 0);
  c.precision = 0;  // bf16 with the default: unused, reported as fp8
  ASSERT_EQ(epmoe_resolved_fp8_wgrad(&c, 1, &resolved), 0) << epmoe_last_error();
  EXPECT_EQ(resolved, 0);
}

TEST(CapiConfig, UnknownPrecisionIsRefusedNamingTheField) {
  epmoe_config c = epmoe_config_default(16, 32, 24, 2, 8);
  c.precision = 4;
  std::vector<char> buf(256);
  EXPECT_NE(epmoe_explain_plan(&c, 2, buf.data(), buf.size()), 0);
  const std::string error = epmoe_last_error();
  EXPECT_NE(error.find("epmoe_config.precision"), std::string::npos) << error;
}

}  // namespace
