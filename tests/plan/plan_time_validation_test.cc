// The time model against measurement on this machine: for the trainer's
// model and the deep MLP (plan_models.h) at world sizes 1 to 4, rank 0
// simulates its step (a dry run of its rank with Gloo's semantics, under the
// CPU profile measure_cpu_profile makes now, which times each distinct
// kernel of the plan), then every rank trains the same model on the CPU and
// rank 0 times its steps. The simulated step must be within 15% of the
// median measured one (issue 32).
//
// [Note: timing on a shared machine] Both sides are measurements of a
// machine other work may load (CI runs two tests at once). Each attempt
// measures the profile and the steps back to back, so they see the same
// load; the test makes up to three attempts and holds the closest to the
// bound. Every attempt is printed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include "fsdp_plan/timeline.h"
#include "fsdp_testing/distributed_test.h"
#include "plan_models.h"

namespace fsdp_plan::test {
namespace {

constexpr int kAttempts = 3;
constexpr int kWarmup = 2;
constexpr int kTimed = 7;

std::vector<OpRecord> dry_ops(RunnerFactory make, int rank, int world_size) {
  DryRunOptions options;
  options.world_size = world_size;
  options.rank = rank;
  options.engine = fsdp::collectives::BackendKind::kGloo;
  DryRun dry(options);
  Runner runner = make(dry.mesh(), c10::Device(c10::kMeta));
  for (int step = 0; step < 2; ++step) runner.step([&](StepPhase p) { dry.begin(p); });
  return dry.ops();
}

void barrier(fsdp::testing::RankContext& ctx) {
  at::Tensor t = at::zeros({1});
  ctx.world_group()->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
}

// The median wall time of a training step on this rank, over kTimed steps
// after kWarmup.
double measured_step_seconds(Runner& runner) {
  std::vector<double> times;
  for (int step = 0; step < kWarmup + kTimed; ++step) {
    const auto start = std::chrono::steady_clock::now();
    runner.step([](StepPhase) {});
    if (step >= kWarmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

class PlanTimeValidation : public ::testing::TestWithParam<int> {};

TEST_P(PlanTimeValidation, SimulatedStepWithinFifteenPercentOfMeasured) {
  const int world_size = GetParam();
  fsdp::testing::run_distributed(world_size, [&](fsdp::testing::RankContext& ctx) {
    const std::pair<const char*, RunnerFactory> models[] = {{"trainer", &trainer_runner}, {"deep MLP", &mlp_runner}};
    for (const auto& [name, make] : models) {
      const std::vector<OpRecord> ops = dry_ops(make, ctx.rank(), world_size);
      Runner runner = make(ctx.mesh(), c10::Device(c10::kCPU));
      double best = INFINITY;
      for (int attempt = 0; attempt < kAttempts; ++attempt) {
        double simulated = 0;
        if (ctx.rank() == 0) {
          TimelineOptions options;
          options.device = measure_cpu_profile(world_size, at::get_num_threads(), ops);
          simulated = simulate(ops, 2, options).step_s;
        }
        barrier(ctx);  // the other ranks wait while rank 0 measures alone
        const double measured = measured_step_seconds(runner);
        if (ctx.rank() != 0) continue;
        const double error = simulated / measured - 1;
        std::fprintf(stderr, "world size %d %-8s attempt %d: simulated %.2f ms, measured %.2f ms (%+.1f%%)\n",
                     world_size, name, attempt + 1, simulated * 1e3, measured * 1e3, 100 * error);
        if (std::abs(error) < std::abs(best)) best = error;
      }
      if (ctx.rank() == 0) {
        EXPECT_LT(std::abs(best), 0.15) << name << " at world size " << world_size << ": closest attempt " << 100 * best
                                        << "% off";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PlanTimeValidation, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace fsdp_plan::test
