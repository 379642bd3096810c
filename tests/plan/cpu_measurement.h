// Measures a real CPU run the way a DryRun predicts one, by wrapping the CPU
// allocator: every tensor allocation (size, FSDP phase label, allocating
// op, free), the peak of the program's tensor bytes, and the peak of the
// process's live heap bytes (what tools/bench/malloc_counter counts, read
// in-process with glibc's mallinfo2: bytes in use in every arena plus
// mmapped chunks), sampled at every allocation and free and as every ATen op
// starts and ends. Tensors that the collective engine's own worker threads
// allocate (Gloo's, for an all-gather in flight) are the engine's, not the
// program's: they are left out of both peaks (on CUDA the counterpart is
// NCCL's memory, which the caching allocator does not see), so what is
// compared is the program's live bytes against the dry run's. One at a time;
// not under the stream-order checker (which wraps the CPU allocator too).
#pragma once

#include <malloc.h>

#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>

#include "fsdp_plan/dry_run.h"

namespace fsdp_plan::test {

class CpuMeasurement {
 public:
  CpuMeasurement() {
    std::lock_guard<std::mutex> lock(mutex_);
    // The wrapper lives for the process and forwards to the CPU allocator it
    // found first: a worker thread of the engine may still be inside it
    // when a measurement ends.
    static Wrapper* const wrapper = [] {
      auto* w = new Wrapper;
      w->inner = c10::GetAllocator(c10::kCPU);
      c10::SetAllocator(c10::kCPU, w, /*priority=*/100);
      return w;
    }();
    (void)wrapper;
    self_ = this;
    generation_ = ++generations_;
    heap_baseline_ = heap_peak_ = heap_live_bytes();
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&enter, &exit)
            .scopes({at::RecordScope::USER_SCOPE, at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
  ~CpuMeasurement() {
    at::removeCallback(handle_);
    std::lock_guard<std::mutex> lock(mutex_);
    self_ = nullptr;
  }
  CpuMeasurement(const CpuMeasurement&) = delete;
  CpuMeasurement& operator=(const CpuMeasurement&) = delete;

  std::vector<AllocationRecord> allocations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return records_;
  }
  // The peak of the program's tensor bytes (the engine's threads' left out).
  int64_t peak() const { return peak_; }
  int64_t peak_seq() const { return peak_seq_; }
  // The peak of the live heap bytes less the engine's threads' tensors, above
  // what was live when the recorder was made.
  int64_t heap_peak_above_baseline() const { return heap_peak_ - heap_baseline_; }

 private:
  static int64_t heap_live_bytes() {
    const struct mallinfo2 info = mallinfo2();
    return static_cast<int64_t>(info.uordblks + info.hblkhd);
  }
  // REQUIRES: mutex_ held.
  void sample_heap() { heap_peak_ = std::max(heap_peak_, heap_live_bytes() - engine_live_); }

  // The wrapper keeps the inner allocation and hands out a DataPtr whose
  // context is its data pointer, as the CPU allocator's own (raw_allocate,
  // which oneDNN uses for scratch, requires it).
  struct Live {
    c10::DataPtr inner;
    int64_t index;
    uint64_t generation = 0;
  };
  struct Wrapper final : c10::Allocator {
    c10::Allocator* inner = nullptr;
    c10::DataPtr allocate(size_t n) override {
      c10::DataPtr block = inner->allocate(n);
      void* data = block.get();
      if (data == nullptr) return block;
      std::lock_guard<std::mutex> lock(mutex_);
      CpuMeasurement* owner = self_;
      if (owner == nullptr) {
        live_blocks_[data] = Live{std::move(block), -1};
        return {data, data, &release, c10::Device(c10::kCPU)};
      }
      AllocationRecord r;
      r.bytes = static_cast<int64_t>(n);
      r.allocated_at = ++owner->seq_;
      r.freed_at = INT64_MAX;
      // The engine's worker threads (Gloo's) are not the program's.
      r.stream = std::this_thread::get_id() == owner->thread_ ? 0 : -1;
      if (!labels_.empty()) r.fsdp_phase = labels_.back();
      for (const auto& o : ops_) r.op += (r.op.empty() ? "" : ">") + o.substr(o.find("::") + 2);
      owner->records_.push_back(r);
      if (r.stream != 0) owner->engine_live_ += r.bytes;
      owner->sample_heap();
      if (r.stream == 0) {
        owner->live_ += r.bytes;
        if (owner->live_ > owner->peak_) {
          owner->peak_ = owner->live_;
          owner->peak_seq_ = r.allocated_at;
        }
      }
      live_blocks_[data] = Live{std::move(block), static_cast<int64_t>(owner->records_.size() - 1), owner->generation_};
      return {data, data, &release, c10::Device(c10::kCPU)};
    }
    c10::DeleterFnPtr raw_deleter() const override { return &release; }
    void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  };
  static void release(void* data) {
    c10::DataPtr inner;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = live_blocks_.find(data);
      if (it == live_blocks_.end()) return;
      inner = std::move(it->second.inner);
      CpuMeasurement* r = self_;
      if (r != nullptr && it->second.index >= 0 && it->second.index < static_cast<int64_t>(r->records_.size()) &&
          r->generation_ == it->second.generation) {
        AllocationRecord& rec = r->records_[static_cast<size_t>(it->second.index)];
        rec.freed_at = ++r->seq_;
        if (rec.stream == 0) r->live_ -= rec.bytes;
        if (rec.stream != 0) r->engine_live_ -= rec.bytes;
        r->sample_heap();
      }
      live_blocks_.erase(it);
    }
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (self_ != nullptr) self_->sample_heap();
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      labels_.push_back(fn.name());
    } else {
      ops_.push_back(fn.name());
    }
    return nullptr;
  }
  static void exit(const at::RecordFunction& fn, at::ObserverContext*) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (self_ != nullptr) self_->sample_heap();
    auto& stack = fn.scope() == at::RecordScope::USER_SCOPE ? labels_ : ops_;
    if (!stack.empty()) stack.pop_back();
  }

  static inline std::mutex mutex_;
  static inline CpuMeasurement* self_ = nullptr;
  static inline thread_local std::vector<std::string> labels_, ops_;
  static inline std::map<void*, Live> live_blocks_;
  std::thread::id thread_ = std::this_thread::get_id();
  static inline uint64_t generations_ = 0;
  uint64_t generation_ = 0;
  at::CallbackHandle handle_ = 0;
  std::vector<AllocationRecord> records_;
  int64_t seq_ = 0, live_ = 0, peak_ = 0, peak_seq_ = 0;
  int64_t engine_live_ = 0, heap_baseline_ = 0, heap_peak_ = 0;
};

// The allocations live at sequence number `at`, summed by (FSDP phase,
// innermost op): what to print of a prediction and a measurement that
// disagree, to see which buffer does (live_by_origin(dry.allocations(), ...)
// against live_by_origin(measurement.allocations(), measurement.peak_seq())).
inline std::map<std::string, int64_t> live_by_origin(const std::vector<AllocationRecord>& records, int64_t at) {
  std::map<std::string, int64_t> out;
  for (const auto& r : records) {
    if (r.allocated_at > at || r.freed_at <= at || r.stream < 0) continue;
    std::string op = r.op.substr(r.op.rfind('>') == std::string::npos ? 0 : r.op.rfind('>') + 1);
    if (op.rfind("aten::", 0) == 0) op = op.substr(6);
    out[r.fsdp_phase.substr(0, r.fsdp_phase.find(' ')) + " | " + op] += r.bytes;
  }
  return out;
}

}  // namespace fsdp_plan::test
