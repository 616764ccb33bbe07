// FP8's E4M3 rows of h, grad_h3 and grad_h13 written by the kernels that write the bf16 rows (the
// SwiGLU forward, gather_grad's pull, the SwiGLU backward) against the separate chain (the bf16
// kernel, then fp8_quantize_rows_counted reading the rows back), both through the CUDA backend's
// stages with EPMOE_FP8_ROW_QUANT=producer / separate: bf16 outputs, codes and scales bitwise over
// the whole capacity (rows past the device row count untouched by both), for R simulated ranks on
// one GPU (the pull reads peers' rows), a received row count below capacity, partial last blocks,
// F % 128 != 0 (the SwiGLU kernels fall back to the separate chain), both backward forms (score in
// gather_grad, row scores after the W2 DGRAD) and a skipped step.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "scoped_env.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

constexpr uint8_t kPoison = 0xA5;  // Dev's fill byte: a byte no stage wrote

struct RowQuantCase {
  std::string name;
  Shape shape;
  Pattern pattern;
  std::optional<int32_t> live;  // live count of every rank
  bool row_scores;              // the Context's backward (score after the W2 DGRAD)
};

std::vector<RowQuantCase> cases() {
  std::vector<RowQuantCase> c;
  for (bool rs : {false, true}) {
    const std::string tag = rs ? ", row scores" : "";
    c.push_back({"R=1 D=128 F=128" + tag, {40, 128, 128, 2, 4, 1, 0}, Pattern::distinct, 31, rs});
    // D = 16: one partial block of two vectors; F = 136: 2F spans blocks across gate and up.
    c.push_back({"R=2 D=16 F=136" + tag, {23, 16, 136, 2, 3, 2, 0}, Pattern::distinct, std::nullopt, rs});
    // D = 272: a 16-wide last block; K = 8 > E, duplicates: a pull fans out to several rows.
    c.push_back({"R=3 D=272 F=256 duplicates" + tag, {50, 272, 256, 8, 2, 3, 50 * 3 * 8},
                 Pattern::duplicates, 37, rs});
    // D = 2048: two passes of the pull's vector loop; F = 768 (qwen3-30b-a3b's).
    c.push_back({"R=2 D=2048 F=768" + tag, {33, 2048, 768, 2, 2, 2, 0}, Pattern::distinct, 30, rs});
  }
  return c;
}

Step fp8_step(World& w, int r, Dev<uint8_t>& scratch) {
  Step s = w.step(r);
  s.fp8 = true;
  s.fp8_scratch = reinterpret_cast<char*>(scratch.ptr);
  return s;
}

int64_t scratch_bytes(const Shape& sh) { return fp8_scratch_layout(sh.dims(), sh.cap(), Fp8Wgrad::fp8).total; }

// The rows region [offset, offset + fp8_rows_bytes(capacity, L)) of a scratch copy.
std::vector<uint8_t> rows_region(const std::vector<uint8_t>& scratch, int64_t offset, int64_t cap,
                                 int64_t L) {
  return std::vector<uint8_t>(scratch.begin() + offset,
                              scratch.begin() + offset + fp8_rows_bytes(cap, L));
}

// Rows [0, M) hold codes and scales, rows [M, capacity) none (still poisoned).
void expect_rows_written_below(const std::vector<uint8_t>& rows, int64_t M, int64_t cap,
                               int64_t L) {
  const int64_t ld = fp8_rows_ld(cap), off = fp8_rows_scales_offset(cap, L);
  bool below_written = M == 0;
  for (int64_t i = 0; i < M * L && !below_written; ++i) below_written = rows[static_cast<size_t>(i)] != kPoison;
  EXPECT_TRUE(below_written) << "no code of rows [0, " << M << ") written";
  for (int64_t i = M * L; i < cap * L; ++i) {
    ASSERT_EQ(rows[static_cast<size_t>(i)], kPoison) << "code of row " << i / L << " >= M = " << M;
  }
  for (int64_t b = 0; b < fp8_blocks(L); ++b) {
    for (int64_t m = M; m < ld; ++m) {
      for (int64_t byte = 0; byte < 4; ++byte) {
        ASSERT_EQ(rows[static_cast<size_t>(off + (b * ld + m) * 4 + byte)], kPoison)
            << "scale of row " << m << " >= M = " << M << ", block " << b;
      }
    }
  }
}

// What one run of a stage leaves: the bf16 buffers it writes and the FP8 scratch.
struct StageOut {
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint8_t> scratch;
};

// Poisons `outs` (device buffers of the given bytes) and a fresh FP8 scratch, runs `stage` on rank
// r's FP8 step with EPMOE_FP8_ROW_QUANT = mode, and reads everything back.
StageOut run_stage(World& w, int r, const char* mode, const std::vector<std::pair<void*, int64_t>>& outs,
                   void (Backend::*stage)(const Step&)) {
  for (const auto& [ptr, bytes] : outs) {
    if (ptr != nullptr) w.fill(ptr, std::vector<uint8_t>(static_cast<size_t>(bytes), kPoison));
  }
  Dev<uint8_t> scratch(static_cast<size_t>(scratch_bytes(w.shape())));
  {
    ScopedEnv env("EPMOE_FP8_ROW_QUANT", mode);
    // The SwiGLU backward's bf16 rows are compared: not the column path (test_gpu_fp8_col_quant).
    ScopedEnv cols("EPMOE_FP8_COL_QUANT", "separate");
    (w.backend().*stage)(fp8_step(w, r, scratch));
    w.backend().synchronize(w.stream);
  }
  StageOut o;
  for (const auto& [ptr, bytes] : outs) {
    o.buffers.push_back(ptr != nullptr ? w.read<uint8_t>(ptr, bytes) : std::vector<uint8_t>{});
  }
  o.scratch = scratch.get();
  return o;
}

void expect_same_outputs(const StageOut& want, const StageOut& got, const std::vector<std::string>& names) {
  ASSERT_EQ(want.buffers.size(), got.buffers.size());
  for (size_t i = 0; i < want.buffers.size(); ++i) {
    EXPECT_TRUE(same_bits(want.buffers[i], got.buffers[i])) << names[i];
  }
  EXPECT_TRUE(same_bits(want.scratch, got.scratch)) << "FP8 scratch";
}

TEST(GpuFp8RowQuant, GatherGradQuantizingPullEqualsPullThenQuantizeBitwise) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 70;
  for (const RowQuantCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Shape& sh = c.shape;
    World w(*gpu, sh);
    w.score_after_w2_dgrad = c.row_scores;
    route_and_publish(w, seed++, c.live, c.pattern);
    const int64_t cap = sh.cap(), D = sh.D;
    const int64_t offset = fp8_scratch_layout(sh.dims(), cap, Fp8Wgrad::fp8).grad_h3_q;
    for (int r = 0; r < sh.R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const int64_t M = w.rows(r);
      ASSERT_GT(M, 0);
      ASSERT_LT(M, cap) << "the case should leave rows past the device count";
      const Step s = w.step(r);
      const std::vector<std::pair<void*, int64_t>> outs = {
          {s.grad_h3_MD, cap * D * 2}, {s.row_scores_M, cap * 4}};
      const StageOut want = run_stage(w, r, "separate", outs, &Backend::gather_grad);
      const StageOut got = run_stage(w, r, nullptr, outs, &Backend::gather_grad);  // unset: producer
      expect_same_outputs(want, got, {"grad_h3", "row scores"});
      expect_rows_written_below(rows_region(got.scratch, offset, cap, D), M, cap, D);
      const StageOut producer = run_stage(w, r, "producer", outs, &Backend::gather_grad);
      expect_same_outputs(want, producer, {"grad_h3", "row scores"});
    }
  }
}

TEST(GpuFp8RowQuant, SwigluBackwardQuantizingEqualsSwigluThenQuantizeBitwise) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 170;
  for (const RowQuantCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Shape& sh = c.shape;
    World w(*gpu, sh);
    w.score_after_w2_dgrad = c.row_scores;
    route_and_publish(w, seed, c.live, c.pattern);
    Rng rng(seed++);
    const int64_t cap = sh.cap(), F = sh.F;
    const int64_t offset = fp8_scratch_layout(sh.dims(), cap, Fp8Wgrad::fp8).grad_h13_q;
    for (int r = 0; r < sh.R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const int64_t M = w.rows(r);
      ASSERT_GT(M, 0);
      ASSERT_LT(M, cap) << "the case should leave rows past the device count";
      const Step s = w.step(r);
      // Stand-ins for the saved h13 and the W2 DGRAD's grad_h (and its row scores).
      w.fill(s.h13_M2F, rng.bf16s(cap * 2 * F));
      w.fill(s.grad_h_MF, rng.bf16s(cap * F));
      if (c.row_scores) w.fill(s.row_scores_M, rng.floats(cap, 0.05f, 1.0f));
      const std::vector<std::pair<void*, int64_t>> outs = {
          {s.grad_h13_M2F, cap * 2 * F * 2},
          {s.h_MF, cap * F * 2},
          {s.score_parts_MC, cap * score_chunks(F) * 4}};
      const StageOut want = run_stage(w, r, "separate", outs, &Backend::swiglu_backward);
      const StageOut got = run_stage(w, r, nullptr, outs, &Backend::swiglu_backward);
      expect_same_outputs(want, got, {"grad_h13", "h", "score parts"});
      expect_rows_written_below(rows_region(got.scratch, offset, cap, 2 * F), M, cap, 2 * F);
    }
  }
}

TEST(GpuFp8RowQuant, SwigluForwardQuantizingEqualsSwigluThenQuantizeBitwise) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 270;
  for (const RowQuantCase& c : cases()) {
    if (c.row_scores) continue;  // the forward has no row scores
    SCOPED_TRACE(c.name);
    const Shape& sh = c.shape;
    World w(*gpu, sh);
    route_and_publish(w, seed, c.live, c.pattern);
    Rng rng(seed++);
    const int64_t cap = sh.cap(), F = sh.F;
    const int64_t offset = fp8_scratch_layout(sh.dims(), cap, Fp8Wgrad::fp8).h_q;
    for (int r = 0; r < sh.R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const int64_t M = w.rows(r);
      ASSERT_GT(M, 0);
      ASSERT_LT(M, cap) << "the case should leave rows past the device count";
      const Step s = w.step(r);
      w.fill(s.h13_M2F, rng.bf16s(cap * 2 * F));  // stands in for the W13 FPROP
      const std::vector<std::pair<void*, int64_t>> outs = {{s.h_MF, cap * F * 2}};
      const StageOut want = run_stage(w, r, "separate", outs, &Backend::swiglu_forward);
      const StageOut got = run_stage(w, r, nullptr, outs, &Backend::swiglu_forward);
      expect_same_outputs(want, got, {"h"});
      expect_rows_written_below(rows_region(got.scratch, offset, cap, F), M, cap, F);
    }
  }
}

// Capacity overflow: the step is skipped; neither form writes a bf16 row, a code or a scale.
TEST(GpuFp8RowQuant, SkippedStepWritesNothing) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  Shape sh{30, 256, 128, 2, 2, 2, 0};
  sh.capacity = 20;
  World w(*gpu, sh);
  route_and_publish(w, 80, std::nullopt, Pattern::one_expert);
  ASSERT_EQ(w.status(0).code, static_cast<int32_t>(StatusCode::capacity_overflow));
  const int64_t cap = sh.cap();
  const std::vector<uint8_t> poisoned(static_cast<size_t>(scratch_bytes(sh)), kPoison);
  for (int r = 0; r < sh.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Step s = w.step(r);
    w.fill(s.h13_M2F, std::vector<bf16_t>(static_cast<size_t>(cap * 2 * sh.F), bf16(1.0f)));
    w.fill(s.grad_h_MF, std::vector<bf16_t>(static_cast<size_t>(cap * sh.F), bf16(1.0f)));
    for (const char* mode : {"separate", "producer"}) {
      SCOPED_TRACE(mode);
      const StageOut g = run_stage(w, r, mode, {{s.grad_h3_MD, cap * sh.D * 2}}, &Backend::gather_grad);
      EXPECT_TRUE(same_bits(std::vector<uint8_t>(static_cast<size_t>(cap * sh.D * 2), kPoison),
                            g.buffers[0])) << "grad_h3 written";
      EXPECT_TRUE(same_bits(poisoned, g.scratch)) << "gather_grad wrote the FP8 scratch";
      const StageOut b = run_stage(w, r, mode, {{s.grad_h13_M2F, cap * 2 * sh.F * 2}},
                                   &Backend::swiglu_backward);
      EXPECT_TRUE(same_bits(std::vector<uint8_t>(static_cast<size_t>(cap * 2 * sh.F * 2), kPoison),
                            b.buffers[0])) << "grad_h13 written";
      EXPECT_TRUE(same_bits(poisoned, b.scratch)) << "swiglu_backward wrote the FP8 scratch";
      const StageOut f = run_stage(w, r, mode, {{s.h_MF, cap * sh.F * 2}}, &Backend::swiglu_forward);
      EXPECT_TRUE(same_bits(std::vector<uint8_t>(static_cast<size_t>(cap * sh.F * 2), kPoison),
                            f.buffers[0])) << "h written";
      EXPECT_TRUE(same_bits(poisoned, f.scratch)) << "swiglu_forward wrote the FP8 scratch";
    }
  }
}

TEST(GpuFp8RowQuant, UnknownModeIsRefusedByName) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  Shape sh{8, 128, 128, 1, 1, 1, 0};
  World w(*gpu, sh);
  route_and_publish(w, 90, std::nullopt, Pattern::distinct);
  Dev<uint8_t> scratch(static_cast<size_t>(scratch_bytes(sh)));
  ScopedEnv env("EPMOE_FP8_ROW_QUANT", "fused");
  try {
    gpu->gather_grad(fp8_step(w, 0, scratch));
    FAIL() << "EPMOE_FP8_ROW_QUANT=fused accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("EPMOE_FP8_ROW_QUANT"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace epmoe::test
