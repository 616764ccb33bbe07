// The status word: data-dependent contract breaks found while a step runs (on the device for
// CUDA) are recorded here instead of trapping. The first error of a step wins; later stages of
// that step skip their work; Context::check() turns it into an epmoe::Error and clears it.
#pragma once

#include <cstdint>
#include <string>

namespace epmoe {

enum class StatusCode : int32_t {
  ok = 0,
  capacity_overflow = 1,       // a rank receives more rows than recv_capacity_rows
  expert_id_out_of_range = 2,  // id outside [-1, E*R)
  non_finite_input = 3,        // NaN / Inf in x_TD or topk_scores_TK
  token_count_mismatch = 4,    // ranks passed different T, or live count outside [0, T]
  slot_overflow = 5,           // saved state does not fit the activation slot
  barrier_timeout = 6,         // a stream barrier did not see rank `rank` within its budget
  arrival_timeout = 7,         // W13 waited past its budget for received rows dispatch never stored
};
const char* to_string(StatusCode code);

// Which tensor a status is about.
enum class StatusArg : int32_t {
  none = 0, x_TD, num_tokens_1, topk_ids_TK, topk_scores_TK, slot, barrier
};
const char* to_string(StatusArg arg);

// Plain-old-data; the same bytes live in host memory (CPU) or device memory (CUDA).
// barrier_timeout: rank = the (lowest) rank waited for, reserved = how many ranks were missing,
// required = the arrival number expected from it, available = the last one seen (-1: it had given
// up itself after its own timeout, -2: not waited: an earlier barrier had timed out), index = the
// barrier channel. arrival_timeout: rank = this rank, index = the 128-row block of received rows,
// required = rows expected in it, available = rows seen.
struct Status {
  int32_t code = 0;       // StatusCode
  int32_t rank = -1;      // rank whose data broke the contract
  int32_t arg = 0;        // StatusArg
  int32_t reserved = 0;
  int64_t required = 0;   // capacity_overflow: rows required; others: offending value
  int64_t available = 0;  // capacity_overflow: rows available; others: expected bound
  int64_t index = -1;     // flat element index of the offending value, when there is one

  bool ok() const { return code == 0; }
  std::string to_string() const;
};
static_assert(sizeof(Status) == 40, "Status is shared with device code; keep its layout");

}  // namespace epmoe
