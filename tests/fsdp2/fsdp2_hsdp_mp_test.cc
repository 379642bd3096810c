// HSDP on 2-D meshes, reshard-after-forward to a smaller world, mixed
// precision and the gradient-reduction controls, each against an unsharded
// reference on real ranks.
#include <c10/core/impl/VirtualGuardImpl.h>

#include "fsdp2_test_util.h"
#include "stream_check/stream_check.h"

namespace fsdp::test {
namespace {

struct Controls {
  std::optional<ReshardAfterForward> reshard_after_forward;
  // Micro-batches per step; all but the last skip the HSDP all-reduce.
  int micro_batches = 1;
  bool skip_all_reduce_before_last = false;
  std::optional<double> divide_factor;
  bool force_sum = false;
  // set_all_reduce_hook on every module, scaling the reduced gradients.
  std::optional<double> hook_scale;
};

// Trains the MLP (every block + root) on `ctx.mesh()` with AdamW for 5 steps
// and compares losses and parameters with single-process training on the
// global batch. Data parallelism spans every rank (replicas and shards).
void expect_hsdp_matches_reference(testing::RankContext& ctx, const Controls& c) {
  auto reference = make_model(ModelKind::kMlp);
  auto model = make_model(ModelKind::kMlp);
  FullyShardOptions fs;
  fs.mesh = ctx.mesh();
  fs.reshard_after_forward = c.reshard_after_forward;
  std::vector<FSDPModule> modules;
  for (auto& block : model->blocks()) modules.push_back(fully_shard(block, fs));
  FSDPModule root = fully_shard(model, fs);
  modules.push_back(root);
  int hook_calls = 0;
  if (c.hook_scale) {
    for (auto& m : modules) {
      m.set_all_reduce_hook([&hook_calls, scale = *c.hook_scale](at::Tensor& reduced) {
        ++hook_calls;
        reduced.mul_(scale);
      });
    }
  }
  // Accepted everywhere; on CPU there are no streams to order, except under
  // the stream-order checker, where the event must have been recorded after
  // the optimizer step (blocking on an unrecorded event waits for nothing).
  auto post_optim_event = std::make_shared<c10::Event>(c10::kCPU);
  if (!stream_check::active()) root.set_post_optim_event(post_optim_event);
  // Both apply to one module's group (as in FSDP2): set them on every one.
  for (auto& m : modules) {
    if (c.divide_factor) m.set_gradient_divide_factor(*c.divide_factor);
    if (c.force_sum) m.set_force_sum_reduction_for_comms(true);
  }
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  // A divide factor f instead of the world size W scales the gradients by
  // W / f; the reference's loss is scaled the same way.
  const double grad_scale =
      (c.divide_factor ? ctx.world_size() / *c.divide_factor : 1.0) * (c.hook_scale ? *c.hook_scale : 1.0);
  for (int step = 0; step < 5; ++step) {
    const Batch batch = make_batch(ModelKind::kMlp, step, 12 * c.micro_batches);
    ref_optim.zero_grad();
    optim.zero_grad();
    double ref_loss = 0, loss_sum = 0;
    for (int m = 0; m < c.micro_batches; ++m) {
      const Batch mb = batch.slice(m, c.micro_batches);
      at::Tensor l = reference->forward(mb.x, mb.y) / c.micro_batches;
      (l * grad_scale).backward();
      ref_loss += l.item<double>();
      if (c.skip_all_reduce_before_last) root.set_requires_all_reduce(m == c.micro_batches - 1);
      const Batch local = mb.slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*model, local.x, local.y) / c.micro_batches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    ref_optim.step();
    optim.step();
    if (stream_check::active()) {
      const c10::impl::VirtualGuardImpl cpu(c10::kCPU);
      post_optim_event->record(cpu.getStream(cpu.getDevice()));
      root.set_post_optim_event(post_optim_event);
    }
    EXPECT_NEAR(mean_over_ranks(ctx, loss_sum), ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
  }
  expect_params_match(*model, *reference, ctx.mesh());
  // The last step's gradients themselves, which AdamW's scale invariance
  // would not show in the parameters.
  auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& ref_grad = ref_params[item.key()].grad();
    expect_close(full_param(item.value().grad(), ref_grad.sizes().vec(), ctx.mesh()), ref_grad, item.key() + ".grad");
  }
  if (c.hook_scale) {
    EXPECT_EQ(hook_calls, 5 * static_cast<int>(modules.size()));
  }
}

struct MeshCase {
  int64_t replicas, shards;
};

class Hsdp : public ::testing::TestWithParam<MeshCase> {};

TEST_P(Hsdp, MatchesUnshardedTrainingWithAndWithoutAllReduce) {
  const testing::DistributedTestOptions options = testing::hsdp_options(GetParam().replicas, GetParam().shards);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    {
      SCOPED_TRACE("plain HSDP");
      expect_hsdp_matches_reference(ctx, {});
    }
    {
      SCOPED_TRACE("3 micro-batches, all-reduce on the last only");
      expect_hsdp_matches_reference(ctx, {.micro_batches = 3, .skip_all_reduce_before_last = true});
    }
    {
      SCOPED_TRACE("force-sum reduction");
      expect_hsdp_matches_reference(ctx, {.force_sum = true});
    }
    {
      SCOPED_TRACE("gradient divide factor 2");
      expect_hsdp_matches_reference(ctx, {.divide_factor = 2.0});
    }
    {
      SCOPED_TRACE("all-reduce hook scaling the reduced gradients");
      expect_hsdp_matches_reference(ctx, {.hook_scale = 0.5});
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, Hsdp,
                         ::testing::Values(MeshCase{2, 2}, MeshCase{1, 4}, MeshCase{4, 1}, MeshCase{2, 3}),
                         [](const auto& info) {
                           return std::to_string(info.param.replicas) + "x" + std::to_string(info.param.shards);
                         });

TEST(ReshardAfterForwardToSmallerWorld, MatchesReferenceAndKeepsOneKthAfterForward) {
  testing::run_distributed(4, [](testing::RankContext& ctx) {
    expect_hsdp_matches_reference(ctx, {.reshard_after_forward = ReshardAfterForward(2)});
    expect_hsdp_matches_reference(ctx, {.reshard_after_forward = ReshardAfterForward(2), .micro_batches = 2});

    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    fs.reshard_after_forward = 2;
    FSDPModule block = fully_shard(model->b0, fs);
    fully_shard(model, fs);
    block.unshard();
    const int64_t full_bytes = block.unsharded_bytes();
    block.reshard();
    EXPECT_EQ(block.unsharded_bytes(), 0);
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = call_module(*model, local.x, local.y);
    // After forward this rank keeps the all-gather rows of 2 of the 4 ranks.
    EXPECT_EQ(block.unsharded_bytes(), full_bytes / 2);
    loss.backward();
    EXPECT_EQ(block.unsharded_bytes(), 0);
  });
}

// The reference for mixed precision: the same casts without sharding. Each
// rank's slice is computed in bf16 by a bf16 copy of fp32 master weights;
// bf16 gradients are averaged in fp32 and applied to the fp32 masters.
TEST(MixedPrecision, Bf16ComputeFp32ReductionFp32MasterWeights) {
  testing::run_distributed(3, [](testing::RankContext& ctx) {
    auto master = make_model(ModelKind::kMlp);
    auto compute = make_model(ModelKind::kMlp);
    compute->to(at::kBFloat16);
    auto model = make_model(ModelKind::kMlp);
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    fs.mp_policy.param_dtype = at::kBFloat16;
    fs.mp_policy.reduce_dtype = at::kFloat;
    fs.mp_policy.output_dtype = at::kFloat;
    std::vector<FSDPModule> blocks;
    for (auto& block : model->blocks()) blocks.push_back(fully_shard(block, fs));
    fully_shard(model, fs);
    torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_optim(master->parameters(), torch::optim::AdamWOptions(1e-2));
    const int world = ctx.world_size();
    for (int step = 0; step < 5; ++step) {
      const Batch batch = make_batch(ModelKind::kMlp, step, 12);
      // Reference.
      {
        c10::NoGradGuard no_grad;
        auto src = master->parameters();
        auto dst = compute->parameters();
        for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      ref_optim.zero_grad();
      std::vector<at::Tensor> grad_sums;
      double ref_loss = 0;
      for (int r = 0; r < world; ++r) {
        for (auto& p : compute->parameters()) p.mutable_grad() = at::Tensor();
        const Batch s = batch.slice(r, world);
        at::Tensor l = compute->forward(s.x.to(at::kBFloat16), s.y.to(at::kBFloat16));
        l.backward();
        ref_loss += l.item<double>() / world;
        auto params = compute->parameters();
        if (grad_sums.empty()) grad_sums.resize(params.size());
        for (size_t i = 0; i < params.size(); ++i) {
          at::Tensor g = params[i].grad().to(at::kFloat);
          grad_sums[i] = grad_sums[i].defined() ? grad_sums[i] + g : g;
        }
      }
      auto masters = master->parameters();
      for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = grad_sums[i] / world;
      ref_optim.step();
      // Sharded.
      optim.zero_grad();
      const Batch local = batch.slice(ctx.rank(), world);
      at::Tensor loss = call_module(*model, local.x, local.y);
      EXPECT_EQ(loss.scalar_type(), at::kFloat) << "output_dtype";
      loss.backward();
      optim.step();
      EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss, 2e-2 * std::abs(ref_loss));
    }
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat) << "master weights stay fp32";
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    }
    for (const auto& state : optim.state()) {
      auto& adam = static_cast<torch::optim::AdamWParamState&>(*state.second);
      EXPECT_EQ(adam.exp_avg().scalar_type(), at::kFloat) << "optimizer state stays fp32";
    }
    expect_params_match(*model, *master, ctx.mesh(), /*rtol=*/2e-2, /*atol=*/2e-3);

    // Unsharded bf16 parameters take half the bytes of fp32 ones.
    auto fp32_model = make_model(ModelKind::kMlp);
    FullyShardOptions fp32;
    fp32.mesh = ctx.mesh();
    FSDPModule fp32_block = fully_shard(std::static_pointer_cast<MLP>(fp32_model)->b0, fp32);
    fully_shard(fp32_model, fp32);
    fp32_block.unshard();
    blocks[0].unshard();
    EXPECT_EQ(blocks[0].unsharded_bytes() * 2, fp32_block.unsharded_bytes());
    EXPECT_EQ(std::static_pointer_cast<MLP>(model)->b0->fc->weight.scalar_type(), at::kBFloat16)
        << "unsharded parameters are in param_dtype";
    blocks[0].reshard();
    fp32_block.reshard();
  });
}

TEST(HsdpErrors, BadMeshesAndOptionsGiveClearErrors) {
  testing::DistributedTestOptions options;
  options.world_size = 4;
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    auto world = ctx.world();
    FullyShardOptions o;
    o.mesh = init_device_mesh(world, c10::kCPU, {4}, {"replicate"});
    EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "1-D mesh", "named as an HSDP replicate dim");
    o.mesh = init_device_mesh(world, c10::kCPU, {2, 2});
    EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "has no dim names");
    o.mesh = init_device_mesh(world, c10::kCPU, {2, 2}, {"shard", "replicate"});
    EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "wrong order");
    o.mesh = ctx.mesh();
    o.reshard_after_forward = 3;
    EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "reshard_after_forward=3", "must divide the shard size 4");
    o.reshard_after_forward = std::nullopt;
    FullyShardOptions two_d;
    two_d.mesh = init_device_mesh(world, c10::kCPU, {2, 2}, {"replicate", "shard"});
    FSDPModule hsdp = fully_shard(MLPBlock(7, 5), two_d);
    EXPECT_THROW_WITH(hsdp.set_all_reduce_hook([](at::Tensor&) {}, c10::Stream(c10::Stream::DEFAULT, c10::kCPU)),
                      "2-D (HSDP)", "pass no stream");
    o.mp_policy.param_dtype = at::kInt;
    EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "param_dtype must be a floating-point type");
  });
}

// As in FSDP2, set_requires_gradient_sync(true) turns the HSDP all-reduce
// back on (it controls both reductions): the gradients are complete.
TEST(HsdpControls, RequiresGradientSyncAlsoSetsTheAllReduce) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    auto model = make_model(ModelKind::kMlp);
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    for (auto& block : model->blocks()) fully_shard(block, fs);
    FSDPModule root = fully_shard(model, fs);
    root.set_requires_all_reduce(false);
    root.set_requires_gradient_sync(true);
    const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
    reference->forward(batch.x, batch.y).backward();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    call_module(*model, local.x, local.y).backward();
    auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& ref_grad = ref_params[item.key()].grad();
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      expect_close(full_param(item.value().grad(), ref_grad.sizes().vec(), ctx.mesh()), ref_grad, item.key());
    }
  });
}

// FSDP2 documents set_requires_all_reduce as having no effect without a
// replicate dim: training on a 1-D mesh is unchanged by it.
TEST(HsdpControls, RequiresAllReduceIsANoOpOnOneDimMeshes) {
  testing::run_distributed(3, [](testing::RankContext& ctx) {
    expect_hsdp_matches_reference(ctx, {.micro_batches = 2, .skip_all_reduce_before_last = true});
  });
}

}  // namespace
}  // namespace fsdp::test
