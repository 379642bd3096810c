#include "checkpointing.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/hf.h"
#include "checkpoint/sharded.h"
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

void print_progress(const Communicator& group, const char* what, const std::string& where, int64_t bytes,
                    double seconds) {
  if (group.rank() != 0) return;
  std::printf("checkpoint  %s %s: %s in %.2f s (%s/s)\n", what, where.c_str(), format_bytes(bytes).c_str(), seconds,
              format_bytes(seconds > 0 ? static_cast<int64_t>(static_cast<double>(bytes) / seconds) : 0).c_str());
  std::fflush(stdout);
}

// POSIX, not std::filesystem: the torch wheel's libtorch.so exports its own
// copy of std::filesystem, and calls bind to it (see distributed_test.cc).
std::string cpu_rng_state_hex() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle: shares the generator
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  static const char* const kDigits = "0123456789abcdef";
  std::string hex;
  const auto* bytes = state.data_ptr<uint8_t>();
  for (int64_t i = 0; i < state.numel(); ++i) {
    hex += kDigits[bytes[i] >> 4];
    hex += kDigits[bytes[i] & 15];
  }
  return hex;
}

void set_cpu_rng_state_hex(const std::string& hex, const std::string& where) {
  TORCH_CHECK(hex.size() % 2 == 0, "--resume: ", where, ": cpu_rng_state is not hex");
  at::Tensor state = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  auto* bytes = state.data_ptr<uint8_t>();
  const auto digit = [&](char c) -> uint8_t {
    if (c >= '0' && c <= '9') return static_cast<uint8_t>(c - '0');
    TORCH_CHECK(c >= 'a' && c <= 'f', "--resume: ", where, ": cpu_rng_state is not hex");
    return static_cast<uint8_t>(c - 'a' + 10);
  };
  for (size_t i = 0; i < hex.size() / 2; ++i)
    bytes[i] = static_cast<uint8_t>(digit(hex[2 * i]) << 4 | digit(hex[2 * i + 1]));
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
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
  group.all_reduce(failed, ReduceOp::max()).wait();
  if (failed.item<int>() == 0) return;
  TORCH_CHECK(group.rank() != 0, flag, ": ", error);
  TORCH_CHECK(false, flag, ": rank 0 found '", dir, "' damaged (its message names the file)");
}

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

}  // namespace

void save_checkpoint(const std::string& save_dir, int64_t keep, const TrainingProgress& progress,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const std::shared_ptr<Communicator>& group) {
  const auto start = Clock::now();
  const fsdp::StateDict model_sd = fsdp::get_model_state_dict(model);
  const fsdp::OptimizerStateDict optim_sd = fsdp::get_optimizer_state_dict(model, optimizer);

  fsdp::checkpoint::CheckpointWriterOptions options;
  options.mesh = progress.mesh;
  fsdp::checkpoint::CheckpointWriter writer(save_dir, progress.step, group, options);
  const auto model_saved = fsdp::checkpoint::save_sharded(model_sd, writer.subdir("model"), group->rank());
  const auto optim_saved = fsdp::checkpoint::save_sharded(optim_sd.state, writer.subdir("optim"), group->rank());
  writer.record(model_saved);
  writer.record(optim_saved);

  nlohmann::json extra;
  extra["param_groups"] = nlohmann::json::parse(optim_sd.param_groups);
  extra["progress"] = {{"step", progress.step},
                       {"world_size", progress.world_size},
                       {"mesh", progress.mesh},
                       {"samples_seen", progress.samples_seen},
                       {"cpu_rng_state", cpu_rng_state_hex()}};
  const std::string final_dir = writer.commit(extra.dump());
  const int64_t bytes = sum_over_ranks(*group, model_saved.bytes + optim_saved.bytes);
  if (group->rank() == 0 && keep > 0) fsdp::checkpoint::prune_checkpoints(save_dir, keep);
  print_progress(*group, "saved", final_dir, bytes, seconds_since(start));
}

TrainingProgress resume_from_latest(const std::string& save_dir, torch::nn::Module& model,
                                    torch::optim::Optimizer& optimizer, const std::shared_ptr<Communicator>& group) {
  TrainingProgress progress;
  const auto latest = fsdp::checkpoint::find_latest_checkpoint(save_dir);
  // Every rank must agree on the checkpoint (a save could complete between
  // two ranks' directory scans only if another job writes there).
  const int64_t step = latest ? latest->step : 0;
  at::Tensor steps = at::tensor({step, -step}, at::kLong);
  group->all_reduce(steps, ReduceOp::max()).wait();
  TORCH_CHECK(steps[0].item<int64_t>() == -steps[1].item<int64_t>(), "--resume: the ranks see different newest ",
              "checkpoints in '", save_dir, "' (is another run writing there?)");
  if (!latest) {
    if (group->rank() == 0) {
      std::printf("checkpoint  no complete checkpoint in %s: starting from step 1\n", save_dir.c_str());
      std::fflush(stdout);
    }
    return progress;
  }
  const auto start = Clock::now();
  verify_on_rank0(latest->path, *group, "--resume");
  const fsdp::checkpoint::CheckpointManifest manifest = fsdp::checkpoint::read_manifest(latest->path);

  fsdp::StateDict model_sd = fsdp::get_model_state_dict(model);
  const auto model_loaded = fsdp::checkpoint::load_sharded(model_sd, latest->path + "/model");
  fsdp::set_model_state_dict(model, model_sd);

  fsdp::OptimizerStateDict optim_sd = fsdp::get_optimizer_state_dict(model, optimizer);
  const auto optim_loaded = fsdp::checkpoint::load_sharded(optim_sd.state, latest->path + "/optim");
  const nlohmann::json extra = nlohmann::json::parse(manifest.extra_json);
  TORCH_CHECK(extra.contains("param_groups") && extra.contains("progress"), "--resume: ", latest->path,
              "/manifest.json has no trainer progress (\"extra\": {\"param_groups\", \"progress\"}); was it written "
              "by fsdp_train?");
  optim_sd.param_groups = extra["param_groups"].dump();
  fsdp::set_optimizer_state_dict(model, optimizer, optim_sd);

  const nlohmann::json& p = extra["progress"];
  progress.step = p.at("step").get<int64_t>();
  progress.world_size = p.at("world_size").get<int64_t>();
  progress.mesh = p.at("mesh").get<std::string>();
  progress.samples_seen = p.at("samples_seen").get<int64_t>();
  progress.cpu_rng_state = p.at("cpu_rng_state").get<std::string>();
  set_cpu_rng_state_hex(progress.cpu_rng_state, latest->path + "/manifest.json");
  TORCH_CHECK(progress.step == manifest.step, "--resume: ", latest->path, " is step ", manifest.step,
              " but its progress record says ", progress.step);
  const int64_t bytes = sum_over_ranks(*group, model_loaded.bytes_read + optim_loaded.bytes_read);
  print_progress(
      *group, "loaded",
      latest->path + " (saved at world size " + std::to_string(progress.world_size) + ", mesh " + progress.mesh + ")",
      bytes, seconds_since(start));
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
