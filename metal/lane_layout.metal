// The lane-layout self-test: does this GPU lay out simdgroup_matrix fragments as common.h's
// fragment_row and fragment_col say? Decode attention, the GDN chunk scan and the prefill GEMMs
// build fragments lane by lane from those helpers (thread_elements()), and read results back
// the same way. Apple documents no layout, so a GPU that lays them out differently would make
// them compute wrong results, not fail; the device checks this kernel's outputs when it opens
// (src/lily/kernels/lane_layout.py).
//
// One SIMD-group, for float and half operands (the fragment types the kernels fill by hand):
// - D = A B + C with A, B and C filled through the helpers, multiplied by
//   simdgroup_multiply_accumulate and stored back through the helpers (exact for the small
//   integers the host passes, so it compares equal to numpy);
// - which matrix element simdgroup_load (which knows the GPU's own layout) puts in each lane's
//   thread_elements(), next to the element the helpers say the lane holds: the difference, if
//   any, is what the host reports.
#include "common.h"

constexpr constant uint LANE_LAYOUT_ELEMENTS = 64;

// This lane's elements of D = A B + C (inputs: A, B, C row-major 8x8), into `product`.
template <typename T>
inline void multiply_through_helpers(device const float* inputs, device float* product,
                                     uint lane) {
  const uint row = fragment_row(lane);
  const uint col = fragment_col(lane);
  simdgroup_matrix<T, 8, 8> a;
  simdgroup_matrix<T, 8, 8> b;
  simdgroup_float8x8 c;
  for (uint i = 0; i < 2; ++i) {
    const uint at = row * 8 + col + i;
    a.thread_elements()[i] = T(inputs[at]);
    b.thread_elements()[i] = T(inputs[LANE_LAYOUT_ELEMENTS + at]);
    c.thread_elements()[i] = inputs[2 * LANE_LAYOUT_ELEMENTS + at];
  }
  simdgroup_multiply_accumulate(c, a, b, c);
  for (uint i = 0; i < 2; ++i) product[row * 8 + col + i] = c.thread_elements()[i];
}

// Loads the matrix whose element (r, c) is r * 8 + c with simdgroup_load and writes the element
// each of this lane's two thread_elements() holds to held[2 lane + i].
template <typename T>
inline void read_layout(threadgroup T* staged, device float* held, uint lane) {
  for (uint i = 0; i < 2; ++i) staged[2 * lane + i] = T(float(2 * lane + i));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> m;
  simdgroup_load(m, staged, 8);
  for (uint i = 0; i < 2; ++i) held[2 * lane + i] = float(m.thread_elements()[i]);
}

// One threadgroup of 32 threads. products: [float, half][64], held: [float, half][64],
// expected[2 lane + i] = the element (row * 8 + column) the helpers say lane `lane` holds as
// thread_elements()[i].
[[kernel, max_total_threads_per_threadgroup(SIMD_WIDTH)]]
void lane_layout_self_test(device const float* inputs [[buffer(0)]],
                           device float* products [[buffer(1)]],
                           device float* held [[buffer(2)]],
                           device uint* expected [[buffer(3)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float staged_float[LANE_LAYOUT_ELEMENTS];
  threadgroup half staged_half[LANE_LAYOUT_ELEMENTS];
  multiply_through_helpers<float>(inputs, products, lane);
  multiply_through_helpers<half>(inputs, products + LANE_LAYOUT_ELEMENTS, lane);
  read_layout(staged_float, held, lane);
  read_layout(staged_half, held + LANE_LAYOUT_ELEMENTS, lane);
  for (uint i = 0; i < 2; ++i) {
    expected[2 * lane + i] = fragment_row(lane) * 8 + fragment_col(lane) + i;
  }
}
