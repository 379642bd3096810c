// The stream-order checker: a model of the GPU's stream order that runs on
// CPU tensors, so that the CUDA orchestration of a program (streams, events,
// record_stream, collectives' streams, the caching allocator's reuse rule) is
// checked where no GPU, or only one, is available.
//
// While a Checker lives, CPU "streams" exist: c10::Stream, c10::StreamGuard
// and c10::Event work on the CPU device as they do on CUDA, and the FSDP
// runtime takes the code paths it takes with streams (StreamSet::enabled()).
// Every ATen op still runs at once, in program order, so the numbers are
// those of the program; what the checker adds is a happens-before model of
// what a GPU could reorder:
//   - each logical stream has a vector clock; recording an event snapshots
//     it, blocking a stream on an event (or wait_stream) joins it, and a host
//     synchronize (event, stream, device, Tensor::item) joins it into every
//     stream;
//   - every tensor argument of every ATen op (reads, writes from the op
//     schema's alias annotations, fresh outputs as writes) is an access by
//     the current stream, at byte-range granularity within its storage;
//   - a collective (collectives::Communicator) runs on its communicator's own
//     stream, which waits for the issuing stream at issue; Work::wait() makes
//     the caller's current stream wait for the collective's end (NCCL's
//     contract, collectives/work.h);
//   - the caching allocator's rule: a block freed by the host may be reused
//     at once by work later enqueued on the stream that allocated it, so every
//     access by another stream must be ordered before that stream's position
//     at the free, unless record_stream() named that other stream;
//   - its other half: a block handed out on stream S may still be in use by
//     work queued on S for its previous occupant, so another stream T that
//     touches the new block must first be ordered after S's position at the
//     allocation (an allocation is a write by S);
//   - host synchronizations (event, stream and device synchronize, item()
//     and other scalar reads, a blocking copy between host and device, a
//     Work::wait that blocks the host) are counted with the op and FSDP phase
//     that made them, as torch.cuda.set_sync_debug_mode does on a GPU
//     (Checker::host_syncs());
//   - the host is an agent of its own (docs/gpu.md, "The host as an agent"):
//     memory can be host memory of the modelled device (HostScope,
//     memory_of), pinned or pageable. An op whose tensors are all host
//     memory is the host's work: the host reads and writes at once, so
//     stream work issued later is ordered after it, but the host is ordered
//     after a stream's work only by a host synchronization. aten::copy_
//     between host and device memory is a transfer on the current stream:
//     non-blocking from or to pinned memory it is stream work, as
//     cudaMemcpyAsync; otherwise the host waits for it (a host
//     synchronization). Host memory is exempt from the caching allocator's
//     rules (the pinned allocator records the streams of the copies that
//     use a block itself).
// An access that is not ordered after a conflicting one (read after write,
// write after read or write), and a free that is not ordered after another
// stream's access, is a race: a Report names the buffer, both streams, both
// FSDP phases and both ops. See docs/gpu.md, "The stream-order checker".
//
// Example (tests/stream_check/stream_check_test.cc):
//
//   fsdp::stream_check::Checker checker;
//   c10::Stream side = checker.new_stream("side");
//   at::Tensor t = at::ones({4});            // written on the default stream
//   {
//     c10::StreamGuard guard(side);
//     t.add_(1);                             // not ordered after the write
//   }
//   ASSERT_EQ(checker.reports().size(), 1u);
//
// Turning it on for a whole program: FSDP2CPP_STREAM_CHECK=1 in the
// environment makes a process-lifetime Checker when the library loads (with
// FSDP2CPP_STREAM_CHECK_MODEL=nccl, in the NCCL model), in OnRace::kThrow
// mode (a race throws c10::Error from the op that found it;
// one found when a block is freed throws from the next op). Races never
// thrown are printed at exit, and the process then exits with status 3.
//
// What it does not model: races inside a kernel, NCCL deadlocks, the real
// allocator's fragmentation, and anything done on threads it does not track
// (only the thread that made the Checker, and threads that call
// track_this_thread(), are seen).
//
// Threads: the model is process-wide and locked; the current stream and the
// phase label are per thread. One Checker at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace fsdp::stream_check {

// One race the model found.
struct Report {
  enum class Kind {
    kReadAfterWrite,               // a read not ordered after the last write
    kWriteAfterRead,               // a write not ordered after an earlier read
    kWriteAfterWrite,              // a write not ordered after an earlier write
    kFreedInUse,                   // freed while another stream's access may still run
    kUsedBeforeAllocationOrdered,  // accessed on a stream not ordered after the allocating one
  };
  Kind kind;
  std::string buffer;  // "all-gather output of layers.3", or how it was made
  // The earlier access and the one (or the free) that is not ordered after it.
  std::string first_stream, second_stream;
  std::string first_phase, second_phase;
  std::string first_op, second_op;
  std::string message;  // all of the above in one paragraph, with the missing edge
};

std::string to_string(Report::Kind kind);

// One host synchronization the model saw: the host waited for device work.
struct HostSync {
  std::string what;   // "aten::_local_scalar_dense (item())", "event synchronize", ...
  std::string phase;  // the FSDP phase label current on the thread, or "outside the FSDP phases"
};

enum class OnRace {
  kRecord,  // keep the report (Checker::reports())
  kThrow,   // also throw c10::Error with the report from the op that found it
};

// Which engine's semantics CPU communicators follow under the checker
// (docs/gpu.md, "The NCCL model"). Gloo moves the bytes either way.
enum class CollectiveModel {
  kGloo,  // as Gloo: the communicators' backend kind is Gloo
  kNccl,  // as NCCL: backend kind NCCL (every NCCL-only branch of the runtime
          // runs: in-place all-gather, native AVG/PREMUL_SUM and NCCL's
          // one-rank rules), and NCCL's wait contract: a wait without a
          // timeout orders a stream, a wait with one blocks the host (counted
          // in host_syncs())
};

// FSDP2CPP_STREAM_CHECK_MODEL: "nccl" or "gloo" (the default when unset).
// Throws c10::Error naming any other value.
CollectiveModel collective_model_from_env();

struct Options {
  OnRace on_race = OnRace::kRecord;
  CollectiveModel collectives = collective_model_from_env();
};

// Turns the model on for this process while it lives. The thread that makes
// it is tracked; others are not unless they call track_this_thread().
// REQUIRES: no other Checker alive (throws c10::Error otherwise). Streams,
// events and models made while it lived must not be used after it is gone.
class Checker {
 public:
  explicit Checker(Options options = {});
  ~Checker();
  Checker(const Checker&) = delete;
  Checker& operator=(const Checker&) = delete;

  // A new logical stream named `name` in reports (a user's side stream).
  c10::Stream new_stream(const std::string& name);
  // The races found so far, each once (the same pair of accesses found again
  // in a later step is not repeated).
  std::vector<Report> reports() const;
  void clear_reports();
};

// Whether a Checker is alive. Cheap (one atomic load).
bool active();

// Whether the meta device has modelled streams now: the planner's dry run of
// a CUDA job (fsdp_plan/dry_run.h) gives the meta device streams and events
// of its own, so that the FSDP runtime takes its CUDA paths (stream-ordered
// buffer lifetimes, events between its streams) on meta tensors. Set only by
// the code that installs those streams. Cheap (one atomic load).
bool meta_streams();
void set_meta_streams(bool modelled);
// While meta streams are modelled, what name_stream hands a meta stream's
// name to (the planner's, so that it knows each FSDP stream by what the
// runtime made it for); null: nothing. Set only by the code that installs
// those streams.
using MetaStreamNamer = void (*)(c10::StreamId stream, const std::string& name);
void set_meta_stream_namer(MetaStreamNamer namer);

// Whether a live Checker models NCCL's semantics for CPU communicators
// (Options::collectives == CollectiveModel::kNccl).
bool models_nccl();

// The host synchronizations the live Checker (the process's own one under
// FSDP2CPP_STREAM_CHECK=1 included) saw since it was made or since
// clear_host_syncs(), in order. Empty when inactive.
std::vector<HostSync> host_syncs();
void clear_host_syncs();

// Where a tensor's memory is in the model: host memory only where HostScope
// made it, or where an op of the host (all its tensors host memory) did.
enum class Memory {
  kDevice,  // the default: every buffer the checker did not see made on the host
  kPageableHost,
  kPinnedHost,  // page-locked, as cudaHostAlloc (CPU offload's shards with pin_memory)
};
// kDevice when inactive or when `t` has no storage.
Memory memory_of(const at::Tensor& t);

// While it lives, what the calling thread does is the host's own work: its
// ops are host accesses, and the memory they allocate is host memory, pinned
// when `pinned` (the stand-in for a pinned allocation, which needs a GPU).
// For code that makes the host memory of a modelled device (CPU offload on a
// CPU mesh under the checker). No-op when inactive. Nests.
class HostScope {
 public:
  explicit HostScope(bool pinned);
  ~HostScope();
  HostScope(const HostScope&) = delete;
  HostScope& operator=(const HostScope&) = delete;

 private:
  bool previous_pinned_;
};

// Tracks the calling thread (its ops, allocations and frees) until it exits.
// No-op when no Checker is alive.
void track_this_thread();

// Names the storage behind `t` in reports ("all-gather output of layers.3").
// No-op when inactive or when `t` has no storage. Build the name only when
// active() to keep the runtime's hot path free of string work.
void name_buffer(const at::Tensor& t, std::string name);

// Names a stream in reports ("all-gather copy-in"): a CPU stream of the live
// Checker, or a meta stream of the planner's dry run (set_meta_stream_namer).
// No-op otherwise.
void name_stream(const c10::Stream& stream, std::string name);

// The logical stream on which the collectives of `communicator` run (NCCL's
// internal stream of a communicator), made at first use and named `name`.
// REQUIRES: active().
c10::Stream collective_stream(const void* communicator, const std::string& name);

// Records an access to `t` by the calling thread's current stream, for an
// engine that touches memory without ATen ops (a collective's transport).
// `what` names the accessor in reports. No-op when inactive.
void record_access(const at::Tensor& t, bool write, const char* what);

// The host waits for `event` (recorded on a checked stream) where the model
// sees no op or guard call: a collective engine's host-blocking wait. Counted
// as a host synchronization named `what`, on the calling thread's phase, and
// every stream's later work is ordered after the event. No-op when inactive
// or on an untracked thread.
void host_wait(const c10::Event& event, const char* what);

// Labels the accesses made on this thread while it lives with `label` (the
// FSDP phase labels, phase.h). `label` must outlive the scope.
class PhaseLabel {
 public:
  explicit PhaseLabel(const char* label);
  ~PhaseLabel();
  PhaseLabel(const PhaseLabel&) = delete;
  PhaseLabel& operator=(const PhaseLabel&) = delete;

 private:
  const char* previous_;
};

}  // namespace fsdp::stream_check
