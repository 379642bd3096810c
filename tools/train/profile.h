// --profile: a LibTorch (Kineto) trace of some training steps, written as
// Chrome trace JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open,
// by the public fsdp::Profiler (fsdp2/profiler.h), which the trainer uses as
// any training program would. The FSDP phases are labelled in it by their
// RecordFunction names ("FSDP::all_gather (layers.0)", "FSDP::reduce_scatter
// (layers.0)", "FSDP::all_gather (root)", ...), each step by
// "ProfilerStep#<step>" with the trainer's step numbers; on CUDA the trace
// also shows the kernels and NCCL on their streams.
//
// Each rank writes <dir>/trace_rank<R>.json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config.h"
#include "fsdp2/profiler.h"

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

// The fsdp::Profiler options that record the steps of --profile-steps, one
// warm-up step before the first of them where the run has one, in a run whose
// first step is `run_first_step` (later than 1 after --resume: steps already
// done are not profiled). nullopt when --profile is unset or every profiled
// step is already done. REQUIRES: validate(config, ...) is OK.
std::optional<fsdp::ProfilerOptions> profiler_options(const TrainConfig& config, int rank, const c10::Device& device,
                                                      int64_t run_first_step);

// "steps A..B in <file> (one file per rank)", for the run's summary.
std::string describe_profile(const fsdp::ProfilerOptions& options, const std::string& file);

}  // namespace fsdp_train
