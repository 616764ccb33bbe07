// epmoe errors: one exception type that names the argument, the expected and the actual value,
// and where it was raised. Library code never exits; it throws epmoe::Error.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace epmoe {

enum class ErrorKind : int {
  invalid_argument,   // host-checkable argument error (dtype, shape, stride, config field)
  capacity_overflow,  // more received rows than the planned capacity
  invalid_routing,    // expert id out of range, token-count mismatch across ranks
  non_finite_input,   // NaN/Inf in an input that is checked
  slot_overflow,      // saved activations do not fit the activation slot
  timeout,            // a cross-rank wait ran past its budget
  backend,            // CUDA / NCCL / OS call failed
  internal,           // broken invariant inside epmoe
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string argument, std::string message, const char* file, int line);

  ErrorKind kind() const { return kind_; }
  // Name of the argument, config field or resource the error is about ("x_TD", "Config.top_k").
  const std::string& argument() const { return argument_; }

 private:
  ErrorKind kind_;
  std::string argument_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
[[noreturn]] void throw_error(ErrorKind kind, const std::string& argument, const std::string& message,
                              const char* file, int line);
}  // namespace detail

}  // namespace epmoe

// Throws Error(kind, argument, "expected <expected>, got <actual>") when cond is false.
#define EPMOE_EXPECT(cond, kind, argument, expected, actual)                                       \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      ::epmoe::detail::throw_error(::epmoe::ErrorKind::kind, (argument),                           \
                                   ::epmoe::detail::concat("expected ", expected, ", got ", actual), \
                                   __FILE__, __LINE__);                                            \
    }                                                                                              \
  } while (0)

#define EPMOE_CHECK_ARG(cond, argument, expected, actual) \
  EPMOE_EXPECT(cond, invalid_argument, argument, expected, actual)

// Internal invariant; names the failed expression.
#define EPMOE_ASSERT(cond)                                                                        \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      ::epmoe::detail::throw_error(::epmoe::ErrorKind::internal, "invariant",                     \
                                   "failed: " #cond, __FILE__, __LINE__);                         \
    }                                                                                             \
  } while (0)
