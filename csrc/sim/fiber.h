// Fibers: stackful coroutines the sim runs simulated GPU threads on.
//
// On x86-64 a hand-written switch saves only the callee-saved registers (about 10x faster than
// glibc swapcontext, which makes a sigprocmask syscall per switch); elsewhere ucontext is the
// portable fallback. The x87/MXCSR control words are not switched: nothing here changes them.
#pragma once

#include <cstddef>

#if defined(__x86_64__) && defined(__ELF__) && !defined(LILY_SIM_UCONTEXT)
#define LILY_SIM_X86_64_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace lily_sim {

struct FiberContext {
#ifdef LILY_SIM_X86_64_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

using FiberMain = void (*)(void* arg);

// Makes `fiber` start running main(arg) on [stack, stack + size) at its first switch-in.
void fiber_prepare(FiberContext& fiber, char* stack, size_t size, FiberMain main, void* arg);
// Saves the running context into `from` and resumes `to`.
void fiber_switch(FiberContext& from, FiberContext& to);

}  // namespace lily_sim
