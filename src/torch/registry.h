// Contexts live in a process-wide registry keyed by an int64 id (what the ops take): an op schema
// cannot hold a C++ object, and an id is a constant that tracing and CUDA graphs keep as is.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "epmoe/context.h"
#include "epmoe/layered.h"
#include "epmoe/transport.h"

namespace epmoe::torch_binding {

struct Entry {
  std::shared_ptr<ThreadTransportGroup> group;  // "local" contexts own their one-rank group
  std::shared_ptr<Transport> transport;
  std::unique_ptr<Context> context;
  std::unique_ptr<Layered> layered;             // created by the first layered call
  std::vector<std::vector<SavedLayer>> saved;   // per slot: forwards awaiting their backward
  std::mutex mu;                                // one call at a time per context
  Layered& layered_api();                       // creates it on first use (collective)
};

// Parses "key=value;..." as written by python/epmoe/config.py. Unknown keys are errors.
Config parse_config(const std::string& text);

int64_t register_context(std::unique_ptr<Entry> entry);
// Throws Error(invalid_argument) naming "context" when the id is unknown or closed.
std::shared_ptr<Entry> find_context(int64_t id);
// Removes and returns the entry (nullptr when unknown: close is idempotent).
std::shared_ptr<Entry> take_context(int64_t id);

}  // namespace epmoe::torch_binding
