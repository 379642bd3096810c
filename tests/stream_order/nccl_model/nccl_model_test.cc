// The runtime as NCCL runs it, on CPU (docs/gpu.md, "The NCCL model"): under
// a stream-order checker that models NCCL, Gloo moves the bytes while every
// communicator follows NCCL's semantics (backend kind, in-place all-gather,
// native reductions, the wait contract). What must hold: communicators act
// as NCCL, and a steady training step makes no host synchronization in any
// configuration (world sizes 1-4, no reshard with mixed precision, reshard
// to a smaller world, HSDP 2x2, accumulation without sync), so that the host
// runs ahead of the GPU. A new host sync in the hot path fails here, with
// the op and the FSDP phase that made it.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "stream_order_util.h"  // tests/stream_order

namespace fsdp::test {
namespace {

constexpr int64_t kRows = kStreamOrderRows;

stream_check::Options nccl_model() {
  stream_check::Options options;
  options.collectives = stream_check::CollectiveModel::kNccl;
  return options;
}

// A CPU communicator made by Gloo acts as NCCL while the model lives: its
// backend kind, and NCCL's wait contract (a wait orders the caller's
// stream; a wait with a timeout blocks the host, counted as a host sync).
TEST(NcclModel, CommunicatorsFollowNcclsWaitContract) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    stream_check::Checker checker(nccl_model());
    const auto comm = ctx.world()->new_group({0, 1}, c10::kCPU);
    EXPECT_EQ(comm->backend_kind(), collectives::BackendKind::kNccl);
    EXPECT_EQ(comm->engine_kind(), collectives::BackendKind::kGloo);
    at::Tensor out = at::empty({6});
    const at::Tensor in = out.narrow(0, 3 * ctx.rank(), 3).fill_(ctx.rank() + 1.0);  // in place, as NCCL allows
    stream_check::clear_host_syncs();
    collectives::Work gathered = comm->all_gather_into_tensor(out, in);
    gathered.wait();
    EXPECT_TRUE(stream_check::host_syncs().empty()) << describe(stream_check::host_syncs());
    at::Tensor averaged = at::full({2}, 2.0 * (ctx.rank() + 1));
    collectives::Work reduced = comm->all_reduce(averaged, collectives::ReduceOp::avg());
    reduced.wait(std::chrono::seconds(120));
    const auto syncs = stream_check::host_syncs();
    ASSERT_EQ(syncs.size(), 1u) << describe(syncs);
    EXPECT_NE(syncs.front().what.find("Work::wait with a timeout"), std::string::npos) << syncs.front().what;
    EXPECT_TRUE(at::equal(out, at::tensor({1.0f, 1.0f, 1.0f, 2.0f, 2.0f, 2.0f})));
    EXPECT_TRUE(at::equal(averaged, at::full({2}, 3.0f)));
    expect_no_races(checker);
  });
}

// The host never waits for the GPU in a steady training step without
// offload: no item(), no synchronize, no blocking collective wait (a wait
// that passed the divergence timeout to NCCL made every all-gather and
// reduce-scatter wait one). The first step's lazy init compares the ranks'
// models on the host, and is left out.
struct HostSyncCase {
  const char* name;
  int world_size;
  std::vector<int64_t> mesh_shape;
  std::function<void(FullyShardOptions&)> configure;
  int micro_batches = 1;  // > 1: accumulate without sync, then sync
};

class HostSyncs : public ::testing::TestWithParam<HostSyncCase> {};

TEST_P(HostSyncs, SteadyTrainingStepsHaveNone) {
  const HostSyncCase c = GetParam();
  testing::run_distributed(rank_options(c.world_size, c.mesh_shape), [&c](testing::RankContext& ctx) {
    stream_check::Checker checker(nccl_model());
    FullyShardOptions o;
    if (c.configure) c.configure(o);
    Sharded s = shard_transformer(ctx, o);
    auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
    for (int step = 0; step < 3; ++step) {
      if (step == 1) stream_check::clear_host_syncs();
      optim->zero_grad();
      for (int micro = 0; micro < c.micro_batches; ++micro) {
        s.root->set_requires_gradient_sync(micro + 1 == c.micro_batches);
        const Batch local = make_batch(ModelKind::kTransformer, step * c.micro_batches + micro, kRows)
                                .slice(ctx.rank(), ctx.world_size());
        call_module(*s.model, local.x, local.y).backward();
      }
      optim->step();
    }
    const auto syncs = stream_check::host_syncs();
    EXPECT_EQ(syncs.size(), 0u) << "host synchronizations in two steady steps:" << describe(syncs);
    expect_no_races(checker);
  });
}

INSTANTIATE_TEST_SUITE_P(Configurations, HostSyncs,
                         ::testing::Values(HostSyncCase{"ws1", 1, {}, {}}, HostSyncCase{"ws2", 2, {}, {}},
                                           HostSyncCase{"ws3", 3, {}, {}}, HostSyncCase{"ws4", 4, {}, {}},
                                           HostSyncCase{"ws3_no_reshard_mixed_precision",
                                                        3,
                                                        {},
                                                        [](FullyShardOptions& o) {
                                                          o.reshard_after_forward = false;
                                                          o.mp_policy.param_dtype = at::kDouble;
                                                          o.mp_policy.reduce_dtype = at::kFloat;
                                                        }},
                                           HostSyncCase{"ws4_reshard_to_two",
                                                        4,
                                                        {},
                                                        [](FullyShardOptions& o) {
                                                          o.reshard_after_forward = ReshardAfterForward(2);
                                                        }},
                                           HostSyncCase{"hsdp2x2", 4, {2, 2}, {}},
                                           HostSyncCase{"ws2_accumulation_without_sync", 2, {}, {}, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace fsdp::test
