#include "core/status_word.h"

#include "epmoe/error.h"

namespace epmoe {

Status take_status_word(Backend& backend, Status* status_word) {
  Status st;
  backend.synchronize(nullptr);
  backend.copy_to_host(&st, status_word, sizeof(Status));
  const Status clear;
  backend.copy_to_device(status_word, &clear, sizeof(Status));
  return st;
}

void throw_status(const Status& st) {
  ErrorKind kind = ErrorKind::internal;
  switch (static_cast<StatusCode>(st.code)) {
    case StatusCode::capacity_overflow: kind = ErrorKind::capacity_overflow; break;
    case StatusCode::expert_id_out_of_range:
    case StatusCode::token_count_mismatch: kind = ErrorKind::invalid_routing; break;
    case StatusCode::non_finite_input: kind = ErrorKind::non_finite_input; break;
    case StatusCode::slot_overflow: kind = ErrorKind::slot_overflow; break;
    case StatusCode::barrier_timeout:
    case StatusCode::arrival_timeout: kind = ErrorKind::timeout; break;
    case StatusCode::ok: break;
  }
  detail::throw_error(kind, to_string(static_cast<StatusArg>(st.arg)), st.to_string(), __FILE__,
                      __LINE__);
}

}  // namespace epmoe
