// Shared pieces of the CUDA stage kernels: launch geometry, 16-byte row vectors of 8 bf16, layout
// header reads, and host checks of the pointers the kernels vectorise over.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "core/step.h"
#include "cuda/check.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

constexpr int kThreads = 256;     // block size of the row kernels
constexpr int kBlocksPerSm = 8;   // persistent grid: kBlocksPerSm * SMs blocks at most
constexpr int kVec = 8;           // bf16 per 16-byte vector (rows are D % 8 == 0 elements)

// Multiprocessors of the current device, cached per device (asked on every launch).
inline int sm_count() {
  static std::atomic<int> cached[64] = {};
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = cached[device % 64];
  int sms = slot.load(std::memory_order_relaxed);
  if (sms == 0) {
    EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    sms = sms > 0 ? sms : 1;
    slot.store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// The shared-memory limit is a per-device attribute of a kernel: sets it once per device (several
// GPUs, one thread each, share this process). The record is per kKernel, so per instantiation.
// Call it before each launch that needs more than 48 KiB of dynamic shared memory. max_carveout:
// also ask for the largest shared-memory carveout of the unified L1, for kernels whose
// occupancy needs several CTAs' shared memory on one SM.
template <auto kKernel>
void set_shared_memory_limit(int bytes, bool max_carveout = false) {
  static std::atomic<uint64_t> set_on{0};  // bit d: set on device d
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t{1} << (device % 64);
  if ((set_on.load(std::memory_order_acquire) & bit) == 0) {
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (max_carveout) {
      EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
    }
    set_on.fetch_or(bit, std::memory_order_release);
  }
}

// Blocks of a grid-stride loop over `items` work items: enough to cover them once, capped at a
// persistent grid. Geometry depends only on host-known sizes (capacity, T), never on counts.
inline unsigned grid_for(int64_t items, int threads_per_block) {
  const int64_t needed = (items + threads_per_block - 1) / threads_per_block;
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  const int64_t blocks = needed < cap ? needed : cap;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

// Rows are read and written as 16-byte vectors: base pointers must be 16-byte aligned.
inline void check_aligned16(const void* ptr, const char* name) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  EPMOE_CHECK_ARG(addr % 16 == 0, name, "a 16-byte aligned data pointer (rows move as 16-byte vectors)",
                  "address " + std::to_string(addr) + " (offset " + std::to_string(addr % 16) + ")");
}

// ---- device helpers ----

// Received rows that exist in the buffers: the layout's M, clamped to the capacity (when M
// exceeds it the step is skipped, but a stage never indexes past its buffers either way).
__device__ __forceinline__ int64_t layout_rows(const int32_t* header, int64_t capacity) {
  const int64_t m = header[kLayoutRows];
  return m < 0 ? 0 : (m < capacity ? m : capacity);
}
__device__ __forceinline__ bool layout_skip(const int32_t* header) {
  return header[kLayoutSkip] != 0;
}

// The call's live tokens (the layout header's count) clamped to [0, tokens].
__device__ __forceinline__ int64_t live_rows(const int32_t* header, int64_t tokens) {
  const int64_t live = header[kLayoutLive];
  return live < 0 ? 0 : (live < tokens ? live : tokens);
}

// 8 bf16 <-> one 16-byte vector (element i in the low half first: little-endian, as in memory).
struct Bf16x8 {
  float v[kVec];
};
__device__ __forceinline__ Bf16x8 unpack8(const uint4 u) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  Bf16x8 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r.v[2 * i] = bf16_to_float(static_cast<bf16_t>(w[i] & 0xffffu));
    r.v[2 * i + 1] = bf16_to_float(static_cast<bf16_t>(w[i] >> 16));
  }
  return r;
}
__device__ __forceinline__ uint4 pack8(const Bf16x8& r) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<uint32_t>(float_to_bf16(r.v[2 * i])) |
           (static_cast<uint32_t>(float_to_bf16(r.v[2 * i + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Row vectors: plain for local data; .cg (L2, bypassing L1) for symmetric buffers that peers
// wrote before a barrier or that live on a peer.
__device__ __forceinline__ uint4 load_vec(const bf16_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ uint4 load_vec_cg(const bf16_t* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}
// One 16-byte store, always: a uint4 assembled from bf16 lanes reaches NVVM as scalars, which it
// stores as four 4-byte STG.E (four L2 sector writes for one). A plain (weak) st.global.v4, not
// __stwb, whose .wb lowers to a strong store.
__device__ __forceinline__ void store_vec(bf16_t* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void store_vec_cg(bf16_t* p, uint4 v) {
  __stcg(reinterpret_cast<uint4*>(p), v);
}

__device__ __forceinline__ bool is_finite_f32(float f) {
  return (__float_as_uint(f) & 0x7f800000u) != 0x7f800000u;
}

}  // namespace epmoe::cuda
