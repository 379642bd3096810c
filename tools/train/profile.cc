#include "profile.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <c10/util/Exception.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp_train {

absl::StatusOr<ProfileSteps> parse_profile_steps(const std::string& text, int64_t steps) {
  ProfileSteps out;
  if (text.empty()) {
    out.first = std::min<int64_t>(2, steps);
    out.last = std::min<int64_t>(3, steps);
    return out;
  }
  const size_t colon = text.find(':');
  bool parsed = false;
  if (colon == std::string::npos) {
    parsed = absl::SimpleAtoi(text, &out.first);
    out.last = out.first;
  } else {
    parsed = absl::SimpleAtoi(text.substr(0, colon), &out.first) && absl::SimpleAtoi(text.substr(colon + 1), &out.last);
  }
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-steps must be A:B (first and last step, 1-based) or A (got '", text, "')"));
  }
  if (out.first < 1 || out.last < out.first || out.last > steps) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile-steps ", text, " must satisfy 1 <= A <= B <= --steps (", steps, ")"));
  }
  return out;
}

std::string trace_path(const std::string& dir, int rank) { return absl::StrCat(dir, "/trace_rank", rank, ".json"); }

// mkdir -p, then a write probe. std::filesystem is safe here because
// fsdp2cpp::torch links libstdc++ ahead of libtorch.so ([Note: libstdc++
// before libtorch] in cmake/Fsdp2cppTorch.cmake).
absl::Status prepare_profile_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile: cannot create the directory '", dir, "': ", ec.message()));
  }
  const std::string probe = dir + "/.fsdp_train_write_test";
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--profile: cannot write in '", dir, "': ", std::strerror(errno)));
  }
  std::fclose(f);
  std::remove(probe.c_str());
  return absl::OkStatus();
}

std::optional<fsdp::ProfilerOptions> profiler_options(const TrainConfig& config, int rank, const c10::Device& device,
                                                      int64_t run_first_step) {
  if (config.profile_dir.empty()) return std::nullopt;
  auto steps = parse_profile_steps(config.profile_steps, config.steps);
  TORCH_CHECK(steps.ok(), steps.status().message());
  const int64_t first = std::max(steps->first, run_first_step);
  if (first > steps->last) return std::nullopt;
  fsdp::ProfilerOptions options;
  options.trace_dir = config.profile_dir;
  options.rank = rank;
  options.first_step_number = run_first_step;
  options.record_cuda = device.is_cuda();
  options.schedule.skip_first = 0;
  // The step before the first profiled one starts the profiler up, so that
  // Kineto's start-up cost is not in the trace.
  options.schedule.warmup = first > run_first_step ? 1 : 0;
  options.schedule.wait = first - run_first_step - options.schedule.warmup;
  options.schedule.active = steps->last - first + 1;
  options.schedule.repeat = 1;
  return options;
}

std::string describe_profile(const fsdp::ProfilerOptions& options, const std::string& file) {
  const int64_t first =
      options.first_step_number + options.schedule.skip_first + options.schedule.wait + options.schedule.warmup;
  return absl::StrCat("steps ", first, "..", first + options.schedule.active - 1, " in ", file, " (one file per rank)");
}

}  // namespace fsdp_train
