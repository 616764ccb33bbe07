// route: every rank computes the same global layout from all ranks' published ids (core/layout.h).
//
//   1. route_histogram_kernel, grid (C, R): block (c, s) copies chunk c (kRouteChunkRoutes routes)
//      of source s's ids into ids_all and writes the chunk's histogram over the E*R global experts.
//   2. route_prefix_kernel, one CTA: counts[s][g] = sum over chunks; an exclusive scan over g of
//      the per-expert totals gives each receiver's expert-major row space; each (s, g) block starts
//      at expert_base + rows of lower source ranks, and each chunk at that block start plus the
//      rows of earlier chunks (written over the chunk histograms). Then the header checks, the
//      capacity check, the status word and the layout header (same rules as the CPU route).
//   3. route_rank_kernel, grid (C, R): within a chunk, warp w takes a contiguous sub-range; a
//      per-warp histogram scanned over warps gives each warp's first row per expert, and the warp
//      walks its routes 32 at a time in order, ranking equal ids with __match_any_sync. Positions
//      come from counts alone, never from atomic order: the result is deterministic and equals
//      the sequential walk of build_layout_reference().
//   Pulls (core/layout.h), around the prefix: route_pull_count_kernel, grid (token chunks, R),
//   counts the tokens of each chunk with a route to this rank (and zeroes the dispatch arrival
//   counters); route_pull_list_kernel numbers them in (s, t) order (earlier chunks' counts + a
//   block scan), writes each pull's source and -1 in its K row slots, and the pull count into the
//   header; route_rank_kernel then writes the row of each route to this rank into its pull's slot.
// Each kernel's body is a device function over one block ("*_block"). Where every source's routes
// fit one chunk and its tokens one pull chunk (decode sizes), route_single_kernel runs the same
// bodies in one CTA, phase by phase behind block barriers, instead of five launches: the same
// stores in the same order per block, so the same layout (select_route_kernels). Its scratch
// (ids, counts, chunk starts, pull numbers) lives in shared memory instead of the route scratch:
// every phase reads what the one before wrote, and at decode sizes the route is a chain of such
// round trips.
#include "cuda/route.h"

#include <cstdlib>
#include <cstring>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/kernel_common.cuh"
#include "epmoe/error.h"

namespace epmoe::cuda {
namespace {

constexpr int kHistogramThreads = 256;
constexpr int kPrefixThreads = 1024;
constexpr int kRankWarps = 8;
constexpr int kRankThreads = kRankWarps * 32;
constexpr int kPullThreads = static_cast<int>(kPullChunkTokens);  // one token per thread
static_assert(kPullThreads == 1024, "a pull chunk is one CTA of 1024 tokens");
// The one-CTA route: the prefix's and the pull chunks' block size, every warp ranking.
constexpr int kSingleThreads = 1024;
constexpr int kSingleRankWarps = kSingleThreads / 32;
static_assert(kPrefixThreads == kSingleThreads && kPullThreads == kSingleThreads,
              "the one-CTA route runs the prefix and pull bodies at their block size");
// Largest E*R of the one-CTA route: its ranking keeps one expert row per (warp, expert) in 64 KiB.
constexpr int kSingleMaxGlobalExperts = 512;
// Shared memory the one-CTA route may take (the device allows 227 KiB a block).
constexpr int64_t kSingleMaxSmemBytes = 200 * 1024;

struct RouteParams {
  char* const* routing_R;  // [R] routing buffers: RoutingHeader | ids [T, K] i32 | scores
  int32_t* ids_all_RTK;    // [R, T*K] i32: every rank's ids (scratch)
  int32_t* counts_RG;      // [R, Eg] i32: routes of source s to global expert g
  int32_t* chunk_RCG;      // [R, C, Eg] i32: chunk histograms, then each chunk's first row per (s, g)
  int32_t* pull_of_token_RT;  // [R, T] i32: pull of (s, t), -1 without a route to this rank
  int32_t* pull_counts_RC;    // [R, token chunks] i32: tokens of each chunk with a route here
  uint32_t* arrivals_B;       // [arrival blocks] u32: dispatch arrival counters (zeroed here)
  LayoutView layout;       // this rank's layout (header, offsets [E+1], recv rows [R], src [cap], row [T*K])
  Status* status;          // [1] status word
  int64_t T;               // Config T
  int64_t tokens;          // this rank's T'
  int64_t capacity;        // receive rows per rank
  int64_t ids_offset;      // bytes of the ids in a routing buffer
  int64_t pull_capacity;   // pulls the layout holds
  int64_t arrival_blocks;  // entries of arrivals_B
  int K, E, R, Eg, chunks, token_chunks, self, trap_on_overflow;
};

// Whether token t of source s has a route to this rank.
__device__ __forceinline__ bool routes_here(const RouteParams& p, int s, int64_t t) {
  const int32_t* ids_K = p.ids_all_RTK + (static_cast<int64_t>(s) * p.T + t) * p.K;  // [K]
  bool here = false;
  for (int k = 0; k < p.K; ++k) {
    const int32_t g = ids_K[k];
    here = here || (g >= 0 && g / p.E == p.self);
  }
  return here;
}

// Block (c, s) of the (token chunks, R) grid; `blocks` of them zero the arrival counters.
__device__ __forceinline__ void pull_count_block(const RouteParams& p, int c, int s, int blocks) {
  const int64_t block = static_cast<int64_t>(s) * p.token_chunks + c;
  const int64_t stride = static_cast<int64_t>(blocks) * kPullThreads;
  for (int64_t j = block * kPullThreads + threadIdx.x; j < p.arrival_blocks; j += stride) {
    p.arrivals_B[j] = 0u;
  }
  const int64_t t = static_cast<int64_t>(c) * kPullChunkTokens + threadIdx.x;
  const int n = __syncthreads_count(t < p.T && routes_here(p, s, t));
  if (threadIdx.x == 0) p.pull_counts_RC[static_cast<int64_t>(s) * p.token_chunks + c] = n;
}

__global__ void __launch_bounds__(kPullThreads) route_pull_count_kernel(const RouteParams p) {
  pull_count_block(p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                   static_cast<int>(gridDim.x * gridDim.y));
}

__device__ __forceinline__ void pull_list_block(const RouteParams& p, int c, int s) {
  using BlockScan = cub::BlockScan<int32_t, kPullThreads>;
  using BlockReduce = cub::BlockReduce<int32_t, kPullThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename BlockReduce::TempStorage reduce_storage;
  __shared__ int32_t first_pull;
  const int64_t chunk = static_cast<int64_t>(s) * p.token_chunks + c;  // (s, c) in (s, t) order
  int32_t before = 0;
  for (int64_t j = threadIdx.x; j < chunk; j += kPullThreads) before += p.pull_counts_RC[j];
  before = BlockReduce(reduce_storage).Sum(before);
  if (threadIdx.x == 0) first_pull = before;
  const int64_t t = static_cast<int64_t>(c) * kPullChunkTokens + threadIdx.x;
  const bool here = t < p.T && routes_here(p, s, t);
  int32_t rank_in_chunk = 0, in_chunk = 0;
  BlockScan(scan_storage).ExclusiveSum(here ? 1 : 0, rank_in_chunk, in_chunk);
  __syncthreads();
  const int32_t pull = first_pull + rank_in_chunk;
  if (t < p.T) p.pull_of_token_RT[static_cast<int64_t>(s) * p.T + t] = here ? pull : -1;
  if (here && pull < p.pull_capacity) {
    p.layout.pull_src_P[pull] = encode_pull(s, t, p.T);
    for (int k = 0; k < p.K; ++k) p.layout.pull_rows_PK[static_cast<int64_t>(pull) * p.K + k] = -1;
  }
  // The last chunk knows P. A layout without rows (none received, or an input error) has none.
  if (threadIdx.x == 0 && s == p.R - 1 && c == p.token_chunks - 1) {
    p.layout.header[kLayoutPulls] = p.layout.header[kLayoutRows] == 0 ? 0 : first_pull + in_chunk;
  }
}

__global__ void __launch_bounds__(kPullThreads) route_pull_list_kernel(const RouteParams p) {
  pull_list_block(p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y));
}

// hist_G: [Eg] shared.
__device__ __forceinline__ void histogram_block(const RouteParams& p, int c, int s, int32_t* hist_G) {
  const int64_t TK = p.T * p.K;
  for (int g = static_cast<int>(threadIdx.x); g < p.Eg; g += blockDim.x) hist_G[g] = 0;
  __syncthreads();
  const auto* src_TK = reinterpret_cast<const int32_t*>(p.routing_R[s] + p.ids_offset);  // [T, K] peer
  int32_t* dst_TK = p.ids_all_RTK + s * TK;                                             // [T, K]
  const int64_t lo = static_cast<int64_t>(c) * kRouteChunkRoutes;
  const int64_t hi = lo + kRouteChunkRoutes < TK ? lo + kRouteChunkRoutes : TK;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    int32_t g = __ldcg(src_TK + i);
    if (g < -1 || g >= p.Eg) g = -1;  // publish never writes these; never index with one anyway
    dst_TK[i] = g;
    if (g >= 0) atomicAdd(&hist_G[g], 1);  // a count: independent of the order of the adds
  }
  __syncthreads();
  int32_t* out_G = p.chunk_RCG + (static_cast<int64_t>(s) * p.chunks + c) * p.Eg;  // [Eg]
  for (int g = static_cast<int>(threadIdx.x); g < p.Eg; g += blockDim.x) out_G[g] = hist_G[g];
}

__global__ void __launch_bounds__(kHistogramThreads) route_histogram_kernel(const RouteParams p) {
  extern __shared__ int32_t hist_G[];  // [Eg]
  histogram_block(p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), hist_G);
}

__device__ __forceinline__ void write_status(Status* st, StatusCode code, int rank, StatusArg arg,
                                             int64_t required, int64_t available, int64_t index) {
  if (st->code != 0) return;  // the first error stays until the host takes it
  st->rank = rank;
  st->arg = static_cast<int32_t>(arg);
  st->reserved = 0;
  st->required = required;
  st->available = available;
  st->index = index;
  st->code = static_cast<int32_t>(code);
}

// Shared ints of prefix_block: the scan [Eg + 1], then the header words its checks read.
__host__ __device__ constexpr int64_t prefix_smem_ints(int Eg, int R) { return Eg + 1 + 2 * R + 2; }

// first_row_G1: prefix_smem_ints shared, the exclusive scan of per-expert totals [Eg + 1], then
// every rank's (tokens, error code) of its routing header, the status code and this rank's live
// rows: loaded by R + 2 threads at the start, so that the checks at the end (one thread) wait on
// shared memory, not on a chain of global loads.
__device__ __forceinline__ void prefix_block(const RouteParams& p, int32_t* first_row_G1) {
  using BlockScan = cub::BlockScan<int32_t, kPrefixThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int tid = static_cast<int>(threadIdx.x);
  const int Eg = p.Eg;
  const int64_t RG = static_cast<int64_t>(p.R) * Eg;
  int32_t* header_words = first_row_G1 + Eg + 1;  // [2R + 2]
  for (int r = tid; r < p.R + 2; r += kPrefixThreads) {
    if (r < p.R) {
      const auto* h = reinterpret_cast<const RoutingHeader*>(p.routing_R[r]);  // [1] rank r's header
      header_words[2 * r] = __ldcg(&h->tokens);
      header_words[2 * r + 1] = __ldcg(&h->error_code);
    } else if (r == p.R) {
      header_words[2 * p.R] = __ldcg(&p.status->code);
    } else {
      header_words[2 * p.R + 1] =
          __ldcg(&reinterpret_cast<const RoutingHeader*>(p.routing_R[p.self])->live);
    }
  }

  // counts[s][g] = sum over chunks.
  for (int64_t j = tid; j < RG; j += kPrefixThreads) {
    const int64_t s = j / Eg, g = j % Eg;
    int32_t total = 0;
    for (int c = 0; c < p.chunks; ++c) total += p.chunk_RCG[(s * p.chunks + c) * Eg + g];
    p.counts_RG[j] = total;
  }
  __syncthreads();
  // Per-expert totals over sources, then an exclusive scan over g (contiguous items per thread).
  for (int g = tid; g < Eg; g += kPrefixThreads) {
    int32_t total = 0;
    for (int s = 0; s < p.R; ++s) total += p.counts_RG[static_cast<int64_t>(s) * Eg + g];
    first_row_G1[g] = total;
  }
  __syncthreads();
  const int per_thread = (Eg + kPrefixThreads - 1) / kPrefixThreads;
  const int g_lo = tid * per_thread < Eg ? tid * per_thread : Eg;
  const int g_hi = g_lo + per_thread < Eg ? g_lo + per_thread : Eg;
  int32_t mine = 0;
  for (int g = g_lo; g < g_hi; ++g) mine += first_row_G1[g];
  int32_t before = 0, all = 0;
  BlockScan(scan_storage).ExclusiveSum(mine, before, all);
  for (int g = g_lo; g < g_hi; ++g) {
    const int32_t v = first_row_G1[g];
    first_row_G1[g] = before;
    before += v;
  }
  if (tid == 0) first_row_G1[Eg] = all;
  __syncthreads();

  // Receivers' row spaces: receiver q owns global experts [q*E, (q+1)*E).
  for (int q = tid; q < p.R; q += kPrefixThreads) {
    p.layout.recv_rows_R[q] = first_row_G1[(q + 1) * p.E] - first_row_G1[q * p.E];
  }
  for (int e = tid; e <= p.E; e += kPrefixThreads) {
    p.layout.expert_offsets_E1[e] = first_row_G1[p.self * p.E + e] - first_row_G1[p.self * p.E];
  }
  // Block (s, g) starts after the lower experts of its receiver and the lower source ranks; each
  // chunk after the earlier chunks of the same source.
  for (int64_t j = tid; j < RG; j += kPrefixThreads) {
    const int64_t s = j / Eg;
    const int g = static_cast<int>(j % Eg);
    int32_t row = first_row_G1[g] - first_row_G1[(g / p.E) * p.E];
    for (int64_t lower = 0; lower < s; ++lower) row += p.counts_RG[lower * Eg + g];
    for (int c = 0; c < p.chunks; ++c) {
      int32_t* cell = p.chunk_RCG + (s * p.chunks + c) * Eg + g;  // [1] chunk c of (s, g)
      const int32_t n = *cell;
      *cell = row;
      row += n;
    }
  }

  if (tid != 0) return;
  // Header checks in rank order, as the CPU reference: a T' that differs from rank 0's (the
  // common reference, so every rank reports the same error), else the rank's input error.
  // A stream barrier that timed out (now or earlier) left peers' buffers unsynchronised: skip.
  bool failed = header_words[2 * p.R] == static_cast<int32_t>(StatusCode::barrier_timeout);
  StatusCode failed_code = failed ? StatusCode::barrier_timeout : StatusCode::ok;
  const int32_t tokens0 = header_words[0];
  for (int r = 0; r < p.R && !failed; ++r) {
    const auto* h = reinterpret_cast<const RoutingHeader*>(p.routing_R[r]);  // [1] rank r's header
    const int32_t tokens = header_words[2 * r];
    const int32_t code = header_words[2 * r + 1];
    if (tokens != tokens0) {
      failed = true;
      failed_code = StatusCode::token_count_mismatch;
      write_status(p.status, failed_code, r, StatusArg::x_TD, tokens, tokens0, -1);
    } else if (code != 0) {
      failed = true;
      failed_code = static_cast<StatusCode>(code);
      write_status(p.status, failed_code, r, static_cast<StatusArg>(__ldcg(&h->error_arg)),
                   __ldcg(reinterpret_cast<const long long*>(&h->error_value)),
                   __ldcg(reinterpret_cast<const long long*>(&h->error_bound)),
                   __ldcg(reinterpret_cast<const long long*>(&h->error_index)));
    }
  }
  // With an input error the reference builds no layout: the header says 0 rows. (The arrays
  // are still written from the sanitised ids; a skipped step never reads them.)
  const bool input_error = failed;
  int32_t max_rows = 0;
  for (int q = 0; q < p.R && !input_error; ++q) {
    const int32_t rows = first_row_G1[(q + 1) * p.E] - first_row_G1[q * p.E];
    max_rows = rows > max_rows ? rows : max_rows;
    if (!failed && rows > p.capacity) {
      failed = true;
      failed_code = StatusCode::capacity_overflow;
      write_status(p.status, failed_code, q, StatusArg::topk_ids_TK, rows, p.capacity, -1);
    }
  }
  int32_t* header = p.layout.header;  // [kLayoutHeaderInts]
  for (int i = 0; i < kLayoutHeaderInts; ++i) header[i] = 0;
  header[kLayoutRows] =
      input_error ? 0 : first_row_G1[(p.self + 1) * p.E] - first_row_G1[p.self * p.E];
  header[kLayoutTokens] = static_cast<int32_t>(p.tokens);
  header[kLayoutLive] = header_words[2 * p.R + 1];
  header[kLayoutSkip] = failed ? 1 : 0;
  header[kLayoutMaxRows] = max_rows;
  if (failed_code == StatusCode::capacity_overflow && p.trap_on_overflow) {
    __threadfence_system();
    __trap();  // OverflowPolicy::trap; the status word above says why
  }
}

__global__ void __launch_bounds__(kPrefixThreads) route_prefix_kernel(const RouteParams p) {
  extern __shared__ int32_t first_row_G1[];  // prefix_smem_ints
  prefix_block(p, first_row_G1);
}

// kWarps warps split the chunk into contiguous sub-ranges; any split gives the same rows (each is
// the chunk's first row of its expert plus the routes to that expert before it).
// next_row_WG: [kWarps, Eg] shared, the next row per (warp, expert).
template <int kWarps>
__device__ __forceinline__ void rank_block(const RouteParams& p, int c, int s, int32_t* next_row_WG) {
  constexpr int64_t kRoutesPerWarp = kRouteChunkRoutes / kWarps;
  static_assert(kRouteChunkRoutes % (kWarps * 32) == 0, "a warp's sub-range is whole warps of routes");
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int Eg = p.Eg;
  const int64_t TK = p.T * p.K;
  const int32_t* ids_TK = p.ids_all_RTK + s * TK;  // [T, K] source s
  const int64_t sub_lo = static_cast<int64_t>(c) * kRouteChunkRoutes + warp * kRoutesPerWarp;
  const int64_t sub_hi = sub_lo + kRoutesPerWarp < TK ? sub_lo + kRoutesPerWarp : TK;
  int32_t* next_G = next_row_WG + static_cast<int64_t>(warp) * Eg;  // [Eg] this warp's row

  for (int64_t j = threadIdx.x; j < static_cast<int64_t>(kWarps) * Eg; j += kWarps * 32) {
    next_row_WG[j] = 0;
  }
  __syncthreads();
  for (int64_t i = sub_lo + lane; i < sub_hi; i += 32) {
    const int32_t g = ids_TK[i];
    if (g >= 0) atomicAdd(&next_G[g], 1);  // a count: order-independent
  }
  __syncthreads();
  // Scan over warps, starting at the chunk's first row of (s, g).
  const int32_t* chunk_first_G = p.chunk_RCG + (static_cast<int64_t>(s) * p.chunks + c) * Eg;  // [Eg]
  for (int g = static_cast<int>(threadIdx.x); g < Eg; g += kWarps * 32) {
    int32_t row = chunk_first_G[g];
    for (int w = 0; w < kWarps; ++w) {
      const int32_t n = next_row_WG[static_cast<int64_t>(w) * Eg + g];
      next_row_WG[static_cast<int64_t>(w) * Eg + g] = row;
      row += n;
    }
  }
  __syncthreads();

  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t base = sub_lo; base < sub_hi; base += 32) {  // warp-uniform trip count
    const int64_t i = base + lane;
    const bool inside = i < sub_hi;
    const int32_t g = inside ? ids_TK[i] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, g);
    int32_t row = -1;
    if (g >= 0) row = next_G[g] + __popc(same & lanes_below);
    __syncwarp();
    if (g >= 0 && lane == 31 - __clz(static_cast<int>(same))) next_G[g] += __popc(same);
    __syncwarp();
    if (!inside) continue;
    if (s == p.self) p.layout.route_row_TK[i] = row;
    if (g >= 0 && g / p.E == p.self && row < p.capacity) {
      p.layout.recv_src_M[row] = encode_src(s, i / p.K, static_cast<int>(i % p.K), p.T, p.K);
      const int32_t pull = p.pull_of_token_RT[static_cast<int64_t>(s) * p.T + i / p.K];
      if (pull < p.pull_capacity) p.layout.pull_rows_PK[static_cast<int64_t>(pull) * p.K + i % p.K] = row;
    }
  }
}

__global__ void __launch_bounds__(kRankThreads) route_rank_kernel(const RouteParams p) {
  extern __shared__ int32_t next_row_WG[];  // [kRankWarps, Eg]
  rank_block<kRankWarps>(p, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), next_row_WG);
}

// Shared-memory ints of the one-CTA route: the phases' common area (the ranking's
// [kSingleRankWarps, Eg], or the prefix's ints where more), then the scratch arrays in
// RouteParams order (ids [R, T*K], counts [R, Eg], chunk rows [R, 1, Eg], pull of token [R, T],
// pull counts [R, 1]).
__host__ __device__ constexpr int64_t single_common_ints(int Eg, int R) {
  return kSingleRankWarps * Eg > prefix_smem_ints(Eg, R) ? kSingleRankWarps * Eg
                                                         : prefix_smem_ints(Eg, R);
}
int64_t single_smem_ints(const Dims& d) {
  const int64_t R = d.R, Eg = static_cast<int64_t>(d.E) * d.R;
  return single_common_ints(static_cast<int>(Eg), d.R) + R * d.T * d.K + 2 * R * Eg + R * d.T + R;
}

// The five launches' blocks in launch order, in one CTA (p.chunks == p.token_chunks == 1, so the
// blocks are (0, s) for each source s). A block barrier stands between blocks that share shared
// memory and between phases: it orders the stores of one phase before the next one's loads, as
// the launch boundaries do. Shared memory (single_smem_ints): the common area reused by every
// phase, then the scratch arrays, which p's pointers name here instead of the route scratch
// (the bodies read them with plain loads, so either space works).
__global__ void __launch_bounds__(kSingleThreads) route_single_kernel(const RouteParams global) {
  extern __shared__ int32_t smem_ints[];
  RouteParams p = global;
  int32_t* scratch = smem_ints + single_common_ints(p.Eg, p.R);
  const int64_t TK = p.T * p.K;
  p.ids_all_RTK = scratch;
  p.counts_RG = p.ids_all_RTK + p.R * TK;
  p.chunk_RCG = p.counts_RG + p.R * p.Eg;
  p.pull_of_token_RT = p.chunk_RCG + p.R * p.Eg;
  p.pull_counts_RC = p.pull_of_token_RT + p.R * p.T;
  for (int s = 0; s < p.R; ++s) {
    histogram_block(p, 0, s, smem_ints);
    __syncthreads();
  }
  for (int s = 0; s < p.R; ++s) pull_count_block(p, 0, s, p.R);  // ends with a block barrier
  prefix_block(p, smem_ints);
  __syncthreads();
  for (int s = 0; s < p.R; ++s) {
    pull_list_block(p, 0, s);
    __syncthreads();
  }
  for (int s = 0; s < p.R; ++s) {
    rank_block<kSingleRankWarps>(p, 0, s, smem_ints);
    __syncthreads();
  }
}

}  // namespace

const char* to_string(RouteKernels k) { return k == RouteKernels::single ? "single" : "chunked"; }

RouteKernels select_route_kernels(const Dims& d) {
  const bool fits = d.T * d.K <= kRouteChunkRoutes && d.T <= kPullChunkTokens &&
                    d.E * d.R <= kSingleMaxGlobalExperts &&
                    single_smem_ints(d) * 4 <= kSingleMaxSmemBytes;
  const char* env = std::getenv("EPMOE_ROUTE_KERNELS");
  if (env == nullptr) return fits ? RouteKernels::single : RouteKernels::chunked;
  if (std::strcmp(env, "chunked") == 0) return RouteKernels::chunked;
  EPMOE_CHECK_ARG(std::strcmp(env, "single") == 0, "EPMOE_ROUTE_KERNELS", "chunked or single", env);
  EPMOE_CHECK_ARG(fits, "EPMOE_ROUTE_KERNELS",
                  "chunked where T * K > " + std::to_string(kRouteChunkRoutes) + ", T > " +
                      std::to_string(kPullChunkTokens) + ", E * R > " +
                      std::to_string(kSingleMaxGlobalExperts) + " or its shared memory > " +
                      std::to_string(kSingleMaxSmemBytes) + " bytes",
                  env);
  return RouteKernels::single;
}

void route(const Step& s) {
  const Dims& d = s.dims;
  const int Eg = d.E * d.R;
  EPMOE_ASSERT(Eg >= 1 && Eg <= kMaxGlobalExperts);
  const RouteScratchLayout sl = route_scratch_layout(d, s.capacity_rows);
  RouteParams p{};
  p.routing_R = s.routing_R;
  p.ids_all_RTK = reinterpret_cast<int32_t*>(s.route_scratch + sl.ids_all);
  p.counts_RG = reinterpret_cast<int32_t*>(s.route_scratch + sl.counts);
  p.chunk_RCG = reinterpret_cast<int32_t*>(s.route_scratch + sl.chunk_counts);
  p.pull_of_token_RT = reinterpret_cast<int32_t*>(s.route_scratch + sl.pull_of_token);
  p.pull_counts_RC = reinterpret_cast<int32_t*>(s.route_scratch + sl.pull_counts);
  p.arrivals_B = reinterpret_cast<uint32_t*>(s.route_scratch + sl.arrivals);
  p.pull_capacity = pull_capacity(s.capacity_rows, d.T, d.R);
  p.arrival_blocks = arrival_blocks(s.capacity_rows);
  p.layout = s.layout;
  p.status = s.status;
  p.T = d.T;
  p.tokens = s.tokens;
  p.capacity = s.capacity_rows;
  p.ids_offset = routing_buffer_layout(d.T, d.K).ids_offset;
  p.K = d.K;
  p.E = d.E;
  p.R = d.R;
  p.Eg = Eg;
  p.chunks = static_cast<int>((d.T * d.K + kRouteChunkRoutes - 1) / kRouteChunkRoutes);
  p.token_chunks = static_cast<int>((d.T + kPullChunkTokens - 1) / kPullChunkTokens);
  p.self = s.rank;
  p.trap_on_overflow = s.trap_on_overflow ? 1 : 0;

  auto stream = static_cast<cudaStream_t>(s.stream);
  if (select_route_kernels(d) == RouteKernels::single) {
    // Past 48 KiB with the bodies' static shared memory (the block scans) the launch needs the
    // opt-in: set once per device to the most select_route_kernels lets through.
    set_shared_memory_limit<route_single_kernel>(static_cast<int>(kSingleMaxSmemBytes));
    const size_t bytes = static_cast<size_t>(single_smem_ints(d)) * sizeof(int32_t);
    route_single_kernel<<<1, kSingleThreads, bytes, stream>>>(p);
    EPMOE_CUDA_LAUNCH_CHECK();
    return;
  }
  const dim3 chunk_grid(static_cast<unsigned>(p.chunks), static_cast<unsigned>(d.R));
  const size_t hist_bytes = static_cast<size_t>(Eg) * sizeof(int32_t);
  route_histogram_kernel<<<chunk_grid, kHistogramThreads, hist_bytes, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
  const dim3 token_grid(static_cast<unsigned>(p.token_chunks), static_cast<unsigned>(d.R));
  route_pull_count_kernel<<<token_grid, kPullThreads, 0, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
  const size_t scan_bytes = static_cast<size_t>(prefix_smem_ints(Eg, d.R)) * sizeof(int32_t);
  route_prefix_kernel<<<1, kPrefixThreads, scan_bytes, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
  route_pull_list_kernel<<<token_grid, kPullThreads, 0, stream>>>(p);  // after the header reset
  EPMOE_CUDA_LAUNCH_CHECK();
  const size_t rank_bytes = static_cast<size_t>(kRankWarps) * Eg * sizeof(int32_t);
  if (rank_bytes > 48 * 1024) {
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(route_rank_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(rank_bytes)));
  }
  route_rank_kernel<<<chunk_grid, kRankThreads, rank_bytes, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
}

}  // namespace epmoe::cuda
