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
  int32_t combine;             /* 0: per_route (default); 1: per_rank (one row per token and rank) */
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
} epmoe_backward_args;

const char* epmoe_last_error(void);
int epmoe_cuda_device_count(void);

/* EP = 1 on cuda:device. */
int epmoe_context_create_single_gpu(const epmoe_config* config, int device, epmoe_context** out);
void epmoe_context_destroy(epmoe_context* ctx);

int epmoe_forward(epmoe_context* ctx, const epmoe_forward_args* args, epmoe_saved* saved);
int epmoe_backward(epmoe_context* ctx, const epmoe_backward_args* args);
/* Synchronises, reads and clears the status word; non-zero with the error when one was set. */
int epmoe_check(epmoe_context* ctx);

/* Stage timing (serialises stages); times of the last forward then backward. */
int epmoe_set_stage_timing(epmoe_context* ctx, int on);
int epmoe_stage_times(epmoe_context* ctx, const char** names, double* ms, int capacity, int* count);

/* plan_memory(config, ep_size).explain() into buf (truncated to len - 1). */
int epmoe_explain_plan(const epmoe_config* config, int ep_size, char* buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* EPMOE_C_API_H */
