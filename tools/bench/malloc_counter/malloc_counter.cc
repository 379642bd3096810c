// libfsdp_malloc_counter.so: an LD_PRELOAD shim that counts the bytes a
// process holds through malloc (live heap bytes) and their peak, so that the
// memory benchmark measures fsdp2cpp and PyTorch FSDP2 on CPU the same way,
// without what glibc keeps after a free (peak RSS counts that too).
//
//   FSDP_MALLOC_COUNTER_DIR=/tmp/d LD_PRELOAD=libfsdp_malloc_counter.so fsdp_train ...
//
// Every process that has the shim preloaded and FSDP_MALLOC_COUNTER_DIR set
// writes, when it exits normally, DIR/malloc_counter.<pid>:
//
//   {"pid": 123, "rank": 0, "peak_live_bytes": 1234, "live_at_exit": 56,
//    "peak_by_size": [[lo, bytes], ...]}
//
// "rank" is $RANK (-1 when unset); "peak_by_size" splits the live bytes at the
// peak by allocation size (power-of-two classes [lo, 2 lo), classes holding
// at least 1 MiB), to see which allocations make the peak.
//
// Counted: malloc, calloc, realloc, free, posix_memalign, aligned_alloc,
// memalign, valloc, pvalloc (C++ new and LibTorch's CPU allocator go through
// them), by malloc_usable_size, so a block's slack is counted. Not counted:
// memory a program maps itself (mmap), e.g. CPython's small-object arenas.
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>

// glibc's own entry points: the shim forwards to them, so it needs no
// dlsym (which allocates) and glibc's malloc behaves as without the shim.
extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void __libc_free(void*);
void* __libc_memalign(size_t, size_t);
}

namespace {

constexpr int kClasses = 64;

int64_t live_bytes;
int64_t peak_bytes;
int64_t class_bytes[kClasses];
int64_t class_bytes_at_peak[kClasses];
int snapshot_lock;

int size_class(size_t n) { return n == 0 ? 0 : 63 - __builtin_clzll(static_cast<unsigned long long>(n)); }

void counted(void* p) {
  if (p == nullptr) return;
  const int64_t n = static_cast<int64_t>(malloc_usable_size(p));
  __atomic_fetch_add(&class_bytes[size_class(static_cast<size_t>(n))], n, __ATOMIC_RELAXED);
  const int64_t now = __atomic_add_fetch(&live_bytes, n, __ATOMIC_RELAXED);
  int64_t peak = __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED);
  while (now > peak) {
    if (__atomic_compare_exchange_n(&peak_bytes, &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      // A new peak: remember what it is made of. Another thread's
      // concurrent change may be half in it; the split is approximate, the
      // peak itself is exact.
      if (!__atomic_exchange_n(&snapshot_lock, 1, __ATOMIC_ACQUIRE)) {
        for (int i = 0; i < kClasses; ++i) class_bytes_at_peak[i] = __atomic_load_n(&class_bytes[i], __ATOMIC_RELAXED);
        __atomic_store_n(&snapshot_lock, 0, __ATOMIC_RELEASE);
      }
      break;
    }
  }
}

void uncounted(void* p) {
  if (p == nullptr) return;
  const int64_t n = static_cast<int64_t>(malloc_usable_size(p));
  __atomic_fetch_sub(&class_bytes[size_class(static_cast<size_t>(n))], n, __ATOMIC_RELAXED);
  __atomic_fetch_sub(&live_bytes, n, __ATOMIC_RELAXED);
}

}  // namespace

extern "C" {

void* malloc(size_t n) noexcept {
  void* p = __libc_malloc(n);
  counted(p);
  return p;
}

void* calloc(size_t count, size_t n) noexcept {
  void* p = __libc_calloc(count, n);
  counted(p);
  return p;
}

void* realloc(void* old, size_t n) noexcept {
  const int64_t before = old == nullptr ? 0 : static_cast<int64_t>(malloc_usable_size(old));
  void* p = __libc_realloc(old, n);
  if (p == nullptr && n != 0) return nullptr;  // the old block is untouched
  if (old != nullptr) {
    __atomic_fetch_sub(&class_bytes[size_class(static_cast<size_t>(before))], before, __ATOMIC_RELAXED);
    __atomic_fetch_sub(&live_bytes, before, __ATOMIC_RELAXED);
  }
  counted(p);
  return p;
}

void free(void* p) noexcept {
  uncounted(p);
  __libc_free(p);
}

void* memalign(size_t alignment, size_t n) noexcept {
  void* p = __libc_memalign(alignment, n);
  counted(p);
  return p;
}

int posix_memalign(void** out, size_t alignment, size_t n) noexcept {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, n);
  if (p == nullptr) return ENOMEM;
  counted(p);
  *out = p;
  return 0;
}

void* aligned_alloc(size_t alignment, size_t n) noexcept { return memalign(alignment, n); }

void* valloc(size_t n) noexcept { return memalign(static_cast<size_t>(sysconf(_SC_PAGESIZE)), n); }

void* pvalloc(size_t n) noexcept {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return memalign(page, (n + page - 1) / page * page);
}

// Written with write(2) from a stack buffer: at exit, malloc may no longer be
// safe to call.
__attribute__((destructor)) void report() {
  const char* dir = getenv("FSDP_MALLOC_COUNTER_DIR");
  if (dir == nullptr || *dir == '\0') return;
  const char* rank_text = getenv("RANK");
  const long rank = rank_text != nullptr && *rank_text != '\0' ? strtol(rank_text, nullptr, 10) : -1;
  const long pid = static_cast<long>(getpid());
  char path[4096];
  snprintf(path, sizeof(path), "%s/malloc_counter.%ld", dir, pid);
  char text[8192];
  size_t len = 0;
  const auto append = [&](int n) { len = n < 0 ? len : std::min(sizeof(text) - 1, len + static_cast<size_t>(n)); };
  append(
      snprintf(text, sizeof(text),
               "{\"pid\": %ld, \"rank\": %ld, \"peak_live_bytes\": %lld, \"live_at_exit\": %lld, \"peak_by_size\": [",
               pid, rank, static_cast<long long>(__atomic_load_n(&peak_bytes, __ATOMIC_RELAXED)),
               static_cast<long long>(__atomic_load_n(&live_bytes, __ATOMIC_RELAXED))));
  const char* separator = "";
  for (int i = 0; i < kClasses; ++i) {
    if (class_bytes_at_peak[i] < (1 << 20)) continue;
    append(snprintf(text + len, sizeof(text) - len, "%s[%llu, %lld]", separator, 1ULL << i,
                    static_cast<long long>(class_bytes_at_peak[i])));
    separator = ", ";
  }
  append(snprintf(text + len, sizeof(text) - len, "]}\n"));
  const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  for (size_t done = 0; done < len;) {
    const ssize_t n = write(fd, text + done, len - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
}

}  // namespace
