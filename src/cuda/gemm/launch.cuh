// Host side of the grouped GEMM: TMA descriptors from plain pointers, shared-memory attribute,
// persistent launch. Included by the per-stage .cu files (one instantiation set each).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/check.h"
#include "cuda/kernel_common.cuh"  // set_shared_memory_limit
#include "cuda/gemm/epilogues.cuh"
#include "cuda/gemm/gemm_config.h"
#include "cuda/gemm/grouped_gemm_sm90.cuh"

namespace epmoe::cuda::gemm {

int device_sm_count();  // of the current device (cached per device)

// An operand as the TMA sees it: base pointer, (rows, cols[, groups]) and strides in elements.
struct Operand {
  const void* ptr;
  int64_t rows, cols;  // mode 0, mode 1 of the CuTe shape
  int64_t stride_rows, stride_cols;
  int groups = 1;      // 3-mode operands (weights): mode 2 extent
  int64_t stride_groups = 0;
};

// kRank 2: (rows, cols); kRank 3: (rows, cols, groups) for per-expert weights. kMulticast > 1:
// the tile is loaded in kMulticast slices, each multicast to the CTAs of the cluster.
template <class Traits, Major kMajor, int kTileRows, int kRank, int kMulticast = 1>
auto make_tma(const Operand& o) {
  using Element = typename Traits::Element;
  const auto* ptr = static_cast<const Element*>(o.ptr);
  using Atom = std::conditional_t<kMajor == Major::K, GMMA::Layout_K_SW128_Atom<Element>,
                                  GMMA::Layout_MN_SW128_Atom<Element>>;
  auto smem = tile_to_shape(Atom{}, make_shape(Int<kTileRows>{}, Int<Traits::BLOCK_K>{}),
                            take<0, 2>(AtomOrder<kMajor>{}));  // as the kernel's stage layout
  auto tile = make_shape(Int<kTileRows>{}, Int<Traits::BLOCK_K>{});
  // K-major: consecutive elements along mode 1; MN-major: along mode 0.
  auto stride2 = [&] {
    if constexpr (kMajor == Major::K) return make_stride(o.stride_rows, Int<1>{});
    else return make_stride(Int<1>{}, o.stride_cols);
  }();
  auto atom = [&](auto tensor) {
    if constexpr (kMulticast == 1) {
      return make_tma_atom(SM90_TMA_LOAD{}, tensor, smem, tile);
    } else {
      return make_tma_atom(SM90_TMA_LOAD_MULTICAST{}, tensor, smem, tile, Int<kMulticast>{});
    }
  };
  // One box (one TMA instruction) fills at least one 128B-swizzle slab: 64 x BLOCK_K elements
  // MN-major, 8 rows of BLOCK_K K-major. A smaller box means the smem layout split the slab.
  auto checked = [](auto tma) {
    constexpr int kBoxBits = size<1>(typename decltype(tma)::SrcLayout{});
    constexpr int kSlabRows = kMajor == Major::K ? 8 : 64;
    static_assert(kBoxBits >= kSlabRows * Traits::BLOCK_K * int(sizeof_bits_v<Element>),
                  "TMA box smaller than one 128B-swizzle slab: check AtomOrder");
    return tma;
  };
  if constexpr (kRank == 2) {
    return checked(
        atom(make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(o.rows, o.cols), stride2))));
  } else {
    return checked(atom(make_tensor(
        make_gmem_ptr(ptr),
        make_layout(make_shape(o.rows, o.cols, static_cast<int64_t>(o.groups)),
                    append(stride2, o.stride_groups)))));
  }
}

// The launch attribute of 1-D clusters of `cluster` CTAs along x.
inline cudaLaunchAttribute cluster_attribute(int cluster) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// Persistent grid of a clustered launch: as many clusters as can be resident at once (clusters
// of two need two free SMs of one GPC, so that can be fewer than SMs / 2). Cached per device.
template <auto kKernel, int kCluster>
int resident_cluster_grid(int threads, int smem_bytes) {
  static std::atomic<int> grids[64] = {};
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& cached = grids[device % 64];
  int grid = cached.load(std::memory_order_acquire);
  if (grid == 0) {
    cudaLaunchAttribute attribute = cluster_attribute(kCluster);
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(device_sm_count()));
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config));
    EPMOE_CHECK_ARG(clusters > 0, "grouped GEMM cluster launch",
                    "at least one resident cluster of " + std::to_string(kCluster) + " CTAs",
                    clusters);
    grid = std::min(clusters, device_sm_count() / kCluster) * kCluster;
    cached.store(grid, std::memory_order_release);
  }
  return grid;
}

// The probe build (-DEPMOE_GEMM_TIMELINE): prints and clears the stamps the GEMM just enqueued
// recorded (tile_timeline.cuh). Nothing otherwise.
template <class Traits>
void enqueue_timeline_print(cudaStream_t stream) {
#if defined(EPMOE_GEMM_TIMELINE)
  print_tile_timeline<<<1, 1, 0, stream>>>(Traits::BLOCK_M, Traits::BLOCK_N, Traits::kNumB,
                                           static_cast<int>(Traits::kGrouping));
  EPMOE_CUDA_CHECK(cudaGetLastError());
#else
  (void)stream;
#endif
}

// Launches one grouped GEMM: A and B as described, groups from the device, epilogue params.
// programmatic: a programmatic dependent launch (it may start while the previous kernel of the
// stream runs; only for a kernel that waits on that kernel's data itself, e.g. the arrival gate).
template <class Traits, Major kMajorA, Major kMajorB, class Epilogue>
void launch_grouped_gemm(const Operand& a, const Operand& b, const GroupArgs& groups,
                         const typename Epilogue::Params& epi, cudaStream_t stream,
                         bool programmatic = false) {
  constexpr int kRankB = Traits::kGrouping == Grouping::rows ? 3 : 2;
  auto tma_a = make_tma<Traits, kMajorA, Traits::BLOCK_M, 2>(a);
  auto tma_b = make_tma<Traits, kMajorB, Traits::BLOCK_N, kRankB, Traits::kClusterM>(b);
  constexpr auto kernel = &grouped_gemm_kernel<Traits, Epilogue, decltype(tma_a), decltype(tma_b)>;
  constexpr int kSmem =
      static_cast<int>(sizeof(SharedStorage<Traits, Epilogue::kSmemBytesPerWarpgroup>));
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90 is at most 227 KiB");
  set_shared_memory_limit<kernel>(kSmem);
  constexpr int kCluster = Traits::kClusterM;
  if (programmatic || kCluster > 1) {
    cudaLaunchAttribute attributes[2] = {};
    unsigned count = 0;
    if (programmatic) {
      attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attributes[count++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (kCluster > 1) attributes[count++] = cluster_attribute(kCluster);
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(
        kCluster > 1 ? resident_cluster_grid<kernel, kCluster>(Traits::kThreads, kSmem)
                     : device_sm_count()));
    config.blockDim = dim3(Traits::kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = count;
    EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tma_a, tma_b, groups, epi, a.rows, a.cols,
                                        b.rows, b.cols));
    enqueue_timeline_print<Traits>(stream);
    return;
  }
  const int grid = device_sm_count();
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(tma_a, tma_b, groups, epi, a.rows, a.cols,
                                                     b.rows, b.cols);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  enqueue_timeline_print<Traits>(stream);
}

}  // namespace epmoe::cuda::gemm
