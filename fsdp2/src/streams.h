// Internal: the streams and events of the FSDP runtime, device-generic.
//
// [Note: streams on CPU] On CPU there is no stream pool and no events; every
// operation here degrades to a no-op there (StreamSet::enabled() is false),
// so the runtime is written once and orders work correctly on both. On CUDA
// the c10 device-generic API is used (c10::Stream, c10::Event, the device
// guard implementation registered by libc10_cuda), so this code compiles
// without CUDA headers and the public headers never change shape.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

namespace fsdp::detail {

// A recorded point on a stream; empty (and a no-op) on CPU.
class DeviceEvent {
 public:
  DeviceEvent() = default;
  // Records an event on `stream`; no-op when `stream` is unset.
  static DeviceEvent record(const std::optional<c10::Stream>& stream);
  // Makes `stream` wait for this event (no host block). No-op when empty.
  void block(const std::optional<c10::Stream>& stream) const;
  // Blocks the host until the event completed. No-op when empty.
  void synchronize() const;
  bool empty() const { return !event_; }

 private:
  std::shared_ptr<c10::Event> event_;
};

// The streams one root's FSDP tree uses (FSDP2's FSDPCommContext streams).
class StreamSet {
 public:
  explicit StreamSet(c10::Device device);
  bool enabled() const { return current_stream().has_value(); }
  c10::Device device() const { return device_; }

  // The caller's current stream, or unset on CPU.
  std::optional<c10::Stream> current_stream() const { return current_stream_of(device_); }
  // The caller's current stream on `device`, or unset where there are none.
  static std::optional<c10::Stream> current_stream_of(c10::Device device);
  // High priority, for copy-in and all-gather (prefetch overlaps compute).
  const std::optional<c10::Stream>& all_gather_copy_in() const { return all_gather_copy_in_; }
  const std::optional<c10::Stream>& all_gather() const { return all_gather_; }
  const std::optional<c10::Stream>& reduce_scatter() const { return reduce_scatter_; }
  const std::optional<c10::Stream>& all_reduce() const { return all_reduce_; }

  // `waiter` waits for all work currently enqueued on `stream`.
  static void wait_stream(const std::optional<c10::Stream>& waiter, const std::optional<c10::Stream>& stream);
  // Tells the caching allocator that `t`'s memory is used on `stream`, so it
  // is not reused before that stream's work finishes. No-op on CPU.
  static void record_stream(const at::Tensor& t, const std::optional<c10::Stream>& stream);

 private:
  c10::Device device_;
  std::optional<c10::Stream> all_gather_copy_in_;
  std::optional<c10::Stream> all_gather_;
  std::optional<c10::Stream> reduce_scatter_;
  std::optional<c10::Stream> all_reduce_;
};

// Makes `stream` current for the scope (no-op when unset).
class OptionalStreamGuard {
 public:
  explicit OptionalStreamGuard(const std::optional<c10::Stream>& stream) {
    if (stream) guard_.emplace(*stream);
  }

 private:
  std::optional<c10::StreamGuard> guard_;
};

}  // namespace fsdp::detail
