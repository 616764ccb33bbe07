// The global routing layout, defined once for both backends (DESIGN.md §3).
//
// Every rank publishes its expert ids (int32, -1 = inactive; rows past the live count are
// published as -1) into its routing buffer. Every rank then computes the same global layout:
//
//   count[q][e][s]  routes from source rank s to local expert e of receiving rank q
//   Rows of receiver q are ordered expert-major (e), then source rank (s), then token t, then k.
//   row(s, t, k) = expert_base[q][e] + sum_{s' < s} count[q][e][s']
//                + #{(t', k') < (t, k) lexicographically : ids_s[t', k'] == ids_s[t, k]}
//
// A token that picks two experts of one rank gets one row per route. The CUDA route kernels must
// reproduce build_layout_reference() bitwise.
//
// Pulls: dispatch reads each source row once per receiver. A pull is one (source rank s, token t)
// with at least one route to this rank; pulls are numbered in (s, t) order, and pull p feeds the
// rows pull_rows_PK[p][k] (one per route k of the token to this rank, -1 for the others), so the
// K routes of a token that land on one rank cross NVLink once and fan out locally. P <= M, and
// P <= R*T; arrays hold P_cap = min(capacity rows, R*T) pulls.
#pragma once

#include <cstdint>

#include "core/hd.h"
#include "epmoe/memory_plan.h"

namespace epmoe {

// ---- Routing buffer (symmetric, one per rank): header, ids [T, K] i32, scores [T, K] f32. ----

struct RoutingHeader {
  int32_t tokens = 0;      // T' of this call
  int32_t live = 0;        // live rows (<= tokens)
  int32_t error_code = 0;  // StatusCode of this rank's input check (0 = inputs fine)
  int32_t error_arg = 0;   // StatusArg
  int64_t error_value = 0;
  int64_t error_bound = 0;
  int64_t error_index = -1;
  int64_t sequence = 0;    // call number on this context (same on every rank)
  int32_t reserved[20] = {};
};
static_assert(sizeof(RoutingHeader) == kAlignment, "RoutingHeader fills one aligned block");

struct RoutingBufferLayout {
  int64_t ids_offset = 0;     // bytes from the buffer start
  int64_t scores_offset = 0;
  int64_t bytes = 0;
};
EPMOE_HD RoutingBufferLayout routing_buffer_layout(int64_t T, int K) {
  RoutingBufferLayout l;
  l.ids_offset = kAlignment;
  l.scores_offset = l.ids_offset + align_bytes(T * K * 4);
  l.bytes = l.scores_offset + align_bytes(T * K * 4);
  return l;
}

// src slot of a route: which rank, token and k it came from, packed in one int32.
EPMOE_HD int32_t encode_src(int rank, int64_t t, int k, int64_t T, int K) {
  return static_cast<int32_t>(rank * T * K + t * K + k);
}
EPMOE_HD int src_rank(int32_t src, int64_t T, int K) { return static_cast<int>(src / (T * K)); }
EPMOE_HD int64_t src_slot(int32_t src, int64_t T, int K) { return src % (T * K); }  // t*K + k

// ---- Layout of one layer on one rank (saved with the layer; host or device memory). ----

constexpr int kLayoutHeaderInts = 32;
enum LayoutHeaderField : int {
  kLayoutRows = 0,     // M: rows this rank receives
  kLayoutTokens = 1,   // T' of the call
  kLayoutLive = 2,     // this rank's live rows
  kLayoutSkip = 3,     // 1: the step is skipped (an error on some rank); later stages do nothing
  kLayoutMaxRows = 4,  // max over ranks of received rows
  kLayoutPulls = 5,    // P: distinct (source rank, token) with a route to this rank (0 when M = 0)
};

// Pull capacity of a layout with room for `rows` received rows: each pull feeds >= 1 row.
EPMOE_HD int64_t pull_capacity(int64_t rows, int64_t T, int R) {
  return rows < R * T ? rows : R * T;
}
// (source rank, token) of a pull, packed in one int32 (R*T < 2^31 since R*T*K is).
EPMOE_HD int32_t encode_pull(int rank, int64_t t, int64_t T) { return static_cast<int32_t>(rank * T + t); }

struct LayoutView {
  int32_t* header = nullptr;             // [kLayoutHeaderInts]
  int32_t* expert_offsets_E1 = nullptr;  // [E + 1]: rows of local expert e are [off[e], off[e+1])
  int32_t* recv_rows_R = nullptr;        // [R]: rows each rank receives (all ranks know all)
  int32_t* recv_src_M = nullptr;         // [capacity]: encode_src() of each received row
  int32_t* route_row_TK = nullptr;       // [T * K]: row of this rank's route in its receiver, -1
  int32_t* pull_src_P = nullptr;         // [P_cap]: encode_pull() of each pull
  int32_t* pull_rows_PK = nullptr;       // [P_cap, K]: row fed by route k of the pull, -1 = none
};

struct LayoutBytes {
  int64_t header, expert_offsets, recv_rows, recv_src, route_row, pull_src, pull_rows, total;
};
// Bytes of one layer's layout when it has room for `rows` received rows.
EPMOE_HD LayoutBytes layout_bytes(int64_t rows, int64_t T, int K, int E, int R) {
  LayoutBytes b;
  b.header = align_bytes(kLayoutHeaderInts * 4);
  b.expert_offsets = align_bytes(static_cast<int64_t>(E + 1) * 4);
  b.recv_rows = align_bytes(static_cast<int64_t>(R) * 4);
  b.recv_src = align_bytes(rows * 4);
  b.route_row = align_bytes(T * K * 4);
  const int64_t pulls = pull_capacity(rows, T, R);
  b.pull_src = align_bytes(pulls * 4);
  b.pull_rows = align_bytes(pulls * K * 4);
  b.total = b.header + b.expert_offsets + b.recv_rows + b.recv_src + b.route_row + b.pull_src +
            b.pull_rows;
  return b;
}
// Carves a LayoutView out of `base` (layout_bytes(rows, ...).total bytes).
LayoutView carve_layout(void* base, int64_t rows, int64_t T, int K, int E, int R);

// Reference builder (host). ids_R[s] points at rank s's published ids [T, K] (T = Config T).
// Fills `out` for receiver `self` (recv_src_M up to min(rows, capacity) entries, pulls up to
// pull_capacity(capacity, T, R), rows of pulls below capacity) and returns M.
// header[kLayoutSkip] is left to the caller.
int64_t build_layout_reference(const int32_t* const* ids_R, int64_t T, int K, int E, int R,
                               int self, int64_t capacity, const LayoutView& out);

}  // namespace epmoe
