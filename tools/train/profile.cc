#include "profile.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>
#include <system_error>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp_train {

namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> out = {ActivityType::CPU};
  if (cuda) out.insert(ActivityType::CUDA);
  return out;
}

}  // namespace

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

StepProfiler::StepProfiler(const TrainConfig& config, int rank, const c10::Device& device)
    : dir_(config.profile_dir), rank_(rank), cuda_(device.is_cuda()) {
  if (dir_.empty()) return;
  auto steps = parse_profile_steps(config.profile_steps, config.steps);
  if (!steps.ok()) throw std::runtime_error(std::string(steps.status().message()));
  steps_ = *steps;
  if (const absl::Status ready = prepare_profile_dir(dir_); !ready.ok()) {
    throw std::runtime_error(std::string(ready.message()));
  }
  // Loads Kineto's activity handlers now, so that their start-up cost is not
  // in the first profiled step.
  profiler::prepareProfiler(ProfilerConfig(ProfilerState::KINETO), activities(cuda_));
}

StepProfiler::~StepProfiler() {
  step_label_.reset();
  if (running_) {
    try {
      profiler::disableProfiler();
    } catch (...) {  // NOLINT(bugprone-empty-catch): already unwinding from the run's own error
    }
  }
}

void StepProfiler::begin_step(int64_t step) {
  if (dir_.empty() || step < steps_.first || step > steps_.last) return;
  if (step == steps_.first) {
    profiler::enableProfiler(ProfilerConfig(ProfilerState::KINETO), activities(cuda_));
    running_ = true;
  }
  step_label_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (step_label_->isActive()) step_label_->before(absl::StrCat("ProfilerStep#", step));
}

void StepProfiler::end_step(int64_t step) {
  if (!running_ || step < steps_.first || step > steps_.last) return;
  step_label_.reset();
  if (step < steps_.last) return;
  running_ = false;
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  const std::string path = trace_path(dir_, rank_);
  TORCH_CHECK(result != nullptr, "--profile: the profiler returned no result for steps ", steps_.first, "..",
              steps_.last);
  result->save(path);
  written_ = path;
}

std::string StepProfiler::describe() const {
  return absl::StrCat("steps ", steps_.first, "..", steps_.last, " in ", written_.value_or("(not written)"),
                      " (one file per rank)");
}

}  // namespace fsdp_train
