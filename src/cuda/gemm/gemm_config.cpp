#include "cuda/gemm/gemm_config.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/check.h"
#include "core/step.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

const char* to_string(Schedule s) { return s == Schedule::pingpong ? "ping-pong" : "cooperative"; }

namespace gemm {

const char* to_string(GemmKind k) {
  switch (k) {
    case GemmKind::w13_fprop: return "w13_fprop";
    case GemmKind::w2_fprop: return "w2_fprop";
    case GemmKind::w2_dgrad: return "w2_dgrad";
    case GemmKind::w13_dgrad: return "w13_dgrad";
    case GemmKind::w2_wgrad: return "w2_wgrad";
    case GemmKind::w13_wgrad: return "w13_wgrad";
  }
  return "?";
}

// Measured on H200 (EP = 1, bench/results/2026-11-29-*-h200*.json, per-stage times):
//   forward W13 / W2: ping-pong (its epilogue overlaps the other warpgroup's MMA;
//     e.g. deepseek-v3 W13 6.48 -> 4.18 ms, qwen3 0.88 -> 0.74 ms);
//   W13 DGRAD: ping-pong only when experts hold few rows (deepseek-v3, ~128: 5.20 -> 4.40 ms);
//     with hundreds of rows the cooperative tile wins (mixtral 5.42 vs 7.63 ms);
//   WGRAD: cooperative (ping-pong was 1.3-1.6x slower on every shape).
// W2 DGRAD: ping-pong on every shape. It stores plain grad_h rows (the SwiGLU backward runs after
// it, cuda/swiglu.h), on W13 DGRAD's operand majors (A K-major, B MN-major). At EP = 2 (3ae623b)
// its ping-pong tile had run 1.2-1.4x slower than the W2 FPROP of the same FLOPs where experts
// hold hundreds of rows (ms: mixtral 3.83 vs 2.79, qwen3 0.394 vs 0.325), so it took W13 DGRAD's
// rule (cooperative above 192 rows). Measured again against that rule at EP = 1 (bench/RESULTS.md
// "2026-12-03 · add9f19", three alternating pairs, W2 DGRAD stage ms, ping-pong against
// cooperative): qwen3 (~512 rows) 0.534 / 0.524 / 0.506 against 0.587 / 0.552 / 0.552 (x0.91-0.95),
// mixtral (~2048) 3.91 / 3.90 / 3.95 against 4.33 / 3.98 / 4.07 (x0.90-0.98), gpt-oss (~256)
// 1.491 / 1.444 / 1.443 against 1.489 / 1.453 / 1.461 (x0.99-1.00). At d911e2f (ping-pong the
// default, "2026-12-03 · d911e2f"), more pairs: qwen3 x0.87-0.99 (five), mixtral x0.87-0.97 (two),
// gpt-oss x0.99-1.07 (five; over all eight pairs cooperative ~1.5 % faster there, ~0.02 ms, left
// on the one rule). Why it changed since 7db1bac is not measured.
// W13 DGRAD also runs ping-pong where its k-loop is short (K = 2F <= 2048, 32 k-blocks: the
// epilogue is a large part of a tile). Measured at d911e2f (bench/RESULTS.md "2026-12-03 ·
// d911e2f", EPMOE_GEMM_SCHEDULE_W13_DGRAD=pingpong against the rows rule, five alternating pairs,
// W13 DGRAD ms): qwen3 (2F = 1536, ~512 rows) 0.686 / 0.652 / 0.661 / 0.675 / 0.712 against 0.704 /
// 0.793 / 0.816 / 0.807 / 0.779 (x0.82-0.97); gpt-oss (2F = 5760, ~256 rows) x1.05-1.16 and
// mixtral (2F = 28672) x1.01-1.05 slower (two pairs): they stay cooperative.
constexpr int64_t kW13DgradPingPongMaxK = 2048;
// And where its N = D fills 192-column tiles exactly and 256-column ones not (gpt-oss's 2880), on
// 64 x 192 ping-pong tiles (select_rows_tile_n): measured at a671919 (bench/RESULTS.md "2026-12-03 ·
// 513de24, a671919"), EPMOE_GEMM_SCHEDULE_W13_DGRAD=pingpong against the 128 x 256 cooperative
// tile, two alternating pairs: 2.134 / 2.134 against 2.312 / 2.330 ms (x0.92), where 64 x 256
// ping-pong had measured x1.05-1.16 slower.
namespace {
bool fills_192_not_256(int64_t n) { return n % 192 == 0 && n % 256 != 0; }
// What fills_192_not_256 read, for the explanations: "2880 = 15 x 192, not a multiple of 256".
std::string width_text(int64_t n) {
  const std::string v = std::to_string(n);
  if (fills_192_not_256(n)) return v + " = " + std::to_string(n / 192) + " x 192, not a multiple of 256";
  return v + (n % 256 == 0 ? ", a multiple of 256" : ", not a multiple of 192");
}
}  // namespace
// Overrides, read on every launch (a getenv is ~100 ns), for measurements; the first set wins:
// EPMOE_GEMM_SCHEDULE_<KIND> (the kind's name in capitals, e.g. EPMOE_GEMM_SCHEDULE_W2_DGRAD),
// EPMOE_GEMM_SCHEDULE_WGRAD (both WGRADs), EPMOE_GEMM_SCHEDULE (every GEMM).
namespace {
bool is_wgrad(GemmKind kind) { return kind == GemmKind::w2_wgrad || kind == GemmKind::w13_wgrad; }

// Appends to a selector's `why` when asked for: `text` is a C string or a callable that builds the
// string, called only then (the launchers call the selectors on every launch, without `why`).
template <class Text>
void say(std::string* why, const Text& text) {
  if (why == nullptr) return;
  if constexpr (std::is_invocable_v<const Text&>) {
    *why += text();
  } else {
    *why += text;
  }
}

// The rules key on the rows an expert receives under balanced routing, T * K / E (as the FP8 WGRAD
// choice and the NVFP4 split-K do, core/plan_terms.h), not on capacity / E, which the capacity
// factor inflates (bench_ep runs Config.capacity_factor 2; the rules were measured at 1, where the
// two agree).
int64_t rows_per_expert(const Step& s) { return balanced_rows_per_expert(s.dims); }

// EPMOE_GEMM_SCHEDULE_<KIND>: the kind's name (to_string) in capitals, built once.
const char* schedule_override_name(GemmKind kind) {
  constexpr int kKinds = static_cast<int>(GemmKind::w13_wgrad) + 1;
  static const std::array<std::string, kKinds> names = [] {
    std::array<std::string, kKinds> n;
    for (int k = 0; k < kKinds; ++k) {
      n[k] = std::string("EPMOE_GEMM_SCHEDULE_") + gemm::to_string(static_cast<GemmKind>(k));
      for (char& c : n[k]) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    }
    return n;
  }();
  return names[static_cast<int>(kind)].c_str();
}
}  // namespace

Schedule select_schedule(GemmKind kind, const Step& s, std::string* why) {
  const char* names[] = {schedule_override_name(kind),
                         is_wgrad(kind) ? "EPMOE_GEMM_SCHEDULE_WGRAD" : nullptr,
                         "EPMOE_GEMM_SCHEDULE"};
  const char* env = nullptr;
  const char* name = nullptr;
  for (const char* n : names) {
    env = n == nullptr ? nullptr : std::getenv(n);
    if (env != nullptr) {
      name = n;
      break;
    }
  }
  if (env != nullptr) {
    say(why, [&] { return std::string(name) + "=" + env + " (override)"; });
    if (std::strcmp(env, "cooperative") == 0) return Schedule::cooperative;
    EPMOE_CHECK_ARG(std::strcmp(env, "pingpong") == 0, name, "cooperative or pingpong", env);
#if !defined(EPMOE_GEMM_ALL_CONFIGS)
    EPMOE_CHECK_ARG(false, name,
                    "cooperative in a build with EPMOE_GEMM_CONFIGS=CI", env);
#endif
    return Schedule::pingpong;
  }
  const int64_t rows = rows_per_expert(s);
  switch (kind) {
    case GemmKind::w13_fprop:
    case GemmKind::w2_fprop:
      say(why, "forward rule: one warpgroup's epilogue under the other's MMA");
      return Schedule::pingpong;
    case GemmKind::w2_dgrad:
      say(why, "W2 DGRAD rule: ping-pong measured x0.87-0.99 against cooperative (gpt-oss x0.99-1.07)");
      return Schedule::pingpong;
    case GemmKind::w13_dgrad: {
      const int64_t k = 2 * s.dims.F;  // its reduction length
      const bool narrow = fills_192_not_256(s.dims.D);
      const bool pp = rows <= 192 || k <= kW13DgradPingPongMaxK || narrow;
      say(why, [&] {
        return "T*K/E = " + std::to_string(rows) + " rows per expert " + (rows <= 192 ? "<=" : ">") +
               " 192, K = 2F = " + std::to_string(k) + (k <= kW13DgradPingPongMaxK ? " <= " : " > ") +
               std::to_string(kW13DgradPingPongMaxK) + (narrow ? ", D = " + width_text(s.dims.D) : "");
      });
      return pp ? Schedule::pingpong : Schedule::cooperative;
    }
    case GemmKind::w2_wgrad:
    case GemmKind::w13_wgrad:
      say(why, "WGRAD rule: ping-pong measured 1.3-1.6x slower");
      return Schedule::cooperative;
  }
  return Schedule::cooperative;
}

// Measured on H200 (EP = 1, bench/results/2026-11-30-781c4d5-h200-wgrad-store-*.json, W2 / W13
// WGRAD ms, TMA / direct): where experts hold few rows the TMA store's overlap wins (deepseek-v3,
// ~128 rows: 4.26 / 6.74, 8.43 / 13.51; gpt-oss, ~256: 2.06 / 2.54, 3.97 / 4.92; qwen3, ~512:
// 0.50 / 0.60, 0.94 / 1.17). With long k-loops the direct store's fourth stage won then (mixtral,
// ~2048 rows: 4.13 / 3.77, 7.84 / 7.38). Measured again at e2eec51 (whose TMA staging computes 8
// addresses per thread instead of 64; the two stagings were not timed against each other), the
// TMA store wins there too: 3.162 / 5.905 against 3.500 / 6.909 and 3.398 / 6.743 (2026-12-01,
// bench/results/2026-12-01-e2eec51-h200-wgrad-store-mixtral-ab*.json, alternating). So the TMA
// store everywhere; the direct store stays for accumulated or f32 gradients and as
// EPMOE_WGRAD_STORE=direct. Measured slower than the TMA store on deepseek-v3
// (bench/RESULTS.md, f0243ba ... and 2026-12-01): TMA staging in two rounds with a fourth stage
// (x1.08-1.10), one bulk group per 64 x 64 box (x1.07-1.10), stores from the registers after a
// quad transpose (x1.20-1.25), staging deferred under the next tile's first k-block (x1.08-1.19 on
// deepseek-v3, gpt-oss, qwen3; none on mixtral; 7e26b45); their code was not kept.
//
// The stores issued by a warp of the producer warpgroup (tma_warp) take the consumers' ~700-clock
// wait for the previous tile's stores and its barrier off their path. Where experts hold ~128 rows
// (deepseek-v3 at EP = 1: two k-blocks a tile) the tile period fell x0.87 (clock stamps, 1 550 ->
// 720 epilogue clocks) and W2 / W13 WGRAD x0.89-0.91 in three alternating A / B pairs. At ~256 rows
// (gpt-oss) it measured x1.02-1.05 slower, though the stamped tile period fell: the stores now run
// under the next tile's k-loop, whose MMA phase grew 4 991 -> 6 162 clocks. Neutral on qwen3 (~512)
// and mixtral (~2048). bench/RESULTS.md "2026-12-01 · 7d26173".
WgradStore select_wgrad_store(GemmKind kind, const Step& s, std::string* why) {
  (void)kind;
  const char* env = std::getenv("EPMOE_WGRAD_STORE");
  if (env != nullptr) {
    say(why, [&] { return std::string("EPMOE_WGRAD_STORE=") + env + " (override)"; });
    if (std::strcmp(env, "tma") == 0) return WgradStore::tma;
    if (std::strcmp(env, "tma_warp") == 0) return WgradStore::tma_warp;
    EPMOE_CHECK_ARG(std::strcmp(env, "direct") == 0, "EPMOE_WGRAD_STORE", "tma, tma_warp or direct", env);
    return WgradStore::direct;
  }
  const int64_t rows = rows_per_expert(s);
  const bool warp = rows <= kWgradStoreWarpMaxRows;
  say(why, [&] {
    return "T*K/E = " + std::to_string(rows) + " rows per expert " + (warp ? "<= " : "> ") +
           std::to_string(kWgradStoreWarpMaxRows);
  });
  return warp ? WgradStore::tma_warp : WgradStore::tma;
}

// 128 x 192 fits a fourth stage beside its TMA-store staging (4 x 40 + 2 x 24 KiB): the timeline
// (bench/RESULTS.md 004ced0) shows gpt-oss's 4-5 k-block tiles waiting for their last stage,
// which three stages let the producer load only once the tile's first block retires, and its
// D = F = 2880 fills 15 tiles of 192 where 256 leaves the twelfth a quarter full. Measured
// (bench/RESULTS.md 8673ba6, two alternating pairs, W2 / W13 WGRAD against 128 x 256): gpt-oss
// x0.99 / 0.97 and x1.20 / 1.22, deepseek-v3 x1.22-1.24, mixtral x1.00-1.05 slower, qwen3 x0.93-
// 0.99 (the defaults' own repeat x0.98): off unless asked for.
WgradTile select_wgrad_tile(GemmKind kind, const Step& s, std::string* why) {
  (void)kind;
  (void)s;
  const char* env = std::getenv("EPMOE_WGRAD_TILE");
  say(why, [&] {
    return env == nullptr ? std::string("rule; 128 x 192 measured slower")
                          : std::string("EPMOE_WGRAD_TILE=") + env + " (override)";
  });
  if (env == nullptr || std::strcmp(env, "128x256") == 0) return WgradTile::n256;
  EPMOE_CHECK_ARG(std::strcmp(env, "128x192") == 0, "EPMOE_WGRAD_TILE", "128x256 or 128x192", env);
#if !defined(EPMOE_GEMM_ALL_CONFIGS)
  EPMOE_CHECK_ARG(false, "EPMOE_WGRAD_TILE", "128x256 in a build with EPMOE_GEMM_CONFIGS=CI", env);
#endif
  return WgradTile::n192;
}

namespace {
// The output width N of a rows-grouping GEMM with one B operand.
int64_t rows_gemm_n(GemmKind kind, const Step& s) {
  return kind == GemmKind::w2_dgrad ? s.dims.F : s.dims.D;  // W2 DGRAD: grad_h; else D-wide rows
}
}  // namespace

RowsTileN select_rows_tile_n(GemmKind kind, const Step& s, std::string* why) {
  return select_rows_tile_n(kind, s, select_schedule(kind, s), why);
}

// 192-column rows tiles where they fill N exactly and 256-column ones do not, on ping-pong tiles.
// Measured on gpt-oss (D = F = 2880: 15 tiles of 192, 11.25 of 256) at 513de24, four alternating
// pairs (bench/RESULTS.md "2026-12-03 · 513de24"), stage ms against 256: W2 FPROP (ping-pong)
// x0.83-0.92, W2 DGRAD (ping-pong) x0.87-0.92, fwd+bwd x0.97; W13 DGRAD (cooperative 128 x 192)
// x1.03-1.07 slower, so cooperative tiles keep 256.
RowsTileN select_rows_tile_n(GemmKind kind, const Step& s, Schedule schedule, std::string* why) {
  EPMOE_CHECK_ARG(kind == GemmKind::w2_fprop || kind == GemmKind::w2_dgrad || kind == GemmKind::w13_dgrad,
                  "select_rows_tile_n kind", "w2_fprop, w2_dgrad or w13_dgrad", to_string(kind));
  const char* env = std::getenv("EPMOE_GEMM_ROWS_TILE_N");
  if (env != nullptr) {
    say(why, [&] { return std::string("EPMOE_GEMM_ROWS_TILE_N=") + env + " (override)"; });
    if (std::strcmp(env, "256") == 0) return RowsTileN::n256;
    EPMOE_CHECK_ARG(std::strcmp(env, "192") == 0, "EPMOE_GEMM_ROWS_TILE_N", "256 or 192", env);
#if !defined(EPMOE_GEMM_ALL_CONFIGS)
    EPMOE_CHECK_ARG(false, "EPMOE_GEMM_ROWS_TILE_N", "256 in a build with EPMOE_GEMM_CONFIGS=CI", env);
#endif
    return RowsTileN::n192;
  }
  const int64_t n = rows_gemm_n(kind, s);
  const bool fits = fills_192_not_256(n);
  const bool pingpong = schedule == Schedule::pingpong;
  say(why, [&] {
    const std::string tiles = "N = " + width_text(n);
    if (!fits) return tiles + ": 256";
    return tiles + (pingpong ? ", ping-pong: 192" : ", cooperative: 256 (192 measured slower)");
  });
  return fits && pingpong ? RowsTileN::n192 : RowsTileN::n256;
}

namespace {
// A 0 / 1 switch read per launch (~100 ns): its value, or `fallback` when unset.
bool switch_from_env(const char* name, bool fallback, std::string* why) {
  const char* env = std::getenv(name);
  say(why, [&] {
    return env == nullptr ? std::string("rule") : std::string(name) + "=" + env + " (override)";
  });
  if (env == nullptr) return fallback;
  EPMOE_CHECK_ARG(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, name, "0 or 1", env);
  return env[0] == '1';
}
}  // namespace

// Peeling the partial k-block out of the WGRAD's loop lets the full k-blocks keep one wgmma batch
// in flight (the rows grouping's loop) instead of retiring each. Measured on every shape at EP = 1
// (bench/RESULTS.md, 0305eb4): W2 / W13 WGRAD x0.86 / 0.87 (qwen3), 0.97 / 0.96 (deepseek-v3),
// 0.91 / 0.91 (gpt-oss), 1.00 / 1.02 (mixtral, direct stores: noise), so on everywhere.
bool select_wgrad_peel(GemmKind kind, const Step& s, std::string* why) {
  (void)kind;
  (void)s;
  return switch_from_env("EPMOE_WGRAD_PEEL", true, why);
}

// Pairs of CTAs multicasting B (grouped_gemm_sm90.cuh) are measured against single CTAs per GEMM
// kind with EPMOE_GEMM_CLUSTER (every kind) or EPMOE_GEMM_CLUSTER_WGRAD (the two WGRADs, first);
// until a kind's row in bench/RESULTS.md shows a gain it runs unpaired. Last measured at 75fe3af,
// before the WGRAD's k-tail fix (004ced0). Since it, deepseek-v3's W13 WGRAD loads its operands
// at about the same rate on the cooperative 128 x 256 tile and on the 64 x 256 ping-pong one (4.8
// and 4.4 TB/s of k-blocks, 1.67x the bytes taking 1.8x the time; bench/RESULTS.md 004ced0): if
// that rate is their bound, pairs (B shared by two m-tiles) cut the L2 reads by a third; unmeasured.
int select_cluster(GemmKind kind, const Step& s, std::string* why) {
  (void)s;
  for (const char* name :
       {is_wgrad(kind) ? "EPMOE_GEMM_CLUSTER_WGRAD" : nullptr, "EPMOE_GEMM_CLUSTER"}) {
    const char* env = name == nullptr ? nullptr : std::getenv(name);
    if (env == nullptr) continue;
    say(why, [&] { return std::string(name) + "=" + env + " (override)"; });
    if (std::strcmp(env, "1") == 0) return 1;
    EPMOE_CHECK_ARG(std::strcmp(env, "2") == 0, name, "1 or 2", env);
#if !defined(EPMOE_GEMM_ALL_CONFIGS)
    EPMOE_CHECK_ARG(false, name, "1 in a build with EPMOE_GEMM_CONFIGS=CI", env);
#endif
    return 2;
  }
  say(why, "rule: pairs showed no gain");
  return 1;
}

namespace {
// A band-rows override: true and `rows` where `name` is set (a count in [0, 2^24]).
bool band_rows_from_env(const char* name, int& rows, std::string* why) {
  const char* env = std::getenv(name);
  if (env == nullptr) return false;
  say(why, [&] { return std::string(name) + "=" + env + " (override)"; });
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  EPMOE_CHECK_ARG(end != env && *end == '\0' && v >= 0 && v <= (1 << 24), name, "a row count in [0, 2^24]",
                  env);
  rows = static_cast<int>(v);
  return true;
}
}  // namespace

// Bands of max(4096, 2 T*K/E, 32 MiB / 2k) rows: balanced routing never splits a group (its largest
// groups stay well under twice T*K/E), skewed routing splits the experts that hold several times
// their share, and only where their rows outgrow L2 (a band re-reads the weights: qwen3's skewed
// groups of ~5 800 x 2 048 bf16, 24 MB, ran x0.95-1.00 without bands against bands of 4 096 rows,
// two pairs at 125ae90).
// Measured on mixtral under skew (experts 0 and 1 at ~8 000 of T = 8 192 rows, K = 4 096 to 28 672)
// at d3d4b2b, bench/RESULTS.md "2026-12-04": bands of 1 024 rows, three alternating pairs, W13
// FPROP x0.79-0.89, W2 FPROP x0.79-0.91, W2 DGRAD x0.83-0.92, W13 DGRAD x0.80-0.93, fwd+bwd
// x0.94-0.95 (under a power cap: fewer HBM re-reads also leave the untouched WGRADs more clock);
// 4 096 in one run about the same; but 1 024 splits mixtral's balanced 2 048-row groups, x1.02-1.04
// slower, and gave qwen3 / deepseek-v3 / gpt-oss under skew nothing (x0.95-1.06). The rule of
// 4 096 rows against none at 125ae90, two pairs under skew: mixtral without bands W13 FPROP
// x1.05-1.07, W2 FPROP x1.02-1.04, W2 DGRAD x1.03-1.10, fwd+bwd x1.03-1.04.
int select_band_rows(const Step& s, int64_t k, std::string* why) {
  int forced = 0;
  if (band_rows_from_env("EPMOE_GEMM_BAND_ROWS", forced, why)) return forced;
  const int64_t balanced = rows_per_expert(s);
  const int64_t in_l2 = k > 0 ? kBandL2Bytes / (2 * k) : 0;
  const int64_t rows = std::max<int64_t>({kBandMinRows, 2 * balanced, in_l2});
  say(why, [&] {
    return "rule: max(" + std::to_string(kBandMinRows) + ", 2 T*K/E = " + std::to_string(2 * balanced) +
           ", 32 MiB of K = " + std::to_string(k) + " bf16 = " + std::to_string(in_l2) + ")";
  });
  return static_cast<int>(std::min<int64_t>(rows, 1 << 24));
}

int select_fp8_band_rows(const Step& s, std::string* why) {
  (void)s;
  int forced = 0;
  if (band_rows_from_env("EPMOE_FP8_BAND_ROWS", forced, why)) return forced;
  say(why, "rule: none (bands not yet measured on FP8)");
  return 0;
}

int device_sm_count() {
  static std::mutex mu;
  static std::vector<int> counts;
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(counts.size()) <= device) counts.resize(device + 1, 0);
  if (counts[device] == 0) {
    EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

void check_groups(const Step& s) {
  EPMOE_CHECK_ARG(s.dims.E <= kMaxGroups, "Config.num_experts",
                  "at most " + std::to_string(kMaxGroups) + " local experts per rank (CUDA GEMM)",
                  s.dims.E);
}

}  // namespace gemm
}  // namespace epmoe::cuda
