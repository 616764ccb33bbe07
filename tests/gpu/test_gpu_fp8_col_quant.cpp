// The FP8 SwiGLU backward that writes the WGRADs' column operands (swiglu_backward_cols.cu,
// EPMOE_FP8_COL_QUANT=swiglu where fp8_swiglu_backward_writes_cols) against the chain it replaces
// (unset or =separate, the default: the SwiGLU backward storing bf16 grad_h13 and h, then
// fp8_quantize_cols_transposed on each, as the WGRAD stages run it), through the CUDA backend's
// swiglu_backward stage: grad_h13's E4M3 rows, the grad_scores partials, h's columns (col_b) and
// grad_h13's columns (over its bf16 rows) bitwise, over the whole scratch and regions (bytes no
// one writes keep the poison); and against the CPU codec (cpu::fp8_quantize_cols, transposed)
// on the chain's bf16 rows. Cases: R = 1 and 2 simulated ranks, a row count below capacity,
// partial and empty experts, more than 32 experts (the block search goes 32 at a time), row
// scores or none, two and three column tiles; a skipped step writes nothing; a shape where the
// columns do not fit over grad_h13's rows runs the chain.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/fp8_terms.h"
#include "cpu/fp8_steps.h"
#include "cuda/formats/formats.h"
#include "cuda/fp8_backward.h"
#include "device_buffer.h"
#include "epmoe/error.h"
#include "scoped_env.h"
#include "step_builder.h"

namespace epmoe::test {
namespace {

constexpr uint8_t kPoison = 0xA5;

struct ColCase {
  std::string name;
  Shape shape;
  Pattern pattern;
  std::optional<int32_t> live;
  bool row_scores;
};

std::vector<ColCase> cases() {
  std::vector<ColCase> c;
  for (bool rs : {false, true}) {
    const std::string tag = rs ? ", row scores" : "";
    c.push_back({"R=1 E=4 F=256" + tag, {400, 128, 256, 2, 4, 1, 0}, Pattern::distinct, 371, rs});
    c.push_back({"R=2 E=3 F=384" + tag, {300, 64, 384, 4, 3, 2, 0}, Pattern::distinct, 290, rs});
    // 40 experts, every third one routed to (empty experts between), K = 8 duplicates allowed.
    c.push_back({"R=1 E=40 sparse" + tag, {1200, 64, 128, 8, 40, 1, 0}, Pattern::sparse, 1100, rs});
  }
  return c;
}

// What one SwiGLU backward leaves: the FP8 scratch, grad_h13's region (bf16 rows or columns),
// h's bf16 rows, the score partials, and grad_h13's columns (the chain: quantized by the test).
struct Out {
  std::vector<uint8_t> scratch, grad_h13, h, parts, g13_cols;
};

Out run(World& w, int r, bool separate) {
  const Shape& sh = w.shape();
  const int64_t cap = sh.cap(), F = sh.F;
  const Dims d = sh.dims();
  const Step s0 = w.step(r);
  const int64_t g13_bytes = align_bytes(cap * 2 * F * 2), parts_bytes = cap * score_chunks(F) * 4;
  w.fill(s0.grad_h13_M2F, std::vector<uint8_t>(static_cast<size_t>(g13_bytes), kPoison));
  w.fill(s0.h_MF, std::vector<uint8_t>(static_cast<size_t>(cap * F * 2), kPoison));
  if (s0.score_parts_MC != nullptr) {
    w.fill(s0.score_parts_MC, std::vector<uint8_t>(static_cast<size_t>(parts_bytes), kPoison));
  }
  const Fp8ScratchLayout l = fp8_scratch_layout(d, cap, Fp8Wgrad::fp8);
  Dev<uint8_t> scratch(static_cast<size_t>(l.total));
  const Fp8GradH13ColsLayout gl = fp8_grad_h13_cols_layout(d, cap);
  Dev<uint8_t> g13_cols(static_cast<size_t>(gl.total));  // the chain's grad_h13 columns
  Step s = s0;
  s.fp8 = true;
  s.fp8_scratch = reinterpret_cast<char*>(scratch.ptr);
  {
    const ScopedEnv env("EPMOE_FP8_COL_QUANT", separate ? "separate" : "swiglu");
    EXPECT_EQ(cuda::fp8_swiglu_backward_writes_cols(s), !separate);
    w.backend().swiglu_backward(s);
  }
  const int64_t max_blocks = fp8_col_blocks(cap, d.E);
  if (separate) {  // the WGRAD stages' quantization of the bf16 rows
    cuda::fp8_quantize_cols_transposed(s.h_MF, cap, F, s.layout.expert_offsets_E1, d.E, s.layout.header + kLayoutSkip,
                                       reinterpret_cast<uint8_t*>(scratch.ptr + l.col_b),
                                       reinterpret_cast<float*>(scratch.ptr + l.col_b_scales), max_blocks, w.stream);
    cuda::fp8_quantize_cols_transposed(s.grad_h13_M2F, cap, 2 * F, s.layout.expert_offsets_E1, d.E,
                                       s.layout.header + kLayoutSkip, g13_cols.ptr + gl.codes,
                                       reinterpret_cast<float*>(g13_cols.ptr + gl.scales), max_blocks, w.stream);
  }
  w.backend().synchronize(w.stream);
  Out o;
  o.scratch = scratch.get();
  o.grad_h13 = w.read<uint8_t>(s.grad_h13_M2F, g13_bytes);
  o.h = w.read<uint8_t>(s.h_MF, cap * F * 2);
  if (s.score_parts_MC != nullptr) o.parts = w.read<uint8_t>(s.score_parts_MC, parts_bytes);
  o.g13_cols = separate ? g13_cols.get() : std::vector<uint8_t>(o.grad_h13.begin(), o.grad_h13.begin() + gl.total);
  return o;
}

std::vector<float> to_float(const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> f(static_cast<size_t>(n));
  const auto* b = reinterpret_cast<const bf16_t*>(bytes.data());
  for (int64_t i = 0; i < n; ++i) f[static_cast<size_t>(i)] = bf16_to_float(b[i]);
  return f;
}

// The CPU codec's column operand of x_ML [cap, L] (bf16 bytes) against the device's codes
// qt [L, K] and scales [max_blocks, L] for the blocks of the layout's experts.
void expect_cpu_columns(const std::vector<uint8_t>& x_bytes, int64_t cap, int64_t L, const std::vector<int32_t>& offsets,
                        int E, const uint8_t* qt, const float* scales, int64_t K, const std::string& what) {
  const std::vector<float> x = to_float(x_bytes, cap * L);
  std::vector<uint8_t> q(static_cast<size_t>(cap * L), 0);
  const int64_t blocks = cpu::fp8_col_block_base(offsets.data(), E);
  std::vector<float> sc(static_cast<size_t>(blocks * L), 0.0f);
  cpu::fp8_quantize_cols(x.data(), L, offsets.data(), E, q.data(), sc.data());
  std::vector<uint8_t> qt_cpu(static_cast<size_t>(L * K), kPoison);
  cpu::fp8_transpose_cols(q.data(), L, offsets.data(), E, K, qt_cpu.data());
  for (int64_t i = 0; i < blocks * L; ++i) {
    ASSERT_TRUE(same_bits(std::vector<float>{sc[static_cast<size_t>(i)]}, std::vector<float>{scales[i]}))
        << what << " scale of block " << i / L << ", column " << i % L;
  }
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t k = 0; k < 128 * blocks; ++k) {
      ASSERT_EQ(qt_cpu[static_cast<size_t>(l * K + k)], qt[l * K + k]) << what << " code of column " << l << ", k " << k;
    }
  }
}

TEST(GpuFp8ColQuant, SwigluBackwardColumnsEqualChainAndCpuBitwise) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  uint32_t seed = 470;
  for (const ColCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Shape& sh = c.shape;
    ASSERT_TRUE(fp8_grad_h13_cols_fit(sh.dims(), sh.cap())) << "the case should take the column path";
    World w(*gpu, sh);
    w.score_after_w2_dgrad = c.row_scores;
    route_and_publish(w, seed, c.live, c.pattern);
    Rng rng(seed++);
    const int64_t cap = sh.cap(), F = sh.F;
    const Dims d = sh.dims();
    for (int r = 0; r < sh.R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const int64_t M = w.rows(r);
      ASSERT_GT(M, 0);
      ASSERT_LT(M, cap) << "the case should leave rows past the device count";
      const Step s = w.step(r);
      w.fill(s.h13_M2F, rng.bf16s(cap * 2 * F));  // stand-ins for the saved h13 and grad_h
      w.fill(s.grad_h_MF, rng.bf16s(cap * F));
      if (c.row_scores) w.fill(s.row_scores_M, rng.floats(cap, 0.05f, 1.0f));
      const Out want = run(w, r, true);
      const Out got = run(w, r, false);
      EXPECT_TRUE(same_bits(want.scratch, got.scratch)) << "FP8 scratch (grad_h13 rows, h columns)";
      EXPECT_TRUE(same_bits(want.parts, got.parts)) << "score partials";
      EXPECT_TRUE(same_bits(want.g13_cols, got.g13_cols)) << "grad_h13 columns";
      EXPECT_TRUE(same_bits(std::vector<uint8_t>(got.h.size(), kPoison), got.h)) << "h stored in bf16";
      // The CPU codec on the chain's bf16 rows.
      const std::vector<int32_t> offsets = w.read<int32_t>(s.layout.expert_offsets_E1, d.E + 1);
      const int64_t K = fp8_col_k(cap, d.E);
      const Fp8ScratchLayout l = fp8_scratch_layout(d, cap, Fp8Wgrad::fp8);
      const Fp8GradH13ColsLayout gl = fp8_grad_h13_cols_layout(d, cap);
      expect_cpu_columns(want.h, cap, F, offsets, d.E, got.scratch.data() + l.col_b,
                         reinterpret_cast<const float*>(got.scratch.data() + l.col_b_scales), K, "h");
      expect_cpu_columns(want.grad_h13, cap, 2 * F, offsets, d.E, got.g13_cols.data() + gl.codes,
                         reinterpret_cast<const float*>(got.g13_cols.data() + gl.scales), K, "grad_h13");
    }
  }
}

// Capacity overflow: the step is skipped; the column path writes no code, scale or partial.
TEST(GpuFp8ColQuant, SkippedStepWritesNothing) {
  EPMOE_REQUIRE_GPU();
  auto gpu = make_cuda_backend(0);
  Shape sh{600, 64, 128, 2, 2, 1, 0};
  sh.capacity = 500;
  World w(*gpu, sh);
  route_and_publish(w, 81, std::nullopt, Pattern::one_expert);
  ASSERT_EQ(w.status(0).code, static_cast<int32_t>(StatusCode::capacity_overflow));
  ASSERT_TRUE(fp8_grad_h13_cols_fit(sh.dims(), sh.cap()));
  const Step s = w.step(0);
  w.fill(s.h13_M2F, std::vector<bf16_t>(static_cast<size_t>(sh.cap() * 2 * sh.F), bf16(1.0f)));
  w.fill(s.grad_h_MF, std::vector<bf16_t>(static_cast<size_t>(sh.cap() * sh.F), bf16(1.0f)));
  const Out got = run(w, 0, false);
  EXPECT_TRUE(same_bits(std::vector<uint8_t>(got.scratch.size(), kPoison), got.scratch)) << "FP8 scratch written";
  EXPECT_TRUE(same_bits(std::vector<uint8_t>(got.grad_h13.size(), kPoison), got.grad_h13)) << "grad_h13 region written";
}

// Few rows per expert (the columns do not fit over grad_h13's bf16 rows), bf16 WGRADs or the
// variable unset: the chain runs.
TEST(GpuFp8ColQuant, ColumnsThatDoNotFitTakeTheChain) {
  const Shape sh{40, 128, 128, 2, 4, 1, 0};
  EXPECT_FALSE(fp8_grad_h13_cols_fit(sh.dims(), sh.cap()));
  Step s;
  s.dims = sh.dims();
  s.capacity_rows = sh.cap();
  s.fp8 = true;
  bf16_t dummy{};
  s.grad_h13_M2F = &dummy;
  const ScopedEnv on("EPMOE_FP8_COL_QUANT", "swiglu");
  EXPECT_FALSE(cuda::fp8_swiglu_backward_writes_cols(s));
  s.capacity_rows = 1024;  // 132 * (8 + 4) blocks' bytes per column <= 2 * 1024
  EXPECT_TRUE(cuda::fp8_swiglu_backward_writes_cols(s));
  s.fp8_wgrad = Fp8Wgrad::bf16;
  EXPECT_FALSE(cuda::fp8_swiglu_backward_writes_cols(s)) << "bf16 WGRADs read the bf16 rows";
  s.fp8_wgrad = Fp8Wgrad::fp8;
  {
    const ScopedEnv off("EPMOE_FP8_COL_QUANT", nullptr);
    EXPECT_FALSE(cuda::fp8_swiglu_backward_writes_cols(s)) << "opt-in: off by default";
  }
  const ScopedEnv env("EPMOE_FP8_COL_QUANT", "bogus");
  EXPECT_THROW(cuda::fp8_swiglu_backward_writes_cols(s), Error);
}

}  // namespace
}  // namespace epmoe::test
