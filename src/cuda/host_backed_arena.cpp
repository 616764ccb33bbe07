#include "cuda/host_backed_arena.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <numeric>
#include <string>

#include "cuda/check.h"
#include "cuda/device_scope.h"
#include "cuda/driver_entry.h"
#include "epmoe/error.h"

namespace epmoe::cuda {

namespace {

// The driver entry points of the VMM calls (signatures unchanged since CUDA 10.2/11.0).
struct Driver {
  CUresult (*get_error_name)(CUresult, const char**) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags) =
      nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) =
      nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                     unsigned long long) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*retain_handle)(CUmemGenericAllocationHandle*, void*) = nullptr;
  CUresult (*properties)(CUmemAllocationProp*, CUmemGenericAllocationHandle) = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    load_driver_entry(x.get_error_name, "cuGetErrorName");
    load_driver_entry(x.device_get, "cuDeviceGet");
    load_driver_entry(x.device_get_attribute, "cuDeviceGetAttribute");
    load_driver_entry(x.granularity, "cuMemGetAllocationGranularity");
    load_driver_entry(x.address_reserve, "cuMemAddressReserve");
    load_driver_entry(x.address_free, "cuMemAddressFree");
    load_driver_entry(x.create, "cuMemCreate");
    load_driver_entry(x.release, "cuMemRelease");
    load_driver_entry(x.map, "cuMemMap");
    load_driver_entry(x.unmap, "cuMemUnmap");
    load_driver_entry(x.set_access, "cuMemSetAccess");
    load_driver_entry(x.retain_handle, "cuMemRetainAllocationHandle");
    load_driver_entry(x.properties, "cuMemGetAllocationPropertiesFromHandle");
    return x;
  }();
  return d;
}

std::string driver_error_text(CUresult r) {
  const char* name = nullptr;
  if (driver().get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
  return name;
}

}  // namespace

}  // namespace epmoe::cuda

// Throws Error(backend) whose argument is the call's text and whose message the CUresult name.
#define EPMOE_CU_CHECK(call)                                                                    \
  do {                                                                                          \
    const CUresult epmoe_cu_err_ = (call);                                                      \
    if (epmoe_cu_err_ != CUDA_SUCCESS) {                                                        \
      ::epmoe::detail::throw_error(::epmoe::ErrorKind::backend, #call,                          \
                                   ::epmoe::cuda::driver_error_text(epmoe_cu_err_), __FILE__,   \
                                   __LINE__);                                                   \
    }                                                                                           \
  } while (0)

namespace epmoe::cuda {

namespace {

std::size_t round_up(std::size_t n, std::size_t granule) { return (n + granule - 1) / granule * granule; }

CUmemAllocationProp pinned_at(CUmemLocationType type, int id) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  prop.location.id = id;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  return prop;
}

}  // namespace

HostBackedArena create_host_backed_arena(int ordinal, std::size_t device_bytes,
                                         std::size_t host_bytes) {
  DeviceScope scope(ordinal);
  EPMOE_CUDA_CHECK(cudaFree(nullptr));  // the device's primary context exists and is current
  const Driver& d = driver();
  CUdevice dev = 0;
  EPMOE_CU_CHECK(d.device_get(&dev, ordinal));
  int vmm = 0, host_vmm = 0, numa_id = -1;
  EPMOE_CU_CHECK(
      d.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  EPMOE_CU_CHECK(d.device_get_attribute(
      &host_vmm, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  EPMOE_CU_CHECK(d.device_get_attribute(&numa_id, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev));
  EPMOE_CHECK_ARG(vmm == 1 && host_vmm == 1, "Config.scratch_device_bytes",
                  "unset on this device (host-backed scratch needs VMM with host NUMA "
                  "allocations, driver 12.2+)",
                  "set; cuda:" + std::to_string(ordinal) + " reports VMM " + std::to_string(vmm) +
                      ", host NUMA VMM " + std::to_string(host_vmm));

  // Without NUMA the driver reports -1 and wants id 0 (cuMemCreate documentation).
  const CUmemAllocationProp device_prop = pinned_at(CU_MEM_LOCATION_TYPE_DEVICE, ordinal);
  const CUmemAllocationProp host_prop =
      pinned_at(CU_MEM_LOCATION_TYPE_HOST_NUMA, numa_id >= 0 ? numa_id : 0);
  size_t device_granule = 0, host_granule = 0;
  EPMOE_CU_CHECK(d.granularity(&device_granule, &device_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  EPMOE_CU_CHECK(d.granularity(&host_granule, &host_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  // Both parts and the boundary between them sit on a multiple of both granularities.
  const std::size_t granule = std::lcm(device_granule, host_granule);

  HostBackedArena a;
  a.device_held = round_up(device_bytes, granule);
  a.host_held = round_up(host_bytes, granule);
  const std::size_t range_bytes = a.device_held + a.host_held;
  try {
    EPMOE_CU_CHECK(d.address_reserve(&a.range, range_bytes, granule, 0, 0));
    const CUdeviceptr host_start = a.range + a.device_held;
    if (a.device_held > 0) {
      EPMOE_CU_CHECK(d.create(&a.device_handle, a.device_held, &device_prop, 0));
      EPMOE_CU_CHECK(d.map(a.range, a.device_held, 0, a.device_handle, 0));
      a.device_mapped = true;
    }
    if (a.host_held > 0) {
      EPMOE_CU_CHECK(d.create(&a.host_handle, a.host_held, &host_prop, 0));
      EPMOE_CU_CHECK(d.map(host_start, a.host_held, 0, a.host_handle, 0));
      a.host_mapped = true;
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = ordinal;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    EPMOE_CU_CHECK(d.set_access(a.range, range_bytes, &access, 1));
    // The arena ends its device part exactly where the host part begins.
    a.ptr = reinterpret_cast<void*>(host_start - device_bytes);
    EPMOE_CUDA_CHECK(cudaMemset(reinterpret_cast<void*>(a.range), 0, range_bytes));
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (...) {
    try {
      destroy_host_backed_arena(a);
    } catch (...) {
      // The first failure is the one to report.
    }
    throw;
  }
  return a;
}

void destroy_host_backed_arena(const HostBackedArena& a) {
  if (a.range == 0) return;
  const Driver& d = driver();
  CUresult first = CUDA_SUCCESS;
  const char* first_call = nullptr;
  auto step = [&](CUresult r, const char* call) {
    if (r != CUDA_SUCCESS && first == CUDA_SUCCESS) {
      first = r;
      first_call = call;
    }
  };
  const CUdeviceptr host_start = a.range + a.device_held;
  if (a.device_mapped) step(d.unmap(a.range, a.device_held), "cuMemUnmap(device part)");
  if (a.host_mapped) step(d.unmap(host_start, a.host_held), "cuMemUnmap(host part)");
  if (a.device_handle != 0) step(d.release(a.device_handle), "cuMemRelease(device part)");
  if (a.host_handle != 0) step(d.release(a.host_handle), "cuMemRelease(host part)");
  step(d.address_free(a.range, a.device_held + a.host_held), "cuMemAddressFree");
  if (first != CUDA_SUCCESS) {
    detail::throw_error(ErrorKind::backend, first_call, driver_error_text(first), __FILE__, __LINE__);
  }
}

MappedLocation mapped_location(const void* addr) {
  const Driver& d = driver();
  CUmemGenericAllocationHandle handle = 0;
  EPMOE_CU_CHECK(d.retain_handle(&handle, const_cast<void*>(addr)));
  CUmemAllocationProp prop{};
  const CUresult got = d.properties(&prop, handle);
  EPMOE_CU_CHECK(d.release(handle));  // retain took a reference
  EPMOE_CU_CHECK(got);
  switch (prop.location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return MappedLocation::device;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA: return MappedLocation::host;
    default: return MappedLocation::other;
  }
}

}  // namespace epmoe::cuda
