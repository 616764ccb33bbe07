// GPU test support for a stack of layers in one activation slot (docs/memory.md): configs at a
// given slot budget, one forward of every layer then the backwards in reverse on one context, and
// the save-or-recompute rule re-derived from the routing (as tests/cpp/test_slots.cpp does), so a
// test can say which layers must replay.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "device_call.h"
#include "epmoe/context.h"
#include "epmoe/memory_plan.h"
#include "moe_case.h"

namespace epmoe::test {

constexpr int kStackLayers = 4;

// slot_bytes < 0: the default budget (maximum useful: no layer can recompute).
inline Config stack_config(const Problem& p, int64_t slot_bytes) {
  ConfigFields f = p.config().fields();
  f.slots.max_layers_per_slot = kStackLayers;
  if (slot_bytes >= 0) f.slots.slot_bytes = slot_bytes;
  return Config(f);
}

// One rank's calls of the stack: inputs[l] is this rank's input of layer l.
inline std::vector<std::unique_ptr<DeviceCall>> stack_calls(const Problem& p,
                                                            const std::vector<RankInputs>& inputs,
                                                            int device) {
  std::vector<std::unique_ptr<DeviceCall>> calls;
  for (const RankInputs& in : inputs) calls.push_back(std::make_unique<DeviceCall>(p, in, device));
  return calls;
}

struct StackResult {
  std::vector<RankOutputs> out;  // [layer], this rank
  std::vector<bool> recomputed;  // [layer]: Context::recomputes
  int64_t peak = 0;              // Context::slot_peak_bytes(0)
};

// Forwards of every layer into slot 0, then the backwards in reverse; eager on `stream`.
inline StackResult run_stack(Context& ctx, std::vector<std::unique_ptr<DeviceCall>>& calls,
                             cudaStream_t stream) {
  StackResult r;
  for (auto& c : calls) c->poison();
  std::vector<SavedLayer> saved;
  for (auto& c : calls) saved.push_back(ctx.forward(c->forward_args(stream)));
  for (const SavedLayer& s : saved) r.recomputed.push_back(ctx.recomputes(s));
  for (int l = static_cast<int>(calls.size()) - 1; l >= 0; --l) {
    ctx.backward(calls[static_cast<size_t>(l)]->backward_args(saved[static_cast<size_t>(l)], stream));
  }
  ctx.check();
  for (auto& c : calls) r.out.push_back(c->outputs());
  r.peak = ctx.slot_peak_bytes(0);
  return r;
}

inline void expect_stack_bitwise_equal(const StackResult& a, const StackResult& b,
                                       const std::string& what) {
  ASSERT_EQ(a.out.size(), b.out.size()) << what;
  for (size_t l = 0; l < a.out.size(); ++l) {
    expect_bitwise_equal({a.out[l]}, {b.out[l]}, what + ", layer " + std::to_string(l));
  }
}

// ---- the rule, re-derived (docs/memory.md): bytes of a full save and of an input save ----
inline int64_t stack_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline int64_t stack_full_bytes(const Problem& p, int64_t rows, int64_t G) {
  const int64_t D = p.hidden, F = p.intermediate;
  // x_gathered | h13
  return stack_round_up(stack_round_up(rows * D * 2, 128) + stack_round_up(rows * 2 * F * 2, 128), G);
}
inline int64_t stack_input_bytes(const Problem& p, int64_t G) {
  return stack_round_up(stack_round_up(p.max_tokens * p.hidden * 2, 128), G);
}

// rows[l][q]: rows rank q receives in layer l (active routes of live tokens to its experts);
// in[l][s] is rank s's input of layer l.
inline std::vector<std::vector<int64_t>> stack_rows(const Problem& p,
                                                    const std::vector<std::vector<RankInputs>>& in) {
  std::vector<std::vector<int64_t>> rows(in.size(), std::vector<int64_t>(p.ranks, 0));
  for (size_t l = 0; l < in.size(); ++l) {
    for (int s = 0; s < p.ranks; ++s) {
      const RankInputs& x = in[l][static_cast<size_t>(s)];
      const int64_t live = x.live >= 0 ? x.live : x.tokens;
      for (int64_t i = 0; i < live * p.top_k; ++i) {
        const int64_t id = x.ids_TK[static_cast<size_t>(i)];
        if (id >= 0) ++rows[l][static_cast<size_t>(id / p.local_experts())];
      }
    }
  }
  return rows;
}

inline std::vector<bool> stack_decisions(const Problem& p,
                                         const std::vector<std::vector<int64_t>>& rows,
                                         int64_t packed, int64_t G) {
  std::vector<int64_t> saved(static_cast<size_t>(p.ranks), 0);
  std::vector<bool> out;
  const int64_t L = static_cast<int64_t>(rows.size());
  for (int64_t l = 0; l < L; ++l) {
    int64_t need = 0;
    for (int r = 0; r < p.ranks; ++r) {
      need = std::max(need, saved[static_cast<size_t>(r)] +
                                stack_full_bytes(p, rows[static_cast<size_t>(l)][static_cast<size_t>(r)], G));
    }
    const bool recompute = need + (L - 1 - l) * stack_input_bytes(p, G) > packed;
    for (int r = 0; r < p.ranks; ++r) {
      saved[static_cast<size_t>(r)] +=
          recompute ? stack_input_bytes(p, G)
                    : stack_full_bytes(p, rows[static_cast<size_t>(l)][static_cast<size_t>(r)], G);
    }
    out.push_back(recompute);
  }
  return out;
}

// A packed budget where layers 0 and 1 fit their full saves (at the fullest rank) plus two
// inputs: with layer 1 smaller than layers 2 and 3, the later layers recompute.
inline int64_t stack_mixed_packed(const Problem& p, const std::vector<std::vector<int64_t>>& rows,
                                  int64_t G) {
  auto max_full = [&](size_t l) {
    int64_t m = 0;
    for (int r = 0; r < p.ranks; ++r) m = std::max(m, stack_full_bytes(p, rows[l][static_cast<size_t>(r)], G));
    return m;
  };
  return max_full(0) + max_full(1) + 2 * stack_input_bytes(p, G);
}

}  // namespace epmoe::test
