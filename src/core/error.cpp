#include "epmoe/error.h"

namespace epmoe {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_argument: return "invalid argument";
    case ErrorKind::capacity_overflow: return "capacity overflow";
    case ErrorKind::invalid_routing: return "invalid routing";
    case ErrorKind::non_finite_input: return "non-finite input";
    case ErrorKind::slot_overflow: return "activation slot overflow";
    case ErrorKind::timeout: return "timeout";
    case ErrorKind::backend: return "backend error";
    case ErrorKind::internal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorKind kind, std::string argument, std::string message, const char* file, int line)
    : std::runtime_error(detail::concat("epmoe: ", to_string(kind), ": ", argument, ": ", message,
                                        " (", file, ":", line, ")")),
      kind_(kind),
      argument_(std::move(argument)) {}

namespace detail {
void throw_error(ErrorKind kind, const std::string& argument, const std::string& message,
                 const char* file, int line) {
  throw Error(kind, argument, message, file, line);
}
}  // namespace detail

}  // namespace epmoe
