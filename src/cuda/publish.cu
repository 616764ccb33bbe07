// publish: the first stage of a call. Writes what peers read after the publish barrier and
// (forward) checks this rank's inputs, as the CPU reference does:
//   live count outside [0, T'] (always checked; the count is then clamped), then with
//   check_inputs: ids outside [-1, E*R) (published as -1), non-finite x in live rows, non-finite
//   scores of active routes in live rows. The recorded error is the one with the smallest key
//   (check order above, then flat index), kept through an atomicMax on the key's complement so
//   that it does not depend on thread timing. The key word lives in the routing header's reserved
//   area, is zero between calls (the buffer is allocated zero-filled) and is consumed and cleared
//   by the header kernel.
#include "cuda/publish.h"

#include <cstddef>

#include "core/fp8_terms.h"
#include "cuda/formats/formats.h"
#include "cuda/kernel_common.cuh"

namespace epmoe::cuda {
namespace {

// RoutingHeader::reserved[kCheckKeyWord .. +1]: the 64-bit check key accumulator.
constexpr int kCheckKeyWord = 16;
static_assert((offsetof(RoutingHeader, reserved) + kCheckKeyWord * sizeof(int32_t)) % 8 == 0,
              "check key must be 8-byte aligned");
static_assert(kCheckKeyWord + 2 <= static_cast<int>(sizeof(RoutingHeader::reserved) / sizeof(int32_t)),
              "check key must fit the reserved words");

// Order of the input checks (smaller wins; the CPU reference checks in this order).
enum CheckArg : unsigned long long { kArgLive = 0, kArgIds = 1, kArgRows = 2, kArgScores = 3 };
constexpr int kKeyArgShift = 56;
constexpr unsigned long long kKeyIndexMask = (1ull << kKeyArgShift) - 1;

struct PublishParams {
  const bf16_t* rows_TD;         // [T', D] bf16: x (forward) or grad_y (backward)
  const int32_t* num_tokens_1;   // [1] i32, nullable (all T' rows live)
  const void* ids_TK;            // [T', K] i32 or i64
  const void* scores_TK;         // [T', K] f32 or bf16
  char* const* routing_R;        // [R] routing buffers: RoutingHeader | ids [T, K] i32 | scores [T, K] f32
  bf16_t* const* dispatch_R;     // [R] dispatch buffers [T, D] bf16
  const int32_t* saved_header;   // backward: the forward's layout header (skip flag, live rows);
                                 // forward: null
  int64_t T;                     // Config T: rows of the published ids / scores
  int64_t tokens;                // T'
  int64_t D;
  int64_t ids_offset, scores_offset;  // bytes into a routing buffer
  int64_t sequence;
  int K, experts_global, rank;
  int ids_i64, scores_bf16, check_inputs;
  int store_rows;  // 0: the rows are only checked (FP8: quantized into the dispatch buffer after)
};

__device__ __forceinline__ unsigned long long* check_key_word(char* routing_buffer) {
  auto* h = reinterpret_cast<RoutingHeader*>(routing_buffer);
  return reinterpret_cast<unsigned long long*>(&h->reserved[kCheckKeyWord]);
}

__device__ __forceinline__ void record_error(unsigned long long* key_word, CheckArg arg, int64_t index) {
  const unsigned long long key = (static_cast<unsigned long long>(arg) << kKeyArgShift) |
                                 (static_cast<unsigned long long>(index) & kKeyIndexMask);
  atomicMax(key_word, ~key);  // smallest key == largest complement; 0 = no error
}

// Forward: the caller's count; backward: the forward's (saved in the layout).
__device__ __forceinline__ int64_t raw_live(const PublishParams& p) {
  if (p.saved_header != nullptr) return p.saved_header[kLayoutLive];
  return p.num_tokens_1 != nullptr ? static_cast<int64_t>(p.num_tokens_1[0]) : p.tokens;
}
__device__ __forceinline__ int64_t clamp_live(int64_t live, int64_t tokens) {
  return live < 0 ? 0 : (live > tokens ? tokens : live);
}
__device__ __forceinline__ int64_t read_id(const PublishParams& p, int64_t i) {
  return p.ids_i64 ? static_cast<const int64_t*>(p.ids_TK)[i]
                   : static_cast<int64_t>(static_cast<const int32_t*>(p.ids_TK)[i]);
}

// Grid-stride over T*K route entries, then T'*(D/8) row vectors.
__global__ void __launch_bounds__(kThreads) publish_kernel(const PublishParams p) {
  if (p.saved_header != nullptr && layout_skip(p.saved_header)) return;
  char* buf = p.routing_R[p.rank];                                         // own routing buffer
  unsigned long long* key_word = check_key_word(buf);                      // [1] u64
  int32_t* ids_out_TK = reinterpret_cast<int32_t*>(buf + p.ids_offset);     // [T, K] i32
  float* scores_out_TK = reinterpret_cast<float*>(buf + p.scores_offset);   // [T, K] f32
  bf16_t* rows_out_TD = p.dispatch_R[p.rank];                                // [T, D] bf16

  const int64_t live_in = raw_live(p);
  const int64_t live = clamp_live(live_in, p.tokens);
  if (blockIdx.x == 0 && threadIdx.x == 0 && live_in != live) {  // bounds every read: always
    record_error(key_word, kArgLive, 0);
  }
  const int64_t routes = p.T * p.K;
  const int64_t vecs_per_row = p.D / kVec;
  const int64_t total = routes + p.tokens * vecs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    if (i < routes) {
      const int64_t t = i / p.K;
      int32_t id = -1;
      float score = 0.0f;
      if (t < live) {  // t < live <= T': i is inside the [T', K] inputs
        const int64_t raw = read_id(p, i);
        if (raw >= -1 && raw < p.experts_global) {
          id = static_cast<int32_t>(raw);
        } else if (p.check_inputs) {
          record_error(key_word, kArgIds, i);
        }
        score = p.scores_bf16 ? bf16_to_float(static_cast<const bf16_t*>(p.scores_TK)[i])
                              : static_cast<const float*>(p.scores_TK)[i];
        // Only active routes' scores are ever read.
        if (p.check_inputs && id >= 0 && !is_finite_f32(score)) record_error(key_word, kArgScores, i);
      }
      ids_out_TK[i] = id;
      scores_out_TK[i] = score;
    } else {
      const int64_t j = i - routes;
      const int64_t t = j / vecs_per_row;
      if (t >= live) continue;  // padding rows cost nothing
      const int64_t col = (j % vecs_per_row) * kVec;
      const uint4 u = load_vec(p.rows_TD + t * p.D + col);
      if (p.store_rows) store_vec(rows_out_TD + t * p.D + col, u);
      if (p.check_inputs) {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const auto v = static_cast<bf16_t>(e % 2 == 0 ? (w[e / 2] & 0xffffu) : (w[e / 2] >> 16));
          if (!is_finite_bf16(v)) {
            record_error(key_word, kArgRows, t * p.D + col + e);
            break;  // the first element of the vector is the smallest index
          }
        }
      }
    }
  }
}

// One thread: consume the check key, fill the header.
__global__ void publish_header_kernel(const PublishParams p) {
  if (p.saved_header != nullptr && layout_skip(p.saved_header)) return;
  char* buf = p.routing_R[p.rank];                     // own routing buffer
  auto* h = reinterpret_cast<RoutingHeader*>(buf);     // [1] header
  unsigned long long* key_word = check_key_word(buf);  // [1] u64
  const unsigned long long complement = *key_word;
  *key_word = 0;  // ready for the next call

  const int64_t live_in = raw_live(p);
  h->tokens = static_cast<int32_t>(p.tokens);
  h->live = static_cast<int32_t>(clamp_live(live_in, p.tokens));
  h->sequence = p.sequence;
  int32_t code = 0, arg = 0;
  int64_t value = 0, bound = 0, index = -1;
  if (complement != 0) {
    const unsigned long long key = ~complement;
    const auto which = static_cast<CheckArg>(key >> kKeyArgShift);
    const auto flat = static_cast<int64_t>(key & kKeyIndexMask);
    switch (which) {
      case kArgLive:
        code = static_cast<int32_t>(StatusCode::token_count_mismatch);
        arg = static_cast<int32_t>(StatusArg::num_tokens_1);
        value = live_in;
        bound = p.tokens;
        index = 0;
        break;
      case kArgIds:
        code = static_cast<int32_t>(StatusCode::expert_id_out_of_range);
        arg = static_cast<int32_t>(StatusArg::topk_ids_TK);
        value = read_id(p, flat);
        bound = p.experts_global;
        index = flat;
        break;
      case kArgScores:
        code = static_cast<int32_t>(StatusCode::non_finite_input);
        arg = static_cast<int32_t>(StatusArg::topk_scores_TK);
        index = flat;
        break;
      case kArgRows:
        code = static_cast<int32_t>(StatusCode::non_finite_input);
        arg = static_cast<int32_t>(StatusArg::x_TD);
        index = flat;
        break;
    }
  }
  h->error_code = code;
  h->error_arg = arg;
  h->error_value = value;
  h->error_bound = bound;
  h->error_index = index;
}

void publish(const Step& s, const bf16_t* rows_TD, const char* rows_name, bool backward) {
  // The first stage checks every caller row pointer the step will vectorise over, so that a bad
  // one fails before any rank has started the step.
  check_aligned16(rows_TD, rows_name);
  if (backward) {
    check_aligned16(s.grad_x_TD, "grad_x_TD");
  } else {
    check_aligned16(s.y_TD, "y_TD");
  }
  const RoutingBufferLayout rl = routing_buffer_layout(s.dims.T, s.dims.K);
  PublishParams p{};
  p.rows_TD = rows_TD;
  p.num_tokens_1 = s.num_tokens_1;
  p.ids_TK = s.ids_TK;
  p.scores_TK = s.scores_TK;
  p.routing_R = s.routing_R;
  p.dispatch_R = s.dispatch_R;
  p.saved_header = backward ? s.layout.header : nullptr;
  p.T = s.dims.T;
  p.tokens = s.tokens;
  p.D = s.dims.D;
  p.ids_offset = rl.ids_offset;
  p.scores_offset = rl.scores_offset;
  p.sequence = s.sequence;
  p.K = s.dims.K;
  p.experts_global = s.dims.E * s.dims.R;
  p.rank = s.rank;
  p.ids_i64 = s.ids_dtype == DType::i64 ? 1 : 0;
  p.scores_bf16 = s.scores_dtype == DType::bf16 ? 1 : 0;
  p.check_inputs = (s.check_inputs && !backward) ? 1 : 0;  // backward reuses the forward's routes
  // FP8 forward: x crosses ranks as E4M3 rows + scales, quantized below; the kernel only checks it.
  const bool fp8_rows = s.fp8 && !backward;
  p.store_rows = fp8_rows ? 0 : 1;
  auto stream = static_cast<cudaStream_t>(s.stream);
  const bool row_items = p.store_rows != 0 || p.check_inputs != 0;
  const int64_t items = s.dims.T * s.dims.K + (row_items ? s.tokens * (s.dims.D / kVec) : 0);
  publish_kernel<<<grid_for(items, kThreads), kThreads, 0, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
  publish_header_kernel<<<1, 1, 0, stream>>>(p);
  EPMOE_CUDA_LAUNCH_CHECK();
  if (fp8_rows) {
    // The live rows (the caller's count, clamped to [0, T'] as the kernels above clamp it), 1x128
    // blocks along D: codes [T, D] | scales [T, S_D] row-major (fp8_dispatch_layout).
    EPMOE_CHECK_ARG(s.dispatch_local != nullptr, "Step.dispatch_local", "this rank's dispatch buffer",
                    "nullptr");
    const Fp8DispatchLayout l = fp8_dispatch_layout(s.dims.T, s.dims.D);
    fp8_quantize_rows_counted(rows_TD, s.tokens, s.dims.D, s.num_tokens_1, nullptr,
                              reinterpret_cast<uint8_t*>(s.dispatch_local + l.codes),
                              reinterpret_cast<float*>(s.dispatch_local + l.scales), 0, s.stream);
  }
}

}  // namespace

void publish_forward(const Step& s) { publish(s, s.x_TD, "x_TD", false); }
void publish_backward(const Step& s) { publish(s, s.grad_y_TD, "grad_y_TD", true); }

}  // namespace epmoe::cuda
