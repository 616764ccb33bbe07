// NCCL transport: EP ranks are GPUs (one per rank) of one NVLink domain, joined by an NCCL
// communicator. Lives in libepmoe_nccl (link epmoe::epmoe_nccl), so that libepmoe itself loads
// without libnccl. No NCCL type appears here: the unique id travels as bytes.
//
//   rank 0:          auto id = epmoe::nccl_unique_id();      // then send the bytes to every rank
//   every rank:      auto t = epmoe::make_nccl_transport(id.data(), id.size(), rank, R, device);
//                    auto ctx = epmoe::Context::create(config, t);
//
// Symmetric buffers are ncclMemAlloc memory registered as NCCL symmetric windows; peers are
// reached through the NCCL device API's load/store-accessible (LSA) pointers. Where NCCL has no
// symmetric memory for the group (see PeerAccess), cudaMalloc memory shared through CUDA IPC (or
// direct peer access between ranks of one process) takes its place. LSA also needs the NCCL release
// libepmoe_nccl was built with at run time (the device API's structures change between releases,
// even 2.28.3 -> 2.28.9): a process that loaded another libnccl.so.2 first (PyTorch's) gets CUDA
// IPC, and nccl_peer_access() says why. Builds with the PyTorch binding use PyTorch's NCCL.
//
// Budgets: barrier() and all_gather() take theirs; allocate_symmetric() and release_symmetric()
// use NcclTransportOptions::setup_budget. A host collective that times out names the ranks that
// did not arrive and withdraws this rank's arrival (the next collective of all ranks still
// matches up); if every rank arrived but NCCL then did not finish, the communicator is aborted
// and the transport refuses further use. Stream barriers record barrier_timeout in the context's
// status word instead (see Transport::barrier_on_stream); after one, the stream barriers of the
// transport stay broken: close the contexts and create a new transport on every rank.
//
// Creation itself (ncclCommInitRank) has no budget of ours: it returns once every rank has called
// it. One transport is used by one host thread at a time; contexts that share a transport must
// run their calls in one stream order (the stream barrier's arrival counters are per transport).
// NVLink multicast is not used; run with NCCL_NVLS_ENABLE=0 where NVSwitch multicast exists.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "epmoe/transport.h"

namespace epmoe {

inline constexpr std::size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using NcclUniqueId = std::array<unsigned char, kNcclUniqueIdBytes>;

// A fresh NCCL unique id. Create it on one rank and give the same bytes to every rank.
NcclUniqueId nccl_unique_id();

// How ranks address each other's symmetric buffers.
enum class PeerAccess : int {
  automatic = 0,  // NCCL LSA pointers when NCCL offers symmetric memory, else CUDA IPC
  nccl_lsa = 1,   // NCCL LSA pointers, or Error(backend) saying why NCCL offers none
  cuda_ipc = 2,   // cudaMalloc + CUDA IPC handles (direct peer access within one process)
};
const char* to_string(PeerAccess access);

struct NcclTransportOptions {
  PeerAccess peer_access = PeerAccess::automatic;  // must be the same on every rank
  // Budget of the collectives that take none (allocate/release_symmetric) and of the setup
  // collectives of make_nccl_transport after the communicator exists.
  std::chrono::milliseconds setup_budget{60000};
};

// Collective over `size` ranks, each calling it with the same id, its own rank, and the CUDA
// device it computes on (one device per rank). Throws Error(invalid_argument) for a bad rank,
// size, device or id size, Error(backend) when NCCL or CUDA fails.
std::shared_ptr<Transport> make_nccl_transport(const void* unique_id, std::size_t unique_id_bytes,
                                               int rank, int size, int device,
                                               const NcclTransportOptions& options = {});

// How an NCCL transport reaches its peers and why: "nccl-lsa", or "cuda-ipc (<reason>)". Empty for
// a transport that is not an NCCL transport.
std::string nccl_peer_access(const Transport& transport);

}  // namespace epmoe
