#include "core/layout.h"

#include <algorithm>
#include <vector>

namespace epmoe {

LayoutView carve_layout(void* base, int64_t rows, int64_t T, int K, int E, int R) {
  LayoutBytes b = layout_bytes(rows, T, K, E, R);
  char* p = static_cast<char*>(base);
  LayoutView v;
  v.header = reinterpret_cast<int32_t*>(p);
  p += b.header;
  v.expert_offsets_E1 = reinterpret_cast<int32_t*>(p);
  p += b.expert_offsets;
  v.recv_rows_R = reinterpret_cast<int32_t*>(p);
  p += b.recv_rows;
  v.recv_src_M = reinterpret_cast<int32_t*>(p);
  p += b.recv_src;
  v.route_row_TK = reinterpret_cast<int32_t*>(p);
  p += b.route_row;
  v.pull_src_P = reinterpret_cast<int32_t*>(p);
  p += b.pull_src;
  v.pull_rows_PK = reinterpret_cast<int32_t*>(p);
  return v;
}

int64_t build_layout_reference(const int32_t* const* ids_R, int64_t T, int K, int E, int R,
                               int self, int64_t capacity, const LayoutView& out) {
  const int Eg = E * R;
  // count[s][g]: routes of source s to global expert g.
  std::vector<int64_t> count(static_cast<size_t>(R) * Eg, 0);
  for (int s = 0; s < R; ++s) {
    for (int64_t i = 0; i < T * K; ++i) {
      int32_t g = ids_R[s][i];
      if (g >= 0) ++count[static_cast<size_t>(s) * Eg + g];
    }
  }
  // base[q][e][s]: first row of block (e, s) in receiver q.
  std::vector<int64_t> base(static_cast<size_t>(R) * Eg, 0);  // indexed [s][g]
  std::vector<int64_t> recv(R, 0);
  for (int q = 0; q < R; ++q) {
    int64_t row = 0;
    for (int e = 0; e < E; ++e) {
      int g = q * E + e;
      if (q == self) out.expert_offsets_E1[e] = static_cast<int32_t>(row);
      for (int s = 0; s < R; ++s) {
        base[static_cast<size_t>(s) * Eg + g] = row;
        row += count[static_cast<size_t>(s) * Eg + g];
      }
    }
    if (q == self) out.expert_offsets_E1[E] = static_cast<int32_t>(row);
    recv[q] = row;
    out.recv_rows_R[q] = static_cast<int32_t>(row);
  }
  // Rows: walk each source's routes in (t, k) order; a token with a route to `self` is a pull.
  std::vector<int64_t> next(base);
  const int64_t pull_cap = pull_capacity(capacity, T, R);
  int64_t pulls = 0;
  for (int s = 0; s < R; ++s) {
    for (int64_t t = 0; t < T; ++t) {
      bool pulled = false;
      for (int k = 0; k < K; ++k) {
        int32_t g = ids_R[s][t * K + k];
        int32_t row = -1;
        if (g >= 0) {
          int64_t r = next[static_cast<size_t>(s) * Eg + g]++;
          row = static_cast<int32_t>(r);
          if (g / E == self) {
            if (r < capacity) out.recv_src_M[r] = encode_src(s, t, k, T, K);
            if (!pulled && pulls < pull_cap) {
              out.pull_src_P[pulls] = encode_pull(s, t, T);
              for (int j = 0; j < K; ++j) out.pull_rows_PK[pulls * K + j] = -1;
            }
            if (pulls < pull_cap && r < capacity) out.pull_rows_PK[pulls * K + k] = row;
            pulled = true;
          }
        }
        if (s == self) out.route_row_TK[t * K + k] = row;
      }
      if (pulled) ++pulls;
    }
  }
  int64_t max_rows = *std::max_element(recv.begin(), recv.end());
  out.header[kLayoutRows] = static_cast<int32_t>(recv[self]);
  out.header[kLayoutMaxRows] = static_cast<int32_t>(max_rows);
  out.header[kLayoutPulls] = static_cast<int32_t>(pulls);
  return recv[self];
}

}  // namespace epmoe
