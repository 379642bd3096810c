// A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp),
// so that a dry run can say what torch.cuda.max_memory_allocated() and
// max_memory_reserved() would report for the allocations it recorded.
//
//   fsdp_plan::CachingAllocatorModel cuda;
//   auto a = cuda.allocate(1000, /*stream=*/0);   // a 512-byte-rounded block: 1024 bytes
//   auto b = cuda.allocate(3 << 20, 0);           // a large block cut from a 20 MiB segment
//   cuda.free(a);
//   cuda.peak_allocated();                        // 1024 + 3 MiB
//   cuda.peak_reserved();                         // 2 MiB (small pool) + 20 MiB (large pool)
//
// The constants are PyTorch 2.11's defaults (PYTORCH_CUDA_ALLOC_CONF unset),
// each with its source below. What is modelled: size rounding, the small (<=
// 1 MiB) and large pools, segment sizes, best-fit reuse of a cached block of
// the same stream and pool (smallest block that fits, ties to the older
// segment), splitting (small pool: when at least 512 bytes remain; large pool:
// when more than 1 MiB remains; an unsplit block counts whole as allocated),
// and merging of free neighbours within a segment. What is not: expandable
// segments, max_split_size_mb and roundup_power2_divisions (their defaults
// turn them off), garbage collection, releasing cached segments on an
// out-of-memory retry (which would lower reserved, never allocated), and
// record_stream's deferred frees (a block freed while another stream uses it
// returns to the pool only when that stream's event completes).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <vector>

namespace fsdp_plan {

// c10/core/AllocatorConfig.h, namespace c10::CachingAllocator (torch 2.11):
//   kMinBlockSize  = 512       "all sizes are rounded to at least 512 bytes"
//   kSmallSize     = 1 MiB     "largest 'small' allocation is 1 MiB"
//   kSmallBuffer   = 2 MiB     "'small' allocations are packed in 2 MiB blocks"
//   kMinLargeAlloc = 10 MiB    "allocations between 1 and 10 MiB may use kLargeBuffer"
//   kRoundLarge    = 2 MiB     "round up large allocations to 2 MiB"
// c10/cuda/CUDACachingAllocator.cpp:
//   kLargeBuffer   = 20 MiB    "'large' allocations may be packed in 20 MiB blocks"
inline constexpr int64_t kMinBlockSize = 512;
inline constexpr int64_t kSmallSize = 1 << 20;
inline constexpr int64_t kSmallBuffer = 2 << 20;
inline constexpr int64_t kMinLargeAlloc = 10 << 20;
inline constexpr int64_t kRoundLarge = 2 << 20;
inline constexpr int64_t kLargeBuffer = 20 << 20;

// The size of the block a request of `bytes` asks for (round_size: at least
// kMinBlockSize, a multiple of it).
int64_t round_size(int64_t bytes);
// The size of the segment cudaMalloc'd when no cached block fits a block of
// `rounded` bytes (get_allocation_size).
int64_t segment_size(int64_t rounded);

class CachingAllocatorModel {
 public:
  // A block handed out; pass it back to free().
  using Handle = int64_t;

  // Allocates `bytes` (> 0) on `stream` (any id: blocks are reused only by
  // allocations on the stream that freed them). Zero-byte requests allocate
  // nothing and return -1, as the allocator returns a null pointer.
  Handle allocate(int64_t bytes, int stream);
  // REQUIRES: `handle` came from allocate() and was not freed. -1 is ignored.
  void free(Handle handle);

  int64_t allocated() const { return allocated_; }
  int64_t reserved() const { return reserved_; }
  int64_t peak_allocated() const { return peak_allocated_; }
  int64_t peak_reserved() const { return peak_reserved_; }
  int64_t segments() const { return static_cast<int64_t>(segment_count_); }

 private:
  struct Block {
    int64_t segment = 0;
    int64_t offset = 0;
    int64_t size = 0;
    int stream = 0;
    bool small = false;
    bool free = true;
    Handle prev = -1, next = -1;  // neighbours in the segment
  };
  // Free blocks, ordered as the allocator's BlockComparatorSize: stream, size,
  // then address (segment order stands in for cudaMalloc's addresses).
  using FreeKey = std::tuple<int, int64_t, int64_t, int64_t>;  // stream, size, segment, offset
  FreeKey key_of(const Block& b) const { return {b.stream, b.size, b.segment, b.offset}; }
  void insert_free(Handle h);
  void erase_free(Handle h);

  std::map<Handle, Block> blocks_;
  std::set<FreeKey> free_small_, free_large_;
  std::map<std::tuple<int64_t, int64_t>, Handle> by_position_;  // (segment, offset) -> block
  Handle next_handle_ = 0;
  int64_t segment_count_ = 0;
  int64_t allocated_ = 0, reserved_ = 0, peak_allocated_ = 0, peak_reserved_ = 0;
};

}  // namespace fsdp_plan
