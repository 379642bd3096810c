// --profile: a LibTorch (Kineto) trace of some training steps, written as
// Chrome trace JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.
// The FSDP phases are labelled in it by their RecordFunction names
// ("FSDP::all_gather (layers.0)", "FSDP::reduce_scatter (layers.0)", ...),
// each step by "ProfilerStep#<step>" as torch.profiler names it; on CUDA the
// trace also shows the kernels and NCCL on their streams.
//
//   StepProfiler profiler(config, rank, device);     // nothing when --profile is unset
//   for (int64_t step = 1; step <= steps; ++step) {
//     profiler.begin_step(step);
//     ... forward, backward, optimizer ...
//     profiler.end_step(step);                        // after the last profiled step: saves
//   }
//
// Each rank writes <dir>/trace_rank<R>.json.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config.h"

namespace at {
class RecordFunction;
}

namespace fsdp_train {

// The steps of --profile-steps: first..last, 1-based, inclusive.
struct ProfileSteps {
  int64_t first = 1;
  int64_t last = 1;
};

// Parses --profile-steps ("A:B", or "A" for one step) for a run of `steps`
// steps; empty text means steps 2..3 (step 1 is warm-up), clipped to the run.
// Fails, naming --profile-steps, on malformed text or a range outside
// 1..steps.
absl::StatusOr<ProfileSteps> parse_profile_steps(const std::string& text, int64_t steps);

// The trace file of `rank` under --profile `dir`.
std::string trace_path(const std::string& dir, int rank);

// Creates --profile's directory if needed and checks that a file can be
// written in it. Fails naming --profile.
absl::Status prepare_profile_dir(const std::string& dir);

// Runs LibTorch's Kineto profiler over the steps of --profile-steps.
// Threading: call from the training thread; the profiler follows the work
// into autograd's threads. Only one profiler may run in a process.
class StepProfiler {
 public:
  // Does nothing when config.profile_dir is empty. REQUIRES:
  // validate(config, ...) is OK.
  StepProfiler(const TrainConfig& config, int rank, const c10::Device& device);
  // Stops a trace that is still running (an exception mid-run) without
  // saving it.
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Starts the profiler at the first profiled step, and labels the step.
  void begin_step(int64_t step);
  // Closes the step's label; after the last profiled step, stops the
  // profiler and writes the trace (throws std::runtime_error when it cannot).
  void end_step(int64_t step);

  // The file written, once written.
  const std::optional<std::string>& written() const { return written_; }
  // "steps A..B in <file> (one file per rank)", for the run's summary.
  std::string describe() const;

 private:
  std::string dir_;
  ProfileSteps steps_;
  int rank_ = 0;
  bool cuda_ = false;
  bool running_ = false;
  std::unique_ptr<at::RecordFunction> step_label_;
  std::optional<std::string> written_;
};

}  // namespace fsdp_train
