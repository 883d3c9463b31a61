// Python bindings of the device layer (lily._native).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "device.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "Lily's native device layer";
  m.def("build_info", [] {
    nb::dict info;
    info["version"] = LILY_VERSION;
    info["compiler"] = __VERSION__;
    return info;
  });
}
