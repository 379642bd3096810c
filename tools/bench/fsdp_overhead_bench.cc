// fsdp_overhead_bench: the runtime's own host work per fully_shard group per
// step (pre/post forward, pre/post backward, the collectives' issue and
// wait), for fsdp2cpp and PyTorch FSDP2 in one run.
//
// A stack of --groups tiny Linear(--width, --width) modules, each its own
// fully_shard group (plus the root), so compute and communication volume are
// negligible. The median forward + backward step time of the sharded stack
// minus that of the same stack unsharded, divided by the number of groups,
// is the overhead per group; the same is measured for PyTorch FSDP2
// (tools/bench/python/fsdp2_bench.py overhead) and the ratio printed. Also
// printed: the flight recorder's cost per collective (one record and the
// two state changes of a wait, timed on their own), and the per-group
// overhead again in strict mode (FSDP2CPP_STRICT_COLLECTIVES=1, which checks
// every collective's fingerprint with one more all-gather).
//
//   fsdp_overhead_bench                   1 rank, 64 groups, 200 steps
//   fsdp_overhead_bench --nproc 2         2 ranks (Gloo latency included)
//   fsdp_overhead_bench --quick           a seconds-long smoke run
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "bench_util.h"
#include "collectives/flight_recorder.h"
#include "collectives/world.h"
#include "command_line.h"
#include "config.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "launch/launch.h"

ABSL_FLAG(int, nproc, 1, "ranks");
ABSL_FLAG(int64_t, groups, 64, "fully_shard groups (tiny Linear modules)");
ABSL_FLAG(int64_t, width, 8, "Linear width");
ABSL_FLAG(int64_t, rows, 2, "batch rows");
ABSL_FLAG(int, steps, 200, "timed steps (forward + backward) per model");
ABSL_FLAG(int, warmup_steps, 20, "untimed first steps per model");
ABSL_FLAG(bool, quick, false, "8 groups, 20 steps: checks the program works, measures nothing");
ABSL_FLAG(std::string, python, "", "Python with torch (default: the build's FSDP2CPP_PYTHON)");
ABSL_FLAG(std::string, script, "", "fsdp2_bench.py (default: the source tree's)");
ABSL_FLAG(std::string, result_file, "", "internal: where rank 0 writes its figures for the launching process");

namespace {

struct TinyImpl : torch::nn::Module {
  explicit TinyImpl(int64_t width) {
    lin = register_module("lin", torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) { return lin(x); }
  torch::nn::Linear lin{nullptr};
};
FSDP2CPP_MODULE(Tiny);

struct TinyStack : torch::nn::Module {
  TinyStack(int64_t groups, int64_t width) {
    list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < groups; ++i) {
      layers.push_back(Tiny(width));
      list->push_back(layers.back());
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& layer : layers) h = layer(h);
    return h;
  }
  torch::nn::ModuleList list{nullptr};
  std::vector<Tiny> layers;
};

struct Sizes {
  int64_t groups, width, rows;
  int steps, warmup;
};

Sizes sizes() {
  const bool quick = absl::GetFlag(FLAGS_quick);
  return {quick ? 8 : absl::GetFlag(FLAGS_groups), absl::GetFlag(FLAGS_width), absl::GetFlag(FLAGS_rows),
          quick ? 20 : absl::GetFlag(FLAGS_steps), quick ? 2 : absl::GetFlag(FLAGS_warmup_steps)};
}

double median_step_seconds(TinyStack& model, const at::Tensor& x, const Sizes& s) {
  std::vector<double> times;
  for (int step = 0; step < s.warmup + s.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    fsdp::call_module(model, x).sum().backward();
    if (step >= s.warmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return bench::median(times);
}

// Nanoseconds per collective of the flight recorder's work: record_issue at
// issue, and the waiting and completed marks of Work::wait(), under the
// labels the runtime sets.
double recorder_ns_per_collective() {
  fsdp::collectives::FlightRecorder recorder(0, 4096);
  const int comm = recorder.register_communicator("gloo[0,1]#0", {0, 1});
  const fsdp::collectives::CollectiveLabel context("FSDP::pre_forward (layers.12)");
  const fsdp::collectives::CollectiveLabel label("FSDP::all_gather (layers.12)");
  constexpr int kCollectives = 200000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= kCollectives; ++i) {
    const int64_t id = recorder.record_issue(comm, i, "all_gather_into_tensor", "", at::kFloat, true, 4096, 1);
    recorder.mark(id, fsdp::collectives::CollectiveState::kWaiting);
    recorder.mark(id, fsdp::collectives::CollectiveState::kCompleted);
  }
  return 1e9 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kCollectives;
}

double max_over_ranks(fsdp::collectives::Communicator& group, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  group.all_reduce(t, fsdp::collectives::ReduceOp::max()).wait();
  return t.item<double>();
}

int run_rank() {
  const auto world = fsdp::collectives::World::from_env();
  at::set_num_threads(1);
  const Sizes s = sizes();
  const fsdp::DeviceMesh mesh = fsdp::init_device_mesh(world, c10::kCPU, {world->size()}, {"shard"});
  torch::manual_seed(0);
  const at::Tensor x = at::randn({s.rows, s.width});
  auto plain = std::make_shared<TinyStack>(s.groups, s.width);
  auto sharded = std::make_shared<TinyStack>(s.groups, s.width);
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  for (auto& layer : sharded->layers) fsdp::fully_shard(layer, options);
  fsdp::fully_shard(sharded, options);
  fsdp::collectives::Communicator& group = *mesh.group(0);
  const double t_plain = max_over_ranks(group, median_step_seconds(*plain, x, s));
  const double t_sharded = max_over_ranks(group, median_step_seconds(*sharded, x, s));
  if (world->rank() == 0) {
    std::ofstream out(absl::GetFlag(FLAGS_result_file));
    out << "{\"plain_step_s\": " << t_plain << ", \"sharded_step_s\": " << t_sharded
        << ", \"recorder_ns\": " << recorder_ns_per_collective() << "}\n";
    if (!out) return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("host overhead per fully_shard group, fsdp2cpp vs PyTorch FSDP2 (docs/benchmarks.md)");
  const std::vector<std::string> args = fsdp_train::parse_command_line(argc, argv);
  if (std::getenv("RANK") != nullptr) return run_rank();

  const int nproc = absl::GetFlag(FLAGS_nproc);
  const Sizes s = sizes();
  if (nproc < 1 || s.groups < 1 || s.width < 1 || s.rows < 1 || s.steps < 1 || s.warmup < 0) {
    std::fprintf(stderr, "fsdp_overhead_bench: --nproc, --groups, --width, --rows, --steps must be >= 1\n");
    return 2;
  }
  const bench::Programs programs =
      bench::programs_with(/*trainer=*/"", absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_script));

  // Ours: the ranks run as children (the trainer's launcher); rank 0 writes
  // its figures to a scratch file.
  bench::ScratchDir dir;
  const std::string result_file = dir.file("ours.json");
  std::vector<std::string> rank_args = fsdp_train::remove_flag(fsdp_train::remove_flag(args, "nproc"), "result_file");
  rank_args.push_back("--result_file=" + result_file);
  if (const int rc = fsdp::launch::launch_local_ranks(nproc, rank_args); rc != 0) {
    std::fprintf(stderr, "fsdp_overhead_bench: the fsdp2cpp ranks failed (exit code %d)\n", rc);
    return 1;
  }
  const std::string ours = bench::read_file(result_file).value_or("");
  const double ours_plain = bench::json_number(ours, "plain_step_s").value_or(0);
  const double ours_sharded = bench::json_number(ours, "sharded_step_s").value_or(0);
  const double recorder_ns = bench::json_number(ours, "recorder_ns").value_or(0);
  // The same in strict mode, in the same run.
  const std::string strict_file = dir.file("strict.json");
  rank_args.back() = "--result_file=" + strict_file;
  ::setenv("FSDP2CPP_STRICT_COLLECTIVES", "1", 1);
  const int strict_rc = fsdp::launch::launch_local_ranks(nproc, rank_args);
  ::unsetenv("FSDP2CPP_STRICT_COLLECTIVES");
  if (strict_rc != 0) {
    std::fprintf(stderr, "fsdp_overhead_bench: the fsdp2cpp ranks failed in strict mode (exit code %d)\n", strict_rc);
    return 1;
  }
  const std::string strict = bench::read_file(strict_file).value_or("");
  const double strict_plain = bench::json_number(strict, "plain_step_s").value_or(0);
  const double strict_sharded = bench::json_number(strict, "sharded_step_s").value_or(0);

  const std::vector<std::string> py_args = {programs.script,  "overhead",
                                            "--nproc",        std::to_string(nproc),
                                            "--groups",       std::to_string(s.groups),
                                            "--width",        std::to_string(s.width),
                                            "--rows",         std::to_string(s.rows),
                                            "--steps",        std::to_string(s.steps),
                                            "--warmup-steps", std::to_string(s.warmup)};
  const bench::RunResult py = bench::run_pytorch_script(programs.python, py_args);
  const size_t at = py.output.rfind("RESULT ");
  if (ours_sharded <= 0 || py.exit_code != 0 || at == std::string::npos) {
    std::fprintf(stderr, "fsdp_overhead_bench: no figures (ours: '%s'; PyTorch exit code %d):\n%s\n", ours.c_str(),
                 py.exit_code, bench::tail(py.output).c_str());
    return 1;
  }
  const double py_plain = bench::json_number(py.output.substr(at), "plain_step_s").value_or(0);
  const double py_sharded = bench::json_number(py.output.substr(at), "sharded_step_s").value_or(0);
  const double groups = static_cast<double>(s.groups);
  const double ours_per_group = 1e6 * (ours_sharded - ours_plain) / groups;
  const double py_per_group = 1e6 * (py_sharded - py_plain) / groups;

  std::printf(
      "fsdp_overhead_bench: %d rank%s (Gloo, 1 intra-op thread), %lld groups of Linear(%lld, %lld) + root, batch "
      "%lld; median of %d steps (forward + backward)%s\n",
      nproc, nproc == 1 ? "" : "s", static_cast<long long>(s.groups), static_cast<long long>(s.width),
      static_cast<long long>(s.width), static_cast<long long>(s.rows), s.steps,
      absl::GetFlag(FLAGS_quick) ? " (--quick: measures nothing)" : "");
  std::printf("%-14s %14s %14s %14s\n", "system", "unsharded us", "sharded us", "per-group us");
  std::printf("%-14s %14.1f %14.1f %14.2f\n", "fsdp2cpp", 1e6 * ours_plain, 1e6 * ours_sharded, ours_per_group);
  std::printf("%-14s %14.1f %14.1f %14.2f\n", "PyTorch FSDP2", 1e6 * py_plain, 1e6 * py_sharded, py_per_group);
  std::printf("%-14s %14.1f %14.1f %14.2f\n", "strict mode", 1e6 * strict_plain, 1e6 * strict_sharded,
              1e6 * (strict_sharded - strict_plain) / groups);
  std::printf("ours / PyTorch per group: %.3f (goal, issue 13: <= 0.33)\n", ours_per_group / py_per_group);
  std::printf("flight recorder per collective (record + wait's two marks): %.0f ns (goal, issue 20: < 1000)\n",
              recorder_ns);
  std::printf(
      "per-group us = (sharded - unsharded step time) / groups: the runtime's pre/post forward and backward work "
      "per group per step, with the collectives' issue and wait.\n");
  return 0;
}
