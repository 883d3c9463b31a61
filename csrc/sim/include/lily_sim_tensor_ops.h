// Metal 4 tensor ops (MSL 4.0, <metal_tensor> and MetalPerformancePrimitives'
// mpp::tensor_ops::matmul2d), as far as Lily's kernels use them, for the sim. Included by
// <metal_stdlib> before the MSL keyword macros; kernels include <metal_tensor> and
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> unchanged (the pre-pass empties those
// includes, as it does every MSL header's).
//
// Written from Apple's header documentation of matmul2d (C = A * B + C, the table of operand
// types) and a working public example of its use, then checked against the macOS 26.2 SDK's
// MetalPerformancePrimitives headers (MPPTensorOpsMatMul2d.h and its __impl; what is checked is
// listed in csrc/sim/tensor_ops_declarations.py, which tools/check_macos_build.py --mpp-headers
// verifies against a copy of those headers). Where Apple leaves something open the emulation
// takes the strictest reading and says so:
//   - tensors are rank 2, built from a pointer and dextents<int32_t, 2>(inner, outer), packed:
//     element (i0, i1) is data[i1 * extent(0) + i0] (no strides, no slices);
//   - A is M x K: extents (K, M), or (M, K) with transpose_left; B is K x N: extents (N, K), or
//     (K, N) with transpose_right (B^T stored row by row, as a weight matrix is). The extents
//     must equal the descriptor's M, N, K exactly (Apple also takes larger tensors and bounds
//     the op by the descriptor, and reads past a smaller one's end as zeros: not emulated);
//   - M, N and K are static multiples of 8 (no dynamic_extent), so that the product counter can
//     count 8x8x8 units;
//   - operand types: float, half and bfloat combinations of Apple's table; the destination is a
//     cooperative tensor (no tensor C). A destination cooperative tensor is made for the left and
//     right operand types it is given, and run refuses operands of other types, as Apple's
//     header does ("Input types must match cooperative tensor types": a half x bfloat run into
//     a tensor made for bfloat x half does not compile), and a const (or `constant`) operand
//     never matches (the destination records the operands' value types, without const); extents
//     are indexed by int;
//   - run takes its operands by non-const reference, as Apple's does: no temporaries;
//   - execution_simdgroups<S> with a threadgroup of exactly S SIMD-groups; every lane of each
//     SIMD-group calls run at the same call site (checked as a SIMD-group collective). The op
//     does not synchronise SIMD-groups: the kernel's own barriers must order the writes of A and
//     B before run and the next writes after it, and the checking sim reports a missing one as a
//     race, as for any threadgroup access;
//   - a cooperative tensor's elements are spread over the scope's threads in an order only
//     get_multidimensional_index reveals (here: column-major over the threads, so that code
//     assuming row-major fragments breaks); index [0] is the column (N), [1] the row (M). Two
//     destination tensors of one op have the same layout. Its elements start as NaN, like
//     uninitialised registers, so accumulating into one never zeroed shows;
//   - each element is computed as sum over k of float(A) * float(B), in k order, added to C in
//     float (products of halves are exact in float); Apple does not document the order or the
//     internal precision beyond fp32 accumulation, so a GPU may differ in the last bits.
// Each run counts M * N * K / 512 products under MatrixProducts.tensor_op.
#pragma once

namespace metal {
LILY_SIM_VARIANT_BEGIN

template <class IndexType, size_t Rank>
struct dextents {
  static_assert(Rank == 2, "the sim emulates rank-2 tensors only");
  using index_type = IndexType;
  IndexType sizes[Rank];
  template <class... I>
  constexpr dextents(I... values) : sizes{IndexType(values)...} {
    static_assert(sizeof...(I) == Rank, "dextents: one extent per dimension");
  }
  constexpr IndexType extent(size_t r) const { return sizes[r]; }
};

struct tensor_inline {};

// ElementType carries the address space of the memory it points into (threadgroup half).
template <class ElementType, class Extents, class Descriptor = tensor_inline>
struct tensor {
  static_assert(std::is_same_v<Descriptor, tensor_inline>,
                "the sim emulates tensors built from a pointer (tensor_inline) only");
  using index_type = typename Extents::index_type;
  ElementType* data;
  Extents extents;
  tensor(ElementType* d, Extents e) : data(d), extents(e) {
    for (size_t r = 0; r < 2; ++r)
      if (e.extent(r) <= 0) lily_sim::fail("tensor: extents must be positive");
  }
  auto get_extent(size_t r) const { return extents.extent(r); }
};
template <class T, class E>
tensor(T*, E) -> tensor<T, E, tensor_inline>;

template <int SimdGroups>
struct execution_simdgroups {
  static_assert(SimdGroups > 0, "execution_simdgroups: at least one SIMD-group");
  static constexpr int simdgroups = SimdGroups;
};

LILY_SIM_VARIANT_END
}  // namespace metal

namespace mpp {
namespace tensor_ops {
LILY_SIM_VARIANT_BEGIN

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_, bool transpose_left_ = false,
                                bool transpose_right_ = false, bool relaxed_precision_ = false,
                                mode mode_ = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(transpose_left_), transpose_right(transpose_right_),
        relaxed_precision(relaxed_precision_), matmul_mode(mode_) {}
};

namespace lily_detail {
// A tensor's element type without its address space or const (its value_type, which is what a
// destination cooperative tensor records): a prvalue drops the qualifiers.
template <class Tensor>
using element_t = std::remove_cvref_t<decltype(+std::declval<Tensor>().data[0])>;
// Whether a tensor's elements are const (a const pointer, or `constant` memory). Apple's run
// compares the operand's element type with only the address space removed against the value
// types its destination recorded, so a const half operand never matches.
template <class Tensor>
inline constexpr bool const_elements =
    std::is_const_v<std::remove_reference_t<decltype(std::declval<Tensor>().data[0])>>;

template <class T>
inline constexpr bool is_float_kind = std::is_same_v<T, float> || std::is_same_v<T, half> ||
                                      std::is_same_v<T, bfloat>;
// Apple's table of (A, B, C) types, its float/half/bfloat rows.
template <class A, class B, class C>
constexpr bool supported_types() {
  using std::is_same_v;
  if (!is_float_kind<A> || !is_float_kind<B> || !is_float_kind<C>) return false;
  if (is_same_v<C, float>) return true;  // every float/half/bfloat pair accumulates into float
  if (is_same_v<A, float> || is_same_v<B, float>) return false;
  if (is_same_v<C, half>) return !(is_same_v<A, bfloat> && is_same_v<B, bfloat>);
  return is_same_v<A, bfloat> || is_same_v<B, bfloat>;  // C bfloat
}

struct element_index {
  int coords[2];  // [0]: column (N), [1]: row (M)
  int operator[](int r) const { return coords[r]; }
};

inline uint scope_thread() { return lily_sim::current_lane->thread_index_in_threadgroup; }
}  // namespace lily_detail

// The destination of a matmul2d<M x N> of Left x Right operands run by `Threads` threads: this
// thread's share of C.
template <class Left, class Right, class T, int M, int N, int Threads>
struct matmul2d_cooperative_tensor {
  static constexpr int capacity = (M * N + Threads - 1) / Threads;
  T elements[capacity];
  uint owner;
  // All-ones bytes are a NaN in float, half and bfloat. One memset, not a loop, which clang would
  // turn into Darwin's memset_pattern16 (a call the checked build's hooks do not see).
  matmul2d_cooperative_tensor() : owner(lily_detail::scope_thread()) {
    __builtin_memset(elements, 0xFF, sizeof elements);
  }
  uint16_t get_capacity() const { return uint16_t(capacity); }
  // Element i of this thread is C's flat element i * Threads + t, column-major.
  int flat(int i) const { return i * Threads + int(owner); }
  void check(int i) const {
    if (i < 0 || i >= capacity) lily_sim::fail("cooperative tensor: element index past its capacity");
    if (lily_detail::scope_thread() != owner)
      lily_sim::fail("cooperative tensor: used by another thread than the one that made it");
  }
  bool is_valid_element(int i) const {
    check(i);
    return flat(i) < M * N;
  }
  lily_detail::element_index get_multidimensional_index(int i) const {
    if (!is_valid_element(i)) lily_sim::fail("cooperative tensor: index of an invalid element");
    return {{flat(i) / M, flat(i) % M}};
  }
  T& operator[](int i) {
    if (!is_valid_element(i)) lily_sim::fail("cooperative tensor: access to an invalid element");
    return elements[i];
  }
  const T& operator[](int i) const {
    if (!is_valid_element(i)) lily_sim::fail("cooperative tensor: access to an invalid element");
    return elements[i];
  }
};

template <matmul2d_descriptor D, class Scope>
struct matmul2d {
  static constexpr int threads = Scope::simdgroups * int(lily_sim::kSimdWidth);
  static_assert(D.m > 0 && D.n > 0 && D.k > 0,
                "matmul2d: the sim emulates static M, N and K only (no dynamic_extent)");
  static_assert(D.m % 8 == 0 && D.n % 8 == 0 && D.k % 8 == 0,
                "matmul2d: the sim emulates M, N and K that are multiples of 8");

  template <class A, class B, class C>
  matmul2d_cooperative_tensor<lily_detail::element_t<A>, lily_detail::element_t<B>, C, D.m, D.n,
                              threads>
  get_destination_cooperative_tensor() const {
    static_assert(lily_detail::supported_types<lily_detail::element_t<A>,
                                               lily_detail::element_t<B>, C>(),
                  "matmul2d: operand types outside Apple's table (or int8, not emulated)");
    check_scope();
    return {};
  }

  template <class A, class B, class MadeForLeft, class MadeForRight, class C>
  void run(A& a, B& b,
           matmul2d_cooperative_tensor<MadeForLeft, MadeForRight, C, D.m, D.n, threads>& c,
           const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) const {
    using TA = lily_detail::element_t<A>;
    using TB = lily_detail::element_t<B>;
    static_assert(std::is_same_v<typename A::index_type, int> &&
                      std::is_same_v<typename B::index_type, int>,
                  "matmul2d: Index type must be int");
    static_assert(std::is_same_v<TA, MadeForLeft> && std::is_same_v<TB, MadeForRight> &&
                      !lily_detail::const_elements<A> && !lily_detail::const_elements<B>,
                  "matmul2d: Input types must match cooperative tensor types (the non-const left "
                  "and right operand types the destination was made for)");
    static_assert(lily_detail::supported_types<TA, TB, C>(),
                  "matmul2d: operand types outside Apple's table (or int8, not emulated)");
    check_scope();
    // A is M x K, B is K x N; extent 0 is the contiguous one.
    const int a_inner = D.transpose_left ? D.m : D.k;
    const int a_outer = D.transpose_left ? D.k : D.m;
    const int b_inner = D.transpose_right ? D.k : D.n;
    const int b_outer = D.transpose_right ? D.n : D.k;
    if (int(a.get_extent(0)) != a_inner || int(a.get_extent(1)) != a_outer)
      lily_sim::fail("matmul2d: the left tensor's extents differ from the descriptor's M x K");
    if (int(b.get_extent(0)) != b_inner || int(b.get_extent(1)) != b_outer)
      lily_sim::fail("matmul2d: the right tensor's extents differ from the descriptor's K x N");
    // Every lane of the SIMD-group takes part at this call site.
    lily_sim::simd_rendezvous({file, line, "matmul2d run"}, [](const lily_sim::CollectiveSlots&) {},
                              nullptr, nullptr);
    for (int i = 0; i < c.get_capacity(); ++i) {
      if (!c.is_valid_element(i)) continue;
      const auto at = c.get_multidimensional_index(i);
      const int col = at[0];
      const int row = at[1];
      float sum = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate
                      ? float(c[i])
                      : 0.0f;
      float products = 0.0f;
      for (int k = 0; k < D.k; ++k) {
        const float left = float(D.transpose_left ? a.data[k * D.m + row] : a.data[row * D.k + k]);
        const float right =
            float(D.transpose_right ? b.data[col * D.k + k] : b.data[k * D.n + col]);
        products += left * right;
      }
      c[i] = C(sum + products);
    }
    if (lily_detail::scope_thread() == 0) {
      lily_sim::count_matrix_products(lily_sim::MatrixOperands::tensor_op,
                                      uint64_t(D.m) * D.n * D.k / 512);
    }
  }

 private:
  static void check_scope() {
    const lily_sim::Lane& lane = *lily_sim::current_lane;
    if (lane.simdgroups_per_threadgroup != uint(Scope::simdgroups) ||
        lane.threads_per_threadgroup.x * lane.threads_per_threadgroup.y *
                lane.threads_per_threadgroup.z !=
            uint(threads)) {
      lily_sim::fail("matmul2d: execution_simdgroups<S> needs a threadgroup of exactly S full "
                     "SIMD-groups");
    }
  }
};

LILY_SIM_VARIANT_END
}  // namespace tensor_ops
}  // namespace mpp
