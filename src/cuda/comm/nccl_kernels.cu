// Kernels of the NCCL transport: the stream barrier (one CTA, one thread per peer), the
// rendezvous of host collectives, and the LSA peer-pointer query.
//
// Memory ordering of the stream barrier (ranks on different GPUs over NVLink):
//   release  The kernel runs after every earlier kernel of the stream has completed, so their
//            writes (local, and stores into peers' buffers) happen-before this kernel. Thread i
//            issues fence.sc.sys (__threadfence_system) and then a release store at system scope
//            of the arrival number into peer i's flag word [channel][rank]: by cumulativity the
//            earlier kernels' writes are visible to any thread that observes that store.
//   acquire  Thread i polls its own flag word [channel][i] with relaxed system-scope loads (a
//            remote store lands in this GPU's L2; .sys loads never hit a stale L1 line), and after
//            it sees the peer's arrival issues an acquire fence at system scope. The kernel ends
//            after __syncthreads(), so every later kernel of the stream sees what the peer wrote
//            before its arrival.
//   epochs   Arrival numbers per channel only grow (1, 2, ...), so a wait is "flag >= expected":
//            a peer that has already moved on to the next barrier of the channel (it can be at
//            most one ahead: it cannot pass that one without this rank) still satisfies it, and no
//            flag ever needs resetting (graph replays need none either).
//   budget   The spin loop reads %globaltimer (ns) and gives up after budget_ns: then it records
//            barrier_timeout in the status word (rank waited for, arrival expected and seen,
//            channel), writes the abort bit into every peer's flag words of this rank (their waits
//            on this rank end at once with "gave up" instead of at their own budget), marks this
//            transport's barriers broken (later barriers return at once and report it) and
//            returns. No trap, no hang.
#include <nccl.h>
#include <nccl_device.h>

#include <climits>
#include <cstring>
#include <cuda/atomic>
#include <memory>
#include <string>

#include "cuda/check.h"
#include "cuda/comm/nccl_check.h"
#include "cuda/comm/nccl_kernels.h"

namespace epmoe::nccl {
namespace {

using SystemWord = ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void record_barrier_status(Status* st, int waited_for, int missing, uint64_t expected,
                                      int64_t seen, int channel) {
  if (st == nullptr || st->code != 0) return;  // the first error of a step wins
  st->rank = waited_for;
  st->arg = static_cast<int32_t>(StatusArg::barrier);
  st->reserved = missing;
  st->required = static_cast<int64_t>(expected);
  st->available = seen;
  st->index = channel;
  st->code = static_cast<int32_t>(StatusCode::barrier_timeout);  // last: the word is complete
}

// Waits until *word >= expected, the abort bit shows, or budget_ns has passed; returns the last
// value read and whether the wait succeeded.
__device__ __forceinline__ bool wait_at_least(uint64_t* word, uint64_t expected, uint64_t budget_ns,
                                              uint64_t* seen) {
  SystemWord w(*word);
  const uint64_t start = now_ns();
  for (;;) {
    const uint64_t v = w.load(::cuda::memory_order_relaxed);
    if ((v & kAbortBit) == 0 && v >= expected) {
      *seen = v;
      ::cuda::atomic_thread_fence(::cuda::memory_order_acquire, ::cuda::thread_scope_system);
      return true;
    }
    if ((v & kAbortBit) != 0 || now_ns() - start > budget_ns) {
      *seen = v;
      return false;
    }
  }
}

__global__ void __launch_bounds__(kMaxRanks) stream_barrier_kernel(const StreamBarrierArgs a) {
  __shared__ int s_first_missing, s_missing;
  __shared__ uint64_t s_seen_R[kMaxRanks];
  const int tid = static_cast<int>(threadIdx.x);
  BarrierState* state = a.state;  // [1] this rank's
  if (tid == 0) {
    s_first_missing = INT_MAX;
    s_missing = 0;
  }
  __syncthreads();
  if (state->broken != 0) {  // written by an earlier kernel: the same value in every thread
    if (tid == 0) {
      record_barrier_status(a.status, state->broken - 1, 0, state->epoch_C[a.channel] + 1, -2,
                            a.channel);
    }
    return;
  }
  const uint64_t expected = state->epoch_C[a.channel] + 1;
  uint64_t* own = a.control_R[a.rank];  // [control words] this rank's
  if (tid < a.R && tid != a.rank) {
    __threadfence_system();
    SystemWord(a.control_R[tid][flag_word(a.channel, a.rank, a.R)])
        .store(expected, ::cuda::memory_order_release);
    uint64_t seen = 0;
    if (!wait_at_least(own + flag_word(a.channel, tid, a.R), expected, a.budget_ns, &seen)) {
      atomicMin(&s_first_missing, tid);
      atomicAdd(&s_missing, 1);
    }
    s_seen_R[tid] = seen;
  }
  __syncthreads();
  if (s_missing == 0) {
    if (tid == 0) state->epoch_C[a.channel] = expected;
    return;
  }
  const int first = s_first_missing;
  if (tid < a.R && tid != a.rank) {
    const uint64_t abort = kAbortBit | (static_cast<uint64_t>(first) << 32);
    for (int c = 0; c < kBarrierChannels; ++c) {
      SystemWord(a.control_R[tid][flag_word(c, a.rank, a.R)])
          .store(abort, ::cuda::memory_order_relaxed);
    }
  }
  if (tid == 0) {
    state->broken = 1 + first;
    state->broken_channel = a.channel;
    state->broken_expected = expected;
    const uint64_t seen = s_seen_R[first];
    record_barrier_status(a.status, first, s_missing, expected,
                          (seen & kAbortBit) != 0 ? -1 : static_cast<int64_t>(seen), a.channel);
  }
}

__global__ void __launch_bounds__(kMaxRanks) rendezvous_kernel(const RendezvousArgs a) {
  __shared__ int s_missing;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) s_missing = 0;
  __syncthreads();
  if (tid < a.R) {
    int missing = 0;
    if (tid != a.rank) {
      __threadfence_system();
      SystemWord(a.control_R[tid][board_word(a.rank)])
          .store(a.number, ::cuda::memory_order_release);
      uint64_t seen = 0;
      if (!wait_at_least(a.control_R[a.rank] + board_word(tid), a.number, a.budget_ns, &seen)) {
        missing = 1;
        atomicAdd(&s_missing, 1);
      }
    }
    a.missing_R[tid] = missing;
  }
  __syncthreads();
  // Withdraw: this rank leaves the collective, so that its next attempt is the same number.
  if (s_missing != 0 && tid < a.R && tid != a.rank) {
    SystemWord(a.control_R[tid][board_word(a.rank)])
        .store(a.number - 1, ::cuda::memory_order_relaxed);
  }
}

__global__ void lsa_pointers_kernel(ncclWindow_t window, int lsa_first, int R, void** out_R) {
  for (int r = static_cast<int>(threadIdx.x); r < R; r += static_cast<int>(blockDim.x)) {
    out_R[r] = ncclGetLsaPointer(window, 0, lsa_first + r);
  }
}

unsigned threads_for(int R) {
  return static_cast<unsigned>((R + 31) / 32 * 32);
}

}  // namespace

void launch_stream_barrier(const StreamBarrierArgs& args, cudaStream_t stream) {
  stream_barrier_kernel<<<1, threads_for(args.R), 0, stream>>>(args);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void launch_rendezvous(const RendezvousArgs& args, cudaStream_t stream) {
  rendezvous_kernel<<<1, threads_for(args.R), 0, stream>>>(args);
  EPMOE_CUDA_LAUNCH_CHECK();
}

void launch_lsa_pointers(ncclWindow_t window, int lsa_first, int R, void** out_R,
                         cudaStream_t stream) {
  lsa_pointers_kernel<<<1, 128, 0, stream>>>(window, lsa_first, R, out_R);
  EPMOE_CUDA_LAUNCH_CHECK();
}

bool probe_symmetric_memory(ncclComm_t comm, int size, int rank, int* lsa_first, std::string* why) {
  // The library's ncclDevComm may be larger than this header's: oversized, zeroed storage.
  struct alignas(256) Storage {
    unsigned char bytes[16384];
  };
  static_assert(sizeof(ncclDevComm) <= sizeof(Storage), "ncclDevComm outgrew its storage");
  auto storage = std::make_unique<Storage>();
  std::memset(storage->bytes, 0, sizeof(storage->bytes));
  auto* dev_comm = reinterpret_cast<ncclDevComm*>(storage->bytes);
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs{};  // nothing: this only asks whether symmetric memory exists
#endif
  const ncclResult_t created = ncclDevCommCreate(comm, &reqs, dev_comm);
  if (created != ncclSuccess) {
    *why = "NCCL offers no symmetric memory for this group (ncclDevCommCreate: " +
           nccl_error_text(created) +
           "); it needs every rank on one node, direct P2P (NVLink) between every pair of GPUs, "
           "NCCL_CUMEM_ENABLE=1 and NCCL_WIN_ENABLE=1";
    return false;
  }
  EPMOE_NCCL_CHECK(ncclDevCommDestroy(comm, dev_comm));
  const ncclTeam lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != size) {
    *why = "the NCCL LSA team (load/store-accessible ranks) holds " + std::to_string(lsa.nRanks) +
           " of the " + std::to_string(size) + " ranks: the group spans several NVLink domains";
    return false;
  }
  *lsa_first = lsa.rank - rank;  // LSA index of world rank r = lsa_first + r
  return true;
}

}  // namespace epmoe::nccl
