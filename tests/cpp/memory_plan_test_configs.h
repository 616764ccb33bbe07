// Shared by the memory-plan tests: the configurations they plan and the checks they repeat.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "epmoe/config.h"
#include "epmoe/error.h"
#include "epmoe/memory_plan.h"

namespace epmoe::plan_test {

inline ConfigFields fields(int64_t T, int64_t D, int64_t F, int experts, int K) {
  ConfigFields f;
  f.max_tokens_per_rank = T;
  f.hidden_dim = D;
  f.intermediate_dim = F;
  f.num_experts = experts;
  f.top_k = K;
  return f;
}

inline ConfigFields ci_tiny() { return fields(64, 128, 96, 8, 2); }

// T=4, D=F=128, K=2, 4 global experts; planned at R=2 (E=2), L=2 layers per slot.
inline ConfigFields small() {
  ConfigFields f = fields(4, 128, 128, 4, 2);
  f.slots.max_layers_per_slot = 2;
  return f;
}

inline void expect_plan_error(const ConfigFields& f, int R, const std::string& field,
                       const std::string& got) {
  try {
    (void)plan_memory(Config(f), R);
    ADD_FAILURE() << "no error for " << field;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    EXPECT_EQ(e.argument(), field) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("expected "), std::string::npos) << what;
    EXPECT_NE(what.find(", got " + got), std::string::npos) << what;
  }
}

inline void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' missing in:\n" << text;
}

}  // namespace epmoe::plan_test
