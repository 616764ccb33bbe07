// Config.fp8_wgrad = by_shape (core/fp8_wgrad_choice.h): the rule on the four bench shapes at
// EP = 1 and EP = 2, its two thresholds at their edges, explicit values passing through, and the
// planner holding the resolved value (scratch, explain()).
#include <gtest/gtest.h>

#include <string>

#include "core/fp8_wgrad_choice.h"
#include "epmoe/config.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"

namespace epmoe {
namespace {

struct BenchShape {
  const char* name;
  int64_t T, D, F;
  int K, experts;
};

// bench/bench_moe.py's shapes (T per rank as benched; the table in fp8_wgrad_choice.h).
constexpr BenchShape kQwen3{"qwen3-30b-a3b", 8192, 2048, 768, 8, 128};
constexpr BenchShape kDeepseek{"deepseek-v3", 4096, 7168, 2048, 8, 256};
constexpr BenchShape kGptOss{"gpt-oss-120b", 8192, 2880, 2880, 4, 128};
constexpr BenchShape kMixtral{"mixtral-8x7b", 8192, 4096, 14336, 2, 8};

ConfigFields fields(const BenchShape& s, Fp8Wgrad wgrad = Fp8Wgrad::by_shape) {
  ConfigFields f;
  f.max_tokens_per_rank = s.T;
  f.hidden_dim = s.D;
  f.intermediate_dim = s.F;
  f.top_k = s.K;
  f.num_experts = s.experts;
  f.precision = Precision::fp8_block;
  f.fp8_wgrad = wgrad;
  return f;
}

Fp8WgradChoice choose(const BenchShape& s, int ep_size) {
  return choose_fp8_wgrad(Config(fields(s)), ep_size);
}

void expect_choice(const BenchShape& s, int ep_size, Fp8Wgrad want, const std::string& reason) {
  const Fp8WgradChoice c = choose(s, ep_size);
  EXPECT_EQ(c.wgrad, want) << s.name << " EP " << ep_size << ": " << c.reason;
  EXPECT_EQ(c.reason, reason) << s.name << " EP " << ep_size;
}

TEST(Fp8WgradChoice, BenchShapesAtEp1) {
  expect_choice(kQwen3, 1, Fp8Wgrad::bf16,
                "bf16: D*F/(D+F) = 558.5 < 1024 (the column quantization costs more than the FP8 "
                "GEMM saves)");
  expect_choice(kDeepseek, 1, Fp8Wgrad::bf16,
                "bf16: 128 rows per expert < 512 (short k-loops: the bf16 WGRAD measured faster)");
  expect_choice(kGptOss, 1, Fp8Wgrad::bf16,
                "bf16: 256 rows per expert < 512 (short k-loops: the bf16 WGRAD measured faster)");
  expect_choice(kMixtral, 1, Fp8Wgrad::fp8,
                "fp8: 2048 rows per expert >= 512 and D*F/(D+F) = 3185.8 >= 1024");
}

// The same T per rank on 2 ranks: each rank's rows per local expert double (T*K*R/E_global).
// qwen3 stays bf16 by the D*F/(D+F) term; deepseek-v3's 256 rows stay below 512; gpt-oss
// reaches 512 with 1440.0 >= 1024.
TEST(Fp8WgradChoice, BenchShapesAtEp2) {
  expect_choice(kQwen3, 2, Fp8Wgrad::bf16,
                "bf16: D*F/(D+F) = 558.5 < 1024 (the column quantization costs more than the FP8 "
                "GEMM saves)");
  expect_choice(kDeepseek, 2, Fp8Wgrad::bf16,
                "bf16: 256 rows per expert < 512 (short k-loops: the bf16 WGRAD measured faster)");
  expect_choice(kGptOss, 2, Fp8Wgrad::fp8,
                "fp8: 512 rows per expert >= 512 and D*F/(D+F) = 1440.0 >= 1024");
  expect_choice(kMixtral, 2, Fp8Wgrad::fp8,
                "fp8: 4096 rows per expert >= 512 and D*F/(D+F) = 3185.8 >= 1024");
}

// Rows per expert round down (16383*4/128 = 511.97 -> 511); D*F/(D+F) is compared exactly
// (D = F = 2048 gives 1024.0; F = 2047 gives 1023.74995).
TEST(Fp8WgradChoice, ThresholdEdges) {
  EXPECT_EQ(choose({"edge", 16384, 2048, 2048, 4, 128}, 1).wgrad, Fp8Wgrad::fp8);
  const Fp8WgradChoice below = choose({"edge", 16383, 2048, 2048, 4, 128}, 1);
  EXPECT_EQ(below.wgrad, Fp8Wgrad::bf16);
  EXPECT_EQ(below.reason.rfind("bf16: 511 rows per expert < 512", 0), 0u) << below.reason;
  const Fp8WgradChoice narrow = choose({"edge", 16384, 2048, 2047, 4, 128}, 1);
  EXPECT_EQ(narrow.wgrad, Fp8Wgrad::bf16);
  EXPECT_EQ(narrow.reason.rfind("bf16: D*F/(D+F) = 1023.7 < 1024", 0), 0u) << narrow.reason;
  // Both terms fail: the rows term is named.
  EXPECT_EQ(choose({"small", 16, 32, 24, 2, 8}, 1).reason.rfind("bf16: 4 rows per expert", 0), 0u);
}

TEST(Fp8WgradChoice, ExplicitValuesPassThrough) {
  for (const BenchShape& s : {kQwen3, kDeepseek, kGptOss, kMixtral}) {
    for (Fp8Wgrad w : {Fp8Wgrad::fp8, Fp8Wgrad::bf16}) {
      for (int ep : {1, 2}) {
        const Fp8WgradChoice c = choose_fp8_wgrad(Config(fields(s, w)), ep);
        EXPECT_EQ(c.wgrad, w) << s.name;
        EXPECT_EQ(c.reason, std::string(to_string(w)) + ": as configured") << s.name;
      }
    }
  }
}

// No FP8 weight gradients (another precision, or inference): by_shape resolves to fp8, unused.
TEST(Fp8WgradChoice, UnusedWithoutFp8Training) {
  ConfigFields f = fields(kDeepseek);
  f.precision = Precision::bf16;
  Fp8WgradChoice c = choose_fp8_wgrad(Config(f), 1);
  EXPECT_EQ(c.wgrad, Fp8Wgrad::fp8);
  EXPECT_EQ(c.reason, "fp8: unused (precision bf16 has no FP8 weight gradients)");
  f.precision = Precision::fp8_block;
  f.inference = true;
  c = choose_fp8_wgrad(Config(f), 1);
  EXPECT_EQ(c.wgrad, Fp8Wgrad::fp8);
  EXPECT_EQ(c.reason, "fp8: unused (inference: no weight gradients)");
  try {
    choose_fp8_wgrad(Config(fields(kDeepseek)), 3);
    ADD_FAILURE() << "256 experts on 3 ranks accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "Config.num_experts") << e.what();
  }
}

// The plan holds the resolved value, sizes the scratch for it (byte for byte the plan of that
// value configured explicitly) and explain() prints the choice with its reason.
TEST(Fp8WgradChoice, PlanHoldsTheResolvedChoice) {
  for (const BenchShape& s : {kQwen3, kDeepseek, kGptOss, kMixtral}) {
    for (int ep : {1, 2}) {
      const MemoryPlan p = plan_memory(Config(fields(s)), ep);
      const Fp8WgradChoice c = choose(s, ep);
      const std::string what = std::string(s.name) + " EP " + std::to_string(ep);
      EXPECT_EQ(p.fp8_wgrad, c.wgrad) << what;
      EXPECT_EQ(p.fp8_wgrad_requested, Fp8Wgrad::by_shape) << what;
      EXPECT_EQ(p.fp8_wgrad_reason, c.reason) << what;
      const MemoryPlan same = plan_memory(Config(fields(s, c.wgrad)), ep);
      const Fp8Wgrad other_wgrad = c.wgrad == Fp8Wgrad::fp8 ? Fp8Wgrad::bf16 : Fp8Wgrad::fp8;
      const MemoryPlan other = plan_memory(Config(fields(s, other_wgrad)), ep);
      EXPECT_EQ(p.fp8_scratch_bytes, same.fp8_scratch_bytes) << what;
      EXPECT_NE(p.fp8_scratch_bytes, other.fp8_scratch_bytes) << what;
      EXPECT_EQ(p.scratch_bytes, same.scratch_bytes) << what;
      EXPECT_EQ(p.total_bytes, same.total_bytes) << what;
      EXPECT_EQ(p.device_total_bytes, same.device_total_bytes) << what;
      const std::string text = p.explain();
      EXPECT_NE(text.find("weight gradients (Config.fp8_wgrad = by_shape): " + c.reason),
                std::string::npos)
          << what << "\n" << text;
      EXPECT_NE(text.find(c.wgrad == Fp8Wgrad::fp8 ? "WGRAD columns (128 rows per block)"
                                                   : "x decoded to bf16 for the bf16 WGRADs"),
                std::string::npos)
          << what << "\n" << text;
    }
  }
}

}  // namespace
}  // namespace epmoe
