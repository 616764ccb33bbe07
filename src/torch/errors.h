// epmoe::Error -> the Python exception a caller expects: invalid arguments become ValueError,
// everything else RuntimeError. The message starts with "[epmoe:<kind>]" so Python can
// tell timeouts and overflows apart without parsing the rest.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "epmoe/error.h"

namespace epmoe::torch_binding {

template <class Fn>
auto guarded(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const epmoe::Error& e) {
    std::string kind = to_string(e.kind());
    for (char& c : kind) c = c == ' ' ? '_' : c;  // "[epmoe:capacity_overflow]"
    const std::string msg = "[epmoe:" + kind + "] " + e.what();
    if (e.kind() == ErrorKind::invalid_argument) TORCH_CHECK_VALUE(false, msg);
    TORCH_CHECK(false, msg);
  }
}

}  // namespace epmoe::torch_binding
