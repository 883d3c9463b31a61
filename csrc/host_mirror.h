// Wrapped host memory that a device holds a copy of (see Device::wrap): the host's bytes are
// copied to the device's copy when a graph that binds them is submitted, and back, for writable
// memory, when it has finished. Between those points the device's copy is the one kernels use.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "device.h"

namespace lily {

class HostMirror {
 public:
  HostMirror(void* host, size_t bytes, bool writable, std::shared_ptr<void> owner)
      : host_(host), bytes_(bytes), writable_(writable), owner_(std::move(owner)) {}

  void* host() const { return host_; }

  // A graph binding the memory is submitted. If no earlier graph binding it is still running,
  // the host's bytes are what kernels must see: copy them (when they differ, so that a copy
  // is made only when the host changed them).
  // Otherwise the device's copy is newer than the host's and stays. Callers serialise calls.
  void submitted(void* device) {
    if (in_flight_++ == 0 && bytes_ != 0 && std::memcmp(device, host_, bytes_) != 0) {
      std::memcpy(device, host_, bytes_);
    }
  }
  // That graph has finished: what its kernels wrote reaches the host (writable memory only).
  void finished(const void* device) {
    if (in_flight_ > 0) --in_flight_;
    if (writable_ && bytes_ != 0) std::memcpy(host_, device, bytes_);
  }

 private:
  void* host_;
  size_t bytes_;
  bool writable_;
  std::shared_ptr<void> owner_;  // keeps the host memory alive
  unsigned in_flight_ = 0;
};

}  // namespace lily
