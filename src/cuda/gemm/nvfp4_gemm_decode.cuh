// The NVFP4 grouped GEMM's stage ring and weight decode (gemm/grouped_gemm_nvfp4.cu), shared by
// its two MMA paths: the work decomposition's constants, the ring's stage layout and occupancy,
// the bit-level helpers, the consumer warps' code rows, and a chunk's weights loaded from a
// stage and decoded into m16n8k16 A fragments (see the kernel file's header for the numbers).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/formats/nvfp4_gemm_order.h"
#include "core/numeric.h"
#include "cuda/gemm/nvfp4_gemm.h"

namespace epmoe::cuda::nvfp4 {

constexpr int kConsumerWarps = 4;
constexpr int kGemmThreads = (kConsumerWarps + 1) * 32;  // the last warp produces
constexpr int kTiles = 2;                                // m16 tiles per consumer warp
constexpr int kSlab = kConsumerWarps * kTiles * 16;      // weight rows per CTA
static_assert(kSlab == kNvfp4Slab, "nvfp4_gemm.h's slab is the consumer warps' rows");
constexpr int kChunk = kNvfp4Chunk;                      // K elements per stage
constexpr int kCodeRowBytes = kChunk / 2;
constexpr int kCodeBytes = kSlab * kCodeRowBytes;        // 8 KiB a stage
constexpr int kActHalf = 64;                             // elements of a 128-byte swizzled row
constexpr int kWeightLog2 = -8;                          // the MMA's weights: e2m1 * e4m3 * 2^-8
// The scale operand's factor 2^(kWeightLog2 - kNvfp4DecodeScaleLog2) = 2^118, as fp32 bits.
constexpr uint32_t kScaleFactorBits = static_cast<uint32_t>(127 + kWeightLog2 - kNvfp4DecodeScaleLog2) << 23;
constexpr float kSumFactor = 256.0f;  // 2^-kWeightLog2
static_assert(kWeightLog2 - kNvfp4DecodeScaleLog2 == 118 && -kWeightLog2 == 8, "the factors above");

// The experts a launch takes, selected on the device by their rows (select_experts): at most
// kNvfp4MaxExperts, counted per 32 (int) and listed (uint16) in shared memory.
constexpr int kExpertChunks = kNvfp4MaxExperts / 32;
constexpr int kExpertListBytes = kExpertChunks * 4 + kNvfp4MaxExperts * 2;

// A stage: the codes, the activation rows' two halves, the scales. The 128-byte swizzle follows
// the shared-memory address (unit u of a row at u ^ (address / 128 % 8)). Lane (g, t) loads unit
// 4 (t % 2) + q of row g in half t / 2, so with both halves on 1024-byte boundaries lanes t and
// t + 2 hit the same banks: each activation load took two wavefronts a quarter-warp. Where the
// stage has room (kHalfShiftRows), half 1 starts 2 rows (256 bytes) past a boundary: its row g
// sits at phase (g + 2) % 8, and a quarter-warp's eight 16-byte loads cover the eight bank
// groups. The same bytes reach the same lanes (the same bits). The wgmma consumer's descriptors
// and rearrangement assume 1024-byte aligned halves: kWgmma keeps them.
template <int kGroups, bool kWgmma = false>
struct Ring {
  static constexpr int kGroupBytes = 8 * kActHalf * 2;           // one 8-row group's half: 1 KiB
  static constexpr int kActBytes = 2 * kGroups * kGroupBytes;    // both halves of kGroups groups
  static constexpr int kScaleBytes = kSlab * (kChunk / 16);      // 8 E4M3 scales a row
  static constexpr int kStages = kGroups == 1 ? 6 : (kGroups == 2 ? 5 : 4);
  // CTAs per SM: registers are allocated per sub-partition (16 Ki each) to whole warps, so a
  // 5-warp CTA needs ceil(5 * CTAs / 4) warps' registers in one: 3 CTAs (4 warps) at <= 128
  // registers, 2 (3 warps) at <= 168. The stages leave room for the same counts.
  static constexpr int kCtasPerSm = kGroups <= 4 ? 3 : 2;
  static constexpr int kMaxRegs = kGroups <= 4 ? 128 : 168;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  static constexpr int smem_bytes(int stage_bytes) {
    return kStages * stage_bytes + kBarrierBytes + kExpertListBytes + 1024;
  }
  static constexpr int round_up_1k(int bytes) { return (bytes + 1023) / 1024 * 1024; }
  static constexpr bool kShiftFits =
      kCtasPerSm * (smem_bytes(round_up_1k(kCodeBytes + kActBytes + 256 + kScaleBytes)) + 1024) <=
      228 * 1024;
  static constexpr int kHalfShiftRows = !kWgmma && kShiftFits ? 2 : 0;  // 2 and 8 groups
  static constexpr int kHalf1Offset = kActBytes / 2 + kHalfShiftRows * 128;  // from half 0
  static constexpr int kScaleOffset = kCodeBytes + kHalf1Offset + kActBytes / 2;
  static constexpr int kStageBytes = round_up_1k(kScaleOffset + kScaleBytes);
  static constexpr int kSmemBytes = smem_bytes(kStageBytes);
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzle atoms need 1024-byte aligned stages");
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "the CTAs' shared memory per SM");
};

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t x, uint32_t y) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
  return r;
}

__device__ __forceinline__ bf16_t to_bf16(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ uint32_t bf16x2_same(float f) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 lds128(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// Two E4M3 block scales as the MMA's scale operands: each e4m3 * 2^118 in both bf16 halves
// (exact: E4M3 -> f16 -> fp32 is exact, the factor a power of two, 4 significant bits; NaN
// stays NaN).
__device__ __forceinline__ void scale_operands(uint32_t two_codes, uint32_t& s0, uint32_t& s1) {
  const __half2_raw h2 =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), __NV_E4M3);
  const float2 f = __half22float2(__half2(h2));
  const float factor = __uint_as_float(kScaleFactorBits);
  s0 = bf16x2_same(__fmul_rn(f.x, factor));
  s1 = bf16x2_same(__fmul_rn(f.y, factor));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int q) {
  return q == 0 ? v.x : (q == 1 ? v.y : (q == 2 ? v.z : v.w));
}

// Shared-memory row (of the stage's codes) of tile `tile`'s A row g + 8 r for consumer warp
// `warp`. Plain: the slab's rows in order, 32 a warp (kWgmma: a tile is 64 rows, 16 a warp: the
// warp's quarter of the warpgroup's m64 A). kSwiglu: the slab's first 64 rows are gate rows
// f0 .. f0 + 63, the next 64 their up rows; tile rows g are gate rows, g + 8 the matching up rows,
// so a lane holds gate and up of the same (row m, column f = f0 + code_row(warp, tile, 0, g)).
template <bool kSwiglu, bool kWgmma = false>
__device__ __forceinline__ int code_row(int warp, int tile, int r, int g) {
  if constexpr (kSwiglu && kWgmma) return r * (kSlab / 2) + tile * 32 + warp * 8 + g;
  if constexpr (kSwiglu) return r * (kSlab / 2) + warp * 16 + tile * 8 + g;
  if constexpr (kWgmma) return tile * 64 + warp * 16 + r * 8 + g;
  return warp * 32 + tile * 16 + r * 8 + g;
}

// Position in the stage ring: stage, and the parity of its current phase (flips every lap).
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// The consumer warp's weights of one chunk: per tile the codes of A rows g and g + 8 (16 bytes
// each: the lane's elements [32 t, 32 t + 32)) and their blocks 2t, 2t + 1 as scale operands.
struct ChunkWeights {
  uint4 codes[kTiles][2];
  uint32_t scale[kTiles][2][2];  // [tile][r][block 2t / 2t + 1]
};
template <int kGroups, bool kSwiglu, bool kWgmma>
__device__ __forceinline__ void load_chunk_weights(const uint8_t* stage, int warp, int g, int t,
                                                   ChunkWeights& cw) {
  using R = Ring<kGroups, kWgmma>;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = code_row<kSwiglu, kWgmma>(warp, tile, r, g);
      cw.codes[tile][r] = lds128(stage + row * kCodeRowBytes + 16 * t);
      // Blocks past the row's end are 0 in the prepared scales; their codes are TMA's zeros.
      const uint32_t two = *reinterpret_cast<const uint16_t*>(stage + R::kScaleOffset + row * 8 + 2 * t);
      scale_operands(two, cw.scale[tile][r][0], cw.scale[tile][r][1]);
    }
  }
}

// Code word q (steps 2q, 2q + 1; block 2t + q / 2) of every tile, decoded and scaled: the A
// operands (m16n8k16's fragment: rows g, g + 8 x k pairs {2t, 2t + 1}, {2t + 8, 2t + 9}) of step 2q
// in a0, of step 2q + 1 in a1.
__device__ __forceinline__ void decode_steps(const ChunkWeights& cw, int q,
                                             uint32_t (&a0)[kTiles][4], uint32_t (&a1)[kTiles][4]) {
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    uint32_t lo[4], hi[4];  // rows g, g + 8
    nvfp4_decode_word(word_of(cw.codes[tile][0], q), lo);
    nvfp4_decode_word(word_of(cw.codes[tile][1], q), hi);
    const uint32_t s_lo = cw.scale[tile][0][q >> 1], s_hi = cw.scale[tile][1][q >> 1];
    a0[tile][0] = mul_bf16x2(lo[0], s_lo);
    a0[tile][1] = mul_bf16x2(hi[0], s_hi);
    a0[tile][2] = mul_bf16x2(lo[1], s_lo);
    a0[tile][3] = mul_bf16x2(hi[1], s_hi);
    a1[tile][0] = mul_bf16x2(lo[2], s_lo);
    a1[tile][1] = mul_bf16x2(hi[2], s_hi);
    a1[tile][2] = mul_bf16x2(lo[3], s_lo);
    a1[tile][3] = mul_bf16x2(hi[3], s_hi);
  }
}

}  // namespace epmoe::cuda::nvfp4
