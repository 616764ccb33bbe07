// DeviceMirror in a build without the CUDA backend: epmoe_run never takes its GPU path there.
#include "device_mirror.h"

#include <stdexcept>

void use_device(int) { throw std::runtime_error("epmoe_run was built without the CUDA backend"); }

DeviceMirror::DeviceMirror(const RankData&) {
  throw std::runtime_error("epmoe_run was built without the CUDA backend");
}
DeviceMirror::~DeviceMirror() = default;
void DeviceMirror::copy_outputs_back(RankData&) const {}
