#include "collectives/communicator.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <thread>
#include <utility>

#include <ATen/ops/amax.h>
#include <ATen/ops/amin.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "divergence_monitor.h"
#include "join_ranks.h"
#include "multi_work.h"
#include "stream_check/stream_check.h"
#include "torch_compat.h"

namespace fsdp::collectives {
namespace {

using detail::join_ranks;

// The engine is told to SUM when it cannot compute `op` itself (see
// reduce_op.h); the scale is applied to the outputs at wait time.
c10d::ReduceOp to_c10d(const ReduceOp& op, bool native) {
  switch (op.kind()) {
    case ReduceOp::Kind::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::Kind::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::Kind::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::Kind::kAvg:
      if (native) return c10d::ReduceOp::AVG;
      return c10d::ReduceOp::SUM;
    case ReduceOp::Kind::kPremulSum:
      if (native) return torch_compat::make_premul_sum(op.factor());
      return c10d::ReduceOp::SUM;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp kind");
}

// The step that turns the SUM the engine computed into `op`'s result, or an
// empty function when the engine computed `op` itself.
std::function<void()> finish_step(const ReduceOp& op, bool native, int group_size, std::vector<at::Tensor> outputs) {
  if (native) return {};
  switch (op.kind()) {
    case ReduceOp::Kind::kAvg:
      // div_ rather than mul_(1/size): x/3 rounds once, x*(1/3) twice.
      return [outputs = std::move(outputs), group_size] {
        for (const auto& t : outputs) t.div_(group_size);
      };
    case ReduceOp::Kind::kPremulSum:
      return [outputs = std::move(outputs), factor = op.factor()] {
        for (const auto& t : outputs) t.mul_(factor);
      };
    default: return {};
  }
}

// [Note: yield after issuing on Gloo]
// Gloo runs a collective on c10d's worker threads, not on the thread that
// issues it. When every core is busy (each rank computing on its own core,
// as on a small machine), the worker woken by the issue waits for the
// issuing thread's time slice to end before it can post its sends: an
// all-gather issued as a prefetch then makes no progress during the compute
// it was meant to overlap, and the peers wait for it afterwards. Yielding
// the issuing thread's core right after the issue lets the worker go first;
// where a core is free the yield returns at once. On the trainer's 16-block
// model at 2 ranks on 2 cores it shortened the step by 7-26% in five
// before/after pairs (docs/benchmarks.md). NCCL enqueues on a stream and needs no such help.

// Calls into the engine; errors it raises while enqueueing (an unsupported
// dtype, say) are rethrown naming the collective.
template <typename F>
c10::intrusive_ptr<c10d::Work> issue(BackendKind kind, const std::string& description, F&& enqueue) {
  try {
    c10::intrusive_ptr<c10d::Work> work = enqueue();
    if (kind == BackendKind::kGloo) std::this_thread::yield();
    return work;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp2cpp: ", description, " could not be issued: ", e.what_without_backtrace());
  }
}

// [Note: Gloo reduce-scatter]
// Gloo has no reduce-scatter of its own: c10d's copies the whole input and
// all-reduces it (a ring: at two ranks two rounds of messages, each rank
// sending the whole input) to keep one chunk of the result. Exchanging the
// chunks directly (one all-to-all: rank j sends chunk r of its input to rank
// r) moves (N-1)/N of the input per rank in one round; each rank then reduces
// the N rows it received, in group-rank order, in Work::wait() on the waiting
// thread. The receive buffer takes the place of c10d's copy of the input, so
// the memory in flight is the same. At two ranks on the trainer's 16-block
// model this cut the host time blocked in reduce-scatter waits from about 15
// to 6 ms per step (docs/benchmarks.md). The reduction runs in wait(), which
// the Work contract already requires before an output is read.
bool reduces_scatter_by_all_to_all(BackendKind kind, c10::DeviceType device_type, int size) {
  return kind == BackendKind::kGloo && device_type == c10::DeviceType::CPU && size > 1;
}

// One reduce-scatter as an all-to-all in flight, and the step that reduces
// the received rows into the output (and applies `op`'s scale) once it is done.
struct ChunkExchange {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> reduce;
};

ChunkExchange exchange_chunks(c10d::Backend& backend, int size, const at::Tensor& output, const at::Tensor& input,
                              const ReduceOp& op, const std::string& description) {
  const int64_t n = output.numel();
  at::Tensor rows = at::empty({size, n}, input.options());
  at::Tensor in = input.view({size, n});
  // Empty split lists mean equal splits along dim 0.
  std::vector<int64_t> equal_splits;
  auto work = issue(BackendKind::kGloo, description,
                    [&] { return backend.alltoall_base(rows, in, equal_splits, equal_splits); });
  std::function<void()> scale = finish_step(op, /*native=*/false, size, {output});
  return ChunkExchange{std::move(work), [rows = std::move(rows), output, kind = op.kind(), scale = std::move(scale)] {
                         at::Tensor out = output.view({-1});
                         switch (kind) {
                           case ReduceOp::Kind::kMax: at::amax_out(out, rows, {0}); break;
                           case ReduceOp::Kind::kMin: at::amin_out(out, rows, {0}); break;
                           // AVG and PREMUL_SUM sum here; `scale` finishes them.
                           default: at::sum_out(out, rows, {0}, /*keepdim=*/false, output.scalar_type()); break;
                         }
                         if (scale) scale();
                       }};
}

// [Note: collectives under the stream-order checker] While a stream_check
// Checker is active, a collective is modelled as NCCL runs it: on its
// communicator's own stream, which first waits for the issuing stream's
// current position; the collective reads its inputs and writes its outputs
// there; the Work carries an event recorded there after it, and each wait()
// makes the caller's current stream wait for that event. The engine (Gloo)
// still runs it, but to completion at issue, finishing step included, so
// that every operation happens in program order and the numbers stay those
// of the program (and an error surfaces at issue, not at wait). The caller's
// wait() then reaches ModelledWork's wait, which in the NCCL model counts a
// wait with a timeout as the host blocking (stream_check::host_wait), as
// ProcessGroupNCCL's does.

// The engine's work under the checker. The checker runs it to completion at
// issue, through this wait (before the end event is recorded); every later
// wait only follows the modelled engine's contract and leaves the engine
// alone (a second wait of some Gloo works copies their output again). In the
// NCCL model a wait with a timeout blocks the host, as ProcessGroupNCCL's
// does, and is counted as a host synchronization.
class ModelledWork final : public c10d::Work {
 public:
  ModelledWork(c10::intrusive_ptr<c10d::Work> engine, std::shared_ptr<c10::Event> end, bool nccl)
      : c10d::Work(/*rank=*/-1, engine->retrieveOpType()),
        engine_(std::move(engine)),
        end_(std::move(end)),
        nccl_(nccl) {}

  bool isCompleted() override { return engine_->isCompleted(); }
  bool isSuccess() const override { return engine_->isSuccess(); }
  std::exception_ptr exception() const override { return engine_->exception(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!end_->was_marked_for_recording()) return engine_->wait(timeout);
    if (nccl_ && timeout != ::kNoTimeout) {
      stream_check::host_wait(*end_, "Work::wait with a timeout (NCCL blocks the host until the collective ends)");
    }
    return true;
  }
  void synchronize() override {}

 private:
  c10::intrusive_ptr<c10d::Work> engine_;
  std::shared_ptr<c10::Event> end_;
  bool nccl_;
};

class ModelledCollective {
 public:
  ModelledCollective(const Communicator& comm, const std::vector<at::Tensor>& reads,
                     const std::vector<at::Tensor>& writes, const char* op,
                     std::shared_ptr<detail::DivergenceMonitor> monitor, int64_t record)
      : monitor_(std::move(monitor)), record_(record), stream_ordered_(comm.backend_kind() == BackendKind::kNccl) {
    if (!stream_check::active()) return;
    stream_ = stream_check::collective_stream(&comm, "collective (" + comm.name() + ")");
    end_ = std::make_shared<c10::Event>(c10::kCPU);
    const c10::impl::VirtualGuardImpl impl(c10::kCPU);
    c10::Event issued(c10::kCPU);
    issued.record(impl.getStream(impl.getDevice()));
    issued.block(*stream_);
    guard_.emplace(*stream_);
    for (const at::Tensor& t : reads) stream_check::record_access(t, /*write=*/false, op);
    for (const at::Tensor& t : writes) stream_check::record_access(t, /*write=*/true, op);
  }

  // The engine's work as the Work will hold it: under the checker, modelled.
  c10::intrusive_ptr<c10d::Work> engine_work(c10::intrusive_ptr<c10d::Work> work) const {
    if (!stream_) return work;
    return c10::make_intrusive<ModelledWork>(std::move(work), end_, stream_ordered_);
  }

  // Attaches the collective's flight record to `work`, and models it when
  // the checker is active.
  Work finish(Work work) {
    if (monitor_) work.set_record(monitor_, record_);
    work.set_stream_ordered(stream_ordered_);
    if (!stream_) return work;
    work.complete_at_issue();
    end_->record(*stream_);
    guard_.reset();
    work.set_end_event(end_);
    return work;
  }

 private:
  std::shared_ptr<detail::DivergenceMonitor> monitor_;
  int64_t record_;
  bool stream_ordered_;
  std::optional<c10::Stream> stream_;
  std::shared_ptr<c10::Event> end_;
  std::optional<c10::StreamGuard> guard_;
};

}  // namespace

std::chrono::milliseconds default_collective_timeout() {
  const char* text = std::getenv("FSDP2CPP_COLLECTIVE_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return std::chrono::minutes(5);
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  // At least 1 ms: a timeout of 0 ms would mean "no timeout" to the engines.
  TORCH_CHECK(end != text && *end == '\0' && std::isfinite(value) && value >= 0.001,
              "fsdp2cpp: FSDP2CPP_COLLECTIVE_TIMEOUT_S='", text,
              "' is not a number of seconds >= 0.001; set it to e.g. 600 (or unset it for the default of 300)");
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(value * 1000)));
}

std::string to_string(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kNccl: return "nccl";
  }
  return "unknown";
}

Communicator::Communicator(c10::intrusive_ptr<c10d::Backend> backend, BackendKind kind, c10::DeviceType device_type,
                           int rank, std::vector<int> global_ranks, CommunicatorOptions options,
                           std::shared_ptr<detail::DivergenceMonitor> monitor, std::string id)
    : backend_(std::move(backend)),
      backend_kind_(kind),
      device_type_(device_type),
      rank_(rank),
      global_ranks_(std::move(global_ranks)),
      options_(std::move(options)),
      name_(to_string(kind) + "[" + join_ranks(global_ranks_) + "]"),
      monitor_(std::move(monitor)),
      id_(id.empty() ? name_ : std::move(id)) {
  TORCH_INTERNAL_ASSERT(backend_, "Communicator needs a backend");
  TORCH_INTERNAL_ASSERT(kind != BackendKind::kAuto, "Communicator needs a resolved backend kind");
  if (monitor_) recorder_index_ = monitor_->recorder().register_communicator(id_, global_ranks_);
}

Communicator::~Communicator() = default;

void Communicator::check_tensor(const at::Tensor& t, const char* op, const char* arg) const {
  TORCH_CHECK(t.defined(), "fsdp2cpp: ", op, " on ", name_, ": `", arg,
              "` is an undefined tensor; pass an allocated tensor");
  TORCH_CHECK(t.device().type() == device_type_, "fsdp2cpp: ", op, " on ", name_, ": `", arg, "` is on device ",
              t.device(), ", expected a ", c10::DeviceTypeName(device_type_, /*lower_case=*/true),
              " tensor (this communicator's device type); move the tensor there, or use a communicator made for ",
              c10::DeviceTypeName(t.device().type(), /*lower_case=*/true));
  TORCH_CHECK(t.layout() == c10::kStrided, "fsdp2cpp: ", op, " on ", name_, ": `", arg, "` has layout ", t.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(t.is_contiguous(), "fsdp2cpp: ", op, " on ", name_, ": `", arg, "` is not contiguous (sizes ", t.sizes(),
              ", strides ", t.strides(),
              "); pass a contiguous tensor (.contiguous()) and copy the result back after wait()");
}

BackendKind Communicator::backend_kind() const {
  if (backend_kind_ == BackendKind::kGloo && device_type_ == c10::kCPU && stream_check::models_nccl()) {
    return BackendKind::kNccl;
  }
  return backend_kind_;
}

// The engine's own rule. In the NCCL model Gloo computes AVG and PREMUL_SUM
// as SUM and the finishing step, which the checker runs at issue on the
// collective's stream: where NCCL's native reduction writes the output.
bool Communicator::native_op(const ReduceOp& op) const {
  if (backend_kind_ == BackendKind::kNccl) {
    // At one rank NCCL copies instead of reducing: it drops PREMUL_SUM's
    // factor (seen on an H100 with NCCL 2.28.9: the output was the input),
    // and pytorch#144045 reports the tail of an AVG output left unwritten
    // before NCCL 2.29.7 (our AVG checks passed on 2.28.9). SUM, then the
    // finishing step, is exact at one rank.
    const bool scaled = op.kind() == ReduceOp::Kind::kAvg || op.kind() == ReduceOp::Kind::kPremulSum;
    return !(scaled && size() == 1);
  }
  // Gloo: no PREMUL_SUM at all, and AVG on reduce-scatter is not dependable
  // across versions (pytorch/pytorch#162338).
  return op.kind() == ReduceOp::Kind::kSum || op.kind() == ReduceOp::Kind::kMax || op.kind() == ReduceOp::Kind::kMin;
}

namespace {

void check_same_dtype(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name, const char* op,
                      const std::string& name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fsdp2cpp: ", op, " on ", name, ": `", a_name, "` has dtype ",
              a.scalar_type(), " but `", b_name, "` has dtype ", b.scalar_type(),
              "; both must have the same dtype (convert one with .to(dtype))");
}

// The rules of an all-gather's or a reduce-scatter's output and input: one
// dtype, and the larger of the two (the all-gather's output, the
// reduce-scatter's input) holds `size` times the elements of the other.
// `advice` ends the message of the size rule.
void check_output_fits_input(const at::Tensor& output, const std::string& output_name, const at::Tensor& input,
                             const std::string& input_name, bool output_is_larger, int size, const char* op,
                             const std::string& name, const char* advice) {
  check_same_dtype(output, output_name.c_str(), input, input_name.c_str(), op, name);
  const at::Tensor& large = output_is_larger ? output : input;
  const at::Tensor& small = output_is_larger ? input : output;
  const std::string& large_name = output_is_larger ? output_name : input_name;
  const std::string& small_name = output_is_larger ? input_name : output_name;
  TORCH_CHECK(large.numel() == size * small.numel(), "fsdp2cpp: ", op, " on ", name, ": `", large_name, "` has ",
              large.numel(), " elements, expected size() * ", small_name, ".numel() = ", size, " * ", small.numel(),
              " = ", size * small.numel(), advice);
}

void check_reducible(const at::Tensor& t, const ReduceOp& op, const char* op_name, const std::string& name) {
  const bool scaled = op.kind() == ReduceOp::Kind::kAvg || op.kind() == ReduceOp::Kind::kPremulSum;
  // An integer average would have to pick a rounding, and backends disagree
  // (NCCL truncates, a post-division floors or truncates by dtype): refuse
  // rather than differ between CPU and GPU.
  TORCH_CHECK(!scaled || at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()),
              "fsdp2cpp: ", op_name, " on ", name, ": ", op.to_string(), " needs a floating-point tensor, got dtype ",
              t.scalar_type(), "; reduce integers with SUM and divide with the rounding you want");
}

}  // namespace

namespace {

const char* reduction_name(const ReduceOp& op) {
  switch (op.kind()) {
    case ReduceOp::Kind::kSum: return "SUM";
    case ReduceOp::Kind::kAvg: return "AVG";
    case ReduceOp::Kind::kMax: return "MAX";
    case ReduceOp::Kind::kMin: return "MIN";
    case ReduceOp::Kind::kPremulSum: return "PREMUL_SUM";
  }
  return "?";
}

// [Note: strict collectives] A fingerprint as int64 words, so that one
// all-gather gives every member every member's: the op and the reduction as
// indices into fixed tables, the dtype, the element and tensor counts, and
// the label's first kLabelWords * 8 bytes.
constexpr const char* kOpNames[] = {
    "all_gather_into_tensor",           "reduce_scatter_tensor",          "all_reduce", "broadcast", "barrier",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"};
constexpr const char* kReductionNames[] = {"", "SUM", "AVG", "MAX", "MIN", "PREMUL_SUM"};
constexpr int64_t kLabelWords = 8;
constexpr int64_t kFingerprintWords = 5 + kLabelWords;

template <size_t N>
int64_t index_of(const char* const (&names)[N], const char* name) {
  for (size_t i = 0; i < N; ++i) {
    if (std::strcmp(names[i], name) == 0) return static_cast<int64_t>(i);
  }
  return -1;
}

CollectiveFingerprint decode_fingerprint(const int64_t* words) {
  CollectiveFingerprint fp;
  const auto name = [](const auto& names, int64_t i) -> std::string {
    return i >= 0 && i < static_cast<int64_t>(std::size(names)) ? names[i] : "?";
  };
  fp.op = name(kOpNames, words[0]);
  fp.reduction = name(kReductionNames, words[1]);
  fp.dtype = words[2] < 0 ? "" : c10::toString(static_cast<c10::ScalarType>(words[2]));
  fp.numel = words[3];
  fp.tensors = words[4];
  const char* label = reinterpret_cast<const char*>(words + 5);
  fp.label = std::string(label, strnlen(label, kLabelWords * sizeof(int64_t)));
  return fp;
}

}  // namespace

int64_t Communicator::begin_collective(const char* op, const char* reduction, const std::vector<at::Tensor>& inputs) {
  ++next_seq_;
  if (!monitor_) return 0;
  if (monitor_->failed()) {
    TORCH_CHECK(false, "fsdp2cpp: ", op, " on ", id_,
                " refused: the ranks' collectives diverged earlier in this process, so the ranks no longer agree on "
                "which collective comes next. Diagnosis: ",
                monitor_->failure().value_or(""));
  }
  int64_t numel = 0;
  for (const auto& t : inputs) numel += t.numel();
  const bool has_dtype = !inputs.empty();
  const int64_t record = monitor_->recorder().record_issue(
      recorder_index_, next_seq_, op, reduction, has_dtype ? inputs.front().scalar_type() : c10::ScalarType::Undefined,
      has_dtype, numel, static_cast<int64_t>(inputs.size()));
  if (monitor_->options().strict) check_strict(record, op, reduction, inputs);
  return record;
}

void Communicator::check_strict(int64_t record, const char* op, const char* reduction,
                                const std::vector<at::Tensor>& inputs) {
  at::Tensor mine = at::zeros({kFingerprintWords}, at::kLong);
  int64_t* words = mine.data_ptr<int64_t>();
  words[0] = index_of(kOpNames, op);
  words[1] = index_of(kReductionNames, reduction);
  words[2] = inputs.empty() ? -1 : static_cast<int64_t>(inputs.front().scalar_type());
  for (const auto& t : inputs) words[3] += t.numel();
  words[4] = static_cast<int64_t>(inputs.size());
  if (const char* label = CollectiveLabel::current()) {
    std::strncpy(reinterpret_cast<char*>(words + 5), label, kLabelWords * sizeof(int64_t));
  }
  const c10::Device device =
      device_type_ == c10::kCPU ? c10::Device(c10::kCPU) : c10::impl::VirtualGuardImpl(device_type_).getDevice();
  at::Tensor input = mine.to(device);
  at::Tensor output = at::empty({size() * kFingerprintWords}, input.options());
  const std::string description = c10::str("the strict-mode check of collective #", next_seq_, " on ", id_);
  Work check = recorded(
      Work(issue(backend_kind_, description, [&] { return backend_->_allgather_base(output, input); }), description),
      record);
  check.wait();
  const at::Tensor all = output.cpu();
  const int64_t* theirs = all.data_ptr<int64_t>();
  for (int r = 0; r < size(); ++r) {
    if (std::equal(words, words + kFingerprintWords, theirs + r * kFingerprintWords)) continue;
    const std::string error = c10::str(
        "fsdp2cpp: strict collectives: the members of ", id_, " issue different collectives as #", next_seq_, ": rank ",
        global_ranks_[rank_], " issues ", decode_fingerprint(words).describe(), "; rank ", global_ranks_[r], " issues ",
        decode_fingerprint(theirs + r * kFingerprintWords).describe(),
        ". The ranks' control flow differs (a module skipped, one more micro-batch, data that ended early on one "
        "rank): every rank must issue the same collectives in the same order");
    monitor_->recorder().mark(record, CollectiveState::kFailed);
    monitor_->fail(error);
    TORCH_CHECK(false, error);
  }
}

Work Communicator::recorded(Work work, int64_t record) const {
  if (monitor_) work.set_record(monitor_, record);
  return work;
}

Work Communicator::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input) {
  constexpr const char* kOp = "all_gather_into_tensor";
  check_tensor(output, kOp, "output");
  check_tensor(input, kOp, "input");
  check_output_fits_input(output, "output", input, "input", /*output_is_larger=*/true, size(), kOp, name_,
                          "; allocate the output as group size times the input");
  std::string description = c10::str(kOp, " on ", name_);
  const int64_t record = begin_collective(kOp, "", {input});
  ModelledCollective modelled(*this, {input}, {output}, kOp, monitor_, record);
  at::Tensor out = output;
  at::Tensor in = input;
  auto work = issue(backend_kind_, description, [&] { return backend_->_allgather_base(out, in); });
  return modelled.finish(Work(modelled.engine_work(std::move(work)), std::move(description)));
}

Work Communicator::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter_tensor";
  check_tensor(output, kOp, "output");
  check_tensor(input, kOp, "input");
  check_output_fits_input(output, "output", input, "input", /*output_is_larger=*/false, size(), kOp, name_,
                          "; pad the input to group size times the output");
  check_reducible(input, op, kOp, name_);
  const bool native = native_op(op);
  std::string description = c10::str(kOp, "(", op.to_string(), ") on ", name_);
  const int64_t record = begin_collective(kOp, reduction_name(op), {input});
  ModelledCollective modelled(*this, {input}, {output}, kOp, monitor_, record);
  if (reduces_scatter_by_all_to_all(backend_kind_, device_type_, size())) {
    ChunkExchange exchange = exchange_chunks(*backend_, size(), output, input, op, description);
    return modelled.finish(
        Work(modelled.engine_work(std::move(exchange.work)), std::move(description), std::move(exchange.reduce)));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = to_c10d(op, native);
  at::Tensor out = output;
  at::Tensor in = input;
  auto work = issue(backend_kind_, description, [&] { return backend_->_reduce_scatter_base(out, in, opts); });
  return modelled.finish(
      Work(modelled.engine_work(std::move(work)), std::move(description), finish_step(op, native, size(), {output})));
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  constexpr const char* kOp = "all_reduce";
  check_tensor(tensor, kOp, "tensor");
  check_reducible(tensor, op, kOp, name_);
  const bool native = native_op(op);
  std::string description = c10::str(kOp, "(", op.to_string(), ") on ", name_);
  const int64_t record = begin_collective(kOp, reduction_name(op), {tensor});
  ModelledCollective modelled(*this, {tensor}, {tensor}, kOp, monitor_, record);
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op, native);
  std::vector<at::Tensor> tensors{tensor};
  auto work = issue(backend_kind_, description, [&] { return backend_->allreduce(tensors, opts); });
  return modelled.finish(
      Work(modelled.engine_work(std::move(work)), std::move(description), finish_step(op, native, size(), {tensor})));
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  constexpr const char* kOp = "broadcast";
  check_tensor(tensor, kOp, "tensor");
  TORCH_CHECK(root >= 0 && root < size(), "fsdp2cpp: ", kOp, " on ", name_, ": root ", root,
              " is not a group rank (expected 0 <= root < ", size(),
              "); pass the root's rank in this group, not its global rank");
  std::string description = c10::str(kOp, "(root ", root, ") on ", name_);
  const int64_t record = begin_collective(kOp, "", {tensor});
  ModelledCollective modelled(*this, {tensor}, {tensor}, kOp, monitor_, record);
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  std::vector<at::Tensor> tensors{tensor};
  auto work = issue(backend_kind_, description, [&] { return backend_->broadcast(tensors, opts); });
  return modelled.finish(Work(modelled.engine_work(std::move(work)), std::move(description)));
}

Work Communicator::barrier() {
  std::string description = c10::str("barrier on ", name_);
  const int64_t record = begin_collective("barrier", "", {});
  ModelledCollective modelled(*this, {}, {}, "barrier", monitor_, record);
  auto work = issue(backend_kind_, description, [&] { return backend_->barrier(); });
  return modelled.finish(Work(modelled.engine_work(std::move(work)), std::move(description)));
}

namespace {

void check_list_sizes(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, const char* op,
                      const std::string& name) {
  TORCH_CHECK(outputs.size() == inputs.size(), "fsdp2cpp: ", op, " on ", name, ": ", outputs.size(), " outputs but ",
              inputs.size(), " inputs; pass one output per input");
}

}  // namespace

void Communicator::check_coalesced_pair(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                        size_t i, bool output_is_larger, const char* op) const {
  const std::string out_name = c10::str("outputs[", i, "]");
  const std::string in_name = c10::str("inputs[", i, "]");
  check_tensor(outputs[i], op, out_name.c_str());
  check_tensor(inputs[i], op, in_name.c_str());
  check_output_fits_input(outputs[i], out_name, inputs[i], in_name, output_is_larger, size(), op, name_,
                          output_is_larger ? "; allocate each output as group size times its input"
                                           : "; pad each input to group size times its output");
}

Work Communicator::all_gather_into_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                    const std::vector<at::Tensor>& inputs) {
  constexpr const char* kOp = "all_gather_into_tensor_coalesced";
  check_list_sizes(outputs, inputs, kOp, name_);
  for (size_t i = 0; i < inputs.size(); ++i) check_coalesced_pair(outputs, inputs, i, /*output_is_larger=*/true, kOp);
  if (inputs.empty()) return Work();
  std::string description = c10::str(kOp, " (", inputs.size(), " tensors) on ", name_);
  const int64_t record = begin_collective(kOp, "", inputs);
  ModelledCollective modelled(*this, inputs, outputs, kOp, monitor_, record);
  std::vector<at::Tensor> outs = outputs;
  std::vector<at::Tensor> ins = inputs;
  if (backend_kind_ == BackendKind::kNccl) {
    auto work = issue(backend_kind_, description, [&] { return backend_->allgather_into_tensor_coalesced(outs, ins); });
    return modelled.finish(Work(modelled.engine_work(std::move(work)), std::move(description)));
  }
  // Gloo runs each collective on its own; back to back is what coalescing
  // would do there anyway.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(ins.size());
  for (size_t i = 0; i < ins.size(); ++i) {
    works.push_back(issue(backend_kind_, description, [&] { return backend_->_allgather_base(outs[i], ins[i]); }));
  }
  return modelled.finish(
      Work(modelled.engine_work(c10::make_intrusive<detail::MultiWork>(std::move(works))), std::move(description)));
}

Work Communicator::reduce_scatter_tensor_coalesced(const std::vector<at::Tensor>& outputs,
                                                   const std::vector<at::Tensor>& inputs, ReduceOp op) {
  constexpr const char* kOp = "reduce_scatter_tensor_coalesced";
  check_list_sizes(outputs, inputs, kOp, name_);
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_coalesced_pair(outputs, inputs, i, /*output_is_larger=*/false, kOp);
    check_reducible(inputs[i], op, kOp, name_);
  }
  if (inputs.empty()) return Work();
  const bool native = native_op(op);
  std::string description = c10::str(kOp, "(", op.to_string(), ", ", inputs.size(), " tensors) on ", name_);
  const int64_t record = begin_collective(kOp, reduction_name(op), inputs);
  ModelledCollective modelled(*this, inputs, outputs, kOp, monitor_, record);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = to_c10d(op, native);
  std::vector<at::Tensor> outs = outputs;
  std::vector<at::Tensor> ins = inputs;
  auto finish = finish_step(op, native, size(), outputs);
  if (backend_kind_ == BackendKind::kNccl) {
    auto work =
        issue(backend_kind_, description, [&] { return backend_->reduce_scatter_tensor_coalesced(outs, ins, opts); });
    return modelled.finish(Work(modelled.engine_work(std::move(work)), std::move(description), std::move(finish)));
  }
  if (reduces_scatter_by_all_to_all(backend_kind_, device_type_, size())) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<std::function<void()>> reduces;
    for (size_t i = 0; i < ins.size(); ++i) {
      ChunkExchange exchange = exchange_chunks(*backend_, size(), outs[i], ins[i], op, description);
      works.push_back(std::move(exchange.work));
      reduces.push_back(std::move(exchange.reduce));
    }
    return modelled.finish(Work(modelled.engine_work(c10::make_intrusive<detail::MultiWork>(std::move(works))),
                                std::move(description), [reduces = std::move(reduces)] {
                                  for (const auto& reduce : reduces) reduce();
                                }));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(ins.size());
  for (size_t i = 0; i < ins.size(); ++i) {
    works.push_back(
        issue(backend_kind_, description, [&] { return backend_->_reduce_scatter_base(outs[i], ins[i], opts); }));
  }
  return modelled.finish(Work(modelled.engine_work(c10::make_intrusive<detail::MultiWork>(std::move(works))),
                              std::move(description), std::move(finish)));
}

}  // namespace fsdp::collectives
