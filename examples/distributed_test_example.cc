// Testing your own sharded code with fsdp2cpp's harness (fsdp2cpp::testing):
// the tests docs/testing.md and the headers' examples quote, compiled and run
// by CTest like any other test (label distributed).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include "collectives/communicator.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/dtensor.h"
#include "device_mesh/state_dict.h"
#include "fsdp_testing/distributed_test.h"

using fsdp::testing::DistributedTestOptions;
using fsdp::testing::RankContext;

class ShardedSum : public ::testing::TestWithParam<int> {};

// Runs on 1, 2, 3 and 4 ranks; 10 rows do not divide evenly over 3 or 4.
TEST_P(ShardedSum, EveryRankSeesTheFullTensorAfterAllGather) {
  fsdp::testing::run_distributed(GetParam(), [](RankContext& ctx) {
    at::Tensor full = at::arange(30, at::kFloat).view({10, 3});
    auto dt = fsdp::distribute_tensor(full, ctx.mesh(), {fsdp::Placement::shard(0)});
    EXPECT_TRUE(dt.full_tensor().equal(full)) << "rank " << ctx.rank();

    auto t = at::full({4}, ctx.rank() + 1.0);
    ctx.world_group()->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
    const int n = ctx.world_size();
    EXPECT_TRUE(t.equal(at::full({4}, n * (n + 1) / 2.0)));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardedSum, ::testing::Values(1, 2, 3, 4));

TEST(AllReduce, SumsAcrossRanks) {
  fsdp::testing::run_distributed(3, [](fsdp::testing::RankContext& ctx) {
    auto t = at::full({4}, ctx.rank() + 1.0);
    ctx.world_group()->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
    EXPECT_TRUE(t.equal(at::full({4}, 6.0)));
  });
}

TEST(Meshes, TwoByTwoMeshHasAGroupPerDimension) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 4;
  options.mesh_shape = {2, 2};  // HSDP-style 2-D mesh
  options.mesh_dim_names = {"replicate", "shard"};
  options.timeout = std::chrono::seconds(60);
  options.communicator.backend = fsdp::collectives::BackendKind::kGloo;  // e.g. several ranks on one GPU
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    EXPECT_EQ(ctx.mesh().size("shard"), 2);
    EXPECT_EQ(ctx.mesh().size("replicate"), 2);

    auto world = ctx.world();
    auto mesh = fsdp::init_device_mesh(world, c10::kCPU, {2, 2}, {"replicate", "shard"});
    auto shard_comm = mesh.group("shard");
    fsdp::DeviceMesh dp = mesh["shard"];  // 1-D slice, same group
    EXPECT_EQ(dp.group(0).get(), shard_comm.get());
    // Rank r's shard group is its row: {0, 1} or {2, 3}.
    auto t = at::full({1}, static_cast<double>(ctx.rank()));
    shard_comm->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
    EXPECT_EQ(t.item<double>(), ctx.rank() < 2 ? 1.0 : 5.0);

    at::Tensor full = at::arange(12, at::kFloat).view({4, 3});
    auto dt = fsdp::distribute_tensor(full, dp, {fsdp::Placement::shard(0)});
    at::Tensor again = dt.full_tensor();  // == full on every rank
    auto rep = dt.redistribute({fsdp::Placement::replicate()});
    EXPECT_TRUE(again.equal(full));
    EXPECT_TRUE(rep.to_local().equal(full));
  });
}

TEST(StateDicts, HoldTensorsAndDTensorsByFqn) {
  fsdp::testing::run_distributed(2, [](RankContext& ctx) {
    const fsdp::DeviceMesh& mesh = ctx.mesh();
    at::Tensor rows = at::full({50, 16}, static_cast<double>(ctx.rank()));  // this rank's half of 100 rows
    fsdp::StateDict sd;
    sd.insert("embed.weight",
              fsdp::DTensor::from_local(rows, mesh, {fsdp::Placement::shard(0)}, std::vector<int64_t>{100, 16}));
    sd.insert("norm.weight", at::ones({16}));  // a plain tensor: the same on every rank
    int64_t local_elements = 0;
    for (const auto& [fqn, value] : sd) local_elements += value.local().numel();
    EXPECT_EQ(local_elements, 50 * 16 + 16);
    EXPECT_EQ(sd.at("embed.weight").global_shape(), (std::vector<int64_t>{100, 16}));
    EXPECT_EQ(sd.at("embed.weight").local_offset(), (std::vector<int64_t>{50 * ctx.rank(), 0}));
    EXPECT_EQ(sd.keys(), (std::vector<std::string>{"embed.weight", "norm.weight"}));
  });
}

TEST(MyGpuTest, Works) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  DistributedTestOptions options;
  options.world_size = std::max(1, fsdp::testing::cuda_device_count());
  options.device_type = c10::kCUDA;
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    auto t = at::ones({2}, at::TensorOptions().device(ctx.device()));
    ctx.world_group()->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
    EXPECT_EQ(t.cpu()[0].item<double>(), ctx.world_size());
  });
}

TEST(MyLibrary, RankThatCrashesIsReportedWithItsSignal) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(30);
  auto outcomes = fsdp::testing::run_distributed_collect(options, [](RankContext& ctx) {
    if (ctx.rank() == 1) std::abort();
    std::cout << "rank 0 finished" << std::endl;
  });
  if (fsdp::testing::is_rank_process()) return;  // parent-side checks only
  EXPECT_EQ(outcomes[1].signal, SIGABRT);
  EXPECT_TRUE(outcomes[0].exited) << outcomes[0].describe() << outcomes[0].output;
}
