// The arena with host-backed scratch (Config.scratch_device_bytes; docs/memory.md "Host-backed
// scratch"): one reserved virtual range, device memory mapped at its start and pinned host memory
// (cuMemCreate at the device's host NUMA node) mapped right behind, both read/write for the
// device, so kernels see one contiguous arena. Driver calls come from
// cudaGetDriverEntryPointByVersion: libepmoe never links libcuda.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epmoe::cuda {

struct HostBackedArena {
  void* ptr = nullptr;          // arena start; ptr + device_bytes is the first host byte
  std::size_t device_held = 0;  // physical bytes of each part (multiples of the granularity)
  std::size_t host_held = 0;
  // The reserved range [range, range + device_held + host_held) and the two physical allocations
  // (handle 0: none; *_mapped: mapped into the range), for destroy_host_backed_arena.
  unsigned long long range = 0;
  unsigned long long device_handle = 0, host_handle = 0;
  bool device_mapped = false, host_mapped = false;
};

// Zero-filled. The device part is device_bytes rounded up to the granularity and ends where the
// host part begins; the arena starts device_bytes before that boundary (both multiples of 128,
// so the arena stays 128-byte aligned). Throws Error(backend) naming the failing driver call,
// after freeing whatever it had made.
HostBackedArena create_host_backed_arena(int ordinal, std::size_t device_bytes,
                                         std::size_t host_bytes);

// Unmaps both parts, releases their physical memory, frees the range (the order the driver
// needs). Attempts every step; throws the first failure after all of them.
void destroy_host_backed_arena(const HostBackedArena& arena);

// Where the memory mapped at addr lives (tests): by the allocation's own properties.
enum class MappedLocation : int { device, host, other };
MappedLocation mapped_location(const void* addr);

}  // namespace epmoe::cuda
