// CPU reference of the activation-slot stages: the forward and backward planners (the rule of
// core/slot_plan.h, called directly) and the input copies of recompute layers (the restore also
// zeroes the dispatch arrival counters for the replayed dispatch, as the CUDA twin does).
#include <algorithm>
#include <cstring>

#include "cpu/cpu_backend.h"

namespace epmoe::cpu {

void CpuBackend::plan_forward(const Step& s) {
  plan_forward_layer(s.slot_geometry, s.layout.recv_rows_R, s.layout.header[kLayoutSkip] != 0,
                     s.rank, s.slot, *s.slot_state, s.slot_saved_R, *s.layer_plan);
}

void CpuBackend::save_input(const Step& s) {
  const LayerPlan& p = *s.layer_plan;
  if (p.replay_skip != 0) return;  // saved everything, or a skipped step (nothing to replay)
  const int64_t live = s.layout.header[kLayoutLive];
  std::memcpy(s.arena + p.x_offset, s.x_TD, static_cast<size_t>(live * s.dims.D) * 2);
}

void CpuBackend::plan_backward(const Step& s) {
  plan_backward_layer(s.slot_geometry, s.layout.recv_rows_R, *s.layer_plan, *s.slot_state,
                      s.slot_saved_R);
}

void CpuBackend::restore_input(const Step& s) {
  const LayerPlan& p = *s.layer_plan;
  if (p.replay_skip != 0) return;
  // The replayed dispatch counts its rows again: the counters restart from zero (as after route).
  if (s.route_scratch != nullptr) std::fill_n(arrivals_B(s), arrival_blocks(s.capacity_rows), 0u);
  const int64_t live = s.layout.header[kLayoutLive];
  const bf16_t* x_TD = reinterpret_cast<const bf16_t*>(s.arena + p.x_offset);
  if (s.fp8) {
    fp8_publish_rows(s, x_TD, live);  // the forward's quantization again: the same bits
    return;
  }
  std::memcpy(s.dispatch_R[s.rank], x_TD, static_cast<size_t>(live * s.dims.D) * 2);
}

}  // namespace epmoe::cpu
