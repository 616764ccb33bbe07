/* epmoe C ABI: a thin, stable layer over the C++ API for foreign-function bindings (Python
 * ctypes in bench/, other languages). Tensors are raw pointers with the shapes of DESIGN.md §1;
 * on a CUDA context they are device pointers and `stream` is a cudaStream_t. Every function
 * returns 0 on success, or non-zero with the message in epmoe_last_error() (per thread).
 * EP over several GPUs (NCCL transport): epmoe/c_api_nccl.h, in libepmoe_nccl. */
#ifndef EPMOE_C_API_H
#define EPMOE_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epmoe_context epmoe_context;

typedef struct {
  int64_t max_tokens_per_rank; /* T */
  int64_t hidden_dim;          /* D */
  int64_t intermediate_dim;    /* F */
  int32_t top_k;               /* K */
  int32_t num_experts;         /* global experts */
  int32_t activation;          /* 0 swiglu, 1 swiglu_clamped */
  float alpha, limit;          /* clamped SwiGLU */
  double capacity_factor;
  int32_t num_slots, layers_per_slot;
  int32_t fuse_epilogues;      /* 1: fused epilogues (default); 0: unfused chain */
  int32_t check_inputs;
  int32_t wgrad_f32;           /* 1: f32 weight gradients; 0: bf16 */
  int32_t barrier_timeout_ms;
  int32_t arrival_gated_w13;   /* 1: W13 waits on dispatch arrivals, overlapped; 0: staged (default) */
  int64_t scratch_device_bytes; /* most scratch bytes in device memory, the rest pinned host memory
                                   in the same range; -1: all device (default) */
  /* Activation slot budget (Config.slots; docs/memory.md), at most one of the two set:
   * slot_capacity_factor f >= 0: minimum + f * (balanced full save - minimum); < 0: unset.
   * slot_bytes >= 0: exact bytes per slot (rounded up to the packing granule); < 0: unset.
   * Neither set (the default): the maximum useful size, no layer ever recomputes. */
  double slot_capacity_factor;
  int64_t slot_bytes;
  int32_t precision;           /* 0 bf16 (default), 1 fp8_block (E4M3, 1x128 / 128x128 fp32 scales),
                                  2 mxfp8 (E4M3 + E8M0 per 1x32 weights and activations;
                                  inference = 1, prepared_weights = 1),
                                  3 nvfp4 (weight-only inference: inference = 1, prepared_weights = 1) */
  int32_t inference;           /* 1: forward only, no activation slots; 0: training (default) */
  int32_t prepared_weights;    /* fp8_block: 1: forward takes prepared weights (below); 0: the bf16
                                  weights are quantized on every call (default). nvfp4 and
                                  mxfp8: must be 1 */
  int32_t combine;             /* 0: per_route (default); 1: per_rank (one row per token and rank) */
  int32_t fp8_wgrad;           /* precision fp8_block training: 0 fp8 (FP8 WGRADs on column-quantized
                                  operands), 1 bf16 (bf16 WGRADs, x decoded from its E4M3 rows),
                                  2 by_shape (the default: the planner picks 0 or 1 from the shape,
                                  see epmoe_resolved_fp8_wgrad); other precisions: 2 */
} epmoe_config;

/* Defaults of the C++ Config for the four required fields. */
epmoe_config epmoe_config_default(int64_t T, int64_t D, int64_t F, int32_t K, int32_t num_experts);

typedef struct {
  const void* x_TD; int64_t tokens; const int32_t* num_tokens_1;  /* nullable */
  const void* topk_ids_TK; int32_t ids_int64;
  const void* topk_scores_TK; int32_t scores_bf16;
  const void* w13_EFD; const void* w2_EDF;
  void* y_TD;
  int32_t save_for_backward; int32_t slot;
  void* stream;
  /* Config.prepared_weights: fp8_block_fp32 weights from epmoe_prepare_weights_fp8 (E4M3 codes
     [E, N, L] and f32 scales [E, ceil(N/128), ceil(L/128)]; w13: N = 2F, L = D; w2: N = D, L = F). */
  const void* w13_q; const float* w13_scales; const void* w2_q; const float* w2_scales;
  /* precision nvfp4: weights from epmoe_prepare_weights_nvfp4: packed E2M1 codes [E, N, L/2] in
     w13_q / w2_q (w13_scales / w2_scales unused), E4M3 block scales [E, ceil(L/128), N, 8] and fp32
     global scales [E] here (codes and scales in the GEMM's order, prepared_weights.h). precision mxfp8: weights from epmoe_prepare_weights_mxfp8: E4M3 codes
     [E, N, L] in w13_q / w2_q, E8M0 scales [E, N, L/32] in w13_block_scales / w2_block_scales
     (the global scales unused). */
  const void* w13_block_scales; const float* w13_global; const void* w2_block_scales;
  const float* w2_global;
} epmoe_forward_args;

typedef struct {
  int32_t slot, layer; int64_t step, tokens;
} epmoe_saved;

typedef struct {
  epmoe_saved saved;
  const void* grad_y_TD; const int32_t* num_tokens_1;
  const void* topk_ids_TK; int32_t ids_int64;
  const void* topk_scores_TK; int32_t scores_bf16;
  const void* w13_EFD; const void* w2_EDF;
  void* grad_x_TD; float* grad_scores_TK; void* grad_w13_EFD; void* grad_w2_EDF;
  int32_t accumulate_wgrad;
  void* stream;
  /* Config.prepared_weights: the forward's prepared weights (as in epmoe_forward_args). */
  const void* w13_q; const float* w13_scales; const void* w2_q; const float* w2_scales;
  /* Config.prepared_weights (required): their transposed copies from epmoe_prepare_weights_fp8
     (codes [E, L, N], f32 scales [E, ceil(L/128), ceil(N/128)]), which the DGRADs read. */
  const void* w13_qt; const float* w13_scales_t; const void* w2_qt; const float* w2_scales_t;
} epmoe_backward_args;

const char* epmoe_last_error(void);
int epmoe_cuda_device_count(void);

/* EP = 1 on cuda:device. */
int epmoe_context_create_single_gpu(const epmoe_config* config, int device, epmoe_context** out);
/* EP = 1 on the CPU backend (host pointers; `stream` is ignored). Every build has it. */
int epmoe_context_create_cpu(const epmoe_config* config, epmoe_context** out);
void epmoe_context_destroy(epmoe_context* ctx);

int epmoe_forward(epmoe_context* ctx, const epmoe_forward_args* args, epmoe_saved* saved);
int epmoe_backward(epmoe_context* ctx, const epmoe_backward_args* args);
/* Synchronises, reads and clears the status word; non-zero with the error when one was set. */
int epmoe_check(epmoe_context* ctx);

/* Stage timing (serialises stages); times of the last forward then backward. */
int epmoe_set_stage_timing(epmoe_context* ctx, int on);
int epmoe_stage_times(epmoe_context* ctx, const char** names, double* ms, int capacity, int* count);

/* prepare_weights for fp8_block_fp32 on cuda:device: bf16 w_GNL [G, N, L] -> E4M3 q_GNL and f32
   scales_GBS [G, ceil(N/128), ceil(L/128)], and, when qt_GLN is not NULL, their transposed copy
   qt_GLN [G, L, N] and scales_t_GSB [G, ceil(L/128), ceil(N/128)] (what a backward reads),
   enqueued on stream (graph-capturable). */
int epmoe_prepare_weights_fp8(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNL,
                              float* scales_GBS, void* qt_GLN, float* scales_t_GSB, int device,
                              void* stream);

/* prepare_weights for nvfp4 on cuda:device: bf16 w_GNL [G, N, L] -> packed E2M1 q_GNP
   [G, N, ceil(L/2)], E4M3 block scales scales_GCN8 [G, ceil(L/128), N, 8] (both in the GEMM's
   order: epmoe/prepared_weights.h) and one fp32 global scale per group global_G [G], enqueued on
   stream (graph-capturable). */
int epmoe_prepare_weights_nvfp4(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNP,
                                void* scales_GCN8, float* global_G, int device, void* stream);

/* prepare_weights for mxfp8 on cuda:device: bf16 w_GNL [G, N, L] -> E4M3 q_GNL [G, N, L] and E8M0
   scales_GNS [G, N, ceil(L/32)], enqueued on stream (graph-capturable). */
int epmoe_prepare_weights_mxfp8(const void* w_GNL, int64_t G, int64_t N, int64_t L, void* q_GNL,
                                void* scales_GNS, int device, void* stream);

/* plan_memory(config, ep_size).explain() into buf (truncated to len - 1). */
int epmoe_explain_plan(const epmoe_config* config, int ep_size, char* buf, size_t len);

/* explain_cuda_kernels(config, ep_size) into buf (truncated to len - 1): the kernel each grouped
   GEMM runs on the CUDA backend and the rule that chose it (host only, no GPU needed). A build
   without the CUDA backend returns the backend error. */
int epmoe_explain_kernels(const epmoe_config* config, int ep_size, char* buf, size_t len);

/* The planner's resolution of config->fp8_wgrad at ep_size (MemoryPlan::fp8_wgrad): *out = 0 fp8
   or 1 bf16, never 2. by_shape (2) with fp8_block training: 0 iff the balanced rows per local
   expert T*K*ep_size/num_experts >= 512 and D*F/(D+F) >= 1024; other precisions and inference: 0
   (unused). 0 fp8 / 1 bf16 pass through. epmoe_explain_plan prints the reason. */
int epmoe_resolved_fp8_wgrad(const epmoe_config* config, int ep_size, int32_t* out);

/* Slot terms of plan_memory(config, ep_size) (MemoryPlan fields of the same names). */
typedef struct {
  int64_t minimum_slot_bytes;            /* every layer recomputes */
  int64_t balanced_full_save_slot_bytes; /* balanced routing never recomputes */
  int64_t maximum_useful_slot_bytes;     /* no routing ever recomputes */
  int64_t slot_bytes;                    /* chosen by the budget fields of the config */
  int64_t activation_bytes;              /* num_slots * slot_bytes */
  int64_t scratch_bytes;
  int64_t arena_bytes;                   /* activation + scratch */
  int64_t total_bytes;                   /* arena + symmetric + status + peer tables + planner */
  int64_t device_total_bytes;            /* total less the host-backed part of the scratch */
} epmoe_slot_plan;
int epmoe_plan_slots(const epmoe_config* config, int ep_size, epmoe_slot_plan* out);

/* Memory a context holds for its lifetime (Context::arena_memory; planned = held except for a
 * host-backed arena, whose parts are rounded up to the VMM granule). */
typedef struct {
  int64_t device_bytes, host_bytes;            /* planned arena split */
  int64_t device_held_bytes, host_held_bytes;  /* physical bytes held by the arena */
  int64_t other_device_bytes;  /* outside the arena: symmetric buffers, status word, peer tables,
                                  planner state (MemoryPlan::total_bytes - arena_bytes) */
} epmoe_context_memory;
int epmoe_context_memory_held(const epmoe_context* ctx, epmoe_context_memory* out);

/* The planner's decision for a saved layer: *recompute = 1 when its forward saved only its input
 * and its backward replays the forward (Context::recomputes; synchronises). Readable after the
 * backward too, until a later forward reuses the layer's place in the slot. */
int epmoe_recomputes(epmoe_context* ctx, const epmoe_saved* saved, int32_t* recompute);
/* High-water mark of the slot's packed bytes since the context was created (synchronises). */
int epmoe_slot_peak_bytes(epmoe_context* ctx, int slot, int64_t* bytes);

#ifdef __cplusplus
}
#endif

#endif /* EPMOE_C_API_H */
