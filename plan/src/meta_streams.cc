#include "meta_streams.h"

#include <atomic>
#include <string>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "stream_check/stream_check.h"

namespace fsdp_plan::detail {
namespace {

// [Note: why global] LibTorch's device guard registry is process-wide, so the
// listener the guard reports to is too: one at a time, behind one atomic
// pointer. The guard itself is made once and never freed (events made under
// it may be destroyed after it is uninstalled, through it).
std::atomic<MetaStreamListener*> g_listener{nullptr};
std::atomic<c10::StreamId> g_next_stream{1};
thread_local c10::StreamId t_stream = 0;

const c10::Device kMeta(c10::kMeta);

struct EventState {
  int64_t op = -1;  // the last op on the recorded stream then; -1: nothing to wait for
};

class MetaStreamGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return c10::kMeta; }
  c10::Device exchangeDevice(c10::Device) const override { return kMeta; }
  c10::Device getDevice() const override { return kMeta; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return c10::Stream(c10::Stream::UNSAFE, kMeta, t_stream); }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kMeta); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override { return new_stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return new_stream(); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::StreamId previous = t_stream;
    t_stream = s.id();
    return c10::Stream(c10::Stream::UNSAFE, kMeta, previous);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventState*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new EventState();
    MetaStreamListener* l = g_listener.load(std::memory_order_acquire);
    static_cast<EventState*>(*event)->op = l != nullptr ? l->last_op_on(stream.id()) : -1;
  }
  void block(void* event, const c10::Stream& stream) const override {
    // Never recorded: no-op, as on CUDA.
    if (event == nullptr) return;
    const int64_t op = static_cast<EventState*>(event)->op;
    if (MetaStreamListener* l = g_listener.load(std::memory_order_acquire); l != nullptr && op >= 0) {
      l->stream_waits(stream.id(), op);
    }
  }
  bool queryEvent(void*) const override { return true; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override {
    if (MetaStreamListener* l = g_listener.load(std::memory_order_acquire)) host_waits(l, l->last_op_on(stream.id()));
  }
  void synchronizeEvent(void* event) const override {
    MetaStreamListener* l = g_listener.load(std::memory_order_acquire);
    if (l != nullptr && event != nullptr) host_waits(l, static_cast<EventState*>(event)->op);
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    if (MetaStreamListener* l = g_listener.load(std::memory_order_acquire)) l->host_waits_for_all();
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }

 private:
  static c10::Stream new_stream() { return c10::Stream(c10::Stream::UNSAFE, kMeta, g_next_stream.fetch_add(1)); }
  static void host_waits(MetaStreamListener* l, int64_t op) {
    if (op >= 0) l->host_waits(op);
  }
};

void name_meta_stream(c10::StreamId stream, const std::string& name) {
  if (MetaStreamListener* l = g_listener.load(std::memory_order_acquire)) l->stream_named(stream, name);
}

auto& guard_slot() { return c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::kMeta)]; }

const c10::impl::DeviceGuardImplInterface* g_original_guard = nullptr;

}  // namespace

MetaStreams::MetaStreams(MetaStreamListener* listener) {
  TORCH_CHECK(listener != nullptr, "fsdp_plan: MetaStreams needs a listener");
  MetaStreamListener* none = nullptr;
  TORCH_CHECK(g_listener.compare_exchange_strong(none, listener),
              "fsdp_plan: the meta device's streams are already modelled for another dry run; one at a time");
  static auto* impl = new MetaStreamGuardImpl();
  g_original_guard = guard_slot().load();
  guard_slot().store(impl);
  t_stream = 0;
  fsdp::stream_check::set_meta_stream_namer(&name_meta_stream);
  fsdp::stream_check::set_meta_streams(true);
}

MetaStreams::~MetaStreams() {
  fsdp::stream_check::set_meta_streams(false);
  fsdp::stream_check::set_meta_stream_namer(nullptr);
  guard_slot().store(g_original_guard);
  t_stream = 0;
  g_listener.store(nullptr, std::memory_order_release);
}

c10::StreamId current_meta_stream() { return t_stream; }

}  // namespace fsdp_plan::detail
