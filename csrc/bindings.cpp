// Python bindings of the device layer (lily._native). Python reaches them only through
// lily/device.py, which adds argument normalisation and friendlier errors.
#include <algorithm>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "device.h"
#include "sim/sim_device.h"
#ifdef LILY_METAL
#include "metal/metal_device.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

lily::Size3 size3(const std::tuple<uint32_t, uint32_t, uint32_t>& t) {
  return {std::get<0>(t), std::get<1>(t), std::get<2>(t)};
}

// Keeps a Python object alive from C++; the reference is dropped under the GIL.
std::shared_ptr<void> hold(nb::object owner) {
  auto* held = new nb::object(std::move(owner));
  return std::shared_ptr<void>(held, [](void* p) {
    if (!Py_IsInitialized()) return;  // interpreter gone: leak rather than crash
    nb::gil_scoped_acquire gil;
    delete static_cast<nb::object*>(p);
  });
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Lily's native device layer";
  m.def("build_info", [] {
    nb::dict info;
    info["version"] = LILY_VERSION;
    info["compiler"] = __VERSION__;
    return info;
  });

  nb::exception<lily::KernelError>(m, "KernelError", PyExc_RuntimeError);

  nb::class_<lily::Buffer>(m, "Buffer")
      .def_prop_ro("size", &lily::Buffer::size)
      .def_prop_ro("writable", &lily::Buffer::writable)
      .def(
          "numpy",
          [](nb::handle self) -> nb::object {
            auto& b = nb::cast<lily::Buffer&>(self);
            b.host_access();
            size_t shape[1] = {b.size()};
            if (b.writable()) {
              return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                  static_cast<uint8_t*>(b.data()), 1, shape, self));
            }
            return nb::cast(nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>(
                static_cast<const uint8_t*>(b.data()), 1, shape, self));
          },
          "A uint8 view of the buffer's memory that keeps the buffer alive.")
      .def("add_region", &lily::Buffer::add_region, "offset"_a, "nbytes"_a)
      .def("extent_at", &lily::Buffer::extent_at, "offset"_a);

  nb::class_<lily::Kernel>(m, "Kernel")
      .def_prop_ro("name", &lily::Kernel::name)
      .def_prop_ro("max_threads_per_threadgroup", &lily::Kernel::max_threads_per_threadgroup);

  nb::class_<lily::Graph>(m, "Graph")
      .def(nb::init<>())
      .def(
          "dispatch",
          [](lily::Graph& g, std::shared_ptr<lily::Kernel> kernel,
             std::tuple<uint32_t, uint32_t, uint32_t> threadgroups,
             std::tuple<uint32_t, uint32_t, uint32_t> threads,
             std::vector<std::tuple<uint32_t, std::shared_ptr<lily::Buffer>, size_t>> buffers,
             std::vector<std::pair<uint32_t, nb::bytes>> bytes,
             std::vector<std::pair<uint32_t, uint32_t>> threadgroup_memory,
             std::vector<std::pair<uint32_t, size_t>> lengths) {
            lily::Dispatch d;
            d.kernel = std::move(kernel);
            d.threadgroups = size3(threadgroups);
            d.threads_per_threadgroup = size3(threads);
            for (auto& [index, buffer, offset] : buffers) d.buffers.push_back({index, buffer, offset});
            for (auto& [index, length] : lengths)
              for (auto& b : d.buffers)
                if (b.index == index) b.length = length;
            for (auto& [index, data] : bytes) {
              auto* p = static_cast<const uint8_t*>(data.data());
              d.bytes.push_back({index, std::vector<uint8_t>(p, p + data.size())});
            }
            for (auto& [index, n] : threadgroup_memory) d.threadgroup_memory.push_back({index, n});
            g.dispatch(std::move(d));
          },
          "kernel"_a, "threadgroups"_a, "threads"_a, "buffers"_a, "bytes"_a,
          "threadgroup_memory"_a, "lengths"_a = std::vector<std::pair<uint32_t, size_t>>{})
      .def("barrier", &lily::Graph::barrier)
      .def("end_command_buffer", &lily::Graph::end_command_buffer)
      .def_prop_ro("command_buffer_count", &lily::Graph::command_buffer_count)
      .def_prop_ro("dispatch_count", &lily::Graph::dispatch_count)
      .def_prop_ro("barrier_count", &lily::Graph::barrier_count);

  nb::class_<lily::Device>(m, "Device")
      .def_prop_ro("name", &lily::Device::name)
      .def("alloc", &lily::Device::alloc, "nbytes"_a)
      .def("alloc_scratch", &lily::Device::alloc_scratch, "nbytes"_a)
      .def("take_traffic",
           [](lily::Device& d) {
             nb::list out;
             for (const auto& t : d.take_traffic()) {
               nb::list bindings;
               for (const auto& b : t.bindings)
                 bindings.append(
                     nb::make_tuple(b.index, b.buffer, b.offset, b.extent, b.read, b.written));
               out.append(nb::make_tuple(t.kernel, bindings));
             }
             return out;
           })
      .def_prop_ro("gemm_path",
                   [](const lily::Device& d) {
                     const lily::GemmPath path = d.gemm_path();
                     return nb::make_tuple(path.tensor_ops, path.reason);
                   })
      .def("take_matrix_products",
           [](lily::Device& d) -> std::optional<nb::list> {
             auto counted = d.take_matrix_products();
             if (!counted) return std::nullopt;
             nb::list out;
             for (const auto& k : *counted) {
               const auto& p = k.products;
               out.append(nb::make_tuple(k.kernel, p.fp32, p.half, p.bfloat, p.tensor_op));
             }
             return out;
           })
      .def(
          "wrap",
          [](lily::Device& d, uintptr_t address, size_t nbytes, bool writable, nb::object owner,
             bool file_mapped) {
            return d.wrap(reinterpret_cast<void*>(address), nbytes, writable, hold(owner),
                          file_mapped);
          },
          "address"_a, "nbytes"_a, "writable"_a, "owner"_a, "file_mapped"_a)
      .def("kernel", &lily::Device::kernel, "host_name"_a)
      .def("kernel_names", &lily::Device::kernel_names)
      .def("submit", &lily::Device::submit, "graph"_a)
      .def("wait", &lily::Device::wait, "ticket"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("run", &lily::Device::run, "graph"_a, nb::call_guard<nb::gil_scoped_release>());

#ifdef LILY_METAL
  // The metal device (cmake/metal.cmake defines LILY_METAL on Apple platforms only).
  m.def("metal_device_info", [] {
    const auto info = lily::metal::device_info();
    nb::dict d;
    d["name"] = info.name;
    d["gpu_family"] = info.gpu_family;
    d["gpu_core_count"] = info.gpu_core_count;
    d["supported"] = info.supported;
    d["unsupported_reason"] = info.unsupported_reason;
    d["recommended_working_set"] = info.recommended_working_set;
    d["max_buffer_length"] = info.max_buffer_length;
    d["physical_memory"] = info.physical_memory;
    d["os_version"] = info.os_version;
    return d;
  });
  m.def("metal_check_memory", &lily::metal::check_memory, "bytes_needed"_a);
  m.def(
      "open_metal_device",
      [](const std::string& metallib_path, const std::string& source_dir) {
        return lily::metal::open_device({metallib_path, source_dir});
      },
      "metallib_path"_a, "source_dir"_a);
  m.def(
      "metal_last_gpu_seconds",
      [](const lily::Device& device) { return lily::metal::last_gpu_seconds(device); },
      "device"_a);
#endif

  m.def(
      "open_sim_device",
      [](const std::string& lane_order, uint64_t seed, unsigned workers, bool execute,
         const std::string& mode, bool tensor_ops, const std::vector<uint8_t>& matrix_lanes,
         bool mirror_wrapped) {
        lily_sim::LaneOrder order;
        if (lane_order == "forward")
          order = lily_sim::LaneOrder::forward;
        else if (lane_order == "reverse")
          order = lily_sim::LaneOrder::reverse;
        else if (lane_order == "random")
          order = lily_sim::LaneOrder::random;
        else
          throw std::invalid_argument("lane_order must be 'forward', 'reverse' or 'random'");
        lily_sim::CheckMode check;
        if (mode == "off")
          check = lily_sim::CheckMode::off;
        else if (mode == "count")
          check = lily_sim::CheckMode::count;
        else if (mode == "check")
          check = lily_sim::CheckMode::check;
        else
          throw std::invalid_argument("mode must be 'off', 'count' or 'check'");
        // Empty: Apple's layout; otherwise a permutation of the 32 lanes.
        lily_sim::MatrixLanes lanes = lily_sim::kAppleMatrixLanes;
        if (!matrix_lanes.empty()) {
          std::vector<uint8_t> sorted = matrix_lanes;
          std::sort(sorted.begin(), sorted.end());
          if (!std::equal(sorted.begin(), sorted.end(), lanes.begin(), lanes.end()))
            throw std::invalid_argument("matrix_lanes must be a permutation of the lanes 0..31");
          std::copy(matrix_lanes.begin(), matrix_lanes.end(), lanes.begin());
        }
        return lily::open_sim_device(order, seed, workers, execute, check, tensor_ops, lanes,
                                     mirror_wrapped);
      },
      "lane_order"_a, "seed"_a, "workers"_a, "execute"_a = true, "mode"_a = "off",
      "tensor_ops"_a = false, "matrix_lanes"_a = std::vector<uint8_t>{},
      "mirror_wrapped"_a = false);
}
