// The NVFP4 grouped GEMM's host-side choices (gemm/nvfp4_gemm.h): work items per expert, the
// split-K and row-group heuristics with their environment overrides, and the launch switches.
// Host only; the kernels and their launcher are in gemm/grouped_gemm_nvfp4.cu.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/gemm/nvfp4_gemm.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

int64_t nvfp4_grid_slabs(int64_t N, bool swiglu) {
  constexpr int64_t kHalf = kNvfp4Slab / 2;
  return swiglu ? (N / 2 + kHalf - 1) / kHalf : (N + kNvfp4Slab - 1) / kNvfp4Slab;
}

int64_t nvfp4_splitk_scratch_bytes(int splits, int64_t M, int64_t N) {
  return splits <= 1 ? 0 : static_cast<int64_t>(splits) * M * N * 4;
}

Nvfp4Splits nvfp4_choose_splits(int64_t N, int64_t K, int E, bool swiglu, int sms) {
  Nvfp4Splits c;
  const int64_t ctas = nvfp4_grid_slabs(N, swiglu) * E;
  const int64_t chunks = (K + kNvfp4Chunk - 1) / kNvfp4Chunk;
  const int64_t target = static_cast<int64_t>(kNvfp4TargetCtasPerSm) * sms;
  int64_t splits = (target + ctas - 1) / ctas;
  const int64_t by_chunks = chunks / kNvfp4MinChunksPerSplit;
  if (splits > by_chunks) splits = by_chunks;
  if (splits > kNvfp4MaxSplits) splits = kNvfp4MaxSplits;
  c.splits = splits < 1 ? 1 : static_cast<int>(splits);
  c.reason = std::to_string(ctas) + " CTAs (" + std::to_string(E) + " experts) for " +
             std::to_string(kNvfp4TargetCtasPerSm) + " x " + std::to_string(sms) + " SMs, " +
             std::to_string(chunks) + " chunks of K (>= " +
             std::to_string(kNvfp4MinChunksPerSplit) + " per split, <= " +
             std::to_string(kNvfp4MaxSplits) + " splits): " + std::to_string(c.splits) +
             " split(s)";
  return c;
}

int64_t nvfp4_requested_splits() {
  const char* env = std::getenv("EPMOE_NVFP4_SPLITK");
  if (env == nullptr) return 1;
  const bool automatic = std::strcmp(env, "auto") == 0;
  const int64_t n = automatic ? 0 : std::atoll(env);
  EPMOE_CHECK_ARG(automatic || n >= 1, "EPMOE_NVFP4_SPLITK", "auto or a count >= 1", env);
  return n;
}

namespace {
// Rows above which an expert leaves the launch of `groups` groups a pass for the 8-group one:
// more than two narrow passes' rows (none beside 8 groups).
int64_t wide_above(int groups) {
  return groups < kNvfp4MaxRowGroups ? 2 * 8 * groups : kNvfp4NoWidePass;
}

// An on / off switch from the environment: "0" or "1", the default where unset.
bool env_switch(const char* name, bool unset) {
  const char* env = std::getenv(name);
  if (env == nullptr) return unset;
  EPMOE_CHECK_ARG(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, name, "0 or 1", env);
  return env[0] == '1';
}
}  // namespace

Nvfp4RowGroups nvfp4_row_groups(int64_t rows_per_group) {
  Nvfp4RowGroups c;
  const double lambda = rows_per_group > 0 ? static_cast<double>(rows_per_group) : 0.0;
  const double want = lambda + 2.0 * std::sqrt(lambda);
  c.groups = 1;
  while (c.groups < kNvfp4MaxRowGroups && 8.0 * c.groups < want) c.groups *= 2;
  c.wide_above = wide_above(c.groups);
  c.reason = std::to_string(rows_per_group) + " rows per expert expected, + 2 sigma = " +
             std::to_string(static_cast<int64_t>(want + 0.5)) + ": " + std::to_string(c.groups) +
             " x 8 rows a pass" +
             (c.wide_above == kNvfp4NoWidePass
                  ? std::string()
                  : "; experts with more than " + std::to_string(c.wide_above) + " rows: " +
                        std::to_string(kNvfp4MaxRowGroups) + " x 8");
  return c;
}

bool nvfp4_wide_fork() { return env_switch("EPMOE_NVFP4_WIDE_FORK", false); }
bool nvfp4_wide_pdl() { return env_switch("EPMOE_NVFP4_WIDE_PDL", true); }
bool nvfp4_wgmma() { return env_switch("EPMOE_NVFP4_WGMMA", false); }
bool nvfp4_act_boxes(bool wide) { return env_switch("EPMOE_NVFP4_ACT_BOXES", !wide); }

int nvfp4_requested_row_groups() {
  const char* env = std::getenv("EPMOE_NVFP4_ROW_GROUPS");
  if (env == nullptr) return 0;
  const int n = std::atoi(env);
  EPMOE_CHECK_ARG(n == 1 || n == 2 || n == 4 || n == 8, "EPMOE_NVFP4_ROW_GROUPS", "1, 2, 4 or 8",
                  env);
  return n;
}

Nvfp4RowGroups nvfp4_launch_row_groups(const Nvfp4GroupedGemmArgs& args) {
  Nvfp4RowGroups rows =
      nvfp4_row_groups(args.rows_per_group > 0 ? args.rows_per_group : args.M / args.E);
  if (const int forced = nvfp4_requested_row_groups(); forced > 0) {
    rows.groups = forced;
    rows.wide_above = wide_above(forced);
  }
  return rows;
}

}  // namespace epmoe::cuda
