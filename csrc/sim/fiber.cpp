#include "fiber.h"

#include <cstdint>

namespace lily_sim {

#ifdef LILY_SIM_X86_64_SWITCH

extern "C" void lily_sim_switch(void** save_sp, void* load_sp);
extern "C" void lily_sim_fiber_start();

// lily_sim_switch pushes the callee-saved registers, stores the stack pointer, loads the other
// one and pops them back. A fresh fiber's stack is laid out as if it had been switched out, with
// main in r13, its argument in r12 and lily_sim_fiber_start as the return address.
asm(R"(
  .text
  .globl lily_sim_switch
  .hidden lily_sim_switch
  .type lily_sim_switch,@function
lily_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size lily_sim_switch, .-lily_sim_switch

  .globl lily_sim_fiber_start
  .hidden lily_sim_fiber_start
  .type lily_sim_fiber_start,@function
lily_sim_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size lily_sim_fiber_start, .-lily_sim_fiber_start
)");

void fiber_prepare(FiberContext& fiber, char* stack, size_t size, FiberMain main, void* arg) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15);
  // Seven slots (six registers and the return address) below a 16-byte aligned top, so that
  // the stack is 16-byte aligned at lily_sim_fiber_start's call, as the ABI requires.
  auto* sp = reinterpret_cast<void**>(top - 16 - 7 * sizeof(void*));
  sp[0] = nullptr;                                          // r15
  sp[1] = nullptr;                                          // r14
  sp[2] = reinterpret_cast<void*>(main);                    // r13
  sp[3] = arg;                                              // r12
  sp[4] = nullptr;                                          // rbx
  sp[5] = nullptr;                                          // rbp
  sp[6] = reinterpret_cast<void*>(&lily_sim_fiber_start);  // return address
  fiber.sp = sp;
}

void fiber_switch(FiberContext& from, FiberContext& to) { lily_sim_switch(&from.sp, to.sp); }

#else

// macOS marks the ucontext functions deprecated but still ships them, and this branch is the
// sim's only fiber switch on arm64. (A hand-written arm64 switch, as above for x86-64, would
// be faster, but nothing here can run it.)
#if defined(__APPLE__)
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace {
// makecontext passes int arguments only: the function and its argument travel in halves.
void start(unsigned main_hi, unsigned main_lo, unsigned arg_hi, unsigned arg_lo) {
  auto join = [](unsigned hi, unsigned lo) { return (uint64_t(hi) << 32) | lo; };
  auto main = reinterpret_cast<FiberMain>(join(main_hi, main_lo));
  main(reinterpret_cast<void*>(join(arg_hi, arg_lo)));
}
}  // namespace

void fiber_prepare(FiberContext& fiber, char* stack, size_t size, FiberMain main, void* arg) {
  getcontext(&fiber.uc);
  fiber.uc.uc_stack.ss_sp = stack;
  fiber.uc.uc_stack.ss_size = size;
  fiber.uc.uc_link = nullptr;
  auto m = reinterpret_cast<uint64_t>(main), a = reinterpret_cast<uint64_t>(arg);
  makecontext(&fiber.uc, reinterpret_cast<void (*)()>(&start), 4, unsigned(m >> 32), unsigned(m),
              unsigned(a >> 32), unsigned(a));
}

void fiber_switch(FiberContext& from, FiberContext& to) { swapcontext(&from.uc, &to.uc); }

#endif

}  // namespace lily_sim
