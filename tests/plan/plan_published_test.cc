// The planner against published runs: torchtitan's Llama 3.1 8B, FSDP only
// (docs/performance.md of pytorch/torchtitan, Table 1 and the 128-GPU row
// issue 32 quotes): 32 layers, dim 4096, 32 heads / 8 key-value heads, FFN
// 14336, vocabulary 128256, sequences of 8192, bf16 parameters and fp32
// reduction, selective activation checkpointing (torchtitan's op policy:
// every other matmul output recomputed, --ac torchtitan), local batch 2, on
// H100s with 96 GB of HBM2e at 500 W, NVLink within a node of 8 and
// 400 Gb/s per GPU across nodes. Without torch.compile, as the rows were
// measured.
//
// The rows: 8 GPUs, 5,762 tokens/s per GPU and 82.4 GiB; 128 GPUs, 5,605
// tokens/s per GPU and 67.0 GiB (torchtitan reads memory as the caching
// allocator's peak reserved bytes). The prediction must be within 20% on
// throughput and 10% on memory. No constant of the profile was fitted to
// these rows (timeline.cc, [Note: the shipped device profiles]).
#include <cmath>
#include <cstdio>
#include <ostream>

#include <gtest/gtest.h>

#include "fsdp_plan/timeline.h"
#include "trainer_plan.h"

namespace fsdp_plan::test {
namespace {

struct PublishedRow {
  int gpus;
  double tokens_per_s_per_gpu;
  double memory_gib;
};

void PrintTo(const PublishedRow& row, std::ostream* os) {
  *os << row.gpus << " GPUs: " << row.tokens_per_s_per_gpu << " tokens/s per GPU, " << row.memory_gib << " GiB";
}

fsdp_train::TrainConfig llama31_8b(int gpus) {
  fsdp_train::TrainConfig c;
  c.layers = 32;
  c.dim = 4096;
  c.heads = 32;
  c.kv_heads = 8;
  c.hidden = 14336;
  c.vocab = 128256;
  c.seq_len = 8192;
  c.global_batch = 2 * gpus;
  c.param_dtype = "bf16";
  c.reduce_dtype = "fp32";
  c.ac = "torchtitan";
  return c;
}

class PlanPublished : public ::testing::TestWithParam<PublishedRow> {};

TEST_P(PlanPublished, TorchtitansLlama31_8BWithin20PercentOnThroughputAnd10PercentOnMemory) {
  const PublishedRow row = GetParam();
  const fsdp_train::TrainConfig c = llama31_8b(row.gpus);
  DryRunOptions options;
  options.world_size = row.gpus;
  const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(c, options, /*local_batch=*/2, /*steps=*/2);
  EXPECT_EQ(plan.parameters, 8'030'261'248);  // Llama 3.1 8B's count
  const std::optional<DeviceProfile> h100 = device_profile("h100-hbm2e-500w");
  ASSERT_TRUE(h100.has_value());
  const StepTime time = fsdp_plan_tool::simulate_trainer(plan, c, 2, 2, *h100);
  const double memory_gib = static_cast<double>(plan.memory.peak_reserved) / (1 << 30);
  const double throughput_error = time.tokens_per_s / row.tokens_per_s_per_gpu - 1;
  const double memory_error = memory_gib / row.memory_gib - 1;
  std::printf(
      "Llama 3.1 8B on %d GPUs: predicted %.0f tokens/s per GPU (published %.0f, %+.1f%%), %.1f GiB reserved "
      "(published %.1f, %+.1f%%), MFU %.1f%%, exposed communication %.1f ms of %.1f ms\n",
      row.gpus, time.tokens_per_s, row.tokens_per_s_per_gpu, 100 * throughput_error, memory_gib, row.memory_gib,
      100 * memory_error, 100 * time.mfu, time.exposed_communication_s * 1e3, time.step_s * 1e3);
  EXPECT_LT(std::abs(throughput_error), 0.20);
  EXPECT_LT(std::abs(memory_error), 0.10);
}

INSTANTIATE_TEST_SUITE_P(Torchtitan, PlanPublished,
                         ::testing::Values(PublishedRow{8, 5762, 82.4}, PublishedRow{128, 5605, 67.0}),
                         [](const auto& info) { return std::to_string(info.param.gpus) + "Gpus"; });

}  // namespace
}  // namespace fsdp_plan::test
