// An LD_PRELOAD library that gives a Linux process the page rules of XNU on Apple silicon, for
// tests/test_page_size.py: 16 KiB pages as sysconf and getpagesize report them, mmap placing
// mappings on 16 KiB boundaries, and mprotect, madvise and munmap failing with EINVAL when the
// address is not on one (XNU rounds the length up, as Linux does).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define XNU_PAGE ((size_t)16384)

static int misaligned(const void* address) { return ((uintptr_t)address & (XNU_PAGE - 1)) != 0; }

// What XNU answers for a range that does not start on a page.
static int refuse_misaligned(void) {
  errno = EINVAL;
  return -1;
}

static long (*next_sysconf)(int);

long sysconf(int name) {
  if (name == _SC_PAGESIZE) return (long)XNU_PAGE;
  if (!next_sysconf) next_sysconf = (long (*)(int))dlsym(RTLD_NEXT, "sysconf");
  return next_sysconf(name);
}

int getpagesize(void) { return (int)XNU_PAGE; }

int mprotect(void* address, size_t length, int protection) {
  static int (*next)(void*, size_t, int);
  if (misaligned(address)) return refuse_misaligned();
  if (!next) next = (int (*)(void*, size_t, int))dlsym(RTLD_NEXT, "mprotect");
  return next(address, length, protection);
}

int madvise(void* address, size_t length, int advice) {
  static int (*next)(void*, size_t, int);
  if (misaligned(address)) return refuse_misaligned();
  if (!next) next = (int (*)(void*, size_t, int))dlsym(RTLD_NEXT, "madvise");
  return next(address, length, advice);
}

static int (*next_munmap)(void*, size_t);

int munmap(void* address, size_t length) {
  if (misaligned(address)) return refuse_misaligned();
  if (!next_munmap) next_munmap = (int (*)(void*, size_t))dlsym(RTLD_NEXT, "munmap");
  return next_munmap(address, length);
}

// A mapping the kernel may place anywhere is placed on a 16 KiB boundary: reserve a page more
// than asked, map over the aligned part of the reservation, and give back the rest.
void* mmap(void* address, size_t length, int protection, int flags, int fd, off_t offset) {
  static void* (*next)(void*, size_t, int, int, int, off_t);
  if (!next) next = (void* (*)(void*, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
  if (!next_munmap) next_munmap = (int (*)(void*, size_t))dlsym(RTLD_NEXT, "munmap");
  if (flags & MAP_FIXED) {
    if (misaligned(address)) {
      errno = EINVAL;
      return MAP_FAILED;
    }
    return next(address, length, protection, flags, fd, offset);
  }
  if (length == 0 || length > SIZE_MAX / 2) return next(address, length, protection, flags, fd, offset);
  const size_t reserved = (length + XNU_PAGE - 1) / XNU_PAGE * XNU_PAGE + XNU_PAGE;
  char* reservation = next(NULL, reserved, PROT_NONE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reservation == MAP_FAILED) return MAP_FAILED;
  char* aligned = (char*)(((uintptr_t)reservation + XNU_PAGE - 1) & ~(uintptr_t)(XNU_PAGE - 1));
  void* mapped = next(aligned, length, protection, flags | MAP_FIXED, fd, offset);
  if (mapped == MAP_FAILED) {
    const int error = errno;
    next_munmap(reservation, reserved);
    errno = error;
    return MAP_FAILED;
  }
  if (!next_sysconf) next_sysconf = (long (*)(int))dlsym(RTLD_NEXT, "sysconf");
  const size_t system_page = (size_t)next_sysconf(_SC_PAGESIZE);
  char* mapped_end = aligned + (length + system_page - 1) / system_page * system_page;
  if (aligned > reservation) next_munmap(reservation, (size_t)(aligned - reservation));
  if (reservation + reserved > mapped_end)
    next_munmap(mapped_end, (size_t)(reservation + reserved - mapped_end));
  return mapped;
}

// Rust's memmap2 (safetensors, tokenizers) maps through the 64-bit-offset name.
void* mmap64(void* address, size_t length, int protection, int flags, int fd, off_t offset) {
  return mmap(address, length, protection, flags, fd, offset);
}
