/* epmoe C ABI for EP over several GPUs through the NCCL transport (include/epmoe/nccl.h): one
 * process (or host thread) per GPU. Implemented in libepmoe_nccl, so that libepmoe loads without
 * libnccl; contexts made here are used and destroyed with the functions of epmoe/c_api.h.
 * Same convention: 0 on success, or non-zero with the message in epmoe_last_error().
 *
 *   rank 0:      epmoe_nccl_unique_id(id, EPMOE_NCCL_UNIQUE_ID_BYTES);  then send the bytes
 *   every rank:  epmoe_context_create_nccl(&config, id, EPMOE_NCCL_UNIQUE_ID_BYTES, rank, R,
 *                                          device, &ctx);                 (collective) */
#ifndef EPMOE_C_API_NCCL_H
#define EPMOE_C_API_NCCL_H

#include <stddef.h>

#include "epmoe/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPMOE_NCCL_UNIQUE_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

/* A fresh NCCL unique id into out[0, EPMOE_NCCL_UNIQUE_ID_BYTES); len must be at least that. */
int epmoe_nccl_unique_id(void* out, size_t len);

/* Collective over `size` ranks, each with the same id and config, its own rank, and the CUDA
 * device it computes on (one device per rank). Tensors passed to the context live on that device.
 * The NCCL transport's peer access is chosen automatically (nccl.h: PeerAccess::automatic). */
int epmoe_context_create_nccl(const epmoe_config* config, const void* id, size_t id_len, int rank,
                              int size, int device, epmoe_context** out);

/* How the context's ranks reach each other ("nccl-lsa" or "cuda-ipc (<reason>)") into buf
 * (truncated to len - 1); empty for a context that was not made here. */
int epmoe_nccl_peer_access(const epmoe_context* ctx, char* buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* EPMOE_C_API_NCCL_H */
