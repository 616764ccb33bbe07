// Device side of the NCCL transport (nccl_transport.cpp): the control buffer every rank holds in
// symmetric memory, the stream barrier, the rendezvous of host collectives and the query of LSA
// peer pointers. Launchers only; the kernels are in nccl_kernels.cu.
//
// Control buffer of rank q (u64 words, symmetric: peers write into it through their peer pointer)
//   board_R   [R]                       [r]: the last host collective rank r entered (rendezvous)
//   flags_CR  [kBarrierChannels, R]     [c][r]: the last stream barrier of channel c rank r entered
// Every word is written by exactly one rank (r), so no atomics are needed, only ordered stores.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/hd.h"
#include "epmoe/status.h"

namespace epmoe::nccl {

constexpr int kBarrierChannels = 8;  // Context uses 0..3
constexpr int kMaxRanks = 1024;      // one thread per peer in a one-CTA kernel
// A flag word with this bit set: its writer gave up (a barrier of its own timed out). Bits 32..62
// hold the rank that writer was waiting for.
constexpr uint64_t kAbortBit = 1ull << 63;

EPMOE_HD std::size_t board_word(int r) {
  return static_cast<std::size_t>(r);
}
EPMOE_HD std::size_t flag_word(int channel, int r, int R) {
  return static_cast<std::size_t>(R) + static_cast<std::size_t>(channel) * R + r;
}
EPMOE_HD std::size_t control_bytes(int R) {
  return (static_cast<std::size_t>(R) * (1 + kBarrierChannels)) * sizeof(uint64_t);
}

// This rank's stream-barrier state (plain device memory, not symmetric; zero-filled at start).
struct BarrierState {
  uint64_t epoch_C[kBarrierChannels];  // barriers of each channel this rank has passed
  int32_t broken;                      // 0, else 1 + the rank an earlier barrier timed out on
  int32_t broken_channel;
  uint64_t broken_expected;  // arrival number it waited for
};

struct StreamBarrierArgs {
  uint64_t* const* control_R = nullptr;  // [R] device table: every rank's control buffer
  BarrierState* state = nullptr;         // [1] this rank's
  Status* status = nullptr;              // [1] the caller's status word (nullable)
  uint64_t budget_ns = 0;
  int rank = 0, R = 0, channel = 0;
};
// One CTA on `stream`: arrive at channel `channel` and wait for every peer (see nccl_kernels.cu).
void launch_stream_barrier(const StreamBarrierArgs& args, cudaStream_t stream);

struct RendezvousArgs {
  uint64_t* const* control_R = nullptr;  // [R] device table
  int32_t* missing_R = nullptr;          // [R] out: 1 = rank did not arrive in time
  uint64_t number = 0;                   // host collective number (1, 2, ...)
  uint64_t budget_ns = 0;
  int rank = 0, R = 0;
};
// One CTA on `stream`: announce collective `number`, wait for every rank to announce it; on
// timeout mark the missing ranks and withdraw this rank's announcement.
void launch_rendezvous(const RendezvousArgs& args, cudaStream_t stream);

// out_R[r] = ncclGetLsaPointer(window, 0, lsa_first + r) for r in [0, R): world rank r's copy.
void launch_lsa_pointers(ncclWindow_t window, int lsa_first, int R, void** out_R,
                         cudaStream_t stream);

// Host side of NCCL's device API (here, not in the g++ translation units). Collective. True when
// NCCL gives this communicator symmetric memory with every rank in the LSA team; then *lsa_first
// is the LSA index of world rank 0. Otherwise *why says what NCCL reported.
bool probe_symmetric_memory(ncclComm_t comm, int size, int rank, int* lsa_first, std::string* why);

}  // namespace epmoe::nccl
