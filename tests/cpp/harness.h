// Test harness: run a function on R thread ranks that share one ThreadTransportGroup. An exception
// on any rank is re-thrown on the calling thread after every rank has finished.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "epmoe/transport.h"

namespace epmoe::test {

inline void run_on_ranks(int R, const std::function<void(int rank, std::shared_ptr<Transport>)>& fn) {
  ThreadTransportGroup group(R);
  std::vector<std::exception_ptr> errors(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, group.transport(r));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace epmoe::test
