// Where a kernel finds a layer's saved buffers (x_gathered, h13; h3 below). With a layer plan they sit
// at arena + the byte offset the planner kernel wrote into the plan, in device memory: the host
// never knows it, so the kernel reads it (once per thread or CTA) and the host launches the same
// kernels whatever the planner decided (CUDA-graph safe). Without a plan (inference, stage tests)
// they are the Step's plain pointers. No CUDA types: launchers and kernels share it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/hd.h"
#include "core/step.h"

namespace epmoe::cuda {

struct Placed {
  char* base = nullptr;
  const int64_t* offset = nullptr;  // bytes from base, device memory; nullptr: base itself

  // A negative offset: the buffer does not exist for the planner's decision (h3 of a layer that
  // recomputes) -> nullptr.
  template <class T>
  EPMOE_HD T* get() const {
    if (offset == nullptr) return reinterpret_cast<T*>(base);
    const int64_t bytes = *offset;
    return bytes < 0 ? nullptr : reinterpret_cast<T*>(base + bytes);
  }
};

inline Placed plain(const void* ptr) {
  return Placed{const_cast<char*>(static_cast<const char*>(ptr)), nullptr};
}

// Address of a field of the step's layer plan (device memory; never dereferenced on the host).
template <class T>
const T* plan_field(const Step& s, std::size_t field_offset) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(s.layer_plan) + field_offset);
}

inline Placed placed_x_gathered(const Step& s) {
  if (s.layer_plan == nullptr) return plain(s.x_gathered_MD);
  return Placed{s.arena, plan_field<int64_t>(s, offsetof(LayerPlan, x_gathered_offset))};
}
inline Placed placed_h13(const Step& s) {
  if (s.layer_plan == nullptr) return plain(s.h13_M2F);
  return Placed{s.arena, plan_field<int64_t>(s, offsetof(LayerPlan, h13_offset))};
}
// nullptr (as get() gives it) when the layer keeps no copy, which is always the case with a layer
// plan (no layer saves W2 outputs: docs/memory.md); readers take the combine buffer.
inline Placed placed_h3(const Step& s) {
  if (s.layer_plan == nullptr) return plain(s.h3_TKD);
  return Placed{s.arena, plan_field<int64_t>(s, offsetof(LayerPlan, h3_offset))};
}

// Per-rank combine: the W2 rows [capacity, D] (h3) the send reads, the call scratch's rows_MD (the
// plan's h3 offset, never -1), or Step::h3_MD without a plan.
inline Placed placed_h3_rows(const Step& s) {
  if (s.layer_plan == nullptr) return plain(s.h3_MD);
  return Placed{s.arena, plan_field<int64_t>(s, offsetof(LayerPlan, h3_offset))};
}

// The replayed stages of backward (Step::replay) skip unless the plan says the layer replays:
// the plan's replay_skip in device memory; nullptr outside the replay (never skip for it).
inline const int32_t* replay_skip_flag(const Step& s) {
  return s.replay ? plan_field<int32_t>(s, offsetof(LayerPlan, replay_skip)) : nullptr;
}
EPMOE_HD bool replay_skipped(const int32_t* flag) { return flag != nullptr && *flag != 0; }

}  // namespace epmoe::cuda
