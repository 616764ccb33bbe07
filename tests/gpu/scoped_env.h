// An environment variable set for a scope and restored (or unset) after it: for the switches the
// launchers read on every launch (EPMOE_NVFP4_SPLITK, EPMOE_GEMM_SCHEDULE, ...); value nullptr
// unsets it for the scope.
#pragma once

#include <cstdlib>
#include <string>

namespace epmoe::test {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_.c_str(), old_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

}  // namespace epmoe::test
