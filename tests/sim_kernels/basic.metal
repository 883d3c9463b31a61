// Small kernels exercising the sim: indexing, buffers, inline parameters.
#include <metal_stdlib>
using namespace metal;

struct AxpyParams {
  float a;
  uint n;
};

// y[i] = a * x[i] + y[i]
[[kernel]] void test_axpy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                          constant AxpyParams& p [[buffer(2)]],
                          uint i [[thread_position_in_grid]]) {
  if (i < p.n) y[i] = p.a * x[i] + y[i];
}

// Writes every built-in of every thread: 12 uints per thread, indexed by position in grid.
kernel void test_builtins(device uint* out [[buffer(0)]],
                          uint3 gid [[thread_position_in_grid]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          ushort3 tid [[thread_position_in_threadgroup]],
                          uint3 tpg [[threads_per_grid]],
                          uint flat [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          ushort lane [[thread_index_in_simdgroup]],
                          uint sgs [[simdgroups_per_threadgroup]],
                          uint3 ntg [[threadgroups_per_grid]],
                          ushort3 tptg [[threads_per_threadgroup]]) {
  uint index = (gid.z * tpg.y + gid.y) * tpg.x + gid.x;
  device uint* o = out + index * 12;
  o[0] = tgid.x;
  o[1] = tgid.y;
  o[2] = tgid.z;
  o[3] = tid.x;
  o[4] = tid.y;
  o[5] = tid.z;
  o[6] = flat;
  o[7] = sg;
  o[8] = lane;
  o[9] = sgs;
  o[10] = ntg.x * ntg.y;
  o[11] = tptg.x * tptg.y * tptg.z;
}

template <typename T>
[[kernel]] void test_scale(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],
                           constant float& s [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = T(float(x[i]) * s);
}
template [[host_name("test_scale_float")]] [[kernel]] decltype(test_scale<float>) test_scale<float>;
template [[host_name("test_scale_half")]] [[kernel]] void test_scale<half>(
    device const half* x [[buffer(0)]], device half* y [[buffer(1)]],
    constant float& s [[buffer(2)]], uint i [[thread_position_in_grid]]);
#define instantiate_scale(name, type) \
  template [[host_name(name)]] [[kernel]] decltype(test_scale<type>) test_scale<type>;
instantiate_scale("test_scale_bfloat", bfloat)

// Records the order in which the threads of each threadgroup ran: ticket[i] = how many threads
// of its group ran before it.
[[kernel]] void test_run_order(device atomic_uint* next [[buffer(0)]], device uint* ticket [[buffer(1)]],
                               uint i [[thread_position_in_grid]],
                               uint group [[threadgroup_position_in_grid]]) {
  ticket[i] = atomic_fetch_add_explicit(&next[group], 1u, memory_order_relaxed);
}

// Declared maxima of threads per threadgroup, in both spellings MSL allows: the sim reports them
// as the kernel's limit and refuses larger threadgroups, as a GPU pipeline does.
constant uint kTestMaxThreads = 64;
[[kernel, max_total_threads_per_threadgroup(kTestMaxThreads)]] void test_max_threads(
    device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = i + 1;
}
[[max_total_threads_per_threadgroup(2 * 16)]] kernel void test_max_threads_32(
    device uint* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = i + 1;
}
template <typename T>
[[kernel, max_total_threads_per_threadgroup(kTestMaxThreads / 2)]] void test_max_threads_of(
    device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = T(i + 1);
}
template [[host_name("test_max_threads_float")]] [[kernel]] decltype(test_max_threads_of<float>)
    test_max_threads_of<float>;
