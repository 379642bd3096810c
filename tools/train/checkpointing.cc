#include "checkpointing.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/fsdp_state.h"
#include "checkpoint/hf.h"
#include "checkpoint/sharded.h"
#include "checkpoint/training_state.h"
#include "fsdp2/state_dict.h"
#include "report.h"

namespace fsdp_train {
namespace {

using Clock = std::chrono::steady_clock;
using fsdp::collectives::Communicator;
using fsdp::collectives::ReduceOp;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

int64_t sum_over_ranks(Communicator& group, int64_t value) {
  at::Tensor t = at::tensor({value}, at::kLong);
  group.all_reduce(t, ReduceOp::sum()).wait();
  return t.item<int64_t>();
}

double max_over_ranks(Communicator& group, double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  group.all_reduce(t, ReduceOp::max()).wait();
  return t.item<double>();
}

void print_progress(const Communicator& group, const char* what, const std::string& where, int64_t bytes,
                    double seconds) {
  if (group.rank() != 0) return;
  std::printf("checkpoint  %s %s: %s in %.2f s (%s/s)\n", what, where.c_str(), format_bytes(bytes).c_str(), seconds,
              format_bytes(seconds > 0 ? static_cast<int64_t>(static_cast<double>(bytes) / seconds) : 0).c_str());
  std::fflush(stdout);
}

// Rank 0 checks `dir`'s files against its manifest (sizes, CRC32) and every
// rank learns the verdict, so a damaged checkpoint fails all ranks at once
// instead of leaving the others waiting in the next collective.
void verify_on_rank0(const std::string& dir, Communicator& group, const char* flag) {
  std::string error;
  if (group.rank() == 0) {
    try {
      fsdp::checkpoint::verify_checkpoint(dir);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  at::Tensor failed = at::tensor({error.empty() ? 0 : 1}, at::kInt);
  // Rank 0 reads every file meanwhile: bounded by the group's timeout, not
  // by the divergence timeout (collectives/divergence.h).
  group.all_reduce(failed, ReduceOp::max()).wait(group.timeout());
  if (failed.item<int>() == 0) return;
  TORCH_CHECK(group.rank() != 0, flag, ": ", error);
  TORCH_CHECK(false, flag, ": rank 0 found '", dir, "' damaged (its message names the file)");
}

// POSIX, not std::filesystem: the torch wheel's libtorch.so exports its own
// copy of std::filesystem, and calls bind to it (see distributed_test.cc).
bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// mkdir -p.
void make_directories(const std::string& path, const char* flag) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (!prefix.empty() && ::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, flag, ": cannot create '", prefix, "': ", std::strerror(errno));
    }
    if (slash == std::string::npos) break;
  }
}

// What the trainer saves and resumes, registered once per call: the model,
// the optimizer (its param groups land in the manifest's extra as
// "param_groups"), the progress record ("progress") and the default CPU
// generator ("cpu_rng_state"). See checkpoint/training_state.h.
struct TrainerState {
  TrainerState(torch::nn::Module& model, torch::optim::Optimizer& optimizer)
      : model_state(model), optim_state(model, optimizer) {
    items.add("model", model_state)
        .add("optim", optim_state)
        .add_json("progress", progress)
        // The trainer draws its batches and initial values from generators of
        // its own seeded by (seed, step) and (seed, FQN), so this only
        // matters to code added to the loop that uses the global generator
        // (dropout, say).
        .add_rng("cpu_rng_state", at::detail::getDefaultCPUGenerator());
  }
  std::string cpu_rng_state_hex() const {
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle: shares the generator
    at::Tensor rng;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng = gen.get_state();
    }
    static const char* const kDigits = "0123456789abcdef";
    std::string hex;
    const auto* bytes = rng.data_ptr<uint8_t>();
    for (int64_t i = 0; i < rng.numel(); ++i) {
      hex += kDigits[bytes[i] >> 4];
      hex += kDigits[bytes[i] & 15];
    }
    return hex;
  }

  fsdp::checkpoint::ModelState model_state;
  fsdp::checkpoint::OptimizerState optim_state;
  std::string progress = "{}";
  fsdp::checkpoint::TrainingState items;
};

}  // namespace

namespace {

std::string progress_json(const TrainingProgress& progress) {
  return nlohmann::json{{"step", progress.step},
                        {"world_size", progress.world_size},
                        {"mesh", progress.mesh},
                        {"samples_seen", progress.samples_seen}}
      .dump();
}

}  // namespace

void save_checkpoint(const std::string& save_dir, int64_t keep, const TrainingProgress& progress,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const std::shared_ptr<Communicator>& group) {
  TrainerState state(model, optimizer);
  state.progress = progress_json(progress);
  fsdp::checkpoint::TrainingStateSaveOptions options;
  options.mesh = progress.mesh;
  options.keep = keep;
  const auto saved = fsdp::checkpoint::save_training_state(save_dir, progress.step, state.items, group, options);
  const int64_t bytes = sum_over_ranks(*group, saved.bytes);
  print_progress(*group, "saved", saved.dir, bytes, saved.seconds);
}

BackgroundCheckpointer::BackgroundCheckpointer(std::string save_dir, int64_t keep,
                                               std::shared_ptr<Communicator> metrics,
                                               std::shared_ptr<Communicator> writer_group)
    : save_dir_(std::move(save_dir)), keep_(keep), metrics_(std::move(metrics)), saver_(std::move(writer_group)) {}

BackgroundCheckpointer::~BackgroundCheckpointer() {
  // A save still in flight at an exception: let it commit (or fail) before
  // the saver goes, without throwing from a destructor.
  try {
    saver_.wait();
  } catch (const std::exception&) {
  }
}

void BackgroundCheckpointer::save(const TrainingProgress& progress, torch::nn::Module& model,
                                  torch::optim::Optimizer& optimizer) {
  report_finished();
  TrainerState state(model, optimizer);
  state.progress = progress_json(progress);
  fsdp::checkpoint::TrainingStateSaveOptions options;
  options.mesh = progress.mesh;
  options.keep = keep_;
  const auto staged = saver_.save(save_dir_, progress.step, state.items, options);
  const int64_t bytes = sum_over_ranks(*metrics_, staged.staged_bytes);
  const double blocked = max_over_ranks(*metrics_, staged.blocked_seconds);
  if (metrics_->rank() == 0) {
    std::printf("checkpoint  staged step-%lld: %s in host memory, the step blocked %.3f s; writing in the background\n",
                static_cast<long long>(progress.step), format_bytes(bytes).c_str(), blocked);
    std::fflush(stdout);
  }
}

void BackgroundCheckpointer::finish() { report_finished(); }

void BackgroundCheckpointer::report_finished() {
  const auto saved = saver_.wait();
  if (!saved) return;
  const int64_t bytes = sum_over_ranks(*metrics_, saved->bytes);
  print_progress(*metrics_, "saved", saved->dir, bytes, saved->seconds);
}

TrainingProgress resume_from_latest(const std::string& save_dir, torch::nn::Module& model,
                                    torch::optim::Optimizer& optimizer, const std::shared_ptr<Communicator>& group) {
  TrainingProgress progress;
  TrainerState state(model, optimizer);
  std::optional<fsdp::checkpoint::TrainingStateLoadResult> loaded;
  try {
    loaded = fsdp::checkpoint::load_latest_training_state(save_dir, state.items, group);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "--resume: ", e.what_without_backtrace());
  }
  if (!loaded) {
    if (group->rank() == 0) {
      std::printf("checkpoint  no complete checkpoint in %s: starting from step 1\n", save_dir.c_str());
      std::fflush(stdout);
    }
    return progress;
  }
  const nlohmann::json p = nlohmann::json::parse(state.progress);
  progress.step = p.at("step").get<int64_t>();
  progress.world_size = p.at("world_size").get<int64_t>();
  progress.mesh = p.at("mesh").get<std::string>();
  progress.samples_seen = p.at("samples_seen").get<int64_t>();
  progress.cpu_rng_state = state.cpu_rng_state_hex();
  TORCH_CHECK(progress.step == loaded->step, "--resume: ", loaded->dir, " is step ", loaded->step,
              " but its progress record says ", progress.step);
  const int64_t bytes = sum_over_ranks(*group, loaded->bytes_read);
  print_progress(
      *group, "loaded",
      loaded->dir + " (saved at world size " + std::to_string(progress.world_size) + ", mesh " + progress.mesh + ")",
      bytes, loaded->seconds);
  return progress;
}

void init_model_from(const std::string& dir, torch::nn::Module& model, const std::shared_ptr<Communicator>& group) {
  const auto start = Clock::now();
  TORCH_CHECK(exists(dir), "--init-from: '", dir, "' does not exist");
  std::string source = dir;
  bool hf = exists(dir + "/model.safetensors.index.json") || exists(dir + "/model.safetensors");
  if (!hf) {
    // A save directory: its newest checkpoint.
    if (!exists(dir + "/manifest.json")) {
      if (auto latest = fsdp::checkpoint::find_latest_checkpoint(dir)) source = latest->path;
    }
    if (exists(source + "/manifest.json")) {
      verify_on_rank0(source, *group, "--init-from");
      source += "/model";
    }
  }
  fsdp::StateDict model_sd = fsdp::get_model_state_dict(model);
  const auto loaded =
      hf ? fsdp::checkpoint::import_hf(model_sd, source) : fsdp::checkpoint::load_sharded(model_sd, source);
  fsdp::set_model_state_dict(model, model_sd);
  const int64_t bytes = sum_over_ranks(*group, loaded.bytes_read);
  print_progress(*group, "initialised from", source, bytes, seconds_since(start));
}

void export_model_hf(const std::string& dir, torch::nn::Module& model, const std::shared_ptr<Communicator>& group) {
  const auto start = Clock::now();
  if (group->rank() == 0) {
    make_directories(dir, "--export-hf");
  }
  const fsdp::StateDict model_sd = fsdp::get_model_state_dict(model);
  const auto saved = fsdp::checkpoint::export_hf(model_sd, dir, group);
  const int64_t bytes = sum_over_ranks(*group, saved.bytes);
  print_progress(*group, "exported", dir + " (Hugging Face layout)", bytes, seconds_since(start));
}

}  // namespace fsdp_train
