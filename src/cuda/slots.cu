// Activation-slot kernels: the planners run the shared rule of core/slot_plan.h on one thread
// (a few dozen integer operations; the same code as the CPU reference, so every rank and both
// backends decide alike). The copies read the offset and the predicate from the layer plan in
// device memory, so the host launches them whatever the planner decided (CUDA-graph safe).
#include "cuda/slots.h"

#include "core/fp8_terms.h"
#include "core/slot_plan.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"
#include "cuda/placed.h"

namespace epmoe::cuda {

namespace {

__global__ void plan_forward_kernel(SlotGeometry g, const int32_t* header,
                                    const int32_t* recv_rows_R, int self, int slot,
                                    SlotState* state, int64_t* saved_R, LayerPlan* plan) {
  plan_forward_layer(g, recv_rows_R, layout_skip(header), self, slot, *state, saved_R, *plan);
}

__global__ void plan_backward_kernel(SlotGeometry g, const int32_t* recv_rows_R,
                                     const LayerPlan* plan, SlotState* state, int64_t* saved_R) {
  plan_backward_layer(g, recv_rows_R, *plan, *state, saved_R);
}

// Input-only layers: x [live, D] into the slot at x_offset, as 16-byte vectors.
__global__ void save_kernel(const LayerPlan* plan, const int32_t* header, char* arena,
                            const bf16_t* x_TD, int64_t D) {
  if (plan->replay_skip != 0) return;
  bf16_t* saved_TD = reinterpret_cast<bf16_t*>(arena + plan->x_offset);  // [T, D] in the slot
  const int64_t vectors = header[kLayoutLive] * D / kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<uint4*>(saved_TD)[i] = reinterpret_cast<const uint4*>(x_TD)[i];
  }
}

cudaStream_t stream_of(const Step& s) { return static_cast<cudaStream_t>(s.stream); }

// The saved x back into this rank's dispatch buffer (its address read from the peer table), and
// the dispatch arrival counters back to zero: route zeroed them for this layer's forward, but the
// replayed dispatch counts again (and later layers' calls reused them), so an arrival-gated
// replayed W13 would otherwise see stale full counts and read rows before they land.
__global__ void restore_kernel(const LayerPlan* plan, const int32_t* header, char* arena,
                               bf16_t* const* dispatch_R, int rank, int64_t D,
                               uint32_t* arrivals_B, int64_t arrival_count, int copy_rows) {
  if (plan->replay_skip != 0) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < arrival_count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    arrivals_B[i] = 0u;
  }
  if (copy_rows == 0) return;
  const bf16_t* saved_TD = reinterpret_cast<const bf16_t*>(arena + plan->x_offset);  // [T, D]
  bf16_t* own_TD = dispatch_R[rank];                                                 // [T, D]
  const int64_t vectors = header[kLayoutLive] * D / kVec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    reinterpret_cast<uint4*>(own_TD)[i] = reinterpret_cast<const uint4*>(saved_TD)[i];
  }
}

}  // namespace

void plan_forward(const Step& s) {
  plan_forward_kernel<<<1, 1, 0, stream_of(s)>>>(s.slot_geometry, s.layout.header,
                                                 s.layout.recv_rows_R, s.rank, s.slot,
                                                 s.slot_state, s.slot_saved_R, s.layer_plan);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void plan_backward(const Step& s) {
  plan_backward_kernel<<<1, 1, 0, stream_of(s)>>>(s.slot_geometry, s.layout.recv_rows_R,
                                                  s.layer_plan, s.slot_state, s.slot_saved_R);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void save_input(const Step& s) {
  check_aligned16(s.arena, "arena");
  check_aligned16(s.x_TD, "x_TD");
  const int64_t items = s.dims.T * s.dims.D / kVec;
  save_kernel<<<grid_for(items, kThreads), kThreads, 0, stream_of(s)>>>(
      s.layer_plan, s.layout.header, s.arena, s.x_TD, s.dims.D);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void restore_input(const Step& s) {
  check_aligned16(s.arena, "arena");
  const int64_t items = s.dims.T * s.dims.D / kVec;
  restore_kernel<<<grid_for(items, kThreads), kThreads, 0, stream_of(s)>>>(
      s.layer_plan, s.layout.header, s.arena, s.dispatch_R, s.rank, s.dims.D,
      s.route_scratch != nullptr ? arrivals_B(s) : nullptr,
      s.route_scratch != nullptr ? arrival_blocks(s.capacity_rows) : 0, s.fp8 ? 0 : 1);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  if (!s.fp8) return;
  // FP8: the dispatch buffer holds E4M3 rows + scales, so the saved bf16 x is quantized again
  // (the forward's publish step on the same rows: the same bits), straight from the slot.
  EPMOE_CHECK_ARG(s.dispatch_local != nullptr, "Step.dispatch_local", "this rank's dispatch buffer",
                  "nullptr");
  const Fp8DispatchLayout l = fp8_dispatch_layout(s.dims.T, s.dims.D);
  fp8_quantize_rows_counted_at(
      reinterpret_cast<const bf16_t*>(s.arena), plan_field<int64_t>(s, offsetof(LayerPlan, x_offset)),
      s.dims.T, s.dims.D, s.layout.header + kLayoutLive,
      plan_field<int32_t>(s, offsetof(LayerPlan, replay_skip)),
      reinterpret_cast<uint8_t*>(s.dispatch_local + l.codes),
      reinterpret_cast<float*>(s.dispatch_local + l.scales), 0, s.stream);
}

}  // namespace epmoe::cuda
