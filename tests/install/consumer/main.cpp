// Uses the installed epmoe: plan the memory of one layer and print every term.
#include <cstdio>

#include "epmoe/config.h"
#include "epmoe/memory_plan.h"

int main() {
  epmoe::ConfigFields f;
  f.max_tokens_per_rank = 64;
  f.hidden_dim = 128;
  f.intermediate_dim = 96;
  f.top_k = 2;
  f.num_experts = 8;
  const epmoe::Config config(f);
  const epmoe::MemoryPlan plan = epmoe::plan_memory(config, 2);
  std::printf("%s\n", plan.explain().c_str());
  return plan.total_bytes > 0 ? 0 : 1;
}
