// fsdp_bench: what fully_shard's options cost, measured in one run.
//
// Trains the trainer's transformer for a few steps under several fully_shard
// configurations on the same ranks and prints one table: step time (slowest
// rank), host time blocked in all-gather and reduce-scatter waits, bytes
// all-gathered per step, the unsharded parameter bytes still resident at the
// end of forward, and each step time as a ratio of the first row's.
//
//   fsdp_bench --nproc 2 --dim 256 --layers 4
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <absl/flags/flag.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include "collectives/world.h"
#include "command_line.h"
#include "config.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/fully_shard.h"
#include "launch/launch.h"
#include "model.h"

ABSL_FLAG(int, nproc, 2, "local ranks to start (ignored under torchrun, where RANK is set)");
ABSL_FLAG(int, steps, 8, "timed steps per configuration");
ABSL_FLAG(int, warmup, 2, "untimed steps per configuration");
ABSL_FLAG(int64_t, dim, 256, "model width");
ABSL_FLAG(int64_t, layers, 4, "transformer blocks (one fully_shard group each)");
ABSL_FLAG(int64_t, heads, 4, "attention heads");
ABSL_FLAG(int64_t, batch, 4, "rows per rank");
ABSL_FLAG(int64_t, seq_len, 128, "tokens per row");

namespace {

struct BenchConfig {
  const char* name;
  bool reshard_after_forward;
  std::optional<c10::ScalarType> param_dtype;
};

struct Row {
  double step_ms = 0, all_gather_wait_ms = 0, forward_all_gather_wait_ms = 0, reduce_scatter_wait_ms = 0,
         gathered_mib = 0, resident_mib = 0;
};

double max_over_ranks(const std::shared_ptr<fsdp::collectives::Communicator>& comm, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  comm->all_reduce(t, fsdp::collectives::ReduceOp::max()).wait();
  return t.item<double>();
}

Row run(const BenchConfig& bench, const fsdp::DeviceMesh& mesh) {
  fsdp_train::ModelConfig config;
  config.dim = absl::GetFlag(FLAGS_dim);
  config.layers = absl::GetFlag(FLAGS_layers);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.hidden = 4 * config.dim;
  config.max_seq_len = absl::GetFlag(FLAGS_seq_len);
  torch::manual_seed(0);
  auto model = std::make_shared<fsdp_train::Transformer>(config);
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  options.reshard_after_forward = bench.reshard_after_forward;
  options.mp_policy.param_dtype = bench.param_dtype;
  std::vector<fsdp::FSDPModule> modules;
  for (auto& block : model->blocks) modules.push_back(fsdp::fully_shard(block, options));
  fsdp::FSDPModule root = fsdp::fully_shard(model, options);
  modules.push_back(root);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t rows = absl::GetFlag(FLAGS_batch), seq = absl::GetFlag(FLAGS_seq_len);
  Row row;
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  double step_seconds = 0, forward_wait_seconds = 0;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) root.reset_runtime_stats();
    at::Tensor tokens = at::randint(config.vocab, {rows, seq + 1}, at::kLong);
    const double wait_before = root.runtime_stats().all_gather_wait_seconds;
    const auto start = std::chrono::steady_clock::now();
    at::Tensor logits = fsdp::call_module(*model, tokens.narrow(1, 0, seq));
    if (step >= warmup) forward_wait_seconds += root.runtime_stats().all_gather_wait_seconds - wait_before;
    if (step == warmup) {
      int64_t resident = 0;
      for (auto& m : modules) resident += m.unsharded_bytes();
      row.resident_mib = resident / 1048576.0;
    }
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}).to(at::kFloat),
                                                           tokens.narrow(1, 1, seq).reshape({-1}));
    loss.backward();
    optim.step();
    optim.zero_grad();
    if (step >= warmup) step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const auto stats = root.runtime_stats();
  const auto& comm = mesh.group(0);
  row.step_ms = max_over_ranks(comm, 1e3 * step_seconds / steps);
  row.all_gather_wait_ms = max_over_ranks(comm, 1e3 * stats.all_gather_wait_seconds / steps);
  row.forward_all_gather_wait_ms = max_over_ranks(comm, 1e3 * forward_wait_seconds / steps);
  row.reduce_scatter_wait_ms = max_over_ranks(comm, 1e3 * stats.reduce_scatter_wait_seconds / steps);
  row.gathered_mib = stats.all_gather_bytes / 1048576.0 / steps;
  row.resident_mib = max_over_ranks(comm, row.resident_mib);
  return row;
}

int run_rank() {
  auto world = fsdp::collectives::World::from_env();
  at::set_num_threads(std::max<int>(1, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) / world->local_size()));
  auto mesh = fsdp::init_device_mesh(world, c10::kCPU, {world->size()}, {"shard"});
  const std::vector<BenchConfig> configs = {
      {"reshard_after_forward=true (default)", true, std::nullopt},
      {"reshard_after_forward=false", false, std::nullopt},
      {"true + param_dtype=bf16", true, at::kBFloat16},
  };
  std::vector<Row> rows;
  for (const auto& c : configs) rows.push_back(run(c, mesh));
  if (world->rank() != 0) return 0;
  std::printf("fsdp_bench: %d ranks on cpu (Gloo), dim %ld, %ld blocks, %ld x %ld tokens per rank, %d timed steps\n",
              world->size(), static_cast<long>(absl::GetFlag(FLAGS_dim)),
              static_cast<long>(absl::GetFlag(FLAGS_layers)), static_cast<long>(absl::GetFlag(FLAGS_batch)),
              static_cast<long>(absl::GetFlag(FLAGS_seq_len)), absl::GetFlag(FLAGS_steps));
  std::printf("%-38s %10s %8s %10s %10s %10s %12s %14s\n", "configuration", "step ms", "ratio", "AG wait", "fwd AG",
              "RS wait", "AG MiB/step", "after-fwd MiB");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%-38s %10.1f %8.2f %10.1f %10.1f %10.1f %12.2f %14.2f\n", configs[i].name, r.step_ms,
                r.step_ms / rows.front().step_ms, r.all_gather_wait_ms, r.forward_all_gather_wait_ms,
                r.reduce_scatter_wait_ms, r.gathered_mib, r.resident_mib);
  }
  std::printf(
      "AG/RS wait: host time blocked in all-gather / reduce-scatter waits per step (exposed communication on "
      "CPU); fwd AG: the part of AG wait in forward; after-fwd: unsharded parameter bytes still held when forward "
      "ends.\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = fsdp_train::parse_command_line(argc, argv);
  return fsdp_train::run_rank_or_launch("fsdp_bench", absl::GetFlag(FLAGS_nproc), args, run_rank);
}
