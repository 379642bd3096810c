// fsdp_plan_time_bench: the planner's simulated step time against the
// measured one, on this machine (issue 32, docs/planning.md, "Checked
// against measurement"). For each model and world size it runs fsdp_plan
// --device cpu --engine gloo (a dry run of rank 0, simulated under the CPU
// profile the tool measures itself, each distinct kernel replayed) and
// fsdp_train on as many local ranks, and prints the two step times and
// their ratio; the goal is within 15%. One table, both sides measured in
// the same run.
//
//   build/tools/bench/fsdp_plan_time_bench            # world sizes 1-4, two models
//   build/tools/bench/fsdp_plan_time_bench --quick    # world sizes 1-2, a tiny model
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench_util.h"

ABSL_FLAG(int, max_nproc, 4, "Largest world size (local ranks).");
ABSL_FLAG(int, steps, 12, "Training steps per measured run (the first 2 untimed).");
ABSL_FLAG(bool, quick, false, "World sizes 1-2, a tiny model, few steps (the smoke test's mode).");

namespace {

// fsdp_plan's simulated step (seconds), or NAN when it failed (printed).
double simulated_step_s(const fsdp_train::TrainConfig& shape, int nproc) {
  std::vector<std::string> args = bench::model_flags(shape);
  args.push_back("--world-size");
  args.push_back(std::to_string(nproc));
  for (const char* a : {"--device", "cpu", "--engine", "gloo", "--threads", "1", "--json", "-"}) args.push_back(a);
  const bench::RunResult run = bench::run_program(FSDP_PLAN_BINARY, args);
  const std::optional<double> step = bench::json_number(run.output, "step_s");
  if (run.exit_code != 0 || !step) {
    std::fprintf(stderr, "fsdp_plan_time_bench: fsdp_plan failed:\n%s\n", bench::tail(run.output).c_str());
    return NAN;
  }
  return *step;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fsdp_plan_time_bench: the planner's simulated CPU step time against fsdp_train's measured one, per world "
      "size");
  absl::ParseCommandLine(argc, argv);
  const bool quick = absl::GetFlag(FLAGS_quick);
  const int max_nproc = quick ? 2 : absl::GetFlag(FLAGS_max_nproc);
  const int steps = quick ? 4 : absl::GetFlag(FLAGS_steps);
  if (max_nproc < 1 || steps < 3) {
    std::fprintf(stderr, "fsdp_plan_time_bench: need --max-nproc >= 1 and --steps >= 3\n");
    return 2;
  }
  std::vector<bench::NamedShape> models;
  if (quick) {
    models.push_back({"tiny", bench::model_shape(2, 32, 4, 16, 4)});
  } else {
    models.push_back({"4 blocks dim 64 seq 32", bench::model_shape(4, 64, 4, 32, 24)});
    models.push_back({"2 blocks dim 256 seq 128", bench::model_shape(2, 256, 8, 128, 12)});
  }
  const bench::Programs programs = bench::default_programs();
  std::printf("fsdp_plan_time_bench: %d steps per run (2 untimed), 1 intra-op thread per rank, Gloo\n", steps);
  std::printf("%-26s %5s %14s %13s %10s\n", "model", "ranks", "simulated ms", "measured ms", "sim/meas");
  for (const bench::NamedShape& m : models) {
    for (int nproc = 1; nproc <= max_nproc; ++nproc) {
      if (m.shape.global_batch % nproc != 0) continue;
      bench::RunOptions options;
      options.nproc = nproc;
      options.steps = steps;
      const bench::Measured measured = bench::run_fsdp_train(programs, m.shape, options);
      if (!measured.ok) {
        std::fprintf(stderr, "fsdp_plan_time_bench: %s\n", measured.error.c_str());
        return 1;
      }
      const double simulated = simulated_step_s(m.shape, nproc);
      if (std::isnan(simulated)) return 1;
      std::printf("%-26s %5d %14.2f %13.2f %10.2f\n", m.name.c_str(), nproc, simulated * 1e3,
                  measured.median_step_s * 1e3, simulated / measured.median_step_s);
    }
  }
  return 0;
}
