#include "epmoe/status.h"

#include <sstream>

namespace epmoe {

const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::ok: return "ok";
    case StatusCode::capacity_overflow: return "capacity overflow";
    case StatusCode::expert_id_out_of_range: return "expert id out of range";
    case StatusCode::non_finite_input: return "non-finite input";
    case StatusCode::token_count_mismatch: return "token count mismatch";
    case StatusCode::slot_overflow: return "activation slot overflow";
    case StatusCode::barrier_timeout: return "barrier timeout";
    case StatusCode::arrival_timeout: return "dispatch arrival timeout";
  }
  return "unknown status";
}

const char* to_string(StatusArg arg) {
  switch (arg) {
    case StatusArg::none: return "step";
    case StatusArg::x_TD: return "x_TD";
    case StatusArg::num_tokens_1: return "num_tokens_1";
    case StatusArg::topk_ids_TK: return "topk_ids_TK";
    case StatusArg::topk_scores_TK: return "topk_scores_TK";
    case StatusArg::slot: return "activation slot";
    case StatusArg::barrier: return "barrier";
  }
  return "?";
}

std::string Status::to_string() const {
  std::ostringstream os;
  const auto c = static_cast<StatusCode>(code);
  if (c == StatusCode::barrier_timeout) {
    // `rank` is the rank waited for, not the one that waited (the caller is that one).
    os << "barrier timeout waiting for rank " << rank << " at stream barrier channel " << index
       << ": expected its arrival #" << required << " within Config.barrier_timeout_ms, got ";
    if (available == -1) {
      os << "its abort: it gave up after its own barrier timed out waiting for another rank";
    } else if (available == -2) {
      os << "no wait: an earlier stream barrier of this transport timed out";
    } else {
      os << "arrival #" << available << " (" << reserved
         << " rank(s) missing: not in the call, or stuck)";
    }
    os << "; the stream barriers of this transport stay broken: close the contexts and create a "
          "new transport on every rank";
    return os.str();
  }
  os << epmoe::to_string(c) << " on rank " << rank;
  switch (c) {
    case StatusCode::ok: return "ok";
    case StatusCode::capacity_overflow:
      os << ": expected at most " << available << " received rows (recv_capacity_rows), got "
         << required
         << "; raise Config.capacity_factor (up to the EP size; a token's expert ids must be distinct)";
      break;
    case StatusCode::expert_id_out_of_range:
      os << ": expected ids in [-1, " << available << "), got " << required << " at flat index "
         << index;
      break;
    case StatusCode::non_finite_input:
      os << ": expected finite values, got a NaN/Inf at flat index " << index;
      break;
    case StatusCode::token_count_mismatch:
      os << ": expected " << available << " tokens, got " << required;
      break;
    case StatusCode::slot_overflow:
      os << ": expected at most " << available << " bytes in the slot, needed " << required;
      break;
    case StatusCode::barrier_timeout: break;  // above
    case StatusCode::arrival_timeout:
      os << ": the W13 GEMM expected " << required << " received rows in 128-row block " << index
         << " within Config.barrier_timeout_ms, saw " << available
         << " (dispatch did not store them; Config.arrival_gated_w13 = false runs staged)";
      break;
  }
  return os.str();
}

}  // namespace epmoe
