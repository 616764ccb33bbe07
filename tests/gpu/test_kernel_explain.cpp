// explain_cuda_kernels (epmoe/cuda.h) on the four bench shapes, host only (no GPU needed): it names
// the kernel the launchers' selectors pick for each GEMM, with the rule and the values it read, and
// follows the environment's overrides as the launchers do.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "../cpp/memory_plan_test_configs.h"
#include "epmoe/c_api.h"
#include "epmoe/config.h"
#include "epmoe/cuda.h"
#include "epmoe/error.h"
#include "scoped_env.h"

namespace epmoe::test {
namespace {

ConfigFields shape(int64_t T, int64_t D, int64_t F, int K, int experts, Precision p) {
  ConfigFields f = plan_test::fields(T, D, F, experts, K);
  f.precision = p;
  return f;
}
// Bench shapes at EP = 1 (bench/shapes.py): rows per expert 128, 256, 512, 2048.
ConfigFields deepseek(Precision p = Precision::bf16) { return shape(4096, 7168, 2048, 8, 256, p); }
ConfigFields gpt_oss(Precision p = Precision::bf16) { return shape(8192, 2880, 2880, 4, 128, p); }
ConfigFields qwen3(Precision p = Precision::bf16) { return shape(8192, 2048, 768, 8, 128, p); }
ConfigFields mixtral(Precision p = Precision::bf16) { return shape(8192, 4096, 14336, 2, 8, p); }

// The text after "  <gemm>: " up to the end of its line.
std::string line_of(const std::string& text, const std::string& gemm) {
  const std::string key = "  " + gemm + ": ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return "";
  const size_t end = text.find('\n', at);
  return text.substr(at + key.size(), end - at - key.size());
}

// Clears every override the selectors read, for the test's scope.
struct NoOverrides {
  ScopedEnv a{"EPMOE_WGRAD_STORE", nullptr}, b{"EPMOE_WGRAD_TILE", nullptr}, c{"EPMOE_WGRAD_PEEL", nullptr},
      d{"EPMOE_GEMM_SCHEDULE", nullptr}, e{"EPMOE_GEMM_SCHEDULE_WGRAD", nullptr},
      f{"EPMOE_GEMM_SCHEDULE_W2_DGRAD", nullptr}, g{"EPMOE_GEMM_CLUSTER", nullptr},
      h{"EPMOE_GEMM_CLUSTER_WGRAD", nullptr}, i{"EPMOE_FP8_TILE", nullptr}, j{"EPMOE_FP8_OVERLAP", nullptr},
      k{"EPMOE_FP8_WGRAD_TILE", nullptr}, l{"EPMOE_FP8_WGRAD_SCALES", nullptr},
      m{"EPMOE_FP8_WGRAD_MULTICAST", nullptr}, n{"EPMOE_FP8_TRIM_ROWS", nullptr},
      o{"EPMOE_GEMM_ROWS_TILE_N", nullptr}, p{"EPMOE_GEMM_BAND_ROWS", nullptr},
      q{"EPMOE_FP8_BAND_ROWS", nullptr};
};

TEST(KernelExplain, Bf16TrainingNamesEachGemmsKernelAndRule) {
  const NoOverrides clean;
  const std::string ds = explain_cuda_kernels(Config(deepseek()), 1);
  std::printf("%s\n", ds.c_str());
  EXPECT_NE(
      ds.find("256 local experts, 128 rows per expert under balanced routing (T*K/E), capacity 32768 rows"),
      std::string::npos)
      << ds;
  EXPECT_NE(line_of(ds, "w13_fprop").find("64 x 128 x 2 (gate, up), ping-pong"), std::string::npos) << ds;
  EXPECT_NE(line_of(ds, "w2_dgrad").find("ping-pong [W2 DGRAD rule"), std::string::npos) << ds;
  EXPECT_NE(line_of(ds, "w13_dgrad").find("ping-pong [T*K/E = 128 rows per expert <= 192, "
                                          "K = 2F = 4096 > 2048]"),
            std::string::npos)
      << ds;
  EXPECT_NE(line_of(ds, "w13_wgrad")
                .find("TMA stores issued by a producer warp [T*K/E = 128 rows per expert <= 192]"),
            std::string::npos)
      << ds;
  const std::string go = explain_cuda_kernels(Config(gpt_oss()), 1);
  EXPECT_NE(line_of(go, "w13_dgrad").find("64 x 192, ping-pong [T*K/E = 256 rows per expert > 192, "
                                          "K = 2F = 5760 > 2048, D = 2880 = 15 x 192, not a multiple of 256]"),
            std::string::npos)
      << go;
  const std::string mx = explain_cuda_kernels(Config(mixtral()), 1);
  EXPECT_NE(line_of(mx, "w13_dgrad").find("128 x 256, cooperative [T*K/E = 2048 rows per expert > 192, "
                                          "K = 2F = 28672 > 2048]"),
            std::string::npos)
      << mx;
  EXPECT_NE(line_of(go, "w2_dgrad").find("64 x 192, ping-pong [W2 DGRAD rule"), std::string::npos) << go;
  EXPECT_NE(line_of(go, "w2_fprop").find("64 x 192, ping-pong"), std::string::npos) << go;
  EXPECT_NE(line_of(go, "w2_fprop").find("tile width [N = 2880 = 15 x 192, not a multiple of 256, ping-pong: 192]"),
            std::string::npos)
      << go;
  EXPECT_NE(line_of(go, "w13_dgrad").find("ping-pong: 192"), std::string::npos) << go;
  EXPECT_NE(line_of(ds, "w2_fprop").find("64 x 256"), std::string::npos) << ds;
  EXPECT_NE(line_of(ds, "w2_fprop").find("tile width [N = 7168, a multiple of 256: 256]"), std::string::npos) << ds;
  const std::string qw = explain_cuda_kernels(Config(qwen3()), 1);
  EXPECT_NE(line_of(qw, "w13_dgrad").find("64 x 256, ping-pong [T*K/E = 512 rows per expert > 192, "
                                          "K = 2F = 1536 <= 2048]"),
            std::string::npos)
      << qw;
  EXPECT_NE(
      line_of(go, "w2_wgrad").find("TMA stores issued by the consumers [T*K/E = 256 rows per expert > 192]"),
      std::string::npos)
      << go;
  for (const char* gemm : {"w13_fprop", "w2_fprop", "w2_dgrad", "w13_dgrad", "w2_wgrad", "w13_wgrad"}) {
    EXPECT_FALSE(line_of(go, gemm).empty()) << gemm << "\n" << go;
  }
}

// The rules key on T*K/E, not on the capacity: a capacity factor of 2 changes no choice.
TEST(KernelExplain, CapacityFactorChangesNoChoice) {
  const NoOverrides clean;
  ConfigFields f = deepseek();
  f.capacity_factor = 2.0;
  const std::string wide = explain_cuda_kernels(Config(f), 2);
  const std::string plain = explain_cuda_kernels(Config(deepseek()), 2);
  EXPECT_NE(wide.find("capacity 65536 rows"), std::string::npos) << wide;
  for (const char* gemm : {"w13_fprop", "w2_fprop", "w2_dgrad", "w13_dgrad", "w2_wgrad", "w13_wgrad"}) {
    EXPECT_EQ(line_of(wide, gemm), line_of(plain, gemm)) << gemm;
  }
  EXPECT_NE(line_of(wide, "w2_wgrad").find("the consumers [T*K/E = 256 rows"), std::string::npos) << wide;
}

// Bands of max(4096, 2 T*K/E, the rows of K bf16 in 32 MiB) rows.
TEST(KernelExplain, BandsKeyOnBalancedRowsAndL2) {
  const NoOverrides clean;
  const std::string mx = explain_cuda_kernels(Config(mixtral()), 1);
  EXPECT_NE(line_of(mx, "w13_fprop").find("m-tile bands of 4096 rows [rule: max(4096, 2 T*K/E = 4096, "
                                          "32 MiB of K = 4096 bf16 = 4096)]"),
            std::string::npos)
      << mx;
  EXPECT_NE(line_of(mx, "w13_dgrad").find("m-tile bands of 4096 rows [rule: max(4096, 2 T*K/E = 4096, "
                                          "32 MiB of K = 28672 bf16 = 585)]"),
            std::string::npos)
      << mx;
  const std::string ds = explain_cuda_kernels(Config(deepseek()), 1);
  EXPECT_NE(line_of(ds, "w2_fprop").find("m-tile bands of 8192 rows [rule: max(4096, 2 T*K/E = 256, "
                                         "32 MiB of K = 2048 bf16 = 8192)]"),
            std::string::npos)
      << ds;
}

TEST(KernelExplain, FollowsTheEnvironmentsOverrides) {
  const NoOverrides clean;
  {
    const ScopedEnv store("EPMOE_WGRAD_STORE", "tma");
    const std::string ds = explain_cuda_kernels(Config(deepseek()), 1);
    EXPECT_NE(line_of(ds, "w2_wgrad").find("the consumers [EPMOE_WGRAD_STORE=tma (override)]"),
              std::string::npos)
        << ds;
  }
  {
    const ScopedEnv schedule("EPMOE_GEMM_SCHEDULE_W2_DGRAD", "cooperative");
    const std::string ds = explain_cuda_kernels(Config(deepseek()), 1);
    EXPECT_NE(
        line_of(ds, "w2_dgrad").find("cooperative [EPMOE_GEMM_SCHEDULE_W2_DGRAD=cooperative (override)]"),
        std::string::npos)
        << ds;
    EXPECT_NE(line_of(ds, "w13_dgrad").find("ping-pong [T*K/E = 128 rows"), std::string::npos) << ds;
  }
  {
    const ScopedEnv band("EPMOE_GEMM_BAND_ROWS", "1024");
    const std::string mx = explain_cuda_kernels(Config(mixtral()), 1);
    for (const char* kind : {"w13_fprop", "w2_fprop", "w2_dgrad", "w13_dgrad"}) {
      EXPECT_NE(line_of(mx, kind).find("m-tile bands of 1024 rows [EPMOE_GEMM_BAND_ROWS=1024 (override)]"),
                std::string::npos)
          << mx;
    }
    const ScopedEnv bad("EPMOE_GEMM_BAND_ROWS", "many");
    EXPECT_THROW(explain_cuda_kernels(Config(mixtral()), 1), Error);
  }
  {
    const std::string plain = explain_cuda_kernels(Config(mixtral(Precision::fp8_block)), 1);
    EXPECT_NE(line_of(plain, "w13_fprop").find("m-tile bands none [rule: none"), std::string::npos) << plain;
    const ScopedEnv band("EPMOE_FP8_BAND_ROWS", "2048");
    const std::string mx = explain_cuda_kernels(Config(mixtral(Precision::fp8_block)), 1);
    for (const char* kind : {"w13_fprop", "w2_fprop", "w2_dgrad", "w13_dgrad"}) {
      EXPECT_NE(line_of(mx, kind).find("m-tile bands of 2048 rows [EPMOE_FP8_BAND_ROWS=2048 (override)]"),
                std::string::npos)
          << mx;
    }
  }
  {
    const ScopedEnv width("EPMOE_GEMM_ROWS_TILE_N", "192");
    std::string go, mx, refused;
    try {
      go = explain_cuda_kernels(Config(gpt_oss()), 1);
      mx = explain_cuda_kernels(Config(mixtral()), 1);
    } catch (const Error& e) {
      refused = e.argument();  // a build with EPMOE_GEMM_CONFIGS=CI has the 256-column tile only
    }
    if (refused.empty()) {
      EXPECT_NE(line_of(go, "w2_fprop").find("bf16 64 x 192, ping-pong"), std::string::npos) << go;
      EXPECT_NE(line_of(mx, "w13_dgrad").find("bf16 128 x 192, cooperative"), std::string::npos) << mx;
      EXPECT_NE(line_of(go, "w2_dgrad").find("tile width [EPMOE_GEMM_ROWS_TILE_N=192 (override)]"),
                std::string::npos)
          << go;
      EXPECT_NE(line_of(go, "w13_fprop").find("64 x 128 x 2 (gate, up)"), std::string::npos) << go;
    } else {
      EXPECT_EQ(refused, "EPMOE_GEMM_ROWS_TILE_N");
    }
  }
  const ScopedEnv bad("EPMOE_WGRAD_STORE", "nowhere");
  std::string field;
  try {
    explain_cuda_kernels(Config(deepseek()), 1);
  } catch (const Error& e) {
    field = e.argument();
  }
  EXPECT_EQ(field, "EPMOE_WGRAD_STORE");
}

TEST(KernelExplain, Fp8TrainingTilesAndWeightGradients) {
  const NoOverrides clean;
  const std::string mx = explain_cuda_kernels(Config(mixtral(Precision::fp8_block)), 1);
  std::printf("%s\n", mx.c_str());
  EXPECT_NE(line_of(mx, "w13_fprop").find("fp8 128 x 128, cooperative, two block accumulators"),
            std::string::npos)
      << mx;
  EXPECT_NE(line_of(mx, "w2_fprop").find("128 x 128, cooperative [K 14336 >= N 4096]"), std::string::npos)
      << mx;
  EXPECT_NE(line_of(mx, "w2_wgrad").find("192 x 128, scales in the stage, single CTAs"), std::string::npos)
      << mx;
  EXPECT_NE(mx.find("weight gradients: fp8: 2048 rows per expert"), std::string::npos) << mx;
  const std::string qw = explain_cuda_kernels(Config(qwen3(Precision::fp8_block)), 1);
  EXPECT_NE(line_of(qw, "w2_fprop").find("64 x 256 ping-pong, halves on neighbouring CTAs [K 768 < N 2048, T*K/E 512 > 192]"),
            std::string::npos)
      << qw;
  EXPECT_NE(qw.find("weight gradients: bf16"), std::string::npos) << qw;
  EXPECT_NE(line_of(qw, "w13_wgrad").find("bf16, cooperative"), std::string::npos) << qw;
  // Row trimming of the cooperative tiles by T*K/E; the ping-pong tile has none to name.
  EXPECT_NE(line_of(mx, "w13_fprop").find("tiles trimmed to their rows [T*K/E 2048 >= 256]"), std::string::npos)
      << mx;
  EXPECT_EQ(line_of(qw, "w2_fprop").find("trimmed"), std::string::npos) << qw;
  const std::string ds = explain_cuda_kernels(Config(deepseek(Precision::fp8_block)), 1);
  EXPECT_NE(line_of(ds, "w2_dgrad").find("whole tiles [T*K/E 128 < 256]"), std::string::npos) << ds;
  EXPECT_NE(line_of(ds, "w2_fprop")
                .find("fp8 192 x 128, cooperative, one block accumulator [K 2048 < N 7168, T*K/E 128 <= 192], "
                      "tiles trimmed to their rows [192 x 128]"),
            std::string::npos)
      << ds;
  {
    const ScopedEnv forced("EPMOE_FP8_TRIM_ROWS", "1");
    EXPECT_NE(line_of(explain_cuda_kernels(Config(deepseek(Precision::fp8_block)), 1), "w13_fprop")
                  .find("tiles trimmed to their rows [EPMOE_FP8_TRIM_ROWS=1 (override)]"),
              std::string::npos);
  }
  const ScopedEnv tile("EPMOE_FP8_WGRAD_TILE", "128x128");
  EXPECT_NE(line_of(explain_cuda_kernels(Config(mixtral(Precision::fp8_block)), 1), "w13_wgrad")
                .find("128 x 128, scales in the stage"),
            std::string::npos);
}

// The epilogue variants Context runs: unfused (plain rows, then the SwiGLU / scatter kernels; W13
// on one 256-column B), per-rank combine, arrival-gated W13.
TEST(KernelExplain, NamesTheEpilogueVariant) {
  const NoOverrides clean;
  ConfigFields f = gpt_oss();
  f.fuse_epilogues = false;
  const std::string unfused = explain_cuda_kernels(Config(f), 2);
  EXPECT_NE(line_of(unfused, "w13_fprop").find("bf16 64 x 256, ping-pong"), std::string::npos) << unfused;
  EXPECT_NE(line_of(unfused, "w13_fprop").find("then the SwiGLU kernel"), std::string::npos) << unfused;
  EXPECT_NE(line_of(unfused, "w2_fprop").find("then the scatter kernel"), std::string::npos) << unfused;
  f = gpt_oss();
  f.combine = CombineMode::per_rank;
  f.arrival_gated_w13 = true;
  const std::string per_rank = explain_cuda_kernels(Config(f), 2);
  EXPECT_NE(line_of(per_rank, "w2_fprop").find("per-rank combine"), std::string::npos) << per_rank;
  EXPECT_NE(line_of(per_rank, "w13_dgrad").find("per-rank combine"), std::string::npos) << per_rank;
  EXPECT_NE(line_of(per_rank, "w13_fprop").find("gated on dispatch arrivals"), std::string::npos) << per_rank;
}

TEST(KernelExplain, InferenceHasTheForwardGemmsOnly) {
  const NoOverrides clean;
  ConfigFields f = gpt_oss();
  f.inference = true;
  const std::string go = explain_cuda_kernels(Config(f), 1);
  EXPECT_FALSE(line_of(go, "w2_fprop").empty()) << go;
  EXPECT_TRUE(line_of(go, "w2_dgrad").empty()) << go;
  EXPECT_TRUE(line_of(go, "w13_wgrad").empty()) << go;
}

// Weight-only inference formats: MXFP8's decode / wgmma kernel by its capacity rule, NVFP4's splits.
TEST(KernelExplain, InferenceFormats) {
  const NoOverrides clean;
  const ScopedEnv mx("EPMOE_MXFP8_KERNEL", nullptr), nv("EPMOE_NVFP4_SPLITK", nullptr);
  ConfigFields f = qwen3(Precision::mxfp8);
  f.inference = true;
  f.prepared_weights = true;
  f.max_tokens_per_rank = 128;  // decode: 8 rows per expert
  const std::string decode = explain_cuda_kernels(Config(f), 1);
  EXPECT_NE(line_of(decode, "w13_fprop").find("mxfp8 decode kernel"), std::string::npos) << decode;
  f.max_tokens_per_rank = 8192;  // prefill: 512 rows per expert
  EXPECT_NE(line_of(explain_cuda_kernels(Config(f), 1), "w2_fprop").find("mxfp8 wgmma kernel"),
            std::string::npos);
  f.precision = Precision::nvfp4;
  const std::string nvfp4 = explain_cuda_kernels(Config(f), 1);
  EXPECT_NE(line_of(nvfp4, "w13_fprop").find("one split"), std::string::npos) << nvfp4;
  EXPECT_NE(line_of(nvfp4, "w13_fprop").find("64 rows a pass"), std::string::npos) << nvfp4;  // 512 rows
  EXPECT_TRUE(line_of(nvfp4, "w2_dgrad").empty()) << nvfp4;
  {  // the launcher's own parser of the override (nvfp4_requested_splits)
    const ScopedEnv three("EPMOE_NVFP4_SPLITK", "3");
    EXPECT_NE(line_of(explain_cuda_kernels(Config(f), 1), "w2_fprop").find("3 splits [EPMOE_NVFP4_SPLITK=3"),
              std::string::npos);
  }
  {
    const ScopedEnv automatic("EPMOE_NVFP4_SPLITK", "auto");
    EXPECT_NE(line_of(explain_cuda_kernels(Config(f), 1), "w2_fprop").find("nvfp4_choose_splits"),
              std::string::npos);
  }
  const ScopedEnv bad("EPMOE_NVFP4_SPLITK", "0");
  std::string field;
  try {
    explain_cuda_kernels(Config(f), 1);
  } catch (const Error& e) {
    field = e.argument();
  }
  EXPECT_EQ(field, "EPMOE_NVFP4_SPLITK");
}

// The C ABI's copy: the same text, truncated to the buffer.
TEST(KernelExplain, CApiCopiesTheText) {
  const NoOverrides clean;
  const epmoe_config c = epmoe_config_default(4096, 7168, 2048, 8, 256);
  char buf[8192];
  ASSERT_EQ(epmoe_explain_kernels(&c, 1, buf, sizeof(buf)), 0);
  EXPECT_NE(std::string(buf).find("w13_wgrad: bf16, cooperative"), std::string::npos) << buf;
  char small[16];
  ASSERT_EQ(epmoe_explain_kernels(&c, 1, small, sizeof(small)), 0);
  EXPECT_EQ(std::string(small).size(), sizeof(small) - 1);
}

}  // namespace
}  // namespace epmoe::test
