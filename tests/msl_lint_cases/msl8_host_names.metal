// MSL8: every kernel template instantiation has a host name, and kernel names are unique.
#include <metal_stdlib>
using namespace metal;

template <typename T>
[[kernel]] void copy(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  y[i] = x[i];
}

template <typename T>
kernel void fill(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = T(0);
}

template [[host_name("copy_float")]] [[kernel]] decltype(copy<float>) copy<float>;
template [[kernel]] decltype(copy<half>) copy<half>;  // expect: MSL8
template kernel void fill<float>(device float* y, uint i);  // expect: MSL8
template [[host_name("copy_float")]] [[kernel]] decltype(copy<int>) copy<int>;  // expect: MSL8

// A plain kernel is named by its function, which must not collide with a host name either.
[[kernel]] void copy_float(device float* y [[buffer(0)]]) {  // expect: MSL8
  y[0] = 0.0f;
}

#define INSTANTIATE_FILL(name, T) \
  template [[host_name(name)]] [[kernel]] decltype(fill<T>) fill<T>;
INSTANTIATE_FILL("fill_half", half)
