#include "fsdp_plan/dry_run.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "collectives/world.h"
#include "dry_backend.h"
#include "fsdp_plan/caching_allocator.h"
#include "host_placement.h"
#include "kernel_call.h"
#include "meta_streams.h"

namespace fsdp_plan {

std::string to_string(Holder holder) {
  switch (holder) {
    case Holder::kParameters: return "sharded parameters";
    case Holder::kGradients: return "sharded gradients";
    case Holder::kOptimizerState: return "optimizer state";
    case Holder::kAllGather: return "all-gather buffers";
    case Holder::kUnshardedParameters: return "unsharded parameters";
    case Holder::kReduceScatter: return "reduce-scatter buffers";
    case Holder::kUnreducedGradients: return "unreduced gradients";
    case Holder::kActivations: return "activations";
    case Holder::kWorkspaces: return "kernel workspaces";
    case Holder::kTemporaries: return "temporaries";
  }
  return "?";
}

std::string to_string(StepPhase phase) {
  switch (phase) {
    case StepPhase::kSetup: return "setup";
    case StepPhase::kForward: return "forward";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kOptimizer: return "optimizer";
  }
  return "?";
}

namespace {

// The FSDP phase a label names, without its module: "FSDP::all_gather (layers.3)" -> "FSDP::all_gather".
std::string phase_of(const std::string& label) { return label.substr(0, label.find(' ')); }

// The CUDA stream FSDP2 runs a phase's work on: copy-in on the all-gather
// copy-in stream (FSDP2's foreach_all_gather allocates the all-gather input
// and output there), the reduce-scatter's output on the reduce-scatter
// stream, the HSDP all-reduce's on the all-reduce stream; everything else on
// the compute (current) stream. Without meta streams (a CPU job's dry run)
// it places every allocation and op; with them the runtime names its
// streams (Recorder::stream_now).
int stream_of(const std::string& phase) {
  if (phase == "FSDP::all_gather_copy_in") return 1;
  if (phase == "FSDP::all_gather") return 2;
  if (phase == "FSDP::reduce_scatter") return 3;
  if (phase == "FSDP::all_reduce") return 4;
  return 0;
}

std::optional<Holder> holder_of_phase(const std::string& phase) {
  if (phase == "FSDP::all_gather_copy_in" || phase == "FSDP::all_gather") return Holder::kAllGather;
  if (phase == "FSDP::all_gather_copy_out") return Holder::kUnshardedParameters;
  if (phase == "FSDP::reduce_scatter_copy_in" || phase == "FSDP::reduce_scatter" || phase == "FSDP::all_reduce" ||
      phase == "FSDP::post_backward_reduce") {
    return Holder::kReduceScatter;
  }
  return std::nullopt;
}

}  // namespace

struct DryRun::Recorder {
  struct Allocation {
    int64_t bytes = 0;
    int64_t allocated_at = 0;  // event sequence numbers
    int64_t freed_at = INT64_MAX;
    int64_t step = 0;
    StepPhase step_phase = StepPhase::kSetup;
    std::string fsdp_phase;  // label, e.g. "FSDP::all_gather_copy_in (layers.3)"
    std::optional<Holder> mark;
    CachingAllocatorModel::Handle block = -1;
    int stream = 0;
    std::string op;
    bool host = false;  // host memory ([Note: host memory in a dry run])
    bool pinned = false;
  };

  mutable std::mutex mutex;
  uint64_t generation = 0;
  std::vector<Allocation> allocations;
  std::vector<std::string> phase_stack;  // FSDP labels, innermost last
  int64_t seq = 0;
  int64_t live = 0, peak = 0, peak_seq = 0;
  // Host memory (a CUDA job's CPU offload): bytes as requested, and pinned
  // bytes as the pinned allocator hands them out (pinned_block_bytes).
  int64_t host_live = 0, host_peak = 0, host_peak_seq = 0, pinned_live = 0, pinned_peak = 0;
  int64_t step = 0;
  StepPhase step_phase = StepPhase::kSetup;
  std::vector<int64_t> backward_start;  // per step (index step - 1): the sequence number
  int64_t setup_end = INT64_MAX;        // the sequence number when step 1 began
  std::vector<int64_t> step_peaks;
  CachingAllocatorModel cuda;
  std::vector<CollectiveRecord> collectives;
  std::vector<OpRecord> ops;
  std::vector<torch::Tensor> tracked;  // parameters
  // The meta device's streams (a CUDA job's dry run): each stream's last op,
  // and the waits its next op (or the host's next op) inherits.
  std::unique_ptr<detail::MetaStreamListener> stream_listener;
  std::unique_ptr<detail::MetaStreams> streams;
  std::unordered_map<c10::StreamId, int64_t> last_op_on_stream;
  std::unordered_map<c10::StreamId, std::vector<int64_t>> pending_stream_waits;
  std::vector<int64_t> pending_host_waits;
  std::unordered_map<c10::StreamId, int> stream_roles;  // meta stream -> its FSDP stream (stream_of), by its name
  // cuBLAS's workspaces made so far, by handle (true: autograd's device
  // thread, which runs backward) and stream; 0 bytes when none are modelled.
  int64_t blas_workspace_bytes = 0;
  std::set<std::pair<bool, int>> blas_workspaces;
  const std::string& current_phase() const {
    static const std::string none;
    return phase_stack.empty() ? none : phase_stack.back();
  }
  // Marks the live allocation behind `t` (when it is one of ours).
  void mark(const at::Tensor& t, Holder holder, bool only_unmarked);
  // The index of the allocation behind `t`, or -1 when it is not one of ours.
  int64_t allocation_of(const at::Tensor& t) const;
  // The FSDP stream (stream_of's numbering) that work issued now runs on:
  // with meta streams, the one the calling thread's current stream is, by
  // the name the runtime gave it (stream_roles; the default stream and the
  // program's own streams are compute streams); without, the one FSDP2 uses
  // for `phase_label`'s phase.
  int stream_now(const std::string& phase_label);
  // Records an allocation of `bytes` on FSDP stream `stream` (stream_of's
  // numbering), or in host memory, made now; returns its index.
  int64_t record_allocation(int64_t bytes, int stream, detail::Placement placement = {});
  // Frees allocation `index` (the storage's last reference went away).
  void record_free(int64_t index);
  // The workspace cuBLAS makes for a matmul about to run on `stream`, when
  // its handle has none there yet.
  void make_blas_workspace(int stream);
  // Fills the fields every op record shares and appends it.
  void add_op(OpRecord op);
  void mark_live_optimizer_state();
};

namespace {

// The process's one recorder (one DryRun at a time); null when none.
std::mutex g_mutex;
DryRun::Recorder* g_recorder = nullptr;
uint64_t g_generation = 0;

struct Cell {
  uint64_t generation;
  int64_t index;
};

void on_free(void* ctx) {
  std::unique_ptr<Cell> cell(static_cast<Cell*>(ctx));
  std::lock_guard<std::mutex> lock(g_mutex);
  DryRun::Recorder* r = g_recorder;
  if (r == nullptr || r->generation != cell->generation) return;
  r->record_free(cell->index);
}

// What PyTorch's pinned-memory allocator hands out for a request of `bytes`:
// the next power of two (CachingHostAllocator rounds every request so, to
// reuse blocks), cached when freed.
int64_t pinned_block_bytes(int64_t bytes) {
  int64_t block = 1;
  while (block < bytes) block <<= 1;
  return block;
}

// The ATen ops (and autograd nodes) running on this thread, innermost last:
// the allocating op of a record, and whether an op called others (then its
// callees are the kernels, not it).
struct Frame {
  const char* name;
  bool aten;  // an ATen op, not an autograd node
  bool has_callees = false;
  std::unique_ptr<OpRecord> kernel;  // what it reads and costs, if it runs a kernel
  size_t allocations_before = 0;     // the recorder's allocations when it started
  // Its tensors in host memory (bytes) and whether any is the device's: an
  // op on host tensors only runs on the host, one on both moves the host's.
  int64_t host_bytes = 0;
  bool device_operand = false;
  std::vector<int64_t> counted;  // allocations counted (an in-place op returns what it wrote)
};
thread_local std::vector<Frame> t_frames;

// Counts tensor `t` (allocation `a`) among the operands of `frame`'s op.
void count_operand(const DryRun::Recorder& r, const at::Tensor& t, int64_t a, Frame& frame) {
  if (std::find(frame.counted.begin(), frame.counted.end(), a) != frame.counted.end()) return;
  frame.counted.push_back(a);
  if (r.allocations[static_cast<size_t>(a)].host) {
    frame.host_bytes += static_cast<int64_t>(t.numel()) * t.element_size();
  } else {
    frame.device_operand = true;
  }
}

const char* current_op() {
  for (auto it = t_frames.rbegin(); it != t_frames.rend(); ++it) {
    if (it->aten) return it->name;
  }
  return nullptr;
}

// The meta device's allocator: as ATen's (no memory, a null pointer), and
// while a DryRun lives it records the allocation, whose DataPtr context
// records the free.
class RecordingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    DryRun::Recorder* r = g_recorder;
    if (r == nullptr || nbytes == 0) return {nullptr, nullptr, &noop, c10::Device(c10::kMeta)};
    const detail::Placement placement =
        detail::host_placement_enabled() ? detail::current_placement() : detail::Placement{};
    const int64_t index =
        r->record_allocation(static_cast<int64_t>(nbytes), r->stream_now(r->current_phase()), placement);
    return {nullptr, new Cell{r->generation, index}, &on_free, c10::Device(c10::kMeta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}

 private:
  static void noop(void*) {}
};

RecordingMetaAllocator g_meta_allocator;

// What the schema of an ATen op says about its cost (looked up once per op).
struct OpInfo {
  bool free = false;                      // a view, an allocation or metadata: no kernel runs
  std::vector<bool> writes;               // per argument: written in place (alias annotation with '!')
  int query = -1, key = -1, causal = -1;  // attention: the arguments named so
};

// Ops that only allocate or change metadata, or views whose schema does not
// say so (_unsafe_view).
bool allocates_only(const std::string& name) {
  static const std::unordered_set<std::string> names = {"aten::resize_", "aten::set_",          "aten::lift_fresh",
                                                        "aten::detach_", "aten::record_stream", "aten::_unsafe_view"};
  return names.count(name) > 0 || name.rfind("aten::empty", 0) == 0 || name.rfind("aten::new_empty", 0) == 0;
}

const OpInfo& info_of(const at::RecordFunction& fn) {
  static std::mutex mutex;
  static std::unordered_map<std::string, OpInfo> cache;
  const std::string name = fn.name();
  // By overload: _chunk_cat.out writes its `out`, _chunk_cat writes nothing.
  const auto op_name = fn.operator_name();
  const std::string key = op_name ? name + "." + op_name->overload_name : name;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  OpInfo info;
  info.free = allocates_only(name);
  if (op_name) {
    if (auto handle = c10::Dispatcher::singleton().findSchema(*op_name)) {
      const c10::FunctionSchema& schema = handle->schema();
      bool returns_tensors = false, writes = false;
      for (const c10::Argument& r : schema.returns()) {
        if (r.alias_info() != nullptr && !r.alias_info()->isWrite()) info.free = true;  // a view
        const c10::TypePtr& type = r.real_type();
        if (type->isSubtypeOf(*c10::TensorType::get()) || type->isSubtypeOf(*c10::ListType::ofTensors())) {
          returns_tensors = true;
        }
      }
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const c10::Argument& a = schema.arguments()[i];
        info.writes.push_back(a.alias_info() != nullptr && a.alias_info()->isWrite());
        writes = writes || info.writes.back();
        if (a.name() == "query") info.query = static_cast<int>(i);
        if (a.name() == "key") info.key = static_cast<int>(i);
        if (a.name() == "is_causal") info.causal = static_cast<int>(i);
      }
      // Neither a result nor a write: a query (result_type, item).
      if (!returns_tensors && !writes) info.free = true;
    }
  }
  return cache.emplace(key, std::move(info)).first->second;
}

int64_t bytes_of(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? static_cast<int64_t>(t.numel()) * t.element_size() : 0;
  }
  if (v.isTensorList()) {
    int64_t total = 0;
    for (const at::Tensor& t : v.toTensorList().vec()) total += t.defined() ? t.numel() * t.element_size() : 0;
    return total;
  }
  return 0;
}

template <typename F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    if (v.toTensor().defined()) f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) {
      if (t.defined()) f(t);
    }
  }
}

// FLOPs of the matmuls and attention (2 per multiply-add): what tensor cores
// do. Attention's backward is 2.5 times its forward (five matmuls of the
// forward's two, FlashAttention's recomputation of the scores included).
void count_flops(const std::string& name, c10::ArrayRef<const c10::IValue> in, const OpInfo& info, OpRecord& op) {
  const auto size = [&](size_t arg, int64_t dim) { return in[arg].toTensor().size(dim); };
  if (name == "aten::mm" && in.size() >= 2) {
    op.flops = 2 * size(0, 0) * size(0, 1) * size(1, 1);
  } else if ((name == "aten::addmm") && in.size() >= 3) {
    op.flops = 2 * size(1, 0) * size(1, 1) * size(2, 1);
  } else if (name == "aten::bmm" && in.size() >= 2) {
    op.flops = 2 * size(0, 0) * size(0, 1) * size(0, 2) * size(1, 2);
  } else if (name == "aten::baddbmm" && in.size() >= 3) {
    op.flops = 2 * size(1, 0) * size(1, 1) * size(1, 2) * size(2, 2);
  } else if (name.find("scaled_dot_product") != std::string::npos && info.query >= 0 && info.key >= 0) {
    // query [batch, heads, q_len, head_dim], key [batch, kv_heads, k_len, head_dim]
    const auto q = static_cast<size_t>(info.query), k = static_cast<size_t>(info.key);
    const int64_t forward = 4 * size(q, 0) * size(q, 1) * size(q, 2) * size(k, 2) * size(q, 3);
    const bool causal = info.causal >= 0 && static_cast<size_t>(info.causal) < in.size() &&
                        in[static_cast<size_t>(info.causal)].isBool() && in[static_cast<size_t>(info.causal)].toBool();
    const bool backward = name.find("backward") != std::string::npos;
    op.flops = (backward ? forward * 5 / 2 : forward) / (causal ? 2 : 1);
    op.attention = true;
    return;
  } else {
    return;
  }
  op.matmul = true;
}

struct OpInfo;
const OpInfo& info_of(const at::RecordFunction& fn);
std::unique_ptr<OpRecord> start_kernel(const at::RecordFunction& fn, Frame& frame);

// FSDP phase labels reach us as RecordFunction user scopes (phase.h opens
// one for each phase when any callback is registered).
std::unique_ptr<at::ObserverContext> on_scope_enter(const at::RecordFunction& fn) {
  if (fn.scope() != at::RecordScope::USER_SCOPE) {
    // A callee that runs no kernel (an allocation, a view) leaves its caller
    // the kernel: flash attention's meta kernel allocates through at::empty.
    // (Autograd's own scopes, "detach", are not ATen ops.)
    const bool aten = fn.scope() == at::RecordScope::FUNCTION && std::strncmp(fn.name(), "aten::", 6) == 0;
    if (!t_frames.empty() && !(aten && info_of(fn).free)) t_frames.back().has_callees = true;
    Frame frame{fn.name(), aten};
    if (aten) frame.kernel = start_kernel(fn, frame);
    t_frames.push_back(std::move(frame));
    return nullptr;
  }
  if (std::strncmp(fn.name(), "FSDP::", 6) != 0) return nullptr;
  const std::string label = fn.name();
  std::lock_guard<std::mutex> lock(g_mutex);
  DryRun::Recorder* r = g_recorder;
  if (r == nullptr) return nullptr;
  r->phase_stack.push_back(label);
  if (phase_of(label) == "FSDP::post_backward") {
    // The group's full gradients, about to be reduced.
    for (const at::Tensor& p : r->tracked) {
      if (p.grad().defined()) r->mark(p.grad(), Holder::kUnreducedGradients, /*only_unmarked=*/true);
    }
  }
  return nullptr;
}

// What an op reads and its cost, taken as it starts (its inputs are gone by
// its end); null for an op that runs no kernel.
std::unique_ptr<OpRecord> start_kernel(const at::RecordFunction& fn, Frame& frame) {
  const OpInfo& info = info_of(fn);
  if (info.free) return nullptr;
  auto op = std::make_unique<OpRecord>();
  op->name = fn.name();
  const c10::ArrayRef<const c10::IValue> in = fn.inputs();
  bool dtype_known = false;
  for (const c10::IValue& v : in) {
    op->bytes += bytes_of(v);
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!dtype_known && at::isFloatingType(t.scalar_type())) {
        op->dtype = t.scalar_type();
        dtype_known = true;
      }
    });
  }
  count_flops(op->name, in, info, *op);
  if (auto call = detail::describe_call(fn)) op->call = std::make_shared<const detail::KernelCall>(std::move(*call));
  std::lock_guard<std::mutex> lock(g_mutex);
  DryRun::Recorder* r = g_recorder;
  if (r == nullptr) return nullptr;
  for (size_t i = 0; i < in.size(); ++i) {
    const bool written = i < info.writes.size() && info.writes[i];
    for_each_tensor(in[i], [&](const at::Tensor& t) {
      if (const int64_t a = r->allocation_of(t); a >= 0) {
        (written ? op->writes : op->reads).push_back(a);
        count_operand(*r, t, a, frame);
      }
    });
  }
  if (op->matmul) r->make_blas_workspace(r->stream_now(r->current_phase()));
  frame.allocations_before = r->allocations.size();
  return op;
}

// A kernel: an ATen op that called no other op and is no view or allocation.
void finish_kernel(const at::RecordFunction& fn, Frame& frame) {
  std::unique_ptr<OpRecord> op = std::move(frame.kernel);
  const size_t allocations_before = frame.allocations_before;
  for (const c10::IValue& v : fn.outputs()) op->bytes += bytes_of(v);
  std::lock_guard<std::mutex> lock(g_mutex);
  DryRun::Recorder* r = g_recorder;
  if (r == nullptr) return;
  // A functional op that returned tensors without allocating any ran no
  // kernel: selective checkpointing's recomputation handed back what
  // forward kept (fsdp2/activation_checkpoint.h), or the op returned an
  // input as it was.
  bool returns_tensors = false;
  for (const c10::IValue& v : fn.outputs()) returns_tensors = returns_tensors || v.isTensor() || v.isTensorList();
  if (op->writes.empty() && returns_tensors && r->allocations.size() == allocations_before) return;
  for (const c10::IValue& v : fn.outputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (const int64_t a = r->allocation_of(t); a >= 0) {
        op->writes.push_back(a);
        count_operand(*r, t, a, frame);
      }
    });
  }
  if (frame.host_bytes > 0) {
    op->on_host = !frame.device_operand;
    if (frame.device_operand) op->host_link_bytes = frame.host_bytes;
  }
  op->stream = r->stream_now(r->current_phase());
  r->add_op(std::move(*op));
}

void on_scope_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.scope() != at::RecordScope::USER_SCOPE) {
    if (t_frames.empty()) return;
    Frame frame = std::move(t_frames.back());
    t_frames.pop_back();
    if (frame.kernel && !frame.has_callees) finish_kernel(fn, frame);
    return;
  }
  if (std::strncmp(fn.name(), "FSDP::", 6) != 0) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  DryRun::Recorder* r = g_recorder;
  if (r == nullptr || r->phase_stack.empty()) return;
  r->phase_stack.pop_back();
}

const Cell* cell_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& ptr = t.storage().data_ptr();
  if (ptr.get_deleter() != &on_free) return nullptr;
  return static_cast<const Cell*>(ptr.get_context());
}

// A store whose waits return at once: the simulated rank's peers never
// check in, and need not.
class DryStore final : public c10d::HashStore {
 public:
  explicit DryStore(int world_size) : world_size_(world_size) {}
  // Every simulated peer does what this rank does, at once: a counter reads
  // as world size times this rank's additions (the divergence watchdog's
  // count of stopped ranks, which rank 0 waits for at exit, included).
  int64_t add(const std::string& key, int64_t value) override { return HashStore::add(key, value) * world_size_; }
  void wait(const std::vector<std::string>&) override {}
  void wait(const std::vector<std::string>&, const std::chrono::milliseconds&) override {}
  bool check(const std::vector<std::string>&) override { return true; }
  // A key no simulated peer will ever set (a diagnosis asking the peers for
  // their flight records): fail at once instead of waiting for it.
  std::vector<uint8_t> get(const std::string& key) override {
    TORCH_CHECK(HashStore::check({key}), "fsdp_plan: the dry run's store has no key '", key,
                "': a dry run simulates one rank, whose peers set nothing");
    return HashStore::get(key);
  }

 private:
  int64_t world_size_;
};

}  // namespace

namespace detail {

bool on_host(const at::Tensor& t) {
  const Cell* cell = cell_of(t);
  if (cell == nullptr) return false;
  std::lock_guard<std::mutex> lock(g_mutex);
  const DryRun::Recorder* r = g_recorder;
  if (r == nullptr || r->generation != cell->generation) return false;
  return r->allocations[static_cast<size_t>(cell->index)].host;
}

}  // namespace detail

void DryRun::Recorder::mark(const at::Tensor& t, Holder holder, bool only_unmarked) {
  const Cell* cell = cell_of(t);
  if (cell == nullptr || cell->generation != generation) return;
  Allocation& a = allocations[static_cast<size_t>(cell->index)];
  if (a.freed_at != INT64_MAX) return;
  if (only_unmarked && (a.mark || holder_of_phase(phase_of(a.fsdp_phase)))) return;
  a.mark = holder;
}

int64_t DryRun::Recorder::allocation_of(const at::Tensor& t) const {
  const Cell* cell = cell_of(t);
  if (cell == nullptr || cell->generation != generation) return -1;
  return cell->index;
}

int DryRun::Recorder::stream_now(const std::string& phase_label) {
  if (!streams) return stream_of(phase_of(phase_label));
  const auto it = stream_roles.find(detail::current_meta_stream());
  return it != stream_roles.end() ? it->second : 0;
}

int64_t DryRun::Recorder::record_allocation(int64_t bytes, int stream, detail::Placement placement) {
  Allocation a;
  a.bytes = bytes;
  a.allocated_at = ++seq;
  a.step = step;
  a.step_phase = step_phase;
  a.fsdp_phase = current_phase();
  a.stream = stream;
  if (const char* op = current_op()) a.op = op;
  if (placement.host) {
    a.host = true;
    a.pinned = placement.pinned;
    host_live += a.bytes;
    if (a.pinned) pinned_live += pinned_block_bytes(a.bytes);
    if (host_live > host_peak) {
      host_peak = host_live;
      host_peak_seq = a.allocated_at;
    }
    pinned_peak = std::max(pinned_peak, pinned_live);
    allocations.push_back(std::move(a));
    return static_cast<int64_t>(allocations.size() - 1);
  }
  a.block = cuda.allocate(a.bytes, a.stream);
  live += a.bytes;
  if (live > peak) {
    peak = live;
    peak_seq = a.allocated_at;
  }
  if (step > 0) {
    auto& step_peak = step_peaks[static_cast<size_t>(step - 1)];
    step_peak = std::max(step_peak, live);
  }
  allocations.push_back(std::move(a));
  return static_cast<int64_t>(allocations.size() - 1);
}

void DryRun::Recorder::record_free(int64_t index) {
  Allocation& a = allocations[static_cast<size_t>(index)];
  a.freed_at = ++seq;
  if (a.host) {
    host_live -= a.bytes;
    if (a.pinned) pinned_live -= pinned_block_bytes(a.bytes);
    return;
  }
  live -= a.bytes;
  cuda.free(a.block);
}

void DryRun::Recorder::make_blas_workspace(int stream) {
  if (blas_workspace_bytes == 0) return;
  if (!blas_workspaces.emplace(step_phase == StepPhase::kBackward, stream).second) return;
  // Held by PyTorch's handle-and-stream map, not by a tensor: never freed.
  allocations[static_cast<size_t>(record_allocation(blas_workspace_bytes, stream))].mark = Holder::kWorkspaces;
}

void DryRun::Recorder::add_op(OpRecord op) {
  op.step = step;
  op.step_phase = step_phase;
  op.fsdp_phase = current_phase();
  const c10::StreamId stream = detail::current_meta_stream();
  if (auto it = pending_stream_waits.find(stream); it != pending_stream_waits.end()) {
    op.after = std::move(it->second);
    pending_stream_waits.erase(it);
  }
  op.host_after = std::move(pending_host_waits);
  pending_host_waits.clear();
  last_op_on_stream[stream] = static_cast<int64_t>(ops.size());
  ops.push_back(std::move(op));
}

namespace {

// What the meta device's streams report, kept for the next op of each
// stream (and of the host).
class RecorderStreamListener final : public detail::MetaStreamListener {
 public:
  explicit RecorderStreamListener(DryRun::Recorder* r) : r_(r) {}
  int64_t last_op_on(c10::StreamId stream) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = r_->last_op_on_stream.find(stream);
    return it == r_->last_op_on_stream.end() ? -1 : it->second;
  }
  void stream_waits(c10::StreamId stream, int64_t op) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    r_->pending_stream_waits[stream].push_back(op);
  }
  void host_waits(int64_t op) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    r_->pending_host_waits.push_back(op);
  }
  void host_waits_for_all() override {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& [stream, op] : r_->last_op_on_stream) r_->pending_host_waits.push_back(op);
  }
  // The names fsdp2's StreamSet gives its streams (fsdp2/src/streams.cc);
  // PlanDryRun's stream test fails when the two disagree.
  void stream_named(c10::StreamId stream, const std::string& name) override {
    static const std::unordered_map<std::string, int> roles = {
        {"all-gather copy-in", 1}, {"all-gather", 2}, {"reduce-scatter", 3}, {"all-reduce", 4}};
    if (auto it = roles.find(name); it != roles.end()) {
      std::lock_guard<std::mutex> lock(g_mutex);
      r_->stream_roles[stream] = it->second;
    }
  }

 private:
  DryRun::Recorder* r_;
};

}  // namespace

void DryRun::Recorder::mark_live_optimizer_state() {
  for (Allocation& a : allocations) {
    if (a.freed_at == INT64_MAX && !a.mark && a.step_phase == StepPhase::kOptimizer) a.mark = Holder::kOptimizerState;
  }
}

namespace {

// The mesh's shape, after checking `o` (c10::Error naming the option).
std::vector<int64_t> checked_mesh_shape(const DryRunOptions& o) {
  TORCH_CHECK(o.world_size >= 1, "fsdp_plan: DryRunOptions::world_size is ", o.world_size, "; it must be at least 1");
  TORCH_CHECK(o.rank >= 0 && o.rank < o.world_size, "fsdp_plan: DryRunOptions::rank ", o.rank,
              " is out of range for world size ", o.world_size, " (expected 0 <= rank < world_size)");
  std::vector<int64_t> shape = o.mesh_shape.empty() ? std::vector<int64_t>{o.world_size} : o.mesh_shape;
  TORCH_CHECK(shape.size() == 1 || shape.size() == 2, "fsdp_plan: DryRunOptions::mesh_shape has ", shape.size(),
              " dims; give {} or {world_size} for FSDP, {replicate, shard} for HSDP");
  int64_t ranks = 1;
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 1, "fsdp_plan: DryRunOptions::mesh_shape has a dim of size ", s, "; every dim must be >= 1");
    ranks *= s;
  }
  TORCH_CHECK(ranks == o.world_size, "fsdp_plan: DryRunOptions::mesh_shape [", c10::Join(", ", shape), "] holds ",
              ranks, " ranks, but world_size is ", o.world_size, "; their product must equal the world size");
  TORCH_CHECK(o.blas_workspace_bytes >= 0, "fsdp_plan: DryRunOptions::blas_workspace_bytes is ", o.blas_workspace_bytes,
              "; give 0 to leave cuBLAS's workspaces out, or their size in bytes");
  TORCH_CHECK(o.engine == fsdp::collectives::BackendKind::kNccl || o.engine == fsdp::collectives::BackendKind::kGloo,
              "fsdp_plan: DryRunOptions::engine must be kNccl or kGloo (got ", fsdp::collectives::to_string(o.engine),
              ")");
  return shape;
}

// A communicator of the dry run over the global ranks `global`, recording
// each collective it issues into `r`.
std::shared_ptr<fsdp::collectives::Communicator> dry_communicator(const DryRunOptions& o,
                                                                  const std::vector<int>& global, DryRun::Recorder* r) {
  const int group_rank = static_cast<int>(std::find(global.begin(), global.end(), o.rank) - global.begin());
  const std::string name =
      fsdp::collectives::to_string(o.engine) + "[" +
      (global.size() <= 8 ? c10::Join(",", global) : c10::str(global.front(), ",...,", global.back())) + "]";
  const int size = static_cast<int>(global.size());
  auto backend = detail::make_dry_backend(
      group_rank, size, o.engine == fsdp::collectives::BackendKind::kGloo,
      [r, name, size, members = std::make_shared<const std::vector<int>>(global)](
          const char* op, int64_t bytes, const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (g_recorder != r) return;
        r->collectives.push_back(CollectiveRecord{op, name, size, bytes, r->step, r->current_phase()});
        OpRecord record;
        record.kind = OpRecord::Kind::kCollective;
        record.name = op;
        record.bytes = bytes;
        record.group = members;
        record.stream = r->stream_now(r->current_phase());
        if (record.stream == 0) record.stream = 5;
        for (const at::Tensor& t : reads) {
          if (const int64_t a = r->allocation_of(t); a >= 0) record.reads.push_back(a);
        }
        for (const at::Tensor& t : writes) {
          if (const int64_t a = r->allocation_of(t); a >= 0) record.writes.push_back(a);
        }
        r->add_op(std::move(record));
      });
  return std::make_shared<fsdp::collectives::Communicator>(std::move(backend), o.engine, c10::kMeta, group_rank, global,
                                                           fsdp::collectives::CommunicatorOptions{});
}

}  // namespace

DryRun::DryRun(DryRunOptions options) : options_(std::move(options)) {
  const DryRunOptions& o = options_;
  const std::vector<int64_t> shape = checked_mesh_shape(o);

  static std::once_flag installed;
  std::call_once(installed, [] { c10::SetAllocator(c10::kMeta, &g_meta_allocator, /*priority=*/1); });

  recorder_ = std::make_shared<Recorder>();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(g_recorder == nullptr, "fsdp_plan: another DryRun is alive in this process; one at a time");
    recorder_->generation = ++g_generation;
    g_recorder = recorder_.get();
  }
  callback_ = at::addGlobalCallback(
      at::RecordFunctionCallback(&on_scope_enter, &on_scope_exit)
          .scopes({at::RecordScope::USER_SCOPE, at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION})
          .needsInputs(true)
          .needsOutputs(true));

  // The mesh, built before the meta mode starts: its rank layout is a CPU tensor.
  Recorder* r = recorder_.get();
  fsdp::collectives::RendezvousOptions rendezvous;
  rendezvous.divergence.strict = false;
  // The groups the runtime makes itself (reshard_after_forward to a smaller
  // world, a separate reduce-scatter group) are dry communicators too.
  rendezvous.group_maker = [o, r](const std::vector<int>& ranks, c10::DeviceType) {
    return dry_communicator(o, ranks, r);
  };
  auto world = fsdp::collectives::World::from_store(c10::make_intrusive<DryStore>(o.world_size), o.rank, o.world_size,
                                                    "dry run", rendezvous);
  const at::Tensor layout = at::arange(o.world_size, at::kLong).view(shape);
  auto group = [&](const at::Tensor& members) {
    std::vector<int> global;
    for (int64_t i = 0; i < members.numel(); ++i) global.push_back(static_cast<int>(members[i].item<int64_t>()));
    return dry_communicator(o, global, r);
  };
  if (shape.size() == 1) {
    mesh_.emplace(fsdp::DeviceMesh::from_communicators(world, layout, {group(layout)}, {"shard"}));
  } else {
    const int64_t row = o.rank / shape[1], column = o.rank % shape[1];
    mesh_.emplace(fsdp::DeviceMesh::from_communicators(
        world, layout, {group(layout.select(1, column).contiguous()), group(layout.select(0, row).contiguous())},
        {"replicate", "shard"}));
  }
  set_attention_layout(o.engine == fsdp::collectives::BackendKind::kGloo ? AttentionLayout::kCpu
                                                                         : AttentionLayout::kCuda);
  if (o.engine == fsdp::collectives::BackendKind::kNccl) {
    detail::set_host_placement(true);
    r->blas_workspace_bytes = o.blas_workspace_bytes;
    r->stream_listener = std::make_unique<RecorderStreamListener>(r);
    r->streams = std::make_unique<detail::MetaStreams>(r->stream_listener.get());
  }
  meta_.emplace();
}

DryRun::~DryRun() {
  meta_.reset();
  detail::set_host_placement(false);
  recorder_->streams.reset();
  at::removeCallback(callback_);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_recorder == recorder_.get()) g_recorder = nullptr;
}

void DryRun::track(std::shared_ptr<torch::nn::Module> model) {
  TORCH_CHECK(model != nullptr, "fsdp_plan: DryRun::track: the model is null");
  model_ = std::move(model);
  std::lock_guard<std::mutex> lock(g_mutex);
  Recorder& r = *recorder_;
  r.tracked = model_->parameters();
  for (const at::Tensor& p : r.tracked) r.mark(p, Holder::kParameters, /*only_unmarked=*/false);
  for (const at::Tensor& b : model_->buffers()) r.mark(b, Holder::kParameters, /*only_unmarked=*/false);
}

void DryRun::begin(StepPhase phase) {
  TORCH_CHECK(phase != StepPhase::kSetup,
              "fsdp_plan: DryRun::begin: kSetup is where a dry run starts, not a step phase");
  std::lock_guard<std::mutex> lock(g_mutex);
  Recorder& r = *recorder_;
  if (phase == StepPhase::kForward) {
    r.mark_live_optimizer_state();
    if (r.step == 0) r.setup_end = r.seq;
    ++r.step;
    r.step_peaks.push_back(r.live);
    r.backward_start.push_back(INT64_MAX);
  }
  TORCH_CHECK(r.step > 0, "fsdp_plan: DryRun::begin(", to_string(phase),
              ") before begin(kForward): a step starts with its forward");
  if (phase == StepPhase::kBackward) r.backward_start.back() = r.seq;
  if (phase == StepPhase::kOptimizer) {
    for (const at::Tensor& p : r.tracked) {
      if (p.grad().defined()) r.mark(p.grad(), Holder::kGradients, /*only_unmarked=*/false);
    }
  }
  r.step_phase = phase;
}

MemoryReport DryRun::memory() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  Recorder& r = *recorder_;
  r.mark_live_optimizer_state();
  MemoryReport report;
  report.peak_bytes = r.peak;
  report.peak_allocated = r.cuda.peak_allocated();
  report.peak_reserved = r.cuda.peak_reserved();
  report.step_peaks = r.step_peaks;
  report.end_bytes = r.live;
  report.allocations = static_cast<int64_t>(r.allocations.size());
  report.host_peak_bytes = r.host_peak;
  report.host_pinned_peak = r.pinned_peak;
  report.host_end_bytes = r.host_live;
  const auto holder_of = [&r](const Recorder::Allocation& a) {
    if (a.mark) return *a.mark;
    if (auto by_phase = holder_of_phase(phase_of(a.fsdp_phase))) return *by_phase;
    // What setup made and kept; what it made and dropped (the trainer's
    // initial values, staged on the host) was a temporary.
    if (a.step == 0) return a.freed_at <= r.setup_end ? Holder::kTemporaries : Holder::kParameters;
    if (a.step_phase == StepPhase::kForward && a.freed_at > r.backward_start[static_cast<size_t>(a.step - 1)]) {
      return Holder::kActivations;
    }
    return Holder::kTemporaries;
  };
  const auto live_at = [](const Recorder::Allocation& a, int64_t seq) {
    return a.allocated_at <= seq && a.freed_at > seq;
  };
  for (const auto& a : r.allocations) {
    if (a.allocated_at == r.peak_seq) {
      report.peak_step = a.step;
      report.peak_step_phase = a.step_phase;
      report.peak_fsdp_phase = a.fsdp_phase;
    }
    if (!a.host && live_at(a, r.peak_seq)) report.peak_by_holder[static_cast<size_t>(holder_of(a))] += a.bytes;
    if (a.host && live_at(a, r.host_peak_seq)) {
      report.host_peak_by_holder[static_cast<size_t>(holder_of(a))] += a.bytes;
    }
  }
  return report;
}

std::vector<AllocationRecord> DryRun::allocations() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<AllocationRecord> out;
  out.reserve(recorder_->allocations.size());
  for (const auto& a : recorder_->allocations) {
    out.push_back({a.bytes, a.allocated_at, a.freed_at, a.step, a.step_phase, a.fsdp_phase, a.stream, a.op, a.host});
  }
  return out;
}

std::vector<OpRecord> DryRun::ops() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return recorder_->ops;
}

std::vector<CollectiveRecord> DryRun::collectives() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return recorder_->collectives;
}

}  // namespace fsdp_plan
