// plan_memory, exact bytes, by mode: inference, the per-rank combine, and the fp8_block, NVFP4 and
// MXFP8 terms. The byte notation and the worked layout / route-scratch / pad figures every total
// below adds are in test_memory_plan.cpp's header comment.
#include <gtest/gtest.h>

#include <string>

#include "core/fp8_terms.h"
#include "core/plan_terms.h"
#include "epmoe/config.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"
#include "memory_plan_test_configs.h"

namespace epmoe {
namespace {

using namespace plan_test;

TEST(MemoryPlan, Inference) {
  ConfigFields f = small();
  f.inference = true;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_TRUE(p.inference);
  EXPECT_EQ(p.slot_sizing, SlotSizing::none);
  EXPECT_EQ(p.num_slots, 0);
  EXPECT_EQ(p.layers_per_slot, 0);
  EXPECT_EQ(p.minimum_slot_bytes, 0);
  EXPECT_EQ(p.maximum_useful_slot_bytes, 0);
  EXPECT_EQ(p.slot_bytes, 0);
  EXPECT_EQ(p.activation_bytes, 0);
  EXPECT_EQ(p.recv_capacity_rows, 8);
  EXPECT_EQ(p.scratch_bytes, 16384);  // as in training: 768 + pad 128 + 15488
  EXPECT_EQ(p.arena_bytes, 16384);
  EXPECT_EQ(p.total_bytes, 20352);    // 16384 + 3456 + 128 + 384 (no planner state)
  const std::string text = p.explain();
  expect_contains(text, "activation slots: 0 slots (inference)");
  expect_contains(text, "scratch-only inference; no saved activations");
}

// Per-rank combine (inference): the combine buffer holds one row per (token, source rank)
// [T, R, D], and the call scratch keeps W2's rows [M, D] (rows_MD) for the send stage.
TEST(MemoryPlan, PerRankCombineInference) {
  ConfigFields f = small();
  f.inference = true;
  f.combine = CombineMode::per_rank;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.combine, CombineMode::per_rank);
  EXPECT_EQ(p.combine_buffer_bytes, 2048);     // A(4*2*128*2): R = K = 2, as per_route
  EXPECT_EQ(p.symmetric_bytes, 3456);          // as MemoryPlan.Inference
  EXPECT_EQ(p.forward_scratch_bytes, 11136);   // fused 9088 + rows_MD A(8*128*2)=2048
  EXPECT_EQ(p.backward_scratch_bytes, 17536);  // fused 15488 + rows_MD 2048 (no grad_h)
  EXPECT_EQ(p.scratch_bytes, 18432);           // 768 + pad 128 + 17536
  EXPECT_EQ(p.arena_bytes, 18432);
  EXPECT_EQ(p.total_bytes, 22400);             // 18432 + 3456 + 128 + 384
  expect_contains(p.explain(), "combine [T,R,D] bf16 (one partial row per source rank): ");
}

// Per-rank combine in training: the same bytes as in inference for the combine buffer (grad_scores
// return through the routing buffer) and a full save as per-route's.
TEST(MemoryPlan, PerRankCombineTraining) {
  ConfigFields f = small();
  f.combine = CombineMode::per_rank;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.combine_buffer_bytes, 2048);     // A(4*2*128*2)
  EXPECT_EQ(p.symmetric_bytes, 3456);          // 384 + 1024 + 2048
  // A(8*128*2)=2048 + A(8*256*2)=4096, as per_route
  EXPECT_EQ(p.saved_full_bytes_balanced, 6144);
  EXPECT_EQ(p.saved_full_bytes_capacity, 6144);
  EXPECT_EQ(p.slot_bytes, 14336);              // 2048 + 2 * 6144
  EXPECT_EQ(p.forward_scratch_bytes, 11136);   // 9088 + rows_MD 2048
  EXPECT_EQ(p.backward_scratch_bytes, 17536);  // 15488 + rows_MD 2048
  EXPECT_EQ(p.scratch_bytes, 18432);           // 768 + 128 + 17536
  EXPECT_EQ(p.arena_bytes, 32768);             // 14336 + 18432
  EXPECT_EQ(p.total_bytes, 36992);             // 32768 + 3456 + 128 + 384 + 256
  expect_contains(p.explain(), "combine [T,R,D] bf16 (one partial row per source rank): ");
  // At 16 capacity rows x_gathered and h13 grow with the rows.
  f.capacity_factor = 2.0;
  const MemoryPlan wide = plan_memory(Config(f), 2);
  EXPECT_EQ(wide.recv_capacity_rows, 16);
  EXPECT_EQ(wide.saved_full_bytes_capacity, 12288);  // 4096 + 8192
  EXPECT_EQ(wide.saved_full_bytes_balanced, 6144);
  f.combine = CombineMode::per_route;
  EXPECT_EQ(plan_memory(Config(f), 2).saved_full_bytes_capacity, 12288);  // 4096 + 8192
}

// ci-tiny at R = 4 (K = 2): [T, R, D] is twice [T, K, D]; unfused adds only grad_h (rows_MD is
// there already).
TEST(MemoryPlan, PerRankCombineAtFourRanks) {
  ConfigFields f = ci_tiny();
  f.inference = true;
  const MemoryPlan route = plan_memory(Config(f), 4);
  f.combine = CombineMode::per_rank;
  const MemoryPlan rank = plan_memory(Config(f), 4);
  EXPECT_EQ(route.combine_buffer_bytes, 32768);  // A(64*2*128*2)
  EXPECT_EQ(rank.combine_buffer_bytes, 65536);   // A(64*4*128*2)
  const int64_t rows_MD = align_bytes(route.recv_capacity_rows * 128 * 2);
  EXPECT_EQ(rows_MD, 32768);  // M = 128 rows
  EXPECT_EQ(rank.backward_scratch_bytes, route.backward_scratch_bytes + rows_MD);
  EXPECT_EQ(rank.total_bytes, route.total_bytes + 32768 + rows_MD);
  f.fuse_epilogues = false;
  const MemoryPlan unfused = plan_memory(Config(f), 4);
  EXPECT_EQ(unfused.backward_scratch_bytes,
            rank.backward_scratch_bytes + align_bytes(route.recv_capacity_rows * 96 * 2));
}

// NVFP4 weight-only inference adds no bytes: the caller owns the weights, activations are bf16.
TEST(MemoryPlan, Nvfp4InferenceAsBf16Inference) {
  ConfigFields f = small();
  f.inference = true;
  f.precision = Precision::nvfp4;
  f.prepared_weights = true;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.precision, Precision::nvfp4);
  EXPECT_EQ(p.dispatch_buffer_bytes, 1024);  // A(4*128*2), bf16 rows
  EXPECT_EQ(p.fp8_scratch_bytes, 0);
  EXPECT_EQ(p.fp8_weight_scratch_bytes, 0);
  EXPECT_EQ(p.scratch_bytes, 16384);  // as MemoryPlan.Inference
  EXPECT_EQ(p.total_bytes, 20352);
  expect_contains(p.explain(), "nvfp4 weights: prepared by the caller");
}

// MXFP8 inference adds no bytes either: the caller owns the weights, bf16 rows cross ranks, the
// CPU GEMMs quantize each activation row into their own temporaries, and the CUDA GEMMs' quantized
// rows (codes [M, max(D, F)] + E8M0 scales [M, max(D, F) / 32]) lie in the call scratch's
// backward rows (grad_h3 .. rows_MD), which an inference context leaves unused.
TEST(MemoryPlan, Mxfp8InferenceAsBf16Inference) {
  ConfigFields f = small();
  f.inference = true;
  const MemoryPlan bf16 = plan_memory(Config(f), 2);
  f.precision = Precision::mxfp8;
  f.prepared_weights = true;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(p.precision, Precision::mxfp8);
  EXPECT_EQ(p.dispatch_buffer_bytes, 1024);  // A(4*128*2), bf16 rows
  EXPECT_EQ(p.fp8_scratch_bytes, 0);
  EXPECT_EQ(p.fp8_weight_scratch_bytes, 0);
  EXPECT_EQ(p.recv_capacity_rows, 8);
  EXPECT_EQ(p.mxfp8_scratch_bytes, 1152);  // A(8*128) = 1024 codes + A(8*4) = 128 scales
  EXPECT_EQ(p.forward_scratch_bytes, bf16.forward_scratch_bytes + 1152);
  EXPECT_EQ(p.scratch_bytes, 16384);  // as MemoryPlan.Inference
  EXPECT_EQ(p.total_bytes, 20352);
  EXPECT_EQ(bf16.mxfp8_scratch_bytes, 0);
  const std::string text = p.explain();
  expect_contains(text, "mxfp8 weights: prepared by the caller");
  expect_contains(text, "mxfp8 quantized rows (CUDA): 0.000 GiB (1,152 bytes)");
  // The region it lies in: grad_h3 A(8*128*2) = 2048 + grad_h13 A(8*256*2) = 4096 bytes.
  const Dims d{4, 128, 128, 2, 2, 2};
  const CallScratchLayout cl = call_scratch_layout(d, 8, false);
  EXPECT_EQ(cl.rows_MD - cl.grad_h3, 6144);
  EXPECT_EQ(mxfp8_scratch_layout(d, 8).scales, 1024);
  EXPECT_TRUE(mxfp8_scratch_fits(cl, d, 8));
  // F > D: the rows are F wide. D 32, F 4096, M 8: A(8*4096) = 32768 + A(8*128) = 1024, within
  // A(8*32*2) = 512 + A(8*8192*2) = 131072.
  const Dims wide{4, 32, 4096, 2, 2, 2};
  EXPECT_EQ(mxfp8_scratch_layout(wide, 8).total, 33792);
  EXPECT_TRUE(mxfp8_scratch_fits(call_scratch_layout(wide, 8, false), wide, 8));
}

TEST(MemoryPlan, Fp8BlockTermsExactBytes) {
  ConfigFields f = fields(16, 32, 24, 8, 2);
  const MemoryPlan bf16 = plan_memory(Config(f), 2);
  f.precision = Precision::fp8_block;
  f.fp8_wgrad = Fp8Wgrad::fp8;  // the WGRAD columns (by_shape resolves this shape to bf16)
  const MemoryPlan fp8 = plan_memory(Config(f), 2);
  EXPECT_EQ(fp8.recv_capacity_rows, 32);
  EXPECT_EQ(fp8.dispatch_buffer_bytes, 1024);
  EXPECT_EQ(fp8.fp8_scratch_bytes, 56576);
  EXPECT_EQ(fp8.fp8_weight_scratch_bytes, 15744);
  EXPECT_EQ(fp8.call_scratch_pad_bytes, 0);  // G = lcm(128, 64) = 128: never a pad
  EXPECT_EQ(fp8.scratch_bytes, bf16.scratch_bytes + 56576 + 15744);
  EXPECT_EQ(fp8.forward_scratch_bytes, bf16.forward_scratch_bytes + 896);
  EXPECT_EQ(fp8.arena_bytes, bf16.arena_bytes + 56576 + 15744);
  EXPECT_EQ(fp8.total_bytes, bf16.total_bytes + 56576 + 15744);
  // Saved state: the received E4M3 rows + scales live in the bf16 x_gathered space.
  EXPECT_EQ(fp8.saved_full_bytes_capacity, bf16.saved_full_bytes_capacity);
  EXPECT_EQ(bf16.fp8_scratch_bytes, 0);
  EXPECT_EQ(bf16.fp8_weight_scratch_bytes, 0);
  const std::string text = fp8.explain();
  for (const char* part :
       {"dispatch x [T,D] E4M3 + scales [T,ceil(D/128)] f32 / grad_y [T,D] bf16: 0.000 GiB (1,024 ",
        "+ fp8 operands 0.000 GiB (56,576 bytes) + fp8 weights 0.000 GiB (15,744 bytes)",
        "h rows 0.000 GiB (896 bytes)", "grad_h3 rows 0.000 GiB (1,152 bytes)",
        "grad_h13 rows 0.000 GiB (1,664 bytes)",
        "WGRAD columns (128 rows per block) 0.000 GiB (52,864 bytes)",
        "fp8 weights quantized per call (w13, w2 + 128x128 scales): 0.000 GiB (9,472 bytes)",
        "fp8 weight transposed for the DGRADs (w2, then w13, one region): 0.000 GiB (6,272 bytes)"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in\n" << text;
  }
  f.prepared_weights = true;
  const MemoryPlan prepared = plan_memory(Config(f), 2);
  EXPECT_EQ(prepared.fp8_weight_scratch_bytes, 0);  // no transposed weight either
  EXPECT_EQ(prepared.scratch_bytes, bf16.scratch_bytes + 56576);
  EXPECT_EQ(prepared.arena_bytes, bf16.arena_bytes + 56576);
  EXPECT_EQ(prepared.total_bytes, bf16.total_bytes + 56576);
  const std::string prepared_text = prepared.explain();
  EXPECT_NE(prepared_text.find("fp8 weights: prepared by the caller (Config.prepared_weights; "
                               "training: with their transposed copies for the DGRADs)"),
            std::string::npos)
      << prepared_text;
  EXPECT_EQ(prepared_text.find("fp8 weight transposed"), std::string::npos) << prepared_text;
  // A large T: the E4M3 rows + scales never exceed the bf16 rows they replace on the wire.
  f = fields(4096, 7168, 2048, 256, 8);
  f.precision = Precision::fp8_block;
  EXPECT_EQ(plan_memory(Config(f), 8).dispatch_buffer_bytes, 4096 * 7168 * 2);
}

// Config.fp8_wgrad = bf16 (the same shape): the WGRAD columns give way to x decoded to bf16, bf16
// [M, max(D, F)] = A(32*32*2) = 2048 (room for the fused W2 DGRAD's grad_h [M, F] too), after the
// same row operands (896 + 1152 + 1664 = 3712): 5760 bytes. The weights, the saved state and the
// forward scratch do not change; an inference context keeps the h rows only either way.
TEST(MemoryPlan, Fp8WgradBf16DecodedXReplacesTheWgradColumns) {
  ConfigFields f = fields(16, 32, 24, 8, 2);
  f.precision = Precision::fp8_block;
  f.fp8_wgrad = Fp8Wgrad::fp8;
  const MemoryPlan fp8 = plan_memory(Config(f), 2);
  f.fp8_wgrad = Fp8Wgrad::bf16;
  const MemoryPlan p = plan_memory(Config(f), 2);
  EXPECT_EQ(fp8.fp8_wgrad, Fp8Wgrad::fp8);
  EXPECT_EQ(p.fp8_wgrad, Fp8Wgrad::bf16);
  EXPECT_EQ(p.fp8_scratch_bytes, 5760);
  EXPECT_EQ(p.fp8_weight_scratch_bytes, fp8.fp8_weight_scratch_bytes);
  EXPECT_EQ(p.forward_scratch_bytes, fp8.forward_scratch_bytes);
  EXPECT_EQ(p.saved_full_bytes_capacity, fp8.saved_full_bytes_capacity);
  EXPECT_EQ(p.slot_bytes, fp8.slot_bytes);
  EXPECT_EQ(p.scratch_bytes, fp8.scratch_bytes - 56576 + 5760);
  EXPECT_EQ(p.total_bytes, fp8.total_bytes - 56576 + 5760);
  const Dims d{16, 32, 24, 2, 4, 2};
  const Fp8ScratchLayout l = fp8_scratch_layout(d, 32, Fp8Wgrad::bf16);
  const Fp8ScratchLayout l8 = fp8_scratch_layout(d, 32, Fp8Wgrad::fp8);
  EXPECT_EQ(l.h_q, l8.h_q);
  EXPECT_EQ(l.grad_h3_q, l8.grad_h3_q);
  EXPECT_EQ(l.grad_h13_q, l8.grad_h13_q);
  EXPECT_EQ(l.col_a, l8.col_a);  // the fused W2 DGRAD's grad_h: the same place in both
  EXPECT_EQ(l.x_bf16, l.col_a);
  EXPECT_EQ(l.total, 5760);
  EXPECT_GE(l.total - l.x_bf16, 32 * 24 * 2);  // grad_h [M, F] bf16 fits
  const std::string text = p.explain();
  for (const char* part :
       {"+ fp8 operands 0.000 GiB (5,760 bytes)", "grad_h13 rows 0.000 GiB (1,664 bytes)",
        "x decoded to bf16 for the bf16 WGRADs (no WGRAD columns) 0.000 GiB (2,048 bytes)",
        "weight gradients (Config.fp8_wgrad = bf16): bf16: as configured"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in\n" << text;
  }
  EXPECT_EQ(text.find("WGRAD columns (128"), std::string::npos) << text;
  // F > D: the region is [M, F] (grad_h); a wide D: [M, D] (x).
  EXPECT_EQ(fp8_scratch_layout(Dims{16, 32, 200, 2, 4, 2}, 32, Fp8Wgrad::bf16).total -
                fp8_scratch_layout(Dims{16, 32, 200, 2, 4, 2}, 32, Fp8Wgrad::bf16).x_bf16,
            align_bytes(32 * 200 * 2));
  EXPECT_EQ(fp8_scratch_layout(Dims{16, 300, 24, 2, 4, 2}, 32, Fp8Wgrad::bf16).total -
                fp8_scratch_layout(Dims{16, 300, 24, 2, 4, 2}, 32, Fp8Wgrad::bf16).x_bf16,
            align_bytes(32 * 300 * 2));
  f.inference = true;
  EXPECT_EQ(plan_memory(Config(f), 2).fp8_scratch_bytes, 896);
}

// An fp8_block inference context (the same shape as above) keeps, of the FP8 operands, the h rows
// only (A(32*24 + 1*32*4) = 896); the dispatch buffer and the per-call weights are as in training.
TEST(MemoryPlan, Fp8BlockInferenceKeepsTheHRowsOnly) {
  ConfigFields f = fields(16, 32, 24, 8, 2);
  f.inference = true;
  const MemoryPlan bf16 = plan_memory(Config(f), 2);
  f.precision = Precision::fp8_block;
  const MemoryPlan fp8 = plan_memory(Config(f), 2);
  EXPECT_EQ(fp8.recv_capacity_rows, 32);
  EXPECT_EQ(fp8.activation_bytes, 0);
  EXPECT_EQ(fp8.dispatch_buffer_bytes, 1024);
  EXPECT_EQ(fp8.fp8_scratch_bytes, 896);
  EXPECT_EQ(fp8.fp8_weight_scratch_bytes, 9472);
  EXPECT_EQ(fp8.forward_scratch_bytes, bf16.forward_scratch_bytes + 896);
  EXPECT_EQ(fp8.scratch_bytes, bf16.scratch_bytes + 896 + 9472);
  EXPECT_EQ(fp8.arena_bytes, bf16.arena_bytes + 896 + 9472);
  EXPECT_EQ(fp8.total_bytes, bf16.total_bytes + 896 + 9472);
  const std::string text = fp8.explain();
  for (const char* part : {"+ fp8 operands 0.000 GiB (896 bytes) + fp8 weights 0.000 GiB (9,472 bytes)",
                           "h rows 0.000 GiB (896 bytes) (inference: forward only)"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in\n" << text;
  }
  EXPECT_EQ(text.find("grad_h3 rows"), std::string::npos) << text;
  f.prepared_weights = true;
  const MemoryPlan prepared = plan_memory(Config(f), 2);
  EXPECT_EQ(prepared.fp8_weight_scratch_bytes, 0);
  EXPECT_EQ(prepared.arena_bytes, bf16.arena_bytes + 896);
}

// fp8_block with the per-rank combine: the FP8 terms of per_route, plus per_rank's own terms as in
// bf16 (the combine buffer [T, R, D] bf16 and the call scratch's rows_MD [M, D] bf16, which W2 and
// the W13 DGRAD write for the send), in training and inference, at R = 4 ([T, R, D] is twice
// [T, K, D] with K = 2).
TEST(MemoryPlan, Fp8BlockPerRankAddsThePerRankTermsOnly) {
  for (bool inference : {false, true}) {
    ConfigFields f = fields(16, 32, 24, 8, 2);
    f.inference = inference;
    auto plan = [&](Precision precision, CombineMode combine) {
      f.precision = precision;
      f.combine = combine;
      return plan_memory(Config(f), 4);
    };
    const MemoryPlan bf16_route = plan(Precision::bf16, CombineMode::per_route);
    const MemoryPlan bf16_rank = plan(Precision::bf16, CombineMode::per_rank);
    const MemoryPlan fp8_route = plan(Precision::fp8_block, CombineMode::per_route);
    const MemoryPlan fp8_rank = plan(Precision::fp8_block, CombineMode::per_rank);
    const std::string what = inference ? "inference" : "training";
    const int64_t rows_MD = align_bytes(fp8_rank.recv_capacity_rows * 32 * 2);
    EXPECT_EQ(fp8_rank.combine, CombineMode::per_rank) << what;
    EXPECT_EQ(fp8_rank.combine_buffer_bytes, align_bytes(16 * 4 * 32 * 2)) << what;
    EXPECT_EQ(fp8_rank.combine_buffer_bytes, 2 * fp8_route.combine_buffer_bytes) << what;
    EXPECT_EQ(fp8_rank.dispatch_buffer_bytes, fp8_route.dispatch_buffer_bytes) << what;
    EXPECT_EQ(fp8_rank.fp8_scratch_bytes, fp8_route.fp8_scratch_bytes) << what;
    EXPECT_EQ(fp8_rank.fp8_weight_scratch_bytes, fp8_route.fp8_weight_scratch_bytes) << what;
    EXPECT_EQ(fp8_rank.slot_bytes, fp8_route.slot_bytes) << what;
    EXPECT_EQ(fp8_rank.backward_scratch_bytes, fp8_route.backward_scratch_bytes + rows_MD) << what;
    EXPECT_EQ(fp8_rank.forward_scratch_bytes, fp8_route.forward_scratch_bytes + rows_MD) << what;
    EXPECT_EQ(fp8_rank.total_bytes - fp8_route.total_bytes,
              bf16_rank.total_bytes - bf16_route.total_bytes)
        << what;
    EXPECT_EQ(fp8_rank.total_bytes,
              fp8_route.total_bytes + fp8_route.combine_buffer_bytes + rows_MD)
        << what;
    const std::string text = fp8_rank.explain();
    for (const char* part : {"dispatch x [T,D] E4M3 + scales [T,ceil(D/128)] f32",
                             "combine [T,R,D] bf16 (one partial row per source rank): "}) {
      EXPECT_NE(text.find(part), std::string::npos) << part << " missing in\n" << text;
    }
  }
}

}  // namespace
}  // namespace epmoe
