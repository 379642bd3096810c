// The dry run against measurement: for three models at world sizes 1 to 4,
// each rank predicts its own peak with a dry run of its rank (Gloo's
// semantics, as the CPU run has), then trains the same model (the same code,
// plan_models.h) for two steps on the CPU with real ranks under a
// CpuMeasurement. Like is compared with like: the bytes of the program's
// tensors at the CPU run's peak (its allocations through the CPU allocator,
// the Gloo engine's worker threads left out) against the dry run's tensor
// bytes before the CUDA allocator's rounding; they must agree within 1% (at
// 2 ranks and more, a race in Gloo can add up to two collective buffers to
// the measurement: [Note: Gloo's late frees] below).
// The process's live heap bytes at the peak (malloc_counter's measure) are
// printed beside them: they add what is not a tensor (autograd's graph,
// tensor and storage objects, library caches), which no tensor-level model
// predicts (docs/planning.md, "Checked against measurement"). Each model is
// run once before it is measured, so that what libraries set up once per
// process stays in the baseline.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include <gtest/gtest.h>

#include "cpu_measurement.h"
#include "fsdp2/fully_shard.h"
#include "fsdp_testing/distributed_test.h"
#include "plan_models.h"

namespace fsdp_plan::test {
namespace {

constexpr int kSteps = 2;

MemoryReport predict(RunnerFactory make, int rank, int world_size, int64_t* largest_collective) {
  DryRunOptions options;
  options.world_size = world_size;
  options.rank = rank;
  options.engine = fsdp::collectives::BackendKind::kGloo;
  DryRun dry(options);
  Runner runner = make(dry.mesh(), c10::Device(c10::kMeta));
  dry.track(runner.model);
  for (int step = 0; step < kSteps; ++step) runner.step([&](StepPhase p) { dry.begin(p); });
  *largest_collective = 0;
  for (const auto& c : dry.collectives()) *largest_collective = std::max(*largest_collective, c.bytes);
  return dry.memory();
}

class PlanValidation : public ::testing::TestWithParam<int> {};

TEST_P(PlanValidation, DryRunPeakMatchesCpuRunWithinOnePercent) {
  const int world_size = GetParam();
  fsdp::testing::run_distributed(world_size, [&](fsdp::testing::RankContext& ctx) {
    const std::pair<const char*, RunnerFactory> models[] = {
        {"trainer", &trainer_runner}, {"deep MLP", &mlp_runner}, {"mixer", &mixer_runner}};
    for (const auto& [name, make] : models) {
      int64_t largest_collective = 0;
      const MemoryReport predicted = predict(make, ctx.rank(), world_size, &largest_collective);
      int64_t tensors = 0, heap = 0;
      {
        // A run before the measured one, so that what libraries set up once
        // in a process (about 1.1 MB for the trainer's first run) is not
        // counted as the step's heap: it stays in the baseline.
        Runner warm_up = make(ctx.mesh(), c10::Device(c10::kCPU));
        warm_up.step([](StepPhase) {});
      }
      // The FSDP states of the models run before (the warm-up's, the dry
      // run's) would otherwise go at this run's fully_shard, in the middle
      // of the measurement, and lower its heap figure by about 1.2 MB.
      fsdp::release_fsdp_state_of_destroyed_modules();
      {
        CpuMeasurement measured;
        {
          Runner runner = make(ctx.mesh(), c10::Device(c10::kCPU));
          for (int step = 0; step < kSteps; ++step) runner.step([](StepPhase) {});
        }
        tensors = measured.peak();
        heap = measured.heap_peak_above_baseline();
      }
      const double error = static_cast<double>(predicted.peak_bytes - tensors) / static_cast<double>(tensors);
      std::printf("world size %d rank %d %-9s predicted %10lld  measured tensors %10lld (%+.3f%%)  live heap %10lld\n",
                  world_size, ctx.rank(), name, static_cast<long long>(predicted.peak_bytes),
                  static_cast<long long>(tensors), 100 * error, static_cast<long long>(heap));
      if (world_size == 1) {
        EXPECT_LT(std::abs(error), 0.01) << name << ": predicted " << predicted.peak_bytes << " bytes, measured "
                                         << tensors;
      } else {
        // [Note: Gloo's late frees] At 2 ranks and more Gloo's worker thread
        // sometimes holds the last reference to a finished collective's
        // tensors (its Work) after the program dropped its own, so a
        // collective's input and output can still be counted at the CPU peak:
        // a race that only adds bytes (seen at 3 and 4 ranks in about one run
        // of three, +4% to +10% of the peak, at most 1.3 of the largest
        // collective's buffer; at 2 ranks once in twenty, +3.5%).
        // The prediction must not exceed the measurement by more than 1%, nor
        // fall below it by more than two such buffers.
        EXPECT_GT(error, -0.01 - 2.0 * static_cast<double>(largest_collective) / static_cast<double>(tensors))
            << name << ": predicted " << predicted.peak_bytes << " bytes, measured " << tensors;
        EXPECT_LT(error, 0.01) << name << ": predicted " << predicted.peak_bytes << " bytes, measured " << tensors;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PlanValidation, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace fsdp_plan::test
