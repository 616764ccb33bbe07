// The grouped GEMMs' kernel choices (host side): what a launch can run (schedule, cluster, the
// WGRAD's store, tile and k-tail) and the selectors that pick one per GEMM of a Step. Each selector
// applies its measured rule (gemm_config.cpp, with the figures behind it) unless an environment
// override is set, and with `why` also says which and on what values: cuda/kernel_explain.h prints
// them for a configuration.
#pragma once

#include <cstdint>
#include <string>

namespace epmoe {
struct Step;
}

namespace epmoe::cuda {

constexpr int kMaxGroups = 512;  // local experts per rank the grouped GEMM schedules

// Which operand dimension the expert groups split.
//   rows:      C[m, n] = sum_k A[m, k] * B_e[n, k] for the rows m of expert e (forward, DGRAD)
//   reduction: C_e[m, n] = sum over rows r of expert e of A[r, m] * B[r, n] (WGRAD)
enum class Grouping : int { rows, reduction };

// Where an operand's consecutive elements run: along K (row-major activations, weights as
// [N, K]) or along M/N (weights read transposed in DGRAD, activations in WGRAD).
enum class Major : int { K, MN };

// Consumer warpgroups: both on one 128-row tile (cooperative), or alternate 64-row tiles so one
// warpgroup's epilogue overlaps the other's MMA (ping-pong).
enum class Schedule : int { cooperative, pingpong };
const char* to_string(Schedule s);

// How the bf16 WGRAD stores an overwritten gradient (gemm::select_wgrad_store): TMA stores issued by
// the consumers, 16-byte stores by the consumers, or TMA stores issued by a producer warp.
enum class WgradStore : int { tma, direct, tma_warp };
// Rows per expert under balanced routing (T * K / local experts) up to which the producer warp
// issues the stores.
constexpr int64_t kWgradStoreWarpMaxRows = 192;

// The TMA-store WGRAD's output tile (gemm::select_wgrad_tile): 128 x 256 on 3 stages, or 128 x 192
// on 4 (the same shared memory; 1.11x the operand bytes per FLOP, a stage more to run ahead with).
enum class WgradTile : int { n256, n192 };

// The width of the rows-grouping tile of the GEMMs with one B operand (W2 FPROP, W2 DGRAD, W13
// DGRAD; gemm::select_rows_tile_n): 256 columns, or 192 (6 ping-pong / 5 cooperative stages in
// about the same shared memory; 1.07x the operand bytes per FLOP of 256), which tiles N = 2880
// exactly where 256 leaves the twelfth tile a quarter full.
enum class RowsTileN : int { n256, n192 };

// The six expert GEMMs (their schedule is chosen per kind).
enum class GemmKind : int { w13_fprop, w2_fprop, w2_dgrad, w13_dgrad, w2_wgrad, w13_wgrad };

namespace gemm {

const char* to_string(GemmKind k);

// Each selector returns its choice for GEMM `kind` of step `s` (only s.dims is read: the rules key
// on the balanced rows per expert T * K / E) and, with `why`, appends the rule or override that
// made it.

// The consumer schedule: EPMOE_GEMM_SCHEDULE[_<KIND>|_WGRAD]=cooperative|pingpong forces one (for
// measurements), else the measured table.
Schedule select_schedule(GemmKind kind, const Step& s, std::string* why = nullptr);

// CTAs that share each B tile (1, or a pair multicasting it): EPMOE_GEMM_CLUSTER[_WGRAD]=1|2
// forces it, else 1.
int select_cluster(GemmKind kind, const Step& s, std::string* why = nullptr);

// How the bf16 WGRAD writes an overwritten gradient: through one TMA-store buffer per warpgroup
// (3 stages) that drains during the next tile's MMA, its stores issued by the consumers or, up to
// kWgradStoreWarpMaxRows rows per expert, by a producer warp; or by the threads (staged rows,
// 16-byte global stores; 4 stages). EPMOE_WGRAD_STORE=tma|tma_warp|direct forces one.
WgradStore select_wgrad_store(GemmKind kind, const Step& s, std::string* why = nullptr);

// The output tile of the TMA-store WGRAD (cooperative, unclustered): EPMOE_WGRAD_TILE=128x256|
// 128x192 forces one (128x192 is built with EPMOE_GEMM_CONFIGS=ALL only), else 128 x 256.
WgradTile select_wgrad_tile(GemmKind kind, const Step& s, std::string* why = nullptr);

// The rows tile's width of W2 FPROP, W2 DGRAD and W13 DGRAD (single CTAs; 192 is built with
// EPMOE_GEMM_CONFIGS=ALL only): EPMOE_GEMM_ROWS_TILE_N=256|192 forces one, else 192 on ping-pong
// tiles where N is a multiple of 192 and not of 256 (gpt-oss's 2880), 256 otherwise.
RowsTileN select_rows_tile_n(GemmKind kind, const Step& s, std::string* why = nullptr);
// The same for the schedule select_schedule() already gave (the launcher reads it once a launch).
RowsTileN select_rows_tile_n(GemmKind kind, const Step& s, Schedule schedule, std::string* why = nullptr);

// Whether the bf16 WGRAD (cooperative, unclustered; overwritten output) runs its full k-blocks with
// one wgmma batch in flight and the partial one after them: EPMOE_WGRAD_PEEL=1|0 forces it, else on.
bool select_wgrad_peel(GemmKind kind, const Step& s, std::string* why = nullptr);

// The rows GEMMs' m-tile bands (grouped_gemm_sm90.cuh's TileScheduler) for a GEMM of reduction
// length k: a group of more rows than this runs as bands of at most this many rows, each over every
// n-tile. EPMOE_GEMM_BAND_ROWS=<rows> forces it (0: no bands), else max(kBandMinRows, 2 T*K/E,
// the rows of k bf16 that fill kBandL2Bytes).
inline constexpr int kBandMinRows = 4096;
inline constexpr int64_t kBandL2Bytes = int64_t{32} << 20;
int select_band_rows(const Step& s, int64_t k, std::string* why = nullptr);
// The same for the FP8 rows GEMMs: EPMOE_FP8_BAND_ROWS=<rows> forces it, else none (not yet
// measured on FP8).
int select_fp8_band_rows(const Step& s, std::string* why = nullptr);

}  // namespace gemm
}  // namespace epmoe::cuda
