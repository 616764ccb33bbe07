// C ABI of the NCCL transport (include/epmoe/c_api_nccl.h): the unique id as bytes, and a
// context over an NCCL transport in the handle of epmoe/c_api.h.
#include "epmoe/c_api_nccl.h"

#include <cstring>
#include <memory>
#include <string>

#include "capi/c_api_internal.h"
#include "epmoe/error.h"
#include "epmoe/nccl.h"

static_assert(EPMOE_NCCL_UNIQUE_ID_BYTES == epmoe::kNcclUniqueIdBytes,
              "EPMOE_NCCL_UNIQUE_ID_BYTES must match epmoe::kNcclUniqueIdBytes");

extern "C" {

int epmoe_nccl_unique_id(void* out, size_t len) {
  return epmoe::capi::guarded([&] {
    EPMOE_CHECK_ARG(out != nullptr, "out", "a buffer", "nullptr");
    EPMOE_CHECK_ARG(len >= epmoe::kNcclUniqueIdBytes, "len",
                    ">= " + std::to_string(epmoe::kNcclUniqueIdBytes) + " bytes",
                    std::to_string(len) + " bytes");
    const epmoe::NcclUniqueId id = epmoe::nccl_unique_id();
    std::memcpy(out, id.data(), id.size());
  });
}

int epmoe_context_create_nccl(const epmoe_config* config, const void* id, size_t id_len, int rank,
                              int size, int device, epmoe_context** out) {
  return epmoe::capi::guarded([&] {
    EPMOE_CHECK_ARG(config != nullptr, "config", "an epmoe_config", "nullptr");
    EPMOE_CHECK_ARG(out != nullptr, "out", "a place for the context", "nullptr");
    const epmoe::Config cfg = epmoe::capi::to_config(*config);  // checks the fields first
    std::shared_ptr<epmoe::Transport> transport =
        epmoe::make_nccl_transport(id, id_len, rank, size, device);
    auto h = std::make_unique<epmoe_context>();
    h->peer_access = epmoe::nccl_peer_access(*transport);
    h->ctx = epmoe::Context::create(cfg, std::move(transport));
    h->device = epmoe::Device::cuda(device);
    *out = h.release();
  });
}

int epmoe_nccl_peer_access(const epmoe_context* ctx, char* buf, size_t len) {
  return epmoe::capi::guarded([&] {
    EPMOE_CHECK_ARG(ctx != nullptr, "ctx", "a context", "nullptr");
    EPMOE_CHECK_ARG(buf != nullptr && len > 0, "buf", "a buffer of at least 1 byte",
                    buf == nullptr ? std::string("nullptr") : std::to_string(len) + " bytes");
    const std::string& s = ctx->peer_access;
    const size_t n = s.size() < len - 1 ? s.size() : len - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  });
}

}  // extern "C"
