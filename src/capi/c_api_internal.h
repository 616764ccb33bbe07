// The C ABI's handle and exception boundary, shared by its translation units in libepmoe
// (c_api.cpp) and libepmoe_nccl (cuda/comm/c_api_nccl.cpp). The per-thread message behind
// epmoe_last_error() lives in libepmoe, so errors of either library read the same way.
#pragma once

#include <exception>
#include <memory>
#include <string>

#include "epmoe/c_api.h"
#include "epmoe/config.h"
#include "epmoe/context.h"
#include "epmoe/tensor.h"

struct epmoe_context {
  std::unique_ptr<epmoe::Context> ctx;
  epmoe::Device device;
  std::string peer_access;  // NCCL contexts: epmoe::nccl_peer_access() of their transport
};

namespace epmoe::capi {

// Sets the calling thread's epmoe_last_error() message ("" clears it).
void set_last_error(std::string message);

Config to_config(const epmoe_config& c);

// Runs fn; 0 on success (the message cleared), 1 with the exception's message kept.
template <class Fn>
int guarded(Fn&& fn) {
  try {
    fn();
    set_last_error({});
    return 0;
  } catch (const std::exception& e) {
    set_last_error(e.what());
  } catch (...) {
    set_last_error("epmoe: unknown exception");
  }
  return 1;
}

}  // namespace epmoe::capi
