// Grouped GEMM problem descriptor and kernel config, apart from each other: the problem says what
// to compute, the config how; select_config() is the printable heuristic between them.
#pragma once

#include <cstdint>
#include <string>

namespace epmoe::cuda {

constexpr int kMaxGroups = 512;  // local experts per rank the grouped GEMM schedules

// Which operand dimension the expert groups split.
//   rows:      C[m, n] = sum_k A[m, k] * B_e[n, k] for the rows m of expert e (forward, DGRAD)
//   reduction: C_e[m, n] = sum over rows r of expert e of A[r, m] * B[r, n] (WGRAD)
enum class Grouping : int { rows, reduction };

// Where an operand's consecutive elements run: along K (row-major activations, weights as
// [N, K]) or along M/N (weights read transposed in DGRAD, activations in WGRAD).
enum class Major : int { K, MN };

struct GemmProblem {
  const char* name = "";   // "w13_fprop", ...
  Grouping grouping = Grouping::rows;
  Major a_major = Major::K;
  Major b_major = Major::K;
  int num_b = 1;           // 2: gate and up halves of W13 as two B operands (SwiGLU pairs)
  int64_t m = 0;           // rows: capacity rows; reduction: output rows
  int64_t n = 0;           // output columns (per B operand when num_b == 2)
  int64_t k = 0;           // rows: reduction length; reduction: capacity rows
  int groups = 0;          // local experts E
  int64_t expected_rows_per_group = 0;  // host estimate (capacity / E), for tile choice only
};

struct GemmConfig {
  int block_m = 128;       // 64 per consumer warpgroup
  int block_n = 256;       // per B operand
  int block_k = 64;
  int stages = 4;
  int num_sms = 0;         // persistent grid size
  std::string to_string() const;
};

// Consumer warpgroups: both on one 128-row tile (cooperative), or alternate 64-row tiles so one
// warpgroup's epilogue overlaps the other's MMA (ping-pong).
enum class Schedule : int { cooperative, pingpong };
const char* to_string(Schedule s);

// How the bf16 WGRAD stores an overwritten gradient (gemm::select_wgrad_store): TMA stores issued by
// the consumers, 16-byte stores by the consumers, or TMA stores issued by a producer warp.
enum class WgradStore : int { tma, direct, tma_warp };
// Rows per expert (capacity / local experts) up to which the producer warp issues the stores.
constexpr int64_t kWgradStoreWarpMaxRows = 192;

// The TMA-store WGRAD's output tile (gemm::select_wgrad_tile): 128 x 256 on 3 stages, or 128 x 192
// on 4 (the same shared memory; 1.11x the operand bytes per FLOP, a stage more to run ahead with).
enum class WgradTile : int { n256, n192 };

// The six expert GEMMs (their schedule is chosen per kind).
enum class GemmKind : int { w13_fprop, w2_fprop, w2_dgrad, w13_dgrad, w2_wgrad, w13_wgrad };
const char* to_string(GemmKind k);

// Printable heuristic: a small table of configs that exist as instantiations.
GemmConfig select_config(const GemmProblem& p, int num_sms);
std::string to_string(const GemmProblem& p);

}  // namespace epmoe::cuda
