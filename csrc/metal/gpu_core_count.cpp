// The GPU's core count, which Metal does not give: the `gpu-core-count` property of the GPU
// driver's AGXAccelerator service in the I/O Registry, where System Information reads it (MLX's
// device_info and fastfetch read the same key). Plain C++ over IOKit's C API, so that the
// Objective-C++ device stays a device.
#include <CoreFoundation/CoreFoundation.h>
#include <IOKit/IOKitLib.h>

#include <cstdint>

#include "metal/metal_device.h"

namespace lily::metal {

uint32_t gpu_core_count() {
  const io_service_t gpu =
      IOServiceGetMatchingService(kIOMainPortDefault, IOServiceMatching("AGXAccelerator"));
  if (gpu == IO_OBJECT_NULL) return 0;
  CFTypeRef count =
      IORegistryEntryCreateCFProperty(gpu, CFSTR("gpu-core-count"), kCFAllocatorDefault, 0);
  IOObjectRelease(gpu);
  if (count == nullptr) return 0;
  int64_t cores = 0;
  if (CFGetTypeID(count) == CFNumberGetTypeID()) {
    CFNumberGetValue(static_cast<CFNumberRef>(count), kCFNumberSInt64Type, &cores);
  }
  CFRelease(count);
  return cores > 0 && cores <= UINT32_MAX ? static_cast<uint32_t>(cores) : 0;
}

}  // namespace lily::metal
