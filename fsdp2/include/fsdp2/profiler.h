// Profiling a training loop: LibTorch's Kineto profiler over a schedule of
// steps, one Chrome trace JSON per rank, the counterpart of
// torch.profiler.profile(schedule=torch.profiler.schedule(...)).
//
//   fsdp::ProfilerOptions options;
//   options.trace_dir = "prof";
//   options.rank = world->rank();
//   options.schedule.wait = 1;    // step 0: not profiled
//   options.schedule.warmup = 1;  // step 1: the profiler starts up
//   options.schedule.active = 2;  // steps 2 and 3: recorded
//   fsdp::Profiler profiler(options);
//   for (int step = 0; step < steps; ++step) {
//     ... forward, backward, optimizer step ...
//     profiler.step();
//   }
//   // Rank R has written prof/trace_rank<R>.json, holding steps 2 and 3.
//
// The trace opens in Perfetto (ui.perfetto.dev) or chrome://tracing. Each
// step is a span "ProfilerStep#<n>" as torch.profiler names it; inside it
// fully_shard's phases are spans named by FSDP2's labels and the module:
// "FSDP::all_gather (layers.3)", "FSDP::reduce_scatter (layers.3)",
// "FSDP::all_gather (root)" for the module fully_shard was applied to last
// (the empty FQN), "FSDP::root_pre_forward", and the ATen operators below
// them. On CUDA it also records the kernels and NCCL on their streams.
//
// Why not LibTorch's profiler directly: enableProfiler() without
// prepareProfiler() first crashes, nothing writes one file per rank, and a
// step schedule (skip the first steps, warm the profiler up, record a few)
// is the part every training program writes again.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace at {
class RecordFunction;
}

namespace fsdp {

// torch.profiler.schedule's fields and meaning. Counting steps from 0 (each
// Profiler::step() call ends one), the first `skip_first` steps are not
// profiled; then each cycle is `wait` steps not profiled, `warmup` steps
// with the profiler started but discarding what it sees (its own start-up
// cost stays out of the trace), and `active` steps recorded and written as
// one trace. The cycle runs `repeat` times; 0 repeats it until the profiler
// is destroyed.
struct ProfilerSchedule {
  int64_t skip_first = 0;
  int64_t wait = 1;
  int64_t warmup = 1;
  int64_t active = 2;
  int64_t repeat = 1;
};

struct ProfilerOptions {
  // Where the traces go; created (with its parents) if missing.
  std::string trace_dir;
  // The rank in the file names; -1 takes $RANK (set by fsdprun, torchrun and
  // the in-process launcher), else $SLURM_PROCID, else 0.
  int rank = -1;
  ProfilerSchedule schedule;
  // The number "ProfilerStep#<n>" gives the first step (torch.profiler: 0);
  // a loop that counts steps from 1 sets 1 so that the labels match its own.
  int64_t first_step_number = 0;
  // Record CUDA activity (kernels, memory copies, NCCL). Unset: whenever
  // LibTorch has CUDA and a device is present. When false, Kineto's own
  // error about a device it cannot query ("gpuGetDeviceCount failed", the
  // CUDA wheel on a host without a GPU) is kept off stderr while a trace is
  // made, unless KINETO_LOG_LEVEL is set.
  std::optional<bool> record_cuda;
  // torch.profiler's record_shapes, profile_memory and with_stack.
  bool record_shapes = false;
  bool profile_memory = false;
  bool with_stack = false;
};

// Runs LibTorch's Kineto profiler over ProfilerOptions::schedule and writes
// each recorded cycle to trace_dir as trace_rank<R>.json (a schedule with
// repeat != 1 writes trace_rank<R>_steps<A>-<B>.json, A..B the cycle's
// ProfilerStep numbers).
//
// RAII: the constructor starts step 0 of the schedule; the destructor ends
// the profiler. A cycle still recording when the profiler is destroyed, or
// stop() is called, is written with the steps it has (as torch.profiler's
// __exit__ does), unless the destructor runs because an exception is
// unwinding the stack: then the trace is dropped and nothing is written.
//
// Threading: construct it and call step() on the training thread. The
// profiler follows that thread's work into autograd's threads and, on CUDA,
// onto the device; it is process-wide (Kineto is), so only one Profiler may
// exist in a process at a time.
class Profiler {
 public:
  // Validates the options and prepares the directory. Throws c10::Error
  // naming the field when the schedule has a negative count or active < 1,
  // when trace_dir is empty or cannot be created or written, when $RANK is
  // not a number, or when another Profiler exists in this process.
  explicit Profiler(ProfilerOptions options);
  // Ends the profiler; see the class comment. Never throws: a trace that
  // cannot be written is reported as a warning.
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Ends the current step and begins the next: closes its ProfilerStep span
  // and moves the schedule on, starting, stopping and writing as it says.
  // Throws c10::Error naming the file when a trace cannot be written, or
  // when called after stop().
  void step();

  // Ends profiling now, writing a cycle that is recording. Later step()
  // calls throw; the destructor then does nothing. Throws as step() does.
  void stop();

  // The number of the step in progress, as its ProfilerStep label gives it.
  int64_t step_number() const { return options_.first_step_number + steps_done_; }
  // Every trace written so far, in order.
  const std::vector<std::string>& traces_written() const { return written_; }
  // The rank in the file names.
  int rank() const { return options_.rank; }

 private:
  enum class Action { kNone, kWarmup, kRecord, kRecordAndSave };

  Action action_at(int64_t step) const;
  void transition(Action from, Action to, int64_t last_step);
  void prepare();
  void start();
  void stop_and_save(int64_t last_step);
  void open_step_label();

  ProfilerOptions options_;
  int64_t steps_done_ = 0;
  int64_t cycle_first_step_ = 0;
  Action action_ = Action::kNone;
  bool running_ = false;
  bool stopped_ = false;
  int uncaught_at_construction_ = 0;
  std::unique_ptr<at::RecordFunction> step_label_;
  std::vector<std::string> written_;
};

}  // namespace fsdp
