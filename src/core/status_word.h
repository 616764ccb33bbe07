// The device/host status word of a Context: reading it back and turning it into an Error. Shared
// by the fused Context and the layered API.
#pragma once

#include "core/backend.h"
#include "epmoe/status.h"

namespace epmoe {

// Synchronises the whole device (the caller's stream of the last call may be gone), copies the
// status word to the host, clears it, and returns what it held.
Status take_status_word(Backend& backend, Status* status_word);

// Throws the epmoe::Error a non-ok status records (kind from its code, argument from its arg).
[[noreturn]] void throw_status(const Status& status);

}  // namespace epmoe
