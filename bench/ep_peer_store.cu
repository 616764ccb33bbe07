// ep_peer_store: the NVLink ceiling of EP dispatch/combine on 2 GPUs. SM-driven 16-byte peer stores
// (each GPU's kernel reads its own HBM and stores into the other GPU's buffer, as the W2 epilogue
// stores rows into owners' combine slots), both directions at once, for a sweep of CTA counts.
// Reports GB/s per GPU (bytes each GPU sends per second). --mode load measures the pull instead
// (each GPU loads the peer's buffer into its own, as dispatch does).
//
// Plain CUDA peer access (cudaDeviceEnablePeerAccess) in one process: the same NVLink path as NCCL
// LSA pointers (both are P2P mappings of the peer's memory).
//
//   ep_peer_store [--devices A,B] [--mib N] [--iters N] [--threads N] [--mode store|load]
//                 [--direction both|one] [--ctas 8,16,...] [--json PATH]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

#define CHECK(call)                                                         \
  do {                                                                      \
    const cudaError_t err_ = (call);                                        \
    if (err_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "ep_peer_store: %s failed: %s (%s:%d)\n", #call, \
                   cudaGetErrorString(err_), __FILE__, __LINE__);           \
      return 1;                                                             \
    }                                                                       \
  } while (0)

// dst_N[i] = src_N[i] for 16-byte vectors; one of src/dst is the peer's memory. Four vectors in
// flight per thread before their stores, so that NVLink latency does not serialise a warp.
__global__ void copy16_kernel(const uint4* __restrict__ src_N, uint4* __restrict__ dst_N,
                              size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src_N[i], b = src_N[i + stride], c = src_N[i + 2 * stride],
                d = src_N[i + 3 * stride];
    dst_N[i] = a;
    dst_N[i + stride] = b;
    dst_N[i + 2 * stride] = c;
    dst_N[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst_N[i] = src_N[i];
}

// x_N[i] = pattern of (seed, i): verifies that every vector arrived.
__global__ void fill_kernel(uint4* x_N, size_t n, uint32_t seed) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const auto lo = static_cast<uint32_t>(i);
    x_N[i] = make_uint4(seed, lo, seed ^ lo, ~lo);
  }
}

struct Options {
  int dev[2] = {0, 1};
  size_t mib = 256;
  int iters = 20;
  int threads = 512;
  bool load = false;     // pull from the peer instead of pushing to it
  bool one_way = false;  // only the first device sends
  std::vector<int> ctas = {8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 132};
  std::string json;
};

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || (*end != ',' && *end != '\0')) return {};
    v.push_back(static_cast<int>(x));
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h" || i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (f == "--devices") {
      const std::vector<int> d = parse_list(v);
      if (d.size() != 2 || d[0] == d[1]) return false;
      o.dev[0] = d[0];
      o.dev[1] = d[1];
    } else if (f == "--mib") {
      o.mib = std::strtoull(v, nullptr, 10);
    } else if (f == "--iters") {
      o.iters = std::atoi(v);
    } else if (f == "--threads") {
      o.threads = std::atoi(v);
    } else if (f == "--mode") {
      if (std::strcmp(v, "store") != 0 && std::strcmp(v, "load") != 0) return false;
      o.load = std::strcmp(v, "load") == 0;
    } else if (f == "--direction") {
      if (std::strcmp(v, "both") != 0 && std::strcmp(v, "one") != 0) return false;
      o.one_way = std::strcmp(v, "one") == 0;
    } else if (f == "--ctas") {
      o.ctas = parse_list(v);
    } else if (f == "--json") {
      o.json = v;
    } else {
      return false;
    }
  }
  return o.mib > 0 && o.iters > 0 && o.threads > 0 && o.threads <= 1024 && !o.ctas.empty();
}

int run(const Options& o) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;  // no driver or no GPU
  if (count < 2 || o.dev[0] >= count || o.dev[1] >= count) {
    std::fprintf(stderr, "ep_peer_store: needs 2 CUDA devices (asked for %d and %d, found %d)\n",
                 o.dev[0], o.dev[1], count);
    return 2;
  }
  const size_t bytes = o.mib << 20;
  const size_t n = bytes / sizeof(uint4);
  uint4 *own[2],
      *inbox[2];  // own: what a GPU sends (store) / receives (load); inbox: the other side
  cudaStream_t stream[2];
  cudaEvent_t start[2], stop[2];
  int sms[2] = {0, 0};
  char name[2][256] = {};
  for (int g = 0; g < 2; ++g) {
    CHECK(cudaSetDevice(o.dev[g]));
    int can = 0;
    CHECK(cudaDeviceCanAccessPeer(&can, o.dev[g], o.dev[1 - g]));
    if (!can) {
      std::fprintf(stderr, "ep_peer_store: cuda:%d cannot reach cuda:%d (no P2P)\n", o.dev[g],
                   o.dev[1 - g]);
      return 2;
    }
    const cudaError_t e = cudaDeviceEnablePeerAccess(o.dev[1 - g], 0);
    if (e != cudaErrorPeerAccessAlreadyEnabled) CHECK(e);
    (void)cudaGetLastError();
    CHECK(cudaMalloc(&own[g], bytes));
    CHECK(cudaMalloc(&inbox[g], bytes));
    CHECK(cudaStreamCreateWithFlags(&stream[g], cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&start[g]));
    CHECK(cudaEventCreate(&stop[g]));
    CHECK(cudaDeviceGetAttribute(&sms[g], cudaDevAttrMultiProcessorCount, o.dev[g]));
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, o.dev[g]));
    std::snprintf(name[g], sizeof(name[g]), "%s", prop.name);
    fill_kernel<<<1024, 256, 0, stream[g]>>>(own[g], n, 0x1000u + static_cast<uint32_t>(g));
    CHECK(cudaGetLastError());
    CHECK(cudaMemsetAsync(inbox[g], 0, bytes, stream[g]));
  }
  for (int g = 0; g < 2; ++g) CHECK(cudaStreamSynchronize(stream[g]));

  std::printf(
      "ep_peer_store: %s, cuda:%d (%s, %d SMs) <-> cuda:%d (%s, %d SMs), %zu MiB per GPU per "
      "iteration, %d iterations, %d threads per CTA, 16-byte vectors\n",
      o.load ? "SM loads from the peer (pull)" : "SM stores into the peer (push)", o.dev[0],
      name[0], sms[0], o.dev[1], name[1], sms[1], o.mib, o.iters, o.threads);
  std::printf("%s\n",
              o.one_way ? "one direction: cuda:A sends, cuda:B idle" : "both directions at once");
  std::printf("  %6s %14s %14s\n", "CTAs", "GPU A GB/s", "GPU B GB/s");

  FILE* json = nullptr;
  if (!o.json.empty()) {
    json = std::fopen(o.json.c_str(), "w");
    if (json == nullptr) {
      std::fprintf(stderr, "ep_peer_store: cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::fprintf(json,
                 "{\"mode\": \"%s\", \"direction\": \"%s\", \"mib\": %zu, \"iters\": %d, "
                 "\"threads\": %d, \"device\": \"%s\", \"results\": [",
                 o.load ? "load" : "store", o.one_way ? "one" : "both", o.mib, o.iters, o.threads,
                 name[0]);
  }
  const int active = o.one_way ? 1 : 2;
  for (size_t c = 0; c < o.ctas.size(); ++c) {
    const int ctas = o.ctas[c];
    // GPU g pushes own[g] into inbox[1-g] (store) or pulls own[1-g] into inbox[g] (load).
    auto launch = [&](int g) -> cudaError_t {
      const uint4* src = o.load ? own[1 - g] : own[g];
      uint4* dst = o.load ? inbox[g] : inbox[1 - g];
      copy16_kernel<<<ctas, o.threads, 0, stream[g]>>>(src, dst, n);
      return cudaGetLastError();
    };
    for (int g = 0; g < active; ++g) {  // warm-up
      CHECK(cudaSetDevice(o.dev[g]));
      CHECK(launch(g));
    }
    for (int g = 0; g < active; ++g) CHECK(cudaStreamSynchronize(stream[g]));
    for (int g = 0; g < active; ++g) {
      CHECK(cudaSetDevice(o.dev[g]));
      CHECK(cudaEventRecord(start[g], stream[g]));
    }
    for (int i = 0; i < o.iters; ++i) {  // interleaved, so both GPUs run at the same time
      for (int g = 0; g < active; ++g) {
        CHECK(cudaSetDevice(o.dev[g]));
        CHECK(launch(g));
      }
    }
    double gbps[2] = {0, 0};
    for (int g = 0; g < active; ++g) {
      CHECK(cudaSetDevice(o.dev[g]));
      CHECK(cudaEventRecord(stop[g], stream[g]));
    }
    for (int g = 0; g < active; ++g) {
      CHECK(cudaEventSynchronize(stop[g]));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, start[g], stop[g]));
      gbps[g] = static_cast<double>(bytes) * o.iters / (ms * 1e-3) / 1e9;
    }
    if (o.one_way) {
      std::printf("  %6d %14.1f %14s\n", ctas, gbps[0], "-");
    } else {
      std::printf("  %6d %14.1f %14.1f\n", ctas, gbps[0], gbps[1]);
    }
    if (json != nullptr) {
      std::fprintf(json, "%s{\"ctas\": %d, \"gbps\": [%.2f, %.2f]}", c ? ", " : "", ctas, gbps[0],
                   gbps[1]);
    }
  }
  if (json != nullptr) {
    std::fprintf(json, "]}\n");
    std::fclose(json);
  }

  // Every vector arrived: the receiving side's inbox equals the sender's pattern (spot checks).
  for (int g = 0; g < active; ++g) {
    const int receiver = o.load ? g : 1 - g;
    const uint32_t seed = 0x1000u + static_cast<uint32_t>(1 - receiver);
    for (size_t i : {size_t{0}, n / 2, n - 1}) {
      uint4 v;
      CHECK(cudaSetDevice(o.dev[receiver]));
      CHECK(cudaMemcpy(&v, inbox[receiver] + i, sizeof(v), cudaMemcpyDeviceToHost));
      const auto lo = static_cast<uint32_t>(i);
      if (v.x != seed || v.y != lo || v.z != (seed ^ lo) || v.w != ~lo) {
        std::fprintf(stderr, "ep_peer_store: wrong data at vector %zu of cuda:%d's inbox\n", i,
                     o.dev[receiver]);
        return 1;
      }
    }
  }
  for (int g = 0; g < 2; ++g) {
    CHECK(cudaSetDevice(o.dev[g]));
    CHECK(cudaFree(own[g]));
    CHECK(cudaFree(inbox[g]));
    CHECK(cudaStreamDestroy(stream[g]));
    CHECK(cudaEventDestroy(start[g]));
    CHECK(cudaEventDestroy(stop[g]));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: ep_peer_store [--devices A,B] [--mib N] [--iters N] [--threads N]\n"
                 "                     [--mode store|load] [--direction both|one]\n"
                 "                     [--ctas 8,16,...] [--json PATH]\n");
    return 2;
  }
  return run(o);
}
