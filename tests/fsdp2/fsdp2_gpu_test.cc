// fully_shard on CUDA: training matches an unsharded reference on the GPU.
// On a one-GPU machine: world size 1 with NCCL, and world sizes 2-3 with Gloo
// moving CUDA tensors (NCCL cannot put two ranks on one GPU). Skips cleanly
// without a GPU.
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

void expect_cuda_training_matches_reference(testing::RankContext& ctx, bool mixed_precision) {
  const c10::Device device = ctx.device();
  auto reference = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  reference->to(device);
  model->to(device);
  FullyShardOptions fs;
  fs.mesh = ctx.mesh();
  if (mixed_precision) {
    fs.mp_policy.param_dtype = at::kBFloat16;
    fs.mp_policy.reduce_dtype = at::kFloat;
  }
  for (auto& block : model->blocks()) fully_shard(block, fs);
  FSDPModule root = fully_shard(model, fs);
  torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  // Under mixed precision the reference does what the policy does: a bf16
  // copy of its fp32 parameters runs forward and backward, the gradients
  // are cast to fp32 and AdamW steps the fp32 parameters. (Against a plain
  // fp32 reference, near-zero gradients change sign in bf16 and AdamW's
  // normalized update moves those elements by lr the other way: 0.02 apart
  // after 5 steps, seen on an H100.)
  std::shared_ptr<Transformer> bf16_copy;
  if (mixed_precision) {
    bf16_copy = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    bf16_copy->to(device, at::kBFloat16);
  }
  auto ref_params = reference->named_parameters();
  // One bf16 ulp of the loss is up to 0.8%.
  const double tolerance = mixed_precision ? 1e-2 : 1e-4;
  for (int step = 0; step < 5; ++step) {
    const Batch batch = make_batch(ModelKind::kTransformer, step, 12);
    const Batch global{batch.x.to(device), batch.y.to(device)};
    ref_optim.zero_grad();
    at::Tensor ref_loss;
    if (bf16_copy) {
      {
        c10::NoGradGuard no_grad;
        for (const auto& item : bf16_copy->named_parameters()) item.value().copy_(ref_params[item.key()]);
      }
      ref_loss = bf16_copy->forward(global.x, global.y);
      ref_loss.backward();
      for (const auto& item : bf16_copy->named_parameters()) {
        ref_params[item.key()].mutable_grad() = item.value().grad().to(at::kFloat);
        item.value().mutable_grad().reset();
      }
    } else {
      ref_loss = reference->forward(global.x, global.y);
      ref_loss.backward();
    }
    ref_optim.step();
    optim.zero_grad();
    const Batch local = global.slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = call_module(*model, local.x, local.y);
    loss.backward();
    optim.step();
    at::Tensor mean = loss.detach().to(at::kFloat).reshape({1}).clone();
    ctx.world_group()->all_reduce(mean, collectives::ReduceOp::avg()).wait();
    EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), tolerance * std::abs(ref_loss.item<double>()))
        << "step " << step;
  }
  // Compare on the CPU with a CPU mesh-free gather: unshard each module.
  for (auto& block : model->blocks()) fsdp_module_of(*block)->unshard();
  root.unshard();
  for (const auto& item : model->named_parameters()) {
    // Unsharded, the parameters are in param_dtype.
    const at::Tensor expected = ref_params[item.key()].detach().to(item.value().scalar_type()).to(at::kFloat).cpu();
    const at::Tensor actual = item.value().detach().to(at::kFloat).cpu();
    expect_close(actual, expected, item.key(), mixed_precision ? 1e-2 : 1e-4, mixed_precision ? 1e-4 : 1e-5);
  }
}

TEST(Fsdp2Gpu, NcclAtWorldSizeOne) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  const testing::DistributedTestOptions options = testing::cuda_options(1);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    expect_cuda_training_matches_reference(ctx, /*mixed_precision=*/false);
    expect_cuda_training_matches_reference(ctx, /*mixed_precision=*/true);
  });
}

// A sharded block called on its own does the root's pre-forward work: the
// CPU input is moved to the GPU (blocking), and the all-gather streams wait
// for the optimizer step.
TEST(Fsdp2Gpu, InnerBlockOnItsOwnMovesInputsToTheDevice) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  const testing::DistributedTestOptions options = testing::cuda_options(1);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    auto reference = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    model->to(ctx.device());
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    for (auto& block : model->blocks()) fully_shard(block, fs);
    fully_shard(model, fs);
    const Batch batch = make_batch(ModelKind::kTransformer, 0, 4);
    call_module(*model, batch.x.to(ctx.device()), batch.y.to(ctx.device())).backward();
    at::Tensor h = at::randn({2, Transformer::kSeq, Transformer::kDim});
    at::Tensor out = call_module(*model->blocks_[1], h);
    EXPECT_EQ(out.device(), ctx.device());
    expect_close(out.cpu(), reference->blocks_[1]->forward(h), "blocks[1] alone", 1e-4, 1e-5);
  });
}

TEST(Fsdp2Gpu, GlooOnCudaTensorsAtWorldSizesTwoAndThree) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  for (int world : {2, 3}) {
    const testing::DistributedTestOptions options = testing::cuda_options(world, collectives::BackendKind::kGloo);
    testing::run_distributed(options, [](testing::RankContext& ctx) {
      expect_cuda_training_matches_reference(ctx, /*mixed_precision=*/false);
    });
  }
}

}  // namespace
}  // namespace fsdp::test
