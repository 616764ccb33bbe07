// Device copies of one rank's tensors for the GPU path of epmoe_run. Built with the CUDA backend
// only; without it, constructing one throws.
#pragma once

#include <vector>

#include "rank_data.h"

// Makes cuda:ordinal the calling thread's current device (DeviceMirror allocates there).
void use_device(int ordinal);

class DeviceMirror {
 public:
  explicit DeviceMirror(const RankData& d);  // allocates on the current device, copies inputs
  ~DeviceMirror();
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  const RankPtrs& ptrs() const { return ptrs_; }
  void copy_outputs_back(RankData& d) const;

 private:
  RankPtrs ptrs_{};
  std::vector<void*> owned_;
};
