// Wires the model (model.h) into LibTorch: a CPU device guard that has
// streams and events, a CPU allocator that reports frees, and a dispatcher
// fallback that sees every op's tensor arguments.
//
// [Note: why global] The dispatcher's fallbacks, the device guard registry
// and the CPU allocator are process-wide in LibTorch, so the checker is too:
// one model at a time, reached through one atomic pointer. The pieces that
// LibTorch keeps pointers to (the guard and the allocator) are made once and
// never freed, as LibTorch requires of them.
#include "stream_check/stream_check.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "model.h"

namespace fsdp::stream_check {
namespace {

using detail::Clock;
using detail::EventState;
using detail::Model;

// A mode key (above autograd): every op called on a tracked thread reaches
// the fallback first, composite ones whole and then their parts.
constexpr c10::DispatchKey kModeKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

std::atomic<Model*> g_model{nullptr};

// [Note: the model outlives its users on other threads] Tensors made under a
// Checker may be freed on any thread: Gloo's worker thread drops a finished
// collective's tensors when its work object dies, which can be while the
// test's thread destroys the Checker. A free that had loaded the model then
// locked the mutex of a deleted one, and its rank hung (CI, twice). So the
// hooks any thread can reach hold a ModelUse while they use the model, and
// ~Checker, once g_model is null, waits for the uses in progress before it
// deletes it. Sequentially consistent: a use either sees null or is seen.
std::atomic<int> g_model_uses{0};

class ModelUse {
 public:
  explicit ModelUse(bool wanted = true) {
    if (!wanted) return;
    counted_ = true;
    g_model_uses.fetch_add(1);
    model_ = g_model.load();
  }
  ~ModelUse() {
    if (counted_) g_model_uses.fetch_sub(1);
  }
  ModelUse(const ModelUse&) = delete;
  ModelUse& operator=(const ModelUse&) = delete;
  Model* get() const { return model_; }

 private:
  bool counted_ = false;
  Model* model_ = nullptr;
};

thread_local bool t_tracked = false;
thread_local c10::StreamId t_stream = 0;
thread_local const char* t_phase = nullptr;
thread_local const char* t_op = nullptr;
// > 0 inside HostScope or an op of the host: the host's own work.
thread_local int t_host_depth = 0;
thread_local bool t_host_pinned = false;

// Who does what the calling thread does now: the host or its current stream.
int current_agent() { return t_host_depth > 0 ? Model::kHostStream : static_cast<int>(t_stream); }

Model* tracked_model() { return t_tracked ? g_model.load(std::memory_order_acquire) : nullptr; }

const c10::Device kCpu(c10::kCPU);

int stream_id(const c10::Stream& s) { return static_cast<int>(s.id()); }

// The CPU device guard while a Checker lives: CPU streams are the model's
// logical streams, the current one per thread; events hold vector clocks.
class CheckedCpuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return c10::kCPU; }
  c10::Device exchangeDevice(c10::Device) const override { return kCpu; }
  c10::Device getDevice() const override { return kCpu; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override { return c10::Stream(c10::Stream::UNSAFE, kCpu, t_stream); }
  c10::Stream getDefaultStream(c10::Device) const override { return c10::Stream(c10::Stream::DEFAULT, kCpu); }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool high_priority) const override {
    return make_stream(high_priority ? "pool (high priority)" : "pool");
  }
  c10::Stream getNewStream(c10::Device, int) const override { return make_stream("new"); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::StreamId previous = t_stream;
    t_stream = s.id();
    return c10::Stream(c10::Stream::UNSAFE, kCpu, previous);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventState*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag) const override {
    Model* m = model();
    if (*event == nullptr) *event = new EventState();
    static_cast<EventState*>(*event)->clock = m->record(stream_id(stream));
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;  // never recorded: no-op, as on CUDA
    model()->block(static_cast<EventState*>(event)->clock, stream_id(stream));
  }
  bool queryEvent(void*) const override { return true; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream& stream) const override {
    Model* m = model();
    m->host_sync(m->record(stream_id(stream)), "stream synchronize", t_phase);
  }
  void synchronizeEvent(void* event) const override {
    // An event never recorded is complete: no wait, as on CUDA.
    if (event != nullptr) model()->host_sync(static_cast<EventState*>(event)->clock, "event synchronize", t_phase);
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    model()->host_sync_all("device synchronize", t_phase);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& stream) const override {
    if (data_ptr.get() != nullptr) model()->record_stream(data_ptr.get(), stream_id(stream));
  }
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }

 private:
  static Model* model() {
    Model* m = g_model.load(std::memory_order_acquire);
    TORCH_CHECK(m != nullptr,
                "fsdp2cpp stream_check: a CPU stream or event was used after its Checker was destroyed; keep the "
                "Checker alive while models made under it are used");
    return m;
  }
  static c10::Stream make_stream(const char* kind) {
    return c10::Stream(c10::Stream::UNSAFE, kCpu, model()->new_stream(std::string(kind) + " stream"));
  }
};

// The CPU allocator while a Checker lives (and after: it forwards). Keeps the
// default allocator's raw interface (context == data), so raw_allocate works.
c10::DeleterFnPtr g_base_deleter = nullptr;

void checked_free(void* ptr) {
  {
    const ModelUse use;
    if (Model* m = use.get()) m->on_free(ptr, t_phase);
  }
  g_base_deleter(ptr);
}

class CheckedCpuAllocator final : public c10::Allocator {
 public:
  explicit CheckedCpuAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* ptr = inner.get();
    if (ptr == nullptr) return inner;
    TORCH_INTERNAL_ASSERT(inner.get_context() == ptr && inner.get_deleter() == g_base_deleter,
                          "fsdp2cpp stream_check: the CPU allocator's memory is not its own context");
    inner.release_context();
    const ModelUse use(t_tracked);
    if (Model* m = use.get()) m->on_alloc(ptr, n, current_agent(), t_phase, t_op, t_host_pinned);
    return {ptr, ptr, &checked_free, kCpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &checked_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { base_->copy_data(dest, src, count); }

 private:
  c10::Allocator* base_;
};

void install_allocator_once() {
  static const bool installed = [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    g_base_deleter = base->raw_deleter();
    TORCH_CHECK(g_base_deleter != nullptr,
                "fsdp2cpp stream_check: the CPU allocator has no raw deleter, so frees cannot be observed");
    c10::SetCPUAllocator(new CheckedCpuAllocator(base), /*priority=*/0);
    return true;
  }();
  (void)installed;
}

CheckedCpuGuardImpl* guard_impl() {
  static auto* impl = new CheckedCpuGuardImpl();
  return impl;
}

auto& guard_slot() { return c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::kCPU)]; }

const c10::impl::DeviceGuardImplInterface* g_original_guard = nullptr;

// The byte range of `t` within its storage, accessed by `agent`.
void record_tensor(Model& m, const at::Tensor& t, bool write, const char* op, int agent) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  const void* base = t.storage().data();
  if (base == nullptr || t.device().type() != c10::kCPU) return;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * std::abs(t.stride(d));
  const int64_t item = static_cast<int64_t>(t.element_size());
  const int64_t begin = t.storage_offset() * item;
  m.access(base, begin, begin + extent * item, write, agent, t_phase, op);
}

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) f(e.toTensor());
    }
  }
}

bool writes(const c10::Argument& arg) {
  const c10::AliasInfo* info = arg.alias_info();
  if (info == nullptr) return false;
  if (info->isWrite()) return true;
  for (const c10::AliasInfo& inner : info->containedTypes()) {
    if (inner.isWrite()) return true;
  }
  return false;
}

bool aliases(const c10::Argument& arg) {
  const c10::AliasInfo* info = arg.alias_info();
  return info != nullptr && !writes(arg);
}

// Ops that touch no tensor data: allocation, metadata, views made by hand.
bool touches_no_data(const std::string& name) {
  static const char* const kPrefixes[] = {"aten::empty",         "aten::new_empty",
                                          "aten::resize",        "aten::set_",
                                          "aten::record_stream", "aten::_has_compatible_shallow_copy_type",
                                          "aten::size",          "aten::stride",
                                          "aten::is_",           "aten::_nested"};
  for (const char* p : kPrefixes) {
    if (name.compare(0, std::strlen(p), p) == 0) return true;
  }
  return false;
}

Memory memory_of(const Model& m, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.storage().data() == nullptr) return Memory::kDevice;
  return m.memory_of(t.storage().data());
}

// [Note: who runs an op] With host memory about (HostScope), an op whose
// tensors are all host memory is the host's; aten::copy_ between host and
// device memory is a transfer, run by the current stream; anything else is
// the current stream's. A 0-dim tensor is left out when the op has larger
// ones: a CPU scalar may join a CUDA kernel as a value, and an op's
// wrapped-number scalars are made as device memory here.
enum class Runner { kStream, kHost, kTransfer };

struct Classified {
  Runner runner = Runner::kStream;
  Memory host_side = Memory::kDevice;  // kTransfer: the host side's memory
  bool to_host = false;                // kTransfer: the destination is host memory
  bool non_blocking = false;           // kTransfer: copy_'s non_blocking
};

Classified classify(const Model& m, const std::string& name, const c10::FunctionSchema& schema,
                    const torch::jit::Stack& stack) {
  Classified c;
  if (t_host_depth > 0) {
    c.runner = Runner::kHost;
    return c;
  }
  if (!m.has_host_memory()) return c;
  const size_t count = schema.arguments().size();
  const size_t first = stack.size() - count;
  struct Seen {
    int hosts = 0, devices = 0;
  } all, sized;
  for (size_t i = 0; i < count; ++i) {
    for_each_tensor(stack[first + i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      const bool host = memory_of(m, t) != Memory::kDevice;
      (host ? all.hosts : all.devices) += 1;
      if (t.dim() > 0) (host ? sized.hosts : sized.devices) += 1;
    });
  }
  const Seen& counted = sized.hosts + sized.devices > 0 ? sized : all;
  if (counted.hosts == 0) return c;
  if (counted.devices == 0) {
    c.runner = Runner::kHost;
    return c;
  }
  if (name == "aten::copy_") {
    const at::Tensor& dst = stack[first].toTensor();
    const at::Tensor& src = stack[first + 1].toTensor();
    const Memory dst_memory = memory_of(m, dst);
    c.runner = Runner::kTransfer;
    c.to_host = dst_memory != Memory::kDevice;
    c.host_side = c.to_host ? dst_memory : memory_of(m, src);
    c.non_blocking = count > 2 && stack[first + 2].isBool() && stack[first + 2].toBool();
  }
  return c;
}

// A non-blocking upload from pageable memory: cudaMemcpyAsync stages the
// source through a pinned buffer before it returns, so the host reads it then,
// and does not wait for the stream.
bool staged_by_the_host(const Classified& c) {
  return c.runner == Runner::kTransfer && c.non_blocking && !c.to_host && c.host_side == Memory::kPageableHost;
}

// After a transfer, as cudaMemcpyAsync and copy_ behave: non-blocking between
// pinned and device memory, or staged from pageable memory, it leaves the host
// free; otherwise the host waits for it (copy_ synchronizes the stream when
// not non_blocking; a copy to pageable memory returns when it is done).
void after_transfer(Model& m, const Classified& c) {
  if (c.non_blocking && (c.host_side == Memory::kPinnedHost || staged_by_the_host(c))) return;
  const char* what =
      c.non_blocking ? "aten::copy_ device to pageable host memory (non_blocking, but synchronous)"
                     : (c.to_host ? "aten::copy_ device to host (blocking)" : "aten::copy_ host to device (blocking)");
  m.host_sync(m.record(static_cast<int>(t_stream)), what, t_phase);
}

void throw_if_raced(Model& m) {
  if (auto message = m.take_unthrown()) TORCH_CHECK(false, "fsdp2cpp: ", *message);
}

void checked_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  Model* m = tracked_model();
  const c10::FunctionSchema& schema = op.schema();
  const std::string& name = schema.name();
  const bool no_data = m == nullptr || touches_no_data(name);
  const char* previous_op = t_op;
  Classified runs;
  if (m != nullptr) {
    throw_if_raced(*m);
    t_op = name.c_str();
    runs = classify(*m, name, schema, *stack);
  }
  const bool on_host = runs.runner == Runner::kHost;
  const int agent = on_host ? Model::kHostStream : static_cast<int>(t_stream);
  const auto& args = schema.arguments();
  const size_t first_arg = stack->size() - args.size();
  if (!no_data) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (aliases(args[i])) continue;  // a view of it is made; no data is read
      const bool write = writes(args[i]);
      // copy_'s source (argument 1) staged by the host is read by the host.
      const int reader = i == 1 && staged_by_the_host(runs) ? Model::kHostStream : agent;
      for_each_tensor((*stack)[first_arg + i],
                      [&](const at::Tensor& t) { record_tensor(*m, t, write, name.c_str(), reader); });
    }
    throw_if_raced(*m);
  }
  const size_t returns = schema.returns().size();
  // The host's op runs whole on the host: its parts, and the memory they
  // allocate (host memory), are the host's too.
  if (on_host) ++t_host_depth;
  try {
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kModeKey), stack);
  } catch (...) {
    if (on_host) --t_host_depth;
    t_op = previous_op;
    throw;
  }
  if (on_host) --t_host_depth;
  t_op = previous_op;
  if (no_data) return;
  const auto& rets = schema.returns();
  const size_t first = stack->size() - returns;
  for (size_t i = 0; i < returns; ++i) {
    if (rets[i].alias_info() != nullptr) continue;
    for_each_tensor((*stack)[first + i], [&](const at::Tensor& t) { record_tensor(*m, t, true, name.c_str(), agent); });
  }
  if (runs.runner == Runner::kTransfer) after_transfer(*m, runs);
  // Reading a device value on the host waits for the stream that made it.
  if (name == "aten::_local_scalar_dense" && !on_host) {
    m->host_sync(m->record(static_cast<int>(t_stream)), "aten::_local_scalar_dense (item() or another scalar read)",
                 t_phase);
  }
  throw_if_raced(*m);
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, lib) {
  lib.fallback(torch::CppFunction::makeFromBoxedFunction<&checked_fallback>());
}

void start_tracking_this_thread() {
  t_tracked = true;
  t_stream = 0;
  c10::impl::tls_set_dispatch_key_included(kModeKey, true);
}

// FSDP2CPP_STREAM_CHECK=1: a checker for the whole process, made at load.
struct EnvironmentChecker {
  EnvironmentChecker() {
    const char* v = std::getenv("FSDP2CPP_STREAM_CHECK");
    if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "0") == 0) return;
    checker = new Checker(Options{OnRace::kThrow});
  }
  ~EnvironmentChecker() {
    Model* m = g_model.load();
    if (checker == nullptr || m == nullptr) return;
    const std::vector<std::string> left = m->unthrown();
    if (left.empty()) return;
    for (const std::string& message : left) std::fprintf(stderr, "fsdp2cpp: %s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(3);
  }
  // Never deleted: the models a program made under it live until exit.
  Checker* checker = nullptr;
};

EnvironmentChecker g_environment_checker;

}  // namespace

Checker::Checker(Options options) {
  install_allocator_once();
  auto* model = new Model(options);
  Model* expected = nullptr;
  if (!g_model.compare_exchange_strong(expected, model)) {
    delete model;
    TORCH_CHECK(false,
                "fsdp2cpp stream_check: a Checker is already alive in this process (one at a time; "
                "FSDP2CPP_STREAM_CHECK=1 makes one for the whole process)");
  }
  g_original_guard = guard_slot().exchange(guard_impl());
  start_tracking_this_thread();
}

Checker::~Checker() {
  c10::impl::tls_set_dispatch_key_included(kModeKey, false);
  t_tracked = false;
  t_stream = 0;
  guard_slot().store(g_original_guard);
  Model* model = g_model.exchange(nullptr);
  while (g_model_uses.load() != 0) std::this_thread::yield();
  delete model;
}

c10::Stream Checker::new_stream(const std::string& name) {
  return c10::Stream(c10::Stream::UNSAFE, kCpu, g_model.load()->new_stream(name));
}

std::vector<Report> Checker::reports() const { return g_model.load()->reports(); }

void Checker::clear_reports() { g_model.load()->clear_reports(); }

std::vector<HostSync> host_syncs() {
  Model* m = g_model.load(std::memory_order_acquire);
  return m != nullptr ? m->host_syncs() : std::vector<HostSync>();
}

void clear_host_syncs() {
  if (Model* m = g_model.load(std::memory_order_acquire)) m->clear_host_syncs();
}

bool active() { return g_model.load(std::memory_order_acquire) != nullptr; }

namespace {
std::atomic<bool> g_meta_streams{false};
std::atomic<MetaStreamNamer> g_meta_stream_namer{nullptr};
}  // namespace

bool meta_streams() { return g_meta_streams.load(std::memory_order_acquire); }

void set_meta_streams(bool modelled) { g_meta_streams.store(modelled, std::memory_order_release); }

void set_meta_stream_namer(MetaStreamNamer namer) { g_meta_stream_namer.store(namer, std::memory_order_release); }

bool models_nccl() {
  const Model* m = g_model.load(std::memory_order_acquire);
  return m != nullptr && m->options().collectives == CollectiveModel::kNccl;
}

CollectiveModel collective_model_from_env() {
  const char* v = std::getenv("FSDP2CPP_STREAM_CHECK_MODEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "gloo") == 0) return CollectiveModel::kGloo;
  TORCH_CHECK(std::strcmp(v, "nccl") == 0, "fsdp2cpp stream_check: FSDP2CPP_STREAM_CHECK_MODEL='", v,
              "' is neither gloo nor nccl; set it to nccl to check the runtime as NCCL runs it, or unset it");
  return CollectiveModel::kNccl;
}

void track_this_thread() {
  if (active()) start_tracking_this_thread();
}

void name_buffer(const at::Tensor& t, std::string name) {
  Model* m = g_model.load(std::memory_order_acquire);
  if (m == nullptr || !t.defined() || !t.has_storage() || t.storage().data() == nullptr) return;
  m->name_buffer(t.storage().data(), std::move(name));
}

void name_stream(const c10::Stream& stream, std::string name) {
  if (stream.device_type() == c10::kMeta) {
    if (MetaStreamNamer namer = g_meta_stream_namer.load(std::memory_order_acquire)) namer(stream.id(), name);
    return;
  }
  Model* m = g_model.load(std::memory_order_acquire);
  if (m != nullptr && stream.device_type() == c10::kCPU) m->name_stream(stream_id(stream), std::move(name));
}

c10::Stream collective_stream(const void* communicator, const std::string& name) {
  Model* m = g_model.load(std::memory_order_acquire);
  TORCH_CHECK(m != nullptr, "fsdp2cpp stream_check: collective_stream() needs a live Checker");
  return c10::Stream(c10::Stream::UNSAFE, kCpu, m->collective_stream(communicator, name));
}

void record_access(const at::Tensor& t, bool write, const char* what) {
  if (Model* m = tracked_model()) {
    record_tensor(*m, t, write, what, current_agent());
    throw_if_raced(*m);
  }
}

void host_wait(const c10::Event& event, const char* what) {
  Model* m = tracked_model();
  if (m == nullptr || event.device_type() != c10::kCPU) return;
  const auto* state = static_cast<const EventState*>(event.eventId());
  // Never recorded: complete, but the host still stopped to find that out.
  m->host_sync(state != nullptr ? state->clock : Clock(), what, t_phase);
}

Memory memory_of(const at::Tensor& t) {
  const Model* m = g_model.load(std::memory_order_acquire);
  return m != nullptr ? memory_of(*m, t) : Memory::kDevice;
}

HostScope::HostScope(bool pinned) : previous_pinned_(t_host_pinned) {
  ++t_host_depth;
  t_host_pinned = pinned;
}

HostScope::~HostScope() {
  --t_host_depth;
  t_host_pinned = previous_pinned_;
}

PhaseLabel::PhaseLabel(const char* label) : previous_(t_phase) { t_phase = label; }

PhaseLabel::~PhaseLabel() { t_phase = previous_; }

}  // namespace fsdp::stream_check
