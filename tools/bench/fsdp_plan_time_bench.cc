// fsdp_plan_time_bench: the planner's simulated step time against the
// measured one, on this machine (issue 32, docs/planning.md, "Checked
// against measurement"). For each model and world size it runs fsdp_plan
// --device cpu --engine gloo (a dry run of rank 0, simulated under the CPU
// profile the tool measures itself, each distinct kernel replayed) and
// fsdp_train on as many local ranks, and prints the two step times and
// their ratio; the goal is within 15%. One table, both sides measured in
// the same run. With --device cuda it does the same on this machine's GPUs
// (one rank per GPU, NCCL): fsdp_plan under a shipped device profile
// (--profile) against fsdp_train --device cuda, for one Llama 3.1 8B block
// and a four-block model in bf16 (the GPU check of issue 32).
//
//   build/tools/bench/fsdp_plan_time_bench            # world sizes 1-4, two models
//   build/tools/bench/fsdp_plan_time_bench --quick    # world sizes 1-2, a tiny model
//   build/tools/bench/fsdp_plan_time_bench --device cuda --profile h200
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
ABSL_FLAG(std::string, device, "cpu", "cpu (Gloo, the measured CPU profile) or cuda (NCCL, one rank per GPU).");
ABSL_FLAG(std::string, profile, "h100",
          "With --device cuda: fsdp_plan's device profile for this machine's GPU (h100, h100-hbm2e-500w, h200).");

namespace {

// fsdp_plan's simulated step (seconds) of a CPU job (`profile` empty: the
// CPU profile it measures) or of a CUDA job under `profile`, or NAN when it
// failed (printed).
double simulated_step_s(const fsdp_train::TrainConfig& shape, int nproc, const std::string& profile) {
  std::vector<std::string> args = bench::model_flags(shape);
  args.insert(args.end(), {"--world-size", std::to_string(nproc), "--json=-"});
  if (profile.empty()) {
    args.insert(args.end(), {"--device", "cpu", "--engine", "gloo", "--threads", "1"});
  } else {
    args.insert(args.end(), {"--device", profile});
  }
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
    std::fprintf(stderr, "fsdp_plan_time_bench: need --max_nproc >= 1 and --steps >= 3\n");
    return 2;
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  const bool cuda = device == "cuda";
  if (!cuda && device != "cpu") {
    std::fprintf(stderr, "fsdp_plan_time_bench: --device is cpu or cuda (got '%s')\n", device.c_str());
    return 2;
  }
  if (cuda && !bench::have_cuda_devices(1)) {
    std::fprintf(stderr, "fsdp_plan_time_bench: --device cuda: no CUDA device on this machine\n");
    return 2;
  }
  std::vector<bench::NamedShape> models;
  if (quick) {
    models.push_back({"tiny", bench::model_shape(2, 32, 4, 16, 4)});
  } else if (cuda) {
    // Llama 3.1 8B's block (GQA, FFN 14336) at seq 4096, and four smaller blocks; bf16 parameters.
    bench::NamedShape llama{"1 Llama-8B block seq 4096", bench::model_shape(1, 4096, 32, 4096, 2)};
    llama.shape.kv_heads = 8;
    llama.shape.hidden = 14336;
    bench::NamedShape four{"4 blocks dim 2048 seq 2048", bench::model_shape(4, 2048, 16, 2048, 4)};
    for (bench::NamedShape* m : {&llama, &four}) m->shape.param_dtype = "bf16";
    models = {llama, four};
  } else {
    models.push_back({"4 blocks dim 64 seq 32", bench::model_shape(4, 64, 4, 32, 24)});
    models.push_back({"2 blocks dim 256 seq 128", bench::model_shape(2, 256, 8, 128, 12)});
  }
  const bench::Programs programs = bench::default_programs();
  const std::string profile = cuda ? absl::GetFlag(FLAGS_profile) : "";
  if (cuda) {
    std::printf("fsdp_plan_time_bench: %d steps per run (2 untimed), CUDA (NCCL), simulated on profile %s\n", steps,
                profile.c_str());
  } else {
    std::printf("fsdp_plan_time_bench: %d steps per run (2 untimed), 1 intra-op thread per rank, Gloo\n", steps);
  }
  std::printf("%-26s %5s %14s %13s %10s\n", "model", "ranks", "simulated ms", "measured ms", "sim/meas");
  for (const bench::NamedShape& m : models) {
    for (int nproc = 1; nproc <= max_nproc; ++nproc) {
      if (m.shape.global_batch % nproc != 0 || (cuda && !bench::have_cuda_devices(nproc))) continue;
      bench::RunOptions options;
      options.nproc = nproc;
      options.steps = steps;
      options.device = device;
      const bench::Measured measured = bench::run_fsdp_train(programs, m.shape, options);
      if (!measured.ok) {
        std::fprintf(stderr, "fsdp_plan_time_bench: %s\n", measured.error.c_str());
        return 1;
      }
      const double simulated = simulated_step_s(m.shape, nproc, profile);
      if (std::isnan(simulated)) return 1;
      std::printf("%-26s %5d %14.2f %13.2f %10.2f\n", m.name.c_str(), nproc, simulated * 1e3,
                  measured.median_step_s * 1e3, simulated / measured.median_step_s);
    }
  }
  return 0;
}
