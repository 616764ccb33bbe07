// DeviceMirror on the CUDA runtime.
#include "device_mirror.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

template <class T>
void* mirror(const std::vector<T>& v, std::vector<void*>& owned) {
  void* d = nullptr;
  check(cudaMalloc(&d, v.size() * sizeof(T)), "cudaMalloc");
  owned.push_back(d);
  check(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

template <class T>
void fetch(std::vector<T>& v, const void* d) {
  check(cudaMemcpy(v.data(), d, v.size() * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
}

}  // namespace

void use_device(int ordinal) { check(cudaSetDevice(ordinal), "cudaSetDevice"); }

DeviceMirror::DeviceMirror(const RankData& d) {
  ptrs_.x_TD = mirror(d.x_TD, owned_);
  ptrs_.w13_EFD = mirror(d.w13_EFD, owned_);
  ptrs_.w2_EDF = mirror(d.w2_EDF, owned_);
  ptrs_.grad_y_TD = mirror(d.grad_y_TD, owned_);
  ptrs_.ids_TK = mirror(d.ids_TK, owned_);
  ptrs_.scores_TK = mirror(d.scores_TK, owned_);
  ptrs_.y_TD = mirror(d.y_TD, owned_);
  ptrs_.grad_x_TD = mirror(d.grad_x_TD, owned_);
  ptrs_.grad_w13_EFD = mirror(d.grad_w13_EFD, owned_);
  ptrs_.grad_w2_EDF = mirror(d.grad_w2_EDF, owned_);
  ptrs_.grad_scores_TK = mirror(d.grad_scores_TK, owned_);
}

DeviceMirror::~DeviceMirror() {
  for (void* p : owned_) cudaFree(p);
}

void DeviceMirror::copy_outputs_back(RankData& d) const {
  fetch(d.y_TD, ptrs_.y_TD);
  fetch(d.grad_x_TD, ptrs_.grad_x_TD);
  fetch(d.grad_w13_EFD, ptrs_.grad_w13_EFD);
  fetch(d.grad_w2_EDF, ptrs_.grad_w2_EDF);
  fetch(d.grad_scores_TK, ptrs_.grad_scores_TK);
}
