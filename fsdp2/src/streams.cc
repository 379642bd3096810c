#include "streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "stream_check/stream_check.h"

namespace fsdp::detail {
namespace {

// Under the stream-order checker the CPU has (modelled) streams, and in the
// planner's dry run of a CUDA job the meta device has; the runtime then takes
// the paths it takes on CUDA (stream_check.h).
bool has_streams(c10::DeviceType type) {
  if (type == c10::kCPU) return stream_check::active();
  if (type == c10::kMeta) return stream_check::meta_streams();
  return true;
}

}  // namespace

DeviceEvent DeviceEvent::record(const std::optional<c10::Stream>& stream) {
  DeviceEvent e;
  if (!stream) return e;
  e.event_ = std::make_shared<c10::Event>(stream->device_type());
  e.event_->record(*stream);
  return e;
}

void DeviceEvent::block(const std::optional<c10::Stream>& stream) const {
  if (event_ && stream) event_->block(*stream);
}

void DeviceEvent::synchronize() const {
  if (event_) event_->synchronize();
}

StreamSet::StreamSet(c10::Device device) : device_(device) {
  if (!has_streams(device.type())) return;
  c10::impl::VirtualGuardImpl impl(device.type());
  // Copy-in and all-gather are high priority so that a prefetched all-gather
  // is not queued behind compute kernels (FSDP2 does the same).
  all_gather_copy_in_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  all_gather_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  reduce_scatter_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  all_reduce_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  // Named for the stream-order checker's reports, and for the planner's dry
  // run, which tells FSDP's streams apart by these names.
  if (stream_check::active() || stream_check::meta_streams()) {
    stream_check::name_stream(*all_gather_copy_in_, "all-gather copy-in");
    stream_check::name_stream(*all_gather_, "all-gather");
    stream_check::name_stream(*reduce_scatter_, "reduce-scatter");
    stream_check::name_stream(*all_reduce_, "all-reduce");
  }
}

std::optional<c10::Stream> StreamSet::current_stream_of(c10::Device device) {
  if (!has_streams(device.type())) return std::nullopt;
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

void StreamSet::wait_stream(const std::optional<c10::Stream>& waiter, const std::optional<c10::Stream>& stream) {
  if (!waiter || !stream || *waiter == *stream) return;
  DeviceEvent::record(stream).block(waiter);
}

void StreamSet::record_stream(const at::Tensor& t, const std::optional<c10::Stream>& stream) {
  if (!stream || !t.defined() || !t.has_storage()) return;
  c10::impl::VirtualGuardImpl(stream->device_type()).recordDataPtrOnStream(t.storage().data_ptr(), *stream);
}

}  // namespace fsdp::detail
