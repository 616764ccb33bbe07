// FP8 block-scaled training (Config.precision = fp8_block, a training context) on one GPU through
// the public API, against the CPU backend on the same inputs:
// - y and every gradient within kBackendTolerances (fp8_block) and the CPU path's float64 bounds
//   (EPMOE_REPORT_ERRORS=1 prints the errors);
// - fused == unfused, repeated calls, prepared == per-call weights (EP = 1): bitwise; prepared on
//   the device (with the transposed copies the DGRADs read) == per-call, bitwise, also after a
//   refill in place;
// - the per-rank combine (Config.combine = per_rank) at EP = 1: every output bitwise the
//   per-route one, and within the bounds of the CPU backend's per-rank outputs;
// - a stack of layers at the minimum slot budget (every layer replays its forward) == full save,
//   bitwise, with either combine; one forward + backward captured in a CUDA graph and replayed
//   with new routings == eager, bitwise, with either combine;
// - Config.fp8_wgrad = bf16 (the bf16 WGRADs, x decoded from its E4M3 rows) in the cases tables:
//   against the CPU backend, variants, edge routings, recompute and graph replay as above (the
//   other cases run fp8 explicitly: moe_case.h's fp8_block default); by_shape (the default) runs
//   the plan's choice, bitwise the explicit one;
// - every FP8 tile (EPMOE_FP8_TILE) == the rules' choice, bitwise.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "captured_step.h"
#include "core/fp8_terms.h"
#include "device_call.h"
#include "device_prepared.h"
#include "epmoe/context.h"
#include "epmoe/cuda.h"
#include "epmoe/memory_plan.h"
#include "epmoe/prepared_weights.h"
#include "moe_case.h"
#include "output_compare.h"
#include "require_gpu.h"
#include "scoped_env.h"
#include "slot_stack.h"
#include "tolerances.h"

namespace epmoe::test {
namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

Problem fp8_problem(int64_t T, int64_t D, int64_t F, int experts, int K, bool clamped = false) {
  Problem p = make_problem(1, T, D, F, K, experts,
                           clamped ? Activation::swiglu_clamped() : Activation::swiglu());
  p.precision = Precision::fp8_block;
  return p;
}

// Forward + backward on `ctx` (with the prepared weights when given), as enqueued on `stream`.
void train_step(Context& ctx, DeviceCall& call, const DevicePrepared* w, cudaStream_t stream) {
  ForwardArgs f = call.forward_args(stream);
  if (w != nullptr) {
    f.w13_prepared = &w->w13;
    f.w2_prepared = &w->w2;
  }
  const SavedLayer saved = ctx.forward(f);
  BackwardArgs b = call.backward_args(saved, stream);
  if (w != nullptr) {
    b.w13_prepared = &w->w13;
    b.w2_prepared = &w->w2;
  }
  ctx.backward(b);
}

// train_step on poisoned outputs; check() on success; returns the outputs.
RankOutputs train_once(Context& ctx, DeviceCall& call, const DevicePrepared* w, cudaStream_t stream) {
  call.poison();
  train_step(ctx, call, w, stream);
  ctx.check();
  return call.outputs();
}

// `calls` forward + backward calls on one fresh context; every later call must repeat the first.
RankOutputs gpu_train(const Problem& p, const RankInputs& in, int calls = 1) {
  auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
  DeviceCall call(p, in);
  std::unique_ptr<DevicePrepared> prepared;
  if (p.prepared_weights) prepared = std::make_unique<DevicePrepared>(p, in);
  RankOutputs first;
  for (int c = 0; c < calls; ++c) {
    const RankOutputs out = train_once(*ctx, call, prepared.get(), nullptr);
    if (c == 0) {
      first = out;
    } else {
      expect_bitwise_equal({out}, {first}, p.name() + ": call " + std::to_string(c));
    }
  }
  ctx->close();
  return first;
}

TEST(GpuFp8Training, MatchesCpuWithinBoundsAndVariantsBitwise) {
  EPMOE_REQUIRE_GPU();
  std::vector<Problem> cases = {
      fp8_problem(64, 128, 96, 8, 2),     // ci-tiny
      fp8_problem(333, 256, 528, 16, 4),  // ragged tiles in every dimension
      fp8_problem(512, 1024, 768, 8, 2),  // many k-blocks, several tiles, > 128 rows per expert
      fp8_problem(1, 64, 64, 4, 2),       // T = 1
      fp8_problem(96, 192, 144, 8, 2, true),
  };
  Problem f32 = fp8_problem(80, 128, 64, 6, 3);
  f32.wgrad_dtype = DType::f32;
  cases.push_back(f32);
  // Each case again with the bf16 weight gradients.
  for (size_t i = 0, n = cases.size(); i < n; ++i) {
    Problem b = cases[i];
    b.fp8_wgrad = Fp8Wgrad::bf16;
    cases.push_back(b);
  }
  uint64_t seed = 900;
  for (const Problem& p : cases) {
    const std::vector<RankInputs> in = make_inputs(p, seed++, p.max_tokens);
    const RankOutputs gpu = gpu_train(p, in[0], 2);
    const RankOutputs cpu = run_layer(p, in)[0];
    const OutputErrors vs_cpu = compare(gpu, cpu);
    report_errors(p.name() + " fp8 gpu vs cpu", vs_cpu);
    for (int o = 0; o < kNumOutputs; ++o) {
      const Output out = static_cast<Output>(o);
      EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::fp8_block, out))
          << p.name() << ": " << to_string(out) << " CUDA vs CPU backend (" << vs_cpu.to_string()
          << ")";
    }
    Problem unfused = p;
    unfused.fused = false;
    expect_bitwise_equal({gpu_train(unfused, in[0])}, {gpu}, p.name() + ": unfused vs fused");
    Problem prepared = p;
    prepared.prepared_weights = true;
    expect_bitwise_equal({gpu_train(prepared, in[0])}, {gpu}, p.name() + ": prepared vs per-call");
  }
}

// Prepared weights made on the device (prepare_weights on CUDA: codes, scales and the transposed
// copies the DGRADs read instead of transposing per call) give the full training layer bitwise
// the per-call path's y and gradients; so does a refill in place after the copies are poisoned.
TEST(GpuFp8Training, DevicePreparedTransposedEqualsPerCallBitwise) {
  EPMOE_REQUIRE_GPU();
  const std::vector<Problem> cases = {
      fp8_problem(64, 128, 96, 8, 2),     // ci-tiny
      fp8_problem(333, 256, 528, 16, 4),  // ragged tiles; 2F = 1056, D = 256: partial blocks
      fp8_problem(512, 1024, 768, 8, 2),  // many k-blocks in both DGRADs
  };
  uint64_t seed = 1200;
  for (const Problem& p : cases) {
    const std::vector<RankInputs> in = make_inputs(p, seed++, p.max_tokens);
    const RankOutputs per_call = gpu_train(p, in[0]);
    Problem q = p;
    q.prepared_weights = true;
    auto ctx = Context::create(q.config(), make_single_gpu_transport(0));
    DeviceCall call(q, in[0]);
    const DevicePrepared w(q, call.w13, call.w2, nullptr);
    expect_bitwise_equal({train_once(*ctx, call, &w, nullptr)}, {per_call},
                         p.name() + ": device-prepared (transposed copies) vs per-call");
    for (const PreparedWeights* v : {&w.w13, &w.w2}) {
      CUDA_OK(cudaMemset(v->data_t.data, 0xAA, v->data_t.nbytes()));
      CUDA_OK(cudaMemset(v->scales_t.data, 0xAA, v->scales_t.nbytes()));
    }
    // Poisoned copies change grad_x: the DGRADs read them (no transpose of their own).
    const RankOutputs poisoned = train_once(*ctx, call, &w, nullptr);
    ASSERT_EQ(poisoned.grad_x_TD.size(), per_call.grad_x_TD.size());
    EXPECT_NE(std::memcmp(poisoned.grad_x_TD.data(), per_call.grad_x_TD.data(),
                          per_call.grad_x_TD.size() * sizeof(bf16_t)),
              0)
        << p.name() << ": grad_x unchanged by poisoned transposed copies";
    w.refill(nullptr);
    expect_bitwise_equal({train_once(*ctx, call, &w, nullptr)}, {per_call},
                         p.name() + ": refilled in place vs per-call");
    ctx->close();
  }
}

// Every FP8 tile (EPMOE_FP8_TILE over the rules of fp8_gemm.h) gives y and every gradient bitwise
// as the rules' choice: 128 x 128, 192 x 128 (here on 300 rows per expert: a full tile and a
// partial one), and the ping-pong tiles; fused and unfused.
TEST(GpuFp8Training, EveryTileEqualsTheRuleBitwise) {
  EPMOE_REQUIRE_GPU();
  const std::vector<Problem> cases = {
      fp8_problem(512, 1024, 768, 8, 2),  // 128 rows per expert
      fp8_problem(600, 256, 384, 4, 2),   // 300 rows per expert: a 192-row tile and a partial one
  };
  uint64_t seed = 1350;
  for (const Problem& base : cases) {
    const std::vector<RankInputs> in = make_inputs(base, seed++, base.max_tokens);
    for (bool fused : {true, false}) {
      Problem p = base;
      p.fused = fused;
      const RankOutputs rule = gpu_train(p, in[0]);
      for (const char* tile : {"128x128", "192x128", "64x256", "64x256-spread"}) {
        const ScopedEnv env("EPMOE_FP8_TILE", tile);
        expect_bitwise_equal({gpu_train(p, in[0])}, {rule},
                             p.name() + (fused ? " fused" : " unfused") + ": EPMOE_FP8_TILE=" + tile);
      }
    }
  }
}

// m-tile bands (EPMOE_FP8_BAND_ROWS) reorder the FP8 rows GEMMs' tiles only, on every tile: 600
// rows per expert are 5 m-tiles of 128 (bands of 1, or 2 + 2 + 1 at 320 rows) or 10 of 64 (5 + 5).
TEST(GpuFp8Training, BandsEqualBitwise) {
  EPMOE_REQUIRE_GPU();
  const Problem p = fp8_problem(1200, 256, 384, 4, 2);  // 600 rows per expert
  const std::vector<RankInputs> in = make_inputs(p, 1370, p.max_tokens);
  for (const char* tile : {"128x128", "192x128", "64x256", "64x256-spread"}) {
    const ScopedEnv env("EPMOE_FP8_TILE", tile);
    const RankOutputs whole = gpu_train(p, in[0]);
    for (const char* rows : {"128", "320"}) {
      const ScopedEnv band("EPMOE_FP8_BAND_ROWS", rows);
      expect_bitwise_equal({gpu_train(p, in[0])}, {whole},
                           p.name() + " EPMOE_FP8_TILE=" + tile + ": bands of " + rows + " rows vs none");
    }
  }
}

// grad_h3 and grad_h13 quantized by the kernels that write them (EPMOE_FP8_ROW_QUANT unset) give
// y and every gradient bitwise as the separate quantization kernel does, fused and unfused.
TEST(GpuFp8Training, RowQuantizationInProducersEqualsSeparateBitwise) {
  EPMOE_REQUIRE_GPU();
  const std::vector<Problem> cases = {
      fp8_problem(512, 1024, 768, 8, 2),  // F % 128 == 0: both producers quantize
      fp8_problem(96, 144, 256, 8, 2),    // D = 144: a 16-wide last block of grad_h3
      fp8_problem(64, 128, 96, 8, 2),     // F % 128 != 0: the SwiGLU backward quantizes apart
  };
  uint64_t seed = 1300;
  for (const Problem& base : cases) {
    const std::vector<RankInputs> in = make_inputs(base, seed++, base.max_tokens);
    for (bool fused : {true, false}) {
      Problem p = base;
      p.fused = fused;
      RankOutputs separate;
      {
        const ScopedEnv env("EPMOE_FP8_ROW_QUANT", "separate");
        separate = gpu_train(p, in[0]);
      }
      expect_bitwise_equal({gpu_train(p, in[0])}, {separate},
                           p.name() + (fused ? " fused" : " unfused") +
                               ": quantized by the producers vs separately");
    }
  }
}

// grad_h13's and h's column operands written by the SwiGLU backward (EPMOE_FP8_COL_QUANT=swiglu, on
// shapes where they fit over grad_h13's rows) give y and every gradient bitwise as the WGRAD
// stages' quantization of the bf16 rows does, fused and unfused, within the bounds of the CPU.
TEST(GpuFp8Training, ColumnQuantizationInSwigluEqualsSeparateBitwise) {
  EPMOE_REQUIRE_GPU();
  const std::vector<Problem> cases = {
      fp8_problem(1024, 256, 256, 4, 2),       // 512 rows per expert: two column tiles
      fp8_problem(700, 192, 256, 3, 2, true),  // clamped SwiGLU, partial column blocks
  };
  uint64_t seed = 1350;
  for (const Problem& base : cases) {
    const Dims d{base.max_tokens, base.hidden, base.intermediate, base.top_k, base.local_experts(), base.ranks};
    ASSERT_TRUE(fp8_grad_h13_cols_fit(d, base.max_tokens * base.top_k))
        << base.name() << ": the case should take the column path";
    const std::vector<RankInputs> in = make_inputs(base, seed++, base.max_tokens);
    for (bool fused : {true, false}) {
      Problem p = base;
      p.fused = fused;
      RankOutputs separate;
      {
        const ScopedEnv env("EPMOE_FP8_COL_QUANT", "separate");
        separate = gpu_train(p, in[0]);
      }
      RankOutputs got;
      {
        const ScopedEnv env("EPMOE_FP8_COL_QUANT", "swiglu");
        got = gpu_train(p, in[0], 2);
      }
      expect_bitwise_equal({got}, {separate},
                           p.name() + (fused ? " fused" : " unfused") + ": columns by the SwiGLU vs separately");
      if (!fused) continue;
      const OutputErrors vs_cpu = compare(got, run_layer(p, in)[0]);
      for (int o = 0; o < kNumOutputs; ++o) {
        const Output out = static_cast<Output>(o);
        EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::fp8_block, out))
            << p.name() << ": " << to_string(out) << " CUDA vs CPU backend (" << vs_cpu.to_string() << ")";
      }
    }
  }
}

// Live counts below T and none, and a skewed routing (one expert with > 128 rows).
TEST(GpuFp8Training, EdgeRoutingsMatchCpuWithinBounds) {
  EPMOE_REQUIRE_GPU();
  for (Fp8Wgrad wgrad : {Fp8Wgrad::fp8, Fp8Wgrad::bf16}) {
    Problem p = fp8_problem(300, 256, 160, 8, 2);
    p.fp8_wgrad = wgrad;
    const auto one_expert = [](int, int64_t, int, std::mt19937_64&) -> int64_t { return 3; };
    struct Case {
      int64_t live;
      Router router;
    };
    uint64_t seed = 950;
    for (const Case& c : {Case{77, nullptr}, Case{0, nullptr}, Case{-1, one_expert}}) {
      std::vector<RankInputs> in =
          make_inputs(p, seed++, p.max_tokens, c.router ? c.router : distinct_router(p.experts, p.top_k));
      in[0].live = c.live;
      const RankOutputs gpu = gpu_train(p, in[0]);
      const RankOutputs cpu = run_layer(p, in)[0];
      const OutputErrors vs_cpu = compare(gpu, cpu);
      const std::string what = p.name() + " live " + std::to_string(c.live);
      report_errors(what + " fp8 gpu vs cpu", vs_cpu);
      for (int o = 0; o < kNumOutputs; ++o) {
        const Output out = static_cast<Output>(o);
        if (c.live == 0) continue;  // all zeros on both sides: checked bitwise below
        EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::fp8_block, out))
            << what << ": " << to_string(out) << " (" << vs_cpu.to_string() << ")";
      }
      if (c.live == 0) expect_bitwise_equal({gpu}, {cpu}, what + ": no live tokens");
    }
  }
}

// A stack of 4 layers in one slot: at the minimum budget every layer saves only x and backward
// replays its forward (restore_input re-quantizes x; the FP8 stages copy to and from the placed
// buffers); the result is bitwise the full save's.
TEST(GpuFp8Training, RecomputeAtMinimumBudgetEqualsFullSaveBitwise) {
  EPMOE_REQUIRE_GPU();
  for (Fp8Wgrad wgrad : {Fp8Wgrad::fp8, Fp8Wgrad::bf16}) {
    for (bool fused : {true, false}) {
      for (CombineMode combine : {CombineMode::per_route, CombineMode::per_rank}) {
        Problem p = fp8_problem(96, 144, 112, 8, 2);  // 2D = 288 bytes: granule lcm(128, 288)
        p.fused = fused;
        p.combine = combine;
        p.fp8_wgrad = wgrad;  // bf16: x decoded from where the plan placed it (slot or scratch)
        p.layers_per_slot = kStackLayers;
        const int64_t tokens[kStackLayers] = {96, 29, 96, 61};
        std::vector<RankInputs> in;
        for (int l = 0; l < kStackLayers; ++l) {
          in.push_back(make_inputs(p, 970 + static_cast<uint64_t>(l), tokens[l])[0]);
        }
        const MemoryPlan plan = plan_memory(stack_config(p, -1), 1);
        StackResult results[2];
        int i = 0;
        for (int64_t budget : {int64_t{-1}, plan.minimum_slot_bytes}) {
          auto ctx = Context::create(stack_config(p, budget), make_single_gpu_transport(0));
          auto calls = stack_calls(p, in, 0);
          results[i] = run_stack(*ctx, calls, nullptr);
          const StackResult again = run_stack(*ctx, calls, nullptr);
          expect_stack_bitwise_equal(again, results[i], p.name() + ": second pass");
          ctx->close();
          ++i;
        }
        EXPECT_EQ(results[0].recomputed, std::vector<bool>(kStackLayers, false)) << p.name();
        EXPECT_EQ(results[1].recomputed, std::vector<bool>(kStackLayers, true)) << p.name();
        expect_stack_bitwise_equal(results[1], results[0], p.name() + ": recompute vs full save");
      }
    }
  }
}

// The per-rank combine at EP = 1: one partial row per token (the sum of its routes' W2 rows,
// score-weighted, and of its W13 DGRAD rows), which the owner adds to 0: y, grad_x and every other
// output bitwise the per-route ones; fused == unfused == prepared, repeated calls; against the CPU
// backend's per-rank outputs within the fp8_block backend bounds; a live count below T.
TEST(GpuFp8Training, PerRankCombineEqualsPerRouteAtEp1AndMatchesCpu) {
  EPMOE_REQUIRE_GPU();
  const std::vector<Problem> cases = {
      fp8_problem(64, 128, 96, 8, 2),     // ci-tiny
      fp8_problem(333, 256, 528, 16, 4),  // ragged tiles in every dimension
      fp8_problem(96, 192, 144, 8, 2, true),
  };
  uint64_t seed = 1400;
  for (const Problem& base : cases) {
    std::vector<RankInputs> in = make_inputs(base, seed++, base.max_tokens);
    in[0].live = base.max_tokens - base.max_tokens / 5;
    Problem p = base;
    p.combine = CombineMode::per_rank;
    const RankOutputs per_rank = gpu_train(p, in[0], 2);
    expect_bitwise_equal({gpu_train(base, in[0])}, {per_rank},
                         p.name() + ": per_route vs per_rank");
    Problem unfused = p;
    unfused.fused = false;
    expect_bitwise_equal({gpu_train(unfused, in[0])}, {per_rank}, p.name() + ": unfused vs fused");
    Problem prepared = p;
    prepared.prepared_weights = true;
    expect_bitwise_equal({gpu_train(prepared, in[0])}, {per_rank},
                         p.name() + ": prepared vs per-call");
    const OutputErrors vs_cpu = compare(per_rank, run_layer(p, in)[0]);
    report_errors(p.name() + " fp8 per_rank gpu vs cpu", vs_cpu);
    for (int o = 0; o < kNumOutputs; ++o) {
      const Output out = static_cast<Output>(o);
      EXPECT_LE(vs_cpu[out], backend_rel_l2_bound(Precision::fp8_block, out))
          << p.name() << ": " << to_string(out) << " CUDA vs CPU backend (" << vs_cpu.to_string()
          << ")";
    }
  }
}

// Config.fp8_wgrad = by_shape (the default) runs the plan's choice on CUDA: bitwise the explicit
// choice's outputs, and not the other choice's weight gradients. 300*2/8 = 75 rows per expert
// resolve to bf16; 1024*2/4 = 512 rows with D = F = 2048 (D*F/(D+F) = 1024) to fp8.
TEST(GpuFp8Training, ByShapeRunsThePlansChoiceBitwise) {
  EPMOE_REQUIRE_GPU();
  struct Case {
    Problem p;
    Fp8Wgrad want;
  };
  for (const Case& c : {Case{fp8_problem(300, 256, 160, 8, 2), Fp8Wgrad::bf16},
                        Case{fp8_problem(1024, 2048, 2048, 4, 2), Fp8Wgrad::fp8}}) {
    Problem p = c.p;
    p.fp8_wgrad = Fp8Wgrad::by_shape;
    const MemoryPlan plan = plan_memory(p.config(), 1);
    ASSERT_EQ(plan.fp8_wgrad, c.want) << p.name() << ": " << plan.fp8_wgrad_reason;
    const std::vector<RankInputs> in = make_inputs(p, 990, p.max_tokens);
    const RankOutputs got = gpu_train(p, in[0]);
    Problem same = p, other = p;
    same.fp8_wgrad = c.want;
    other.fp8_wgrad = c.want == Fp8Wgrad::fp8 ? Fp8Wgrad::bf16 : Fp8Wgrad::fp8;
    expect_bitwise_equal({got}, {gpu_train(same, in[0])},
                         p.name() + ": by_shape vs " + to_string(c.want));
    const RankOutputs o = gpu_train(other, in[0]);
    const std::string ran_other = p.name() + ": by_shape ran the other choice";
    EXPECT_TRUE(got.grad_w2_EDF != o.grad_w2_EDF) << ran_other;
    EXPECT_TRUE(got.grad_w13_EFD != o.grad_w13_EFD) << ran_other;
  }
}

// One forward + backward captured in a graph, replayed with new routings and live counts.
TEST(GpuFp8Training, GraphReplayWithNewRoutingsEqualsEager) {
  EPMOE_REQUIRE_GPU();
  struct Variant {
    bool prepared;
    CombineMode combine;
    Fp8Wgrad wgrad = Fp8Wgrad::fp8;
  };
  for (const Variant v : {Variant{false, CombineMode::per_route},
                          Variant{true, CombineMode::per_route},
                          Variant{false, CombineMode::per_rank},
                          Variant{false, CombineMode::per_route, Fp8Wgrad::bf16}}) {
    const bool prepared = v.prepared;
    Problem p = fp8_problem(256, 256, 192, 16, 4);
    p.capacity_factor = 1.0;
    p.prepared_weights = prepared;
    p.combine = v.combine;
    p.fp8_wgrad = v.wgrad;
    // Same x, grad_y and weights every time; a new routing per seed.
    auto routing = [&](uint64_t seed, int64_t live) {
      return rerouted(p, 100, seed, 256, {live})[0];
    };
    const RankInputs first = routing(1, 256);
    auto ctx = Context::create(p.config(), make_single_gpu_transport(0));
    DeviceCall call(p, first);
    DevicePrepared weights(p, first);
    const DevicePrepared* w = prepared ? &weights : nullptr;
    StreamGraph graph(
        [&](cudaStream_t stream) {
          train_once(*ctx, call, w, stream);  // warm-up outside capture
          CUDA_OK(cudaStreamSynchronize(stream));
        },
        [&](cudaStream_t stream) { train_step(*ctx, call, w, stream); });
    for (const auto& [seed, live] :
         std::vector<std::pair<uint64_t, int64_t>>{{2, 256}, {3, 100}, {4, 1}, {5, 0}, {6, 256}}) {
      const RankInputs in = routing(seed, live);
      call.set_routing(in);
      call.poison();
      graph.launch();
      ctx->check();
      expect_bitwise_equal({call.outputs()}, {gpu_train(p, in)},
                           p.name() + ": graph replay, routing seed " + std::to_string(seed) +
                               " live " + std::to_string(live));
    }
    ctx->close();
  }
}

}  // namespace
}  // namespace epmoe::test
