#include "fsdp_plan/caching_allocator.h"

#include <algorithm>

#include <c10/util/Exception.h>

namespace fsdp_plan {

int64_t round_size(int64_t bytes) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * ((bytes + kMinBlockSize - 1) / kMinBlockSize);
}

int64_t segment_size(int64_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
}

void CachingAllocatorModel::insert_free(Handle h) {
  const Block& b = blocks_.at(h);
  (b.small ? free_small_ : free_large_).insert(key_of(b));
}

void CachingAllocatorModel::erase_free(Handle h) {
  const Block& b = blocks_.at(h);
  (b.small ? free_small_ : free_large_).erase(key_of(b));
}

CachingAllocatorModel::Handle CachingAllocatorModel::allocate(int64_t bytes, int stream) {
  TORCH_CHECK(bytes >= 0, "fsdp_plan: CachingAllocatorModel::allocate: negative size ", bytes);
  if (bytes == 0) return -1;
  const int64_t size = round_size(bytes);
  const bool small = size <= kSmallSize;
  std::set<FreeKey>& pool = small ? free_small_ : free_large_;
  Handle h = -1;
  auto it = pool.lower_bound(FreeKey{stream, size, INT64_MIN, INT64_MIN});
  if (it != pool.end() && std::get<0>(*it) == stream) {
    h = by_position_.at({std::get<2>(*it), std::get<3>(*it)});
    pool.erase(it);
  } else {
    // No cached block fits: a new segment (cudaMalloc).
    Block seg;
    seg.segment = segment_count_++;
    seg.size = segment_size(size);
    seg.stream = stream;
    seg.small = small;
    h = next_handle_++;
    blocks_[h] = seg;
    by_position_[{seg.segment, 0}] = h;
    reserved_ += seg.size;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
  }
  Block& b = blocks_.at(h);
  const int64_t remaining = b.size - size;
  // should_split(): the small pool splits whenever a minimum block remains;
  // the large pool only when more than a small allocation's worth does.
  if (small ? remaining >= kMinBlockSize : remaining > kSmallSize) {
    Block rest = b;
    rest.offset = b.offset + size;
    rest.size = remaining;
    rest.prev = h;
    rest.free = true;
    const Handle r = next_handle_++;
    if (b.next >= 0) blocks_.at(b.next).prev = r;
    b.next = r;
    b.size = size;
    blocks_[r] = rest;
    by_position_[{rest.segment, rest.offset}] = r;
    insert_free(r);
  }
  Block& got = blocks_.at(h);
  got.free = false;
  allocated_ += got.size;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  return h;
}

void CachingAllocatorModel::free(Handle handle) {
  if (handle < 0) return;
  auto found = blocks_.find(handle);
  TORCH_CHECK(found != blocks_.end() && !found->second.free, "fsdp_plan: CachingAllocatorModel::free: block ", handle,
              " is not allocated");
  Handle h = handle;
  Block& b = found->second;
  b.free = true;
  allocated_ -= b.size;
  // try_merge_blocks(): absorb free neighbours of the same segment.
  for (Handle side : {b.prev, b.next}) {
    if (side < 0) continue;
    Block& other = blocks_.at(side);
    if (!other.free) continue;
    erase_free(side);
    Block& self = blocks_.at(h);
    by_position_.erase({other.segment, other.offset});
    by_position_.erase({self.segment, self.offset});
    if (side == self.prev) {
      self.offset = other.offset;
      self.prev = other.prev;
      if (other.prev >= 0) blocks_.at(other.prev).next = h;
    } else {
      self.next = other.next;
      if (other.next >= 0) blocks_.at(other.next).prev = h;
    }
    self.size += other.size;
    by_position_[{self.segment, self.offset}] = h;
    blocks_.erase(side);
  }
  insert_free(h);
}

}  // namespace fsdp_plan
