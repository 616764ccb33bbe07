// PreparedWeights (include/epmoe/prepared_weights.h) on the host: shapes per format, the same bits
// as the codecs, the round trip within the format tolerance, refill in place after a weight
// update equal to a fresh preparation, the transposed copy (fp8_block_fp32) bitwise the per-call
// transpose, argument errors naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/formats/codecs.h"
#include "core/formats/nvfp4_gemm_order.h"
#include "core/numeric.h"
#include "cpu/fp8_steps.h"
#include "epmoe/error.h"
#include "epmoe/prepared_weights.h"
#include "tolerances.h"

namespace epmoe {
namespace {

// Host buffers of one prepared weight.
struct Owned {
  std::vector<uint8_t> data, scales_u8;
  std::vector<float> scales_f32, global;
  PreparedWeights view;
  Owned(WeightFormat f, int64_t G, int64_t N, int64_t L) {
    const PreparedWeightShapes s = prepared_weight_shapes(f, G, N, L);
    view = PreparedWeights{f, G, N, L, s.data, s.scales, s.global_scale, {}, {}};
    data.assign(static_cast<size_t>(s.data.numel()), 0xAA);
    view.data.data = data.data();
    if (s.scales.dtype == DType::f32) {
      scales_f32.assign(static_cast<size_t>(s.scales.numel()), -1.0f);
      view.scales.data = scales_f32.data();
    } else {
      scales_u8.assign(static_cast<size_t>(s.scales.numel()), 0xAA);
      view.scales.data = scales_u8.data();
    }
    if (s.global_scale.ndim > 0) {
      global.assign(static_cast<size_t>(s.global_scale.numel()), -1.0f);
      view.global_scale.data = global.data();
    }
  }
};

std::vector<bf16_t> normal_bf16(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<bf16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = float_to_bf16(d(rng));
  return v;
}

std::vector<float> widen(const std::vector<bf16_t>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

constexpr int64_t G = 3, N = 200, L = 260;

TEST(PreparedWeights, ShapesPerFormat) {
  const PreparedWeightShapes f = prepared_weight_shapes(WeightFormat::fp8_block_fp32, G, N, L);
  EXPECT_EQ(f.data.shape_string(), "[3, 200, 260]");
  EXPECT_EQ(f.scales.shape_string(), "[3, 2, 3]");
  EXPECT_EQ(f.scales.dtype, DType::f32);
  EXPECT_EQ(f.global_scale.ndim, 0);
  const PreparedWeightShapes u = prepared_weight_shapes(WeightFormat::fp8_block_ue8m0, G, N, L);
  EXPECT_EQ(u.scales.shape_string(), "[3, 2, 3]");
  EXPECT_EQ(u.scales.dtype, DType::u8);
  const PreparedWeightShapes m = prepared_weight_shapes(WeightFormat::mxfp8, G, N, L);
  EXPECT_EQ(m.data.shape_string(), "[3, 200, 260]");
  EXPECT_EQ(m.scales.shape_string(), "[3, 200, 9]");
  const PreparedWeightShapes n = prepared_weight_shapes(WeightFormat::nvfp4, G, N, L);
  EXPECT_EQ(n.data.shape_string(), "[3, 200, 130]");
  EXPECT_EQ(n.scales.shape_string(), "[3, 3, 200, 8]");  // ceil(260 / 128) chunks of 8 blocks
  EXPECT_EQ(n.global_scale.shape_string(), "[3]");
}

TEST(PreparedWeights, SameBitsAsTheCodecs) {
  const std::vector<bf16_t> w = normal_bf16(1, G * N * L);
  const std::vector<float> x = widen(w);
  const TensorRef w_ref = TensorRef::contiguous(const_cast<bf16_t*>(w.data()), DType::bf16, {G, N, L});
  for (WeightFormat f : {WeightFormat::fp8_block_fp32, WeightFormat::fp8_block_ue8m0,
                         WeightFormat::mxfp8, WeightFormat::nvfp4}) {
    Owned got(f, G, N, L), want(f, G, N, L);
    prepare_weights(w_ref, got.view);
    switch (f) {
      case WeightFormat::fp8_block_fp32:
        fp8_quantize_weights(x.data(), G, N, L, want.data.data(), want.scales_f32.data());
        break;
      case WeightFormat::fp8_block_ue8m0:
        fp8_quantize_weights(x.data(), G, N, L, want.data.data(), want.scales_u8.data());
        break;
      case WeightFormat::mxfp8:
        mxfp8_quantize_rows(x.data(), G * N, L, want.data.data(), want.scales_u8.data());
        break;
      case WeightFormat::nvfp4:
        nvfp4_global_scales(x.data(), G, G * N, L, want.global.data());
      {
        std::vector<uint8_t> codec_scales(static_cast<size_t>(G * N * scale_blocks(L, kNvfp4Block)));
        nvfp4_quantize_rows(x.data(), G, G * N, L, want.global.data(), want.data.data(),
                            codec_scales.data());
        // The prepared order of codes and scales (core/formats/nvfp4_gemm_order.h).
        nvfp4_codes_to_gemm_order(want.data.data(), G * N, nvfp4_packed_bytes(L));
        nvfp4_scales_to_gemm_order(codec_scales.data(), G, N, L, want.scales_u8.data());
        break;
      }
    }
    EXPECT_EQ(got.data, want.data) << to_string(f);
    EXPECT_EQ(got.scales_u8, want.scales_u8) << to_string(f);
    EXPECT_EQ(got.scales_f32, want.scales_f32) << to_string(f);
    EXPECT_EQ(got.global, want.global) << to_string(f);
  }
}

TEST(PreparedWeights, Fp8RoundTripWithinTheFormatTolerance) {
  const std::vector<bf16_t> w = normal_bf16(2, G * N * L);
  const std::vector<float> x = widen(w);
  Owned p(WeightFormat::fp8_block_fp32, G, N, L);
  prepare_weights(TensorRef::contiguous(const_cast<bf16_t*>(w.data()), DType::bf16, {G, N, L}),
                  p.view);
  std::vector<float> back(x.size());
  fp8_dequantize_weights(p.data.data(), p.scales_f32.data(), G, N, L, back.data());
  double num = 0.0, den = 0.0, worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (back[i] - x[i]) * static_cast<double>(back[i] - x[i]);
    den += static_cast<double>(x[i]) * x[i];
    worst = std::max(worst, static_cast<double>(std::fabs(back[i] - x[i])));
  }
  const test::FormatTolerance* t =
      test::format_tolerance(Precision::fp8_block, test::Direction::roundtrip_weights);
  ASSERT_NE(t, nullptr);
  EXPECT_LE(std::sqrt(num / den), t->rel_l2);
  EXPECT_LE(worst, t->atol);
}

TEST(PreparedWeights, RefillInPlaceEqualsAFreshPreparation) {
  std::vector<bf16_t> w = normal_bf16(3, G * N * L);
  const TensorRef w_ref = TensorRef::contiguous(w.data(), DType::bf16, {G, N, L});
  for (WeightFormat f : {WeightFormat::fp8_block_fp32, WeightFormat::nvfp4}) {
    Owned p(f, G, N, L);
    prepare_weights(w_ref, p.view);
    const void* data = p.view.data.data;
    const void* scales = p.view.scales.data;
    const std::vector<uint8_t> before = p.data;
    // An optimizer step: every weight moves.
    for (bf16_t& v : w) v = float_to_bf16(bf16_to_float(v) * 0.75f + 0.01f);
    prepare_weights(w_ref, p.view);
    EXPECT_EQ(p.view.data.data, data);
    EXPECT_EQ(p.view.scales.data, scales);
    EXPECT_NE(p.data, before) << to_string(f) << ": the refill changed nothing";
    Owned fresh(f, G, N, L);
    prepare_weights(w_ref, fresh.view);
    EXPECT_EQ(p.data, fresh.data) << to_string(f);
    EXPECT_EQ(p.scales_f32, fresh.scales_f32) << to_string(f);
    EXPECT_EQ(p.scales_u8, fresh.scales_u8) << to_string(f);
    EXPECT_EQ(p.global, fresh.global) << to_string(f);
  }
}

// fp8_block_fp32 with its transposed copy (what an FP8 training backward reads).
struct OwnedTransposed : Owned {
  std::vector<uint8_t> data_t;
  std::vector<float> scales_t;
  OwnedTransposed(int64_t g, int64_t n, int64_t l) : Owned(WeightFormat::fp8_block_fp32, g, n, l) {
    const PreparedWeightShapes s = prepared_weight_shapes(WeightFormat::fp8_block_fp32, g, n, l);
    data_t.assign(static_cast<size_t>(s.data_t.numel()), 0xAA);
    scales_t.assign(static_cast<size_t>(s.scales_t.numel()), -1.0f);
    view.data_t = s.data_t;
    view.scales_t = s.scales_t;
    view.data_t.data = data_t.data();
    view.scales_t.data = scales_t.data();
  }
};

TEST(PreparedWeights, TransposedShapesFp8BlockFp32Only) {
  const PreparedWeightShapes f = prepared_weight_shapes(WeightFormat::fp8_block_fp32, G, N, L);
  EXPECT_EQ(f.data_t.shape_string(), "[3, 260, 200]");
  EXPECT_EQ(f.data_t.dtype, DType::u8);
  EXPECT_EQ(f.scales_t.shape_string(), "[3, 3, 2]");
  EXPECT_EQ(f.scales_t.dtype, DType::f32);
  for (WeightFormat other :
       {WeightFormat::fp8_block_ue8m0, WeightFormat::mxfp8, WeightFormat::nvfp4}) {
    const PreparedWeightShapes s = prepared_weight_shapes(other, G, N, L);
    EXPECT_EQ(s.data_t.ndim, 0) << to_string(other);
    EXPECT_EQ(s.scales_t.ndim, 0) << to_string(other);
  }
}

// The prepared transposed copy is bitwise cpu::fp8_transpose_weights of the prepared codes and
// scales (what the per-call path transposes), and data / scales are unchanged by asking for it;
// a refill in place keeps it so.
TEST(PreparedWeights, TransposedCopyIsBitwiseThePerCallTranspose) {
  for (const auto& [g, n, l] : {std::tuple<int64_t, int64_t, int64_t>{G, N, L}, {2, 256, 128},
                                {1, 48, 32}, {2, 129, 7}}) {
    std::vector<bf16_t> w = normal_bf16(5, g * n * l);
    const TensorRef w_ref = TensorRef::contiguous(w.data(), DType::bf16, {g, n, l});
    for (int refill = 0; refill < 2; ++refill) {
      if (refill == 1) {
        for (bf16_t& v : w) v = float_to_bf16(bf16_to_float(v) * 0.75f + 0.01f);
      }
      OwnedTransposed p(g, n, l);
      Owned plain(WeightFormat::fp8_block_fp32, g, n, l);
      prepare_weights(w_ref, p.view);
      prepare_weights(w_ref, plain.view);
      EXPECT_EQ(p.data, plain.data);
      EXPECT_EQ(p.scales_f32, plain.scales_f32);
      std::vector<uint8_t> want_q(p.data_t.size(), 0x55);
      std::vector<float> want_s(p.scales_t.size(), -2.0f);
      cpu::fp8_transpose_weights(plain.data.data(), plain.scales_f32.data(), g, n, l,
                                 want_q.data(), want_s.data());
      std::string what = "[";  // appended: GCC 12 warns (-Wrestrict) on "literal" + string
      what += std::to_string(g) + ", " + std::to_string(n) + ", " + std::to_string(l) +
              "] refill " + std::to_string(refill);
      EXPECT_EQ(p.data_t, want_q) << what;
      ASSERT_EQ(p.scales_t.size(), want_s.size());
      EXPECT_EQ(std::memcmp(p.scales_t.data(), want_s.data(), want_s.size() * sizeof(float)), 0)
          << what;
      // Spot check of the layout itself: element (e, k, m) of the copy is (e, m, k) of data.
      EXPECT_EQ(p.data_t[static_cast<size_t>((g - 1) * l * n + (l - 1) * n + 0)],
                p.data[static_cast<size_t>((g - 1) * n * l + 0 * l + (l - 1))])
          << what;
    }
  }
}

TEST(PreparedWeights, TransposedCopyErrorsNameTheTensor) {
  std::vector<bf16_t> w = normal_bf16(6, G * N * L);
  const TensorRef w_ref = TensorRef::contiguous(w.data(), DType::bf16, {G, N, L});
  OwnedTransposed p(G, N, L);
  PreparedWeights half = p.view;
  half.scales_t = TensorRef{};
  try {
    prepare_weights(w_ref, half);
    ADD_FAILURE() << "a transposed copy without its scales accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "prepared.scales_t") << e.what();
  }
  PreparedWeights wrong = p.view;
  wrong.data_t = p.view.data;  // [G, N, L], not [G, L, N]
  try {
    prepare_weights(w_ref, wrong);
    ADD_FAILURE() << "an untransposed copy accepted as data_t";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "prepared.data_t") << e.what();
  }
  Owned ue8m0(WeightFormat::fp8_block_ue8m0, G, N, L);
  PreparedWeights other = ue8m0.view;
  other.data_t = p.view.data_t;
  other.scales_t = p.view.scales_t;
  try {
    prepare_weights(w_ref, other);
    ADD_FAILURE() << "a transposed copy accepted for fp8_block_ue8m0";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "prepared.data_t") << e.what();
  }
}

TEST(PreparedWeights, ErrorsNameTheTensor) {
  std::vector<bf16_t> w = normal_bf16(4, G * N * L);
  Owned p(WeightFormat::fp8_block_fp32, G, N, L);
  PreparedWeights bad = p.view;
  bad.scales.dtype = DType::u8;
  try {
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {G, N, L}), bad);
    ADD_FAILURE() << "u8 scales accepted for fp8_block_fp32";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "prepared.scales") << e.what();
  }
  try {
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {G, L, N}), p.view);
    ADD_FAILURE() << "a transposed weight accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "w_GNL") << e.what();
  }
  try {
    prepare_weights(TensorRef::contiguous(w.data(), DType::bf16, {G, N, L}, Device::cuda(0)),
                    p.view);
    ADD_FAILURE() << "a device weight with host buffers accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "prepared.data") << e.what();
  }
}

}  // namespace
}  // namespace epmoe
