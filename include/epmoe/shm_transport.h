// Shared-memory transport: the R ranks of an EP group are processes of one host and compute on
// the CPU. Symmetric buffers are POSIX shared-memory objects that every rank maps (each rank maps
// every peer's copy); barriers and the setup all-gather run through a control segment in shared
// memory, with the time budget of the Transport interface and errors naming the missing ranks.
//
// Bootstrap: the ranks agree on a session name out of band (the Python binding broadcasts one
// through torch.distributed), then each calls make_shm_transport(session, rank, size). Rank 0
// creates the control segment; the others wait for it up to `setup_budget`. Names are unlinked as
// soon as every rank has mapped them, so nothing is left in /dev/shm after setup, even on a crash.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "epmoe/transport.h"

namespace epmoe {

// At most this many ranks (one bit each in the barrier word).
constexpr int kShmMaxRanks = 63;
// Largest all_gather contribution per rank, in bytes.
constexpr std::size_t kShmMaxGatherBytes = 1024;

// Collective over `size` processes. `session` must be the same on every rank and unique on the
// host for the lifetime of the group (letters, digits, '-', '_'; at most 64 characters).
// Throws Error(invalid_argument) for a bad session, rank or size, Error(timeout) when a rank does
// not join within setup_budget, Error(backend) when the OS refuses shared memory.
std::shared_ptr<Transport> make_shm_transport(
    const std::string& session, int rank, int size,
    std::chrono::milliseconds setup_budget = std::chrono::milliseconds(60000));

}  // namespace epmoe
