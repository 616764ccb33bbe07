// Checked NCCL calls: a failure throws Error(backend) whose argument is the call's text and whose
// message is "<result name>: <NCCL's last error text>".
#pragma once

#include <nccl.h>

#include <string>

#include "epmoe/error.h"

namespace epmoe::nccl {

inline std::string nccl_error_text(ncclResult_t result) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') text += std::string(" (") + last + ")";
  return text;
}

}  // namespace epmoe::nccl

#define EPMOE_NCCL_CHECK(call)                                                                \
  do {                                                                                        \
    const ncclResult_t epmoe_nccl_res_ = (call);                                              \
    if (epmoe_nccl_res_ != ncclSuccess) {                                                     \
      ::epmoe::detail::throw_error(::epmoe::ErrorKind::backend, #call,                        \
                                   ::epmoe::nccl::nccl_error_text(epmoe_nccl_res_), __FILE__, \
                                   __LINE__);                                                 \
    }                                                                                         \
  } while (0)
