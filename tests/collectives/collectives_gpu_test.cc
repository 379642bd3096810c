// GPU tests of the collectives layer: NCCL at world size 1 (NCCL cannot put
// two ranks on one GPU) and Gloo moving CUDA tensors at world sizes 2 to 4
// (several ranks sharing one GPU). Skipped where no GPU is present.
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "collective_checks.h"
#include "collectives/communicator.h"
#include "fsdp_testing/distributed_test.h"

namespace fsdp::collectives {
namespace {

using ::fsdp::testing::RankContext;

void check_everything(RankContext& ctx) {
  auto& comm = *ctx.world_group();
  EXPECT_EQ(comm.device_type(), c10::kCUDA);
  testing::check_all_gather(comm, ctx.device());
  testing::check_reduce_scatter(comm, ctx.device());
  testing::check_reduce_scatters_in_flight(comm, ctx.device());
  testing::check_all_reduce(comm, ctx.device());
  testing::check_broadcast(comm, ctx.device());
  testing::check_coalesced(comm, ctx.device());
  comm.barrier().wait();
}

TEST(CollectivesGpuTest, NcclAtWorldSizeOne) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  const fsdp::testing::DistributedTestOptions options = fsdp::testing::cuda_options(1);
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    EXPECT_EQ(ctx.world_group()->backend_kind(), BackendKind::kNccl);
    check_everything(ctx);
  });
}

class GlooOnCudaTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooOnCudaTest, EveryCollectiveMovesCudaTensors) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  const fsdp::testing::DistributedTestOptions options = fsdp::testing::cuda_options(GetParam(), BackendKind::kGloo);
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    EXPECT_EQ(ctx.world_group()->backend_kind(), BackendKind::kGloo);
    check_everything(ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GlooOnCudaTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "WorldSize" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace fsdp::collectives
