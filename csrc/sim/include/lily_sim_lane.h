// What a simulated GPU thread sees of the sim runtime: its built-in ids, the dispatch's buffers,
// and the runtime calls that may switch fibers (rendezvous) or abandon the dispatch (fail).
//
// Included by <metal_stdlib> before any MSL keyword macro is defined, and by the runtime itself.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lily_sim {

// A collective operation: computes every waiting lane's result at once, when all live lanes of
// the simdgroup have reached the same call site. `in`/`out` of inactive (returned) lanes are null.
struct CollectiveSlots {
  const void* in[32];
  void* out[32];
  uint32_t active_mask;  // bit l set when lane l of the simdgroup takes part
};
using CollectiveOp = void (*)(const CollectiveSlots& slots);

struct CallSite {
  const char* file;
  unsigned line;
  const char* what;  // "threadgroup_barrier", "simd_sum", ...
};

// A simdgroup_multiply(_accumulate) needs every lane's operands, so on the sim it is a collective,
// and one rendezvous per 8x8x8 product would dominate the time of every GEMM kernel. Instead each
// lane queues its part of a product (its elements of A and B, captured when issued) and the
// simdgroup computes the whole queue at one rendezvous, in issue order, when a result is needed:
// a lane reads, overwrites or destroys a pending destination matrix, uses one as A or B, fills its
// queue, or reaches any other collective or barrier. The results are those of computing each
// product where it was issued.
struct DeferredMatrixOp {
  const char* file;
  unsigned line;
  // Computes all 32 lanes' results (lanes[l]: lane l's part) and clears D's `pending`.
  void (*run)(const DeferredMatrixOp* lanes);
  float a[2], b[2], c[2];  // this lane's elements of A and B, and of C unless c_source is set
  uint8_t operands;        // MatrixOperands of A and B, for the product counter
  const void* c_source;    // the C matrix, read when run: C is an earlier queued product
  void* d;                 // the D matrix
};
static constexpr unsigned kMaxDeferredMatrixOps = 64;
// The rate class an 8x8x8 product runs at, by its A and B operands: half only when both are
// half, bfloat only when both are bfloat, fp32 otherwise (a float operand, or half mixed with
// bfloat, which no GPU multiplies natively). `tensor_op` counts Metal 4 tensor-op matmuls in
// 8x8x8 units (lily_sim_tensor_ops.h).
enum class MatrixOperands : uint8_t { fp32, half, bfloat, tensor_op };
static constexpr unsigned kMatrixOperandKinds = 4;
// A simdgroup's queues, position-major so that computing one product reads adjacent memory.
struct DeferredMatrixOps {
  unsigned count[32];  // by lane
  DeferredMatrixOp ops[kMaxDeferredMatrixOps][32];
};

struct Ids3 {
  uint32_t x, y, z;
};

// One simulated thread. Built-ins are filled in before the lane first runs.
struct Lane {
  Ids3 thread_position_in_grid;
  Ids3 threadgroup_position_in_grid;
  Ids3 thread_position_in_threadgroup;
  Ids3 threads_per_threadgroup;
  Ids3 threadgroups_per_grid;
  Ids3 threads_per_grid;
  uint32_t thread_index_in_threadgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup;
  void* const* buffers;             // by [[buffer(n)]] index; unbound ones point at PROT_NONE pages
  void* const* threadgroup_args;    // by [[threadgroup(n)]] index
  void* group;                      // the runtime's threadgroup state (opaque here)
  DeferredMatrixOps* deferred;      // the simdgroup's queued simdgroup-matrix products
  // Lane l of a simdgroup holds the simdgroup_matrix elements Apple's layout gives lane
  // matrix_lanes[l]: l itself, unless the sim plays a GPU that lays fragments out differently.
  const uint8_t* matrix_lanes;
};

static constexpr unsigned kMaxBufferBindings = 31;
static constexpr unsigned kMaxThreadgroupBindings = 31;
static constexpr unsigned kSimdWidth = 32;

// Initial-exec TLS is a plain offset from the thread pointer on ELF; Mach-O has its own scheme.
#ifdef __ELF__
#define LILY_SIM_FAST_TLS __attribute__((tls_model("initial-exec")))
#else
#define LILY_SIM_FAST_TLS
#endif

// The lane running on this OS thread; set by the runtime before it switches into a fiber.
extern thread_local constinit Lane* current_lane LILY_SIM_FAST_TLS;

// Suspends the current lane until every live lane of its simdgroup reaches a collective at the
// same call site, then runs `op` for all of them. Divergence is reported as a KernelError.
void simd_rendezvous(const CallSite& site, CollectiveOp op, const void* in, void* out);
// Suspends the current lane until every live lane of the threadgroup reaches this barrier.
void threadgroup_rendezvous(const CallSite& site);
// Computes the queued simdgroup-matrix products of the current lane's simdgroup (a rendezvous).
void flush_matrix_ops();
// Adds `products` 8x8x8 products of kind `kind` to the current dispatch's count (the tensor ops,
// which are no SIMD-group collective of queued products).
void count_matrix_products(MatrixOperands kind, uint64_t products);
// The element size and extents of a threadgroup array, for the checker's messages.
struct ArrayShape {
  uint32_t element_bytes;
  uint32_t rank;
  uint32_t extents[4];
};
// Storage shared by the threadgroup for the `slot`-th threadgroup variable of a kernel body;
// the first lane to ask allocates it (poisoned) and the others get the same bytes.
void* threadgroup_variable(unsigned slot, size_t bytes, size_t align, const char* name,
                           const ArrayShape* shape);

// What an atomic operation does to its object; the checked build reports each one (atomics do
// not race with each other, and their own loads and stores are not instrumented).
enum class AtomicAccess : uint8_t { load, store, update };
void atomic_access(const volatile void* object, size_t bytes, AtomicAccess kind);
// Abandons the dispatch with a KernelError naming the kernel and threadgroup.
[[noreturn]] void fail(const char* message);

// A kernel as the pre-pass registers it.
using KernelEntry = void (*)(const Lane& lane);
struct KernelInfo {
  const char* host_name;
  KernelEntry entry;
  const char* source_file;
  // Its [[max_total_threads_per_threadgroup(N)]], or 0 when it declares none.
  uint32_t max_total_threads_per_threadgroup;
};
// Called by static initialisers of the generated kernel translation units; `checked`: the build
// with load/store hooks that the checking device modes run.
void register_kernels(const KernelInfo* kernels, size_t count, bool checked);

}  // namespace lily_sim
