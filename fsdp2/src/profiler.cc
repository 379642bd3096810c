#include "fsdp2/profiler.h"

#include <dlfcn.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <kineto/ILoggerObserver.h>
#include <torch/csrc/autograd/profiler_kineto.h>

namespace fsdp {
namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// Kineto is one profiler per process, so this is the one piece of global
// state: a second Profiler would stop the first one's trace from under it.
std::atomic<bool> profiler_exists{false};

int rank_from_environment() {
  for (const char* name : {"RANK", "SLURM_PROCID"}) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(text, &end, 10);
    TORCH_CHECK(errno == 0 && *end == '\0' && value >= 0 && value <= (1L << 30),
                "fsdp::Profiler: ProfilerOptions::rank is -1 (take it from the environment) but $", name, " is '", text,
                "', not a rank; set ProfilerOptions::rank");
    return static_cast<int>(value);
  }
  return 0;
}

// mkdir -p, then a probe file: a directory the trace cannot be written to
// fails here, not after the profiled steps ran.
void prepare_trace_dir(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "fsdp::Profiler: ProfilerOptions::trace_dir is empty; say where the traces go");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "fsdp::Profiler: cannot create the trace directory '", dir, "': ", ec.message());
  const std::string probe = dir + "/.fsdp_profiler_write_test";
  std::FILE* f = std::fopen(probe.c_str(), "w");
  TORCH_CHECK(f != nullptr, "fsdp::Profiler: cannot write in the trace directory '", dir, "': ", std::strerror(errno));
  std::fclose(f);
  std::remove(probe.c_str());
}

void check_schedule(const ProfilerSchedule& s) {
  const std::pair<const char*, int64_t> counts[] = {
      {"skip_first", s.skip_first}, {"wait", s.wait}, {"warmup", s.warmup}, {"repeat", s.repeat}};
  for (const auto& [name, value] : counts) {
    TORCH_CHECK(value >= 0, "fsdp::Profiler: ProfilerSchedule::", name, " is ", value, "; it counts steps, so >= 0");
  }
  TORCH_CHECK(s.active >= 1, "fsdp::Profiler: ProfilerSchedule::active is ", s.active,
              "; a cycle records at least one step");
}

// [Note: Kineto without a GPU] Kineto (inside libtorch_cpu; the CUDA wheel's
// is built with CUPTI) asks the CUDA runtime for the device count when it
// processes a trace, to write the devices' properties, whatever activities
// were asked for, and logs a failure at ERROR: on a host without a GPU
// driver every rank printed "gpuGetDeviceCount failed with code 35" with
// record_cuda false. Kineto lowers its own threshold to ERROR when it first
// starts (unless KINETO_LOG_LEVEL is set), so while a trace of CPU activity
// only is being made, its threshold is raised above ERROR, and put back when
// the trace is written. Its threshold is a variable libtorch_cpu exports
// (libkineto::Logger::severityLevel_, a std::atomic<int>), found at run time:
// a LibTorch without it keeps Kineto's message, and nothing else changes.
std::atomic<int>* kineto_log_threshold() {
  static std::atomic<int>* const level =
      static_cast<std::atomic<int>*>(::dlsym(RTLD_DEFAULT, "_ZN9libkineto6Logger14severityLevel_E"));
  return level;
}

// The threshold to put back, or -1 when it was not raised.
int kineto_threshold_before = -1;

void quiet_kineto_errors() {
  std::atomic<int>* level = kineto_log_threshold();
  const char* user_level = std::getenv("KINETO_LOG_LEVEL");
  if (level == nullptr || kineto_threshold_before >= 0 || (user_level != nullptr && *user_level != '\0')) return;
  kineto_threshold_before = level->exchange(libkineto::LoggerOutputType::ERROR + 1);
}

void restore_kineto_errors() {
  if (kineto_threshold_before < 0) return;
  kineto_log_threshold()->store(kineto_threshold_before);
  kineto_threshold_before = -1;
}

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> out = {ActivityType::CPU};
  if (cuda) out.insert(ActivityType::CUDA);
  return out;
}

ProfilerConfig config_of(const ProfilerOptions& o) {
  return ProfilerConfig(ProfilerState::KINETO, o.record_shapes, o.profile_memory, o.with_stack);
}

}  // namespace

Profiler::Profiler(ProfilerOptions options)
    : options_(std::move(options)), uncaught_at_construction_(std::uncaught_exceptions()) {
  check_schedule(options_.schedule);
  TORCH_CHECK(options_.rank >= -1, "fsdp::Profiler: ProfilerOptions::rank is ", options_.rank,
              "; give the rank, or -1 to take $RANK");
  if (options_.rank == -1) options_.rank = rank_from_environment();
  if (!options_.record_cuda.has_value()) options_.record_cuda = at::hasCUDA();
  prepare_trace_dir(options_.trace_dir);
  TORCH_CHECK(!profiler_exists.exchange(true),
              "fsdp::Profiler: another Profiler exists in this process; LibTorch's profiler is process-wide, so "
              "destroy (or stop()) the first before making another");
  action_ = action_at(0);
  try {
    transition(Action::kNone, action_, /*last_step=*/-1);
  } catch (...) {
    profiler_exists = false;
    throw;
  }
  open_step_label();
}

Profiler::~Profiler() {
  if (!stopped_) {
    step_label_.reset();
    if (running_ && std::uncaught_exceptions() > uncaught_at_construction_) {
      // The loop is failing: its partial trace would be mistaken for a
      // profile of the steps.
      running_ = false;
      try {
        kineto::disableProfiler();
      } catch (...) {  // NOLINT(bugprone-empty-catch): already unwinding from the loop's own error
      }
      restore_kineto_errors();
    } else {
      try {
        stop_and_save(step_number());
      } catch (const std::exception& e) {
        TORCH_WARN("fsdp::Profiler: the last trace was not written: ", e.what());
      }
    }
    stopped_ = true;
  }
  restore_kineto_errors();  // a warm-up that never recorded raised it too
  profiler_exists = false;
}

Profiler::Action Profiler::action_at(int64_t step) const {
  const ProfilerSchedule& s = options_.schedule;
  if (step < s.skip_first) return Action::kNone;
  step -= s.skip_first;
  const int64_t cycle = s.wait + s.warmup + s.active;
  if (s.repeat > 0 && step / cycle >= s.repeat) return Action::kNone;
  const int64_t in_cycle = step % cycle;
  if (in_cycle < s.wait) return Action::kNone;
  if (in_cycle < s.wait + s.warmup) return Action::kWarmup;
  return in_cycle < cycle - 1 ? Action::kRecord : Action::kRecordAndSave;
}

// torch.profiler's _transit_action table, for the sequences a schedule can
// produce. `last_step` is the step that just ended: the last one of a cycle
// that is saved now.
void Profiler::transition(Action from, Action to, int64_t last_step) {
  const bool recording = from == Action::kRecord || from == Action::kRecordAndSave;
  if (recording && (from == Action::kRecordAndSave || to == Action::kNone)) stop_and_save(last_step);
  if (to == Action::kWarmup && from != Action::kWarmup) prepare();
  if ((to == Action::kRecord || to == Action::kRecordAndSave) && !running_) {
    // A warm-up step prepared the profiler already.
    if (from != Action::kWarmup) prepare();
    start();
  }
}

void Profiler::prepare() {
  kineto::prepareProfiler(config_of(options_), activities(*options_.record_cuda));
  // After Kineto's first start, which sets its threshold (see the note).
  if (!*options_.record_cuda) quiet_kineto_errors();
}

void Profiler::start() {
  kineto::enableProfiler(config_of(options_), activities(*options_.record_cuda));
  if (!*options_.record_cuda) quiet_kineto_errors();
  running_ = true;
  cycle_first_step_ = step_number();
}

void Profiler::stop_and_save(int64_t last_step) {
  if (!running_) return;
  running_ = false;
  // Kineto's threshold comes back once the trace is processed and written.
  const struct RestoreKinetoErrors {
    ~RestoreKinetoErrors() { restore_kineto_errors(); }
  } restore;
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  TORCH_CHECK(result != nullptr, "fsdp::Profiler: LibTorch's profiler returned no result for steps ", cycle_first_step_,
              "..", last_step);
  std::string path = options_.trace_dir + "/trace_rank" + std::to_string(options_.rank);
  if (options_.schedule.repeat != 1) {
    path += "_steps" + std::to_string(cycle_first_step_) + "-" + std::to_string(last_step);
  }
  path += ".json";
  result->save(path);
  // ProfilerResult::save does not say whether the write succeeded.
  TORCH_CHECK(std::filesystem::exists(path), "fsdp::Profiler: the trace of steps ", cycle_first_step_, "..", last_step,
              " was not written to '", path, "'");
  written_.push_back(std::move(path));
}

void Profiler::open_step_label() {
  if (!running_) return;
  step_label_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (step_label_->isActive()) step_label_->before("ProfilerStep#" + std::to_string(step_number()));
}

void Profiler::step() {
  TORCH_CHECK(!stopped_, "fsdp::Profiler::step() after stop(); make a new Profiler to profile more steps");
  step_label_.reset();
  const int64_t ended = step_number();
  const Action previous = action_;
  ++steps_done_;
  action_ = action_at(steps_done_);
  transition(previous, action_, ended);
  open_step_label();
}

void Profiler::stop() {
  TORCH_CHECK(!stopped_, "fsdp::Profiler::stop() called twice");
  step_label_.reset();
  stopped_ = true;
  stop_and_save(step_number());
}

}  // namespace fsdp
