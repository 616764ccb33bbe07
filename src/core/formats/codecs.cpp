// Host encoders/decoders: plain loops over the EPMOE_HD block and element functions.
#include "core/formats/codecs.h"

#include <string>

#include "epmoe/error.h"

namespace epmoe {

void check_codec_shape(int64_t N, int64_t L, const char* rows_arg, const char* cols_arg) {
  EPMOE_CHECK_ARG(N >= 0, rows_arg, "a row count >= 0", N);
  EPMOE_CHECK_ARG(L >= 0, cols_arg, "a row length >= 0", L);
}

void check_codec_pointer(const void* p, int64_t elements, const char* name) {
  EPMOE_CHECK_ARG(p != nullptr || elements == 0, name,
                  "a non-null pointer (" + std::to_string(elements) + " elements)", "nullptr");
}

void check_codec_groups(int64_t groups, int64_t N) {
  EPMOE_CHECK_ARG(groups >= 1, "groups", "at least 1 group", groups);
  EPMOE_CHECK_ARG(N % groups == 0, "groups",
                  "a divisor of the row count N = " + std::to_string(N), groups);
}

void check_codec_weights(int64_t G, int64_t N, int64_t L) {
  EPMOE_CHECK_ARG(G >= 0, "G", "a matrix count >= 0", G);
  check_codec_shape(N, L, "N", "L");
}

namespace {

// Row blocks of `kBlock` elements along L, one scale each.
template <class Policy, int kBlock>
void quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL,
                   typename Policy::Scale* scales_NS) {
  check_codec_shape(N, L, "N", "L");
  const int64_t S = scale_blocks(L, kBlock);
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(q_NL, N * L, "q_NL");
  check_codec_pointer(scales_NS, N * S, "scales_NS");
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t begin = n * L + s * kBlock;
      const int64_t end = n * L + (s + 1 < S ? (s + 1) * kBlock : L);
      uint32_t amax = 0;
      for (int64_t i = begin; i < end; ++i) amax = amax_bits_add(amax, x_NL[i]);
      const typename Policy::Scale scale = Policy::from_amax(amax);
      scales_NS[n * S + s] = scale;
      for (int64_t i = begin; i < end; ++i) q_NL[i] = Policy::encode(x_NL[i], scale);
    }
  }
}

template <class Policy, int kBlock>
void dequantize_rows(const uint8_t* q_NL, const typename Policy::Scale* scales_NS, int64_t N,
                     int64_t L, float* x_NL) {
  check_codec_shape(N, L, "N", "L");
  const int64_t S = scale_blocks(L, kBlock);
  check_codec_pointer(q_NL, N * L, "q_NL");
  check_codec_pointer(scales_NS, N * S, "scales_NS");
  check_codec_pointer(x_NL, N * L, "x_NL");
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t l = 0; l < L; ++l) {
      x_NL[n * L + l] = Policy::decode(q_NL[n * L + l], scales_NS[n * S + l / kBlock]);
    }
  }
}

// 128x128 blocks of each [N, L] matrix; the blocks of the last rows and columns may be partial.
template <class Policy>
void quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                      typename Policy::Scale* scales_GBS) {
  check_codec_weights(G, N, L);
  constexpr int64_t kB = kFp8WeightBlock;
  const int64_t B = scale_blocks(N, kB), S = scale_blocks(L, kB);
  check_codec_pointer(w_GNL, G * N * L, "w_GNL");
  check_codec_pointer(q_GNL, G * N * L, "q_GNL");
  check_codec_pointer(scales_GBS, G * B * S, "scales_GBS");
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n_end = b + 1 < B ? (b + 1) * kB : N;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t l_end = s + 1 < S ? (s + 1) * kB : L;
        uint32_t amax = 0;
        for (int64_t n = b * kB; n < n_end; ++n) {
          for (int64_t l = s * kB; l < l_end; ++l) amax = amax_bits_add(amax, w_GNL[(g * N + n) * L + l]);
        }
        const typename Policy::Scale scale = Policy::from_amax(amax);
        scales_GBS[(g * B + b) * S + s] = scale;
        for (int64_t n = b * kB; n < n_end; ++n) {
          for (int64_t l = s * kB; l < l_end; ++l) {
            const int64_t i = (g * N + n) * L + l;
            q_GNL[i] = Policy::encode(w_GNL[i], scale);
          }
        }
      }
    }
  }
}

template <class Policy>
void dequantize_weights(const uint8_t* q_GNL, const typename Policy::Scale* scales_GBS, int64_t G,
                        int64_t N, int64_t L, float* w_GNL) {
  check_codec_weights(G, N, L);
  constexpr int64_t kB = kFp8WeightBlock;
  const int64_t B = scale_blocks(N, kB), S = scale_blocks(L, kB);
  check_codec_pointer(q_GNL, G * N * L, "q_GNL");
  check_codec_pointer(scales_GBS, G * B * S, "scales_GBS");
  check_codec_pointer(w_GNL, G * N * L, "w_GNL");
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t l = 0; l < L; ++l) {
        const int64_t i = (g * N + n) * L + l;
        w_GNL[i] = Policy::decode(q_GNL[i], scales_GBS[(g * B + n / kB) * S + l / kB]);
      }
    }
  }
}

}  // namespace

void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, float* scales_NS) {
  quantize_rows<Fp8Fp32Scale, kFp8RowBlock>(x_NL, N, L, q_NL, scales_NS);
}
void fp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS) {
  quantize_rows<Fp8Ue8m0Scale, kFp8RowBlock>(x_NL, N, L, q_NL, scales_NS);
}
void fp8_dequantize_rows(const uint8_t* q_NL, const float* scales_NS, int64_t N, int64_t L, float* x_NL) {
  dequantize_rows<Fp8Fp32Scale, kFp8RowBlock>(q_NL, scales_NS, N, L, x_NL);
}
void fp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L, float* x_NL) {
  dequantize_rows<Fp8Ue8m0Scale, kFp8RowBlock>(q_NL, scales_NS, N, L, x_NL);
}

void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          float* scales_GBS) {
  quantize_weights<Fp8Fp32Scale>(w_GNL, G, N, L, q_GNL, scales_GBS);
}
void fp8_quantize_weights(const float* w_GNL, int64_t G, int64_t N, int64_t L, uint8_t* q_GNL,
                          uint8_t* scales_GBS) {
  quantize_weights<Fp8Ue8m0Scale>(w_GNL, G, N, L, q_GNL, scales_GBS);
}
void fp8_dequantize_weights(const uint8_t* q_GNL, const float* scales_GBS, int64_t G, int64_t N,
                            int64_t L, float* w_GNL) {
  dequantize_weights<Fp8Fp32Scale>(q_GNL, scales_GBS, G, N, L, w_GNL);
}
void fp8_dequantize_weights(const uint8_t* q_GNL, const uint8_t* scales_GBS, int64_t G, int64_t N,
                            int64_t L, float* w_GNL) {
  dequantize_weights<Fp8Ue8m0Scale>(q_GNL, scales_GBS, G, N, L, w_GNL);
}

void mxfp8_quantize_rows(const float* x_NL, int64_t N, int64_t L, uint8_t* q_NL, uint8_t* scales_NS) {
  quantize_rows<Mxfp8Scale, kMxBlock>(x_NL, N, L, q_NL, scales_NS);
}
void mxfp8_dequantize_rows(const uint8_t* q_NL, const uint8_t* scales_NS, int64_t N, int64_t L,
                           float* x_NL) {
  dequantize_rows<Mxfp8Scale, kMxBlock>(q_NL, scales_NS, N, L, x_NL);
}

void nvfp4_global_scales(const float* x_NL, int64_t groups, int64_t N, int64_t L, float* global_G) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(global_G, groups, "global_G");
  const int64_t rows = N / groups;
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t amax = 0;
    for (int64_t i = g * rows * L; i < (g + 1) * rows * L; ++i) amax = finite_amax_bits_add(amax, x_NL[i]);
    global_G[g] = nvfp4_global_scale(amax);
  }
}

void nvfp4_quantize_rows(const float* x_NL, int64_t groups, int64_t N, int64_t L,
                         const float* global_G, uint8_t* q_NP, uint8_t* scales_NS) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  const int64_t S = scale_blocks(L, kNvfp4Block), P = nvfp4_packed_bytes(L);
  check_codec_pointer(x_NL, N * L, "x_NL");
  check_codec_pointer(global_G, groups, "global_G");
  check_codec_pointer(q_NP, N * P, "q_NP");
  check_codec_pointer(scales_NS, N * S, "scales_NS");
  const int64_t rows = N / groups;
  for (int64_t n = 0; n < N; ++n) {
    const float global = global_G[n / rows];
    const float* x_L = x_NL + n * L;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t begin = s * kNvfp4Block;
      const int64_t end = s + 1 < S ? begin + kNvfp4Block : L;
      uint32_t amax = 0;
      for (int64_t l = begin; l < end; ++l) amax = amax_bits_add(amax, x_L[l]);
      const uint8_t scale = nvfp4_block_scale(amax, global);
      scales_NS[n * S + s] = scale;
      const float element_scale = nvfp4_element_scale(scale, global);
      // Blocks start at even l (16 | begin): a byte never straddles two blocks.
      for (int64_t l = begin; l < end; l += 2) {
        const uint8_t first = nvfp4_encode(x_L[l], element_scale);
        const uint8_t second = l + 1 < end ? nvfp4_encode(x_L[l + 1], element_scale) : uint8_t{0};
        q_NP[n * P + l / 2] = pack_e2m1x2(first, second);
      }
    }
  }
}

void nvfp4_dequantize_rows(const uint8_t* q_NP, const uint8_t* scales_NS, const float* global_G,
                           int64_t groups, int64_t N, int64_t L, float* x_NL) {
  check_codec_shape(N, L, "N", "L");
  check_codec_groups(groups, N);
  const int64_t S = scale_blocks(L, kNvfp4Block), P = nvfp4_packed_bytes(L);
  check_codec_pointer(q_NP, N * P, "q_NP");
  check_codec_pointer(scales_NS, N * S, "scales_NS");
  check_codec_pointer(global_G, groups, "global_G");
  check_codec_pointer(x_NL, N * L, "x_NL");
  const int64_t rows = N / groups;
  for (int64_t n = 0; n < N; ++n) {
    const float global = global_G[n / rows];
    for (int64_t l = 0; l < L; ++l) {
      const float element_scale = nvfp4_element_scale(scales_NS[n * S + l / kNvfp4Block], global);
      const uint8_t byte = q_NP[n * P + l / 2];
      x_NL[n * L + l] = nvfp4_decode(l % 2 == 0 ? e2m1_first(byte) : e2m1_second(byte), element_scale);
    }
  }
}

}  // namespace epmoe
