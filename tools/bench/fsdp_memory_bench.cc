// fsdp_memory_bench: how much peak memory one more block costs a rank, next
// to what a rank must hold for it, for fsdp2cpp and PyTorch FSDP2 in one run.
//
// Trains the trainer's model (fsdp_train) at two depths (--small-layers,
// --large-layers) on --nproc ranks and reports, per rank: the peak memory at
// each depth, the growth per extra block, the block's sharded state (its
// parameters, gradients and both AdamW moments, fp32, divided by the world
// size), their ratio (goal <= 1.2), and the same for the same model under
// PyTorch FSDP2 (tools/bench/python/fsdp2_bench.py), with ours / PyTorch.
//
// Two CPU peaks per run, from the same processes: "live", the peak of bytes
// held through malloc (libfsdp_malloc_counter.so preloaded into every rank of
// both systems; the CPU analogue of the CUDA allocator's peak, and the figure
// the goal is judged on), and "rss", the max resident set size, which also
// counts what glibc keeps after frees. CUDA rows (only when --nproc GPUs are
// present): the caching allocator's peak ("alloc").
//
//   fsdp_memory_bench                       issue 10's configuration (dim 512, 4 vs 16 blocks)
//   fsdp_memory_bench --glibc-tunables glibc.malloc.mmap_threshold=131072
//   fsdp_memory_bench --quick               a seconds-long smoke run (tiny model)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "bench_util.h"
#include "command_line.h"
#include "config.h"
#include "model.h"

ABSL_FLAG(int, nproc, 2, "ranks per run");
ABSL_FLAG(int64_t, small_layers, 4, "blocks of the shallow run");
ABSL_FLAG(int64_t, large_layers, 16, "blocks of the deep run");
ABSL_FLAG(int64_t, dim, 512, "model width");
ABSL_FLAG(int64_t, heads, 8, "attention heads");
ABSL_FLAG(int64_t, seq_len, 16, "tokens per row");
ABSL_FLAG(int64_t, global_batch, 2, "rows per step over all ranks");
ABSL_FLAG(int, steps, 3, "optimizer steps per run (the peak is reached by step 2)");
ABSL_FLAG(bool, quick, false, "tiny model, 1 vs 3 blocks, 2 steps: checks the program works, measures nothing");
ABSL_FLAG(bool, cpu_only, false, "skip the CUDA rows even where GPUs are present");
ABSL_FLAG(std::string, trainer, "", "fsdp_train to run (default: the one built with this program)");
ABSL_FLAG(std::string, python, "", "Python with torch (default: the build's FSDP2CPP_PYTHON)");
ABSL_FLAG(std::string, script, "", "fsdp2_bench.py (default: the source tree's)");
ABSL_FLAG(std::string, glibc_tunables, "",
          "GLIBC_TUNABLES for every rank of both systems, e.g. glibc.malloc.mmap_threshold=131072 (a fixed mmap "
          "threshold: large blocks go back to the system when freed, so RSS follows live bytes more closely)");

namespace {

struct Row {
  std::string device, system;
  bench::Measured small, large;
};

// One figure of a Measured: the rows print it for both depths.
struct Measure {
  const char* name;
  double bench::Measured::*peak;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("peak memory per extra block, fsdp2cpp vs PyTorch FSDP2 (see docs/benchmarks.md)");
  const std::vector<std::string> args = fsdp_train::parse_command_line(argc, argv);

  const bench::Programs programs =
      bench::programs_with(absl::GetFlag(FLAGS_trainer), absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_script));

  const bool quick = absl::GetFlag(FLAGS_quick);
  const int nproc = absl::GetFlag(FLAGS_nproc);
  fsdp_train::TrainConfig shape;
  shape.dim = quick ? 32 : absl::GetFlag(FLAGS_dim);
  shape.heads = quick ? 4 : absl::GetFlag(FLAGS_heads);
  shape.seq_len = quick ? 8 : absl::GetFlag(FLAGS_seq_len);
  shape.global_batch = quick ? nproc : absl::GetFlag(FLAGS_global_batch);
  shape.clip = 0;
  const int64_t small = quick ? 1 : absl::GetFlag(FLAGS_small_layers);
  const int64_t large = quick ? 3 : absl::GetFlag(FLAGS_large_layers);
  bench::RunOptions options;
  options.nproc = nproc;
  options.steps = quick ? 2 : absl::GetFlag(FLAGS_steps);
  options.warmup_steps = 1;
  options.glibc_tunables = absl::GetFlag(FLAGS_glibc_tunables);
  if (nproc < 1 || large <= small || small < 1 || options.steps < 1 || shape.global_batch % nproc != 0) {
    std::fprintf(stderr,
                 "fsdp_memory_bench: need --nproc >= 1, 1 <= --small-layers < --large-layers, --steps >= 1 and "
                 "--global-batch divisible by --nproc\n");
    return 2;
  }

  // The per-rank state of one block: parameters, gradients, two AdamW
  // moments, fp32, sharded over the ranks.
  fsdp_train::TrainConfig tc;
  tc.dim = shape.dim;
  fsdp_train::ModelConfig mc;
  mc.dim = shape.dim;
  mc.hidden = fsdp_train::hidden_size(tc);
  const double state_per_block = 4.0 * 4.0 * static_cast<double>(fsdp_train::block_parameter_count(mc)) / nproc;

  std::vector<std::string> devices = {"cpu"};
  const bool cuda = !absl::GetFlag(FLAGS_cpu_only) && bench::have_cuda_devices(nproc);
  if (cuda) devices.push_back("cuda");
  std::vector<Row> rows;
  for (const std::string& device : devices) {
    options.device = device;
    options.count_live_bytes = device == "cpu";
    for (const bool ours : {true, false}) {
      Row row{device, ours ? "fsdp2cpp" : "PyTorch FSDP2", {}, {}};
      for (const int64_t layers : {small, large}) {
        shape.layers = layers;
        const bench::Measured m =
            ours ? bench::run_fsdp_train(programs, shape, options) : bench::run_pytorch_fsdp2(programs, shape, options);
        if (!m.ok) {
          std::fprintf(stderr, "fsdp_memory_bench: %s\n", m.error.c_str());
          return 1;
        }
        (layers == small ? row.small : row.large) = m;
      }
      rows.push_back(row);
    }
  }

  std::printf(
      "fsdp_memory_bench: %d ranks, dim %lld, %lld heads, seq %lld, global batch %lld, clip 0, %d steps; %lld vs "
      "%lld blocks%s\n",
      nproc, static_cast<long long>(shape.dim), static_cast<long long>(shape.heads),
      static_cast<long long>(shape.seq_len), static_cast<long long>(shape.global_batch), options.steps,
      static_cast<long long>(small), static_cast<long long>(large), quick ? " (--quick: measures nothing)" : "");
  std::printf("%-6s %-14s %-7s %12s %12s %14s %14s %13s %11s\n", "device", "system", "measure", "peak small",
              "peak large", "growth/block", "state/block", "growth/state", "vs PyTorch");
  const double blocks = static_cast<double>(large - small);
  for (size_t i = 0; i < rows.size(); i += 2) {
    std::vector<Measure> measures = {{"alloc", &bench::Measured::peak_bytes}};
    if (rows[i].device == "cpu") {
      measures = {{"live", &bench::Measured::peak_live_bytes}, {"rss", &bench::Measured::peak_bytes}};
    }
    for (const Measure& measure : measures) {
      const auto growth_of = [&](const Row& r) { return (r.large.*measure.peak - r.small.*measure.peak) / blocks; };
      const double pytorch_growth = growth_of(rows[i + 1]);
      for (size_t j = i; j < i + 2; ++j) {
        const Row& r = rows[j];
        const double growth = growth_of(r);
        std::printf("%-6s %-14s %-7s %12s %12s %14s %14s %13.2f %11.2f\n", r.device.c_str(), r.system.c_str(),
                    measure.name, bench::mib(r.small.*measure.peak).c_str(), bench::mib(r.large.*measure.peak).c_str(),
                    bench::mib(growth).c_str(), bench::mib(state_per_block).c_str(), growth / state_per_block,
                    growth / pytorch_growth);
      }
    }
  }
  if (!cuda)
    std::printf("cuda rows skipped: %s\n", absl::GetFlag(FLAGS_cpu_only) ? "--cpu-only" : "fewer GPUs than --nproc");
  if (!options.glibc_tunables.empty()) std::printf("GLIBC_TUNABLES=%s\n", options.glibc_tunables.c_str());
  std::printf(
      "MiB per rank (max over ranks). peak: live = peak of bytes held through malloc (libfsdp_malloc_counter.so), "
      "rss = max RSS, alloc = CUDA caching-allocator peak. growth/block: (peak large - peak small) / %lld. "
      "state/block: a block's fp32 parameters + gradients + 2 AdamW moments / %d ranks. Goal (issue 10): "
      "growth/state <= 1.2 on the live (cpu) and alloc (cuda) rows.\n",
      static_cast<long long>(large - small), nproc);
  return 0;
}
