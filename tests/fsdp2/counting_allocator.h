// A CPU allocator for tests that counts the live allocations of each size,
// so that a test can assert which buffers the runtime keeps alive (an
// all-gather output, a reduce-scatter input) by their exact byte size.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace fsdp::test {

class CountingCPUAllocator final : public c10::Allocator {
 public:
  // Lives for the whole process: tensors allocated through it may outlive
  // the scope that installed it.
  static CountingCPUAllocator& instance() {
    static auto* allocator = new CountingCPUAllocator();
    return *allocator;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base_->allocate(nbytes);
    void* data = inner.get();
    if (data == nullptr) return inner;
    const c10::Device device = inner.device();
    std::lock_guard<std::mutex> lock(mutex_);
    ++live_[nbytes];
    // The context is the data pointer itself, as raw_allocate requires.
    entries_.emplace(data, Entry{std::move(inner), nbytes});
    return c10::DataPtr(data, data, &CountingCPUAllocator::release, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingCPUAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Live allocations of exactly `nbytes`.
  int64_t live(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(nbytes);
    return it == live_.end() ? 0 : it->second;
  }

 private:
  friend class ScopedCountingAllocator;
  struct Entry {
    c10::DataPtr inner;
    size_t nbytes;
  };
  static void release(void* data) {
    auto& self = instance();
    c10::DataPtr inner;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.entries_.find(data);
      if (it == self.entries_.end()) return;
      --self.live_[it->second.nbytes];
      inner = std::move(it->second.inner);
      self.entries_.erase(it);
    }
    // `inner` frees the memory here, outside the lock.
  }

  c10::Allocator* base_ = nullptr;
  std::mutex mutex_;
  std::map<size_t, int64_t> live_;
  std::unordered_map<void*, Entry> entries_;
};

// Makes CountingCPUAllocator the process's CPU allocator for the scope.
class ScopedCountingAllocator {
 public:
  ScopedCountingAllocator() : previous_(c10::GetCPUAllocator()) {
    auto& counting = CountingCPUAllocator::instance();
    if (previous_ != &counting) counting.base_ = previous_;
    c10::SetCPUAllocator(&counting, kPriority);
  }
  ~ScopedCountingAllocator() { c10::SetCPUAllocator(previous_, kPriority); }
  ScopedCountingAllocator(const ScopedCountingAllocator&) = delete;
  ScopedCountingAllocator& operator=(const ScopedCountingAllocator&) = delete;

  int64_t live(size_t nbytes) { return CountingCPUAllocator::instance().live(nbytes); }
  // live(nbytes) once it is at most `expected`, or after a second. Gloo's
  // worker thread drops its reference to a collective's buffers just after
  // the collective's waiter wakes up, so a buffer the caller freed may stay
  // counted for a moment.
  int64_t settled_live(size_t nbytes, int64_t expected) {
    for (int i = 0; i < 1000 && live(nbytes) > expected; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return live(nbytes);
  }

 private:
  static constexpr uint8_t kPriority = 100;
  c10::Allocator* previous_;
};

}  // namespace fsdp::test
