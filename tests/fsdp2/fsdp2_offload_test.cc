// fully_shard with CPU offload (OffloadPolicy, FSDP2's CPUOffloadPolicy).
// Everywhere: the option rules (a clear error on a CPU mesh, pin_memory
// ignored without offload). On a GPU (tests named Gpu*, label gpu; they skip
// without one): training with offload matches the same sharded training
// without it, step by step, at world size 1 on NCCL and at world sizes 2 and
// 3 with Gloo moving CUDA tensors on one GPU, with the sharded parameters,
// gradients and optimizer state in (pinned) host memory, gradient
// accumulation, mixed precision, a model built on the CPU, and state dicts.
#include <functional>

#include <torch/optim/adamw.h>

#include "fsdp2/clip_grad.h"
#include "fsdp_common/config.h"
#if FSDP2CPP_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include "fsdp2/state_dict.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// --- rules, on CPU ------------------------------------------------------------

TEST(Fsdp2Offload, OffloadOnACpuMeshIsAClearError) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto model = std::make_shared<MLP>();
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    fs.offload_policy.offload_to_cpu = true;
    const std::string mesh = ctx.mesh().to_string();
    EXPECT_THROW_WITH(fully_shard(model->b0, fs), "MLPBlockImpl)", "offload_to_cpu needs a CUDA mesh", mesh.c_str(),
                      "is on CPU", "leave offload_to_cpu false");
    // Nothing was sharded: the module can still be sharded without offload.
    EXPECT_EQ(model->b0->fc->weight.size(0), 13);
    EXPECT_FALSE(fsdp_module_of(*model->b0).has_value());

    // Without a mesh the default one follows the parameters (CPU here).
    FullyShardOptions by_world;
    by_world.world = ctx.world();
    by_world.offload_policy.offload_to_cpu = true;
    by_world.offload_policy.pin_memory = false;
    EXPECT_THROW_WITH(fully_shard(model, by_world), "MLP)", "offload_to_cpu needs a CUDA mesh",
                      "FullyShardOptions::mesh is unset");
  });
}

TEST(Fsdp2Offload, OffloadOnAModuleInsideAShardedRootNamesItsFqn) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    auto model = std::make_shared<MLP>();
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    fully_shard(model, fs);
    // The root is sharded, so the block's FQN is known (the error about
    // offload comes before the one about the order of the calls).
    fs.offload_policy.offload_to_cpu = true;
    EXPECT_THROW_WITH(fully_shard(model->b1, fs), "module 'b1' (", "MLPBlockImpl)", "offload_to_cpu needs a CUDA mesh");
  });
}

// As FSDP2, whose OffloadPolicy base class has no pinning: pin_memory alone
// changes nothing, and training matches the default options exactly.
TEST(Fsdp2Offload, PinMemoryWithoutOffloadIsIgnored) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    std::vector<double> losses[2];
    std::vector<at::Tensor> params[2];
    for (int i = 0; i < 2; ++i) {
      auto model = make_model(ModelKind::kMlp);
      FullyShardOptions fs;
      fs.mesh = ctx.mesh();
      fs.offload_policy.pin_memory = i == 0;  // offload_to_cpu stays false
      for (auto& block : model->blocks()) fully_shard(block, fs);
      fully_shard(model, fs);
      auto optim = make_optimizer(Optim::kAdamW, model->parameters());
      for (int step = 0; step < 2; ++step) {
        const Batch batch = make_batch(ModelKind::kMlp, step, 8).slice(ctx.rank(), ctx.world_size());
        optim->zero_grad();
        at::Tensor loss = call_module(*model, batch.x, batch.y);
        loss.backward();
        optim->step();
        losses[i].push_back(loss.item<double>());
      }
      for (const auto& p : model->parameters()) {
        EXPECT_TRUE(p.is_cpu());
        params[i].push_back(p.detach().clone());
      }
    }
    EXPECT_EQ(losses[0], losses[1]);
    ASSERT_EQ(params[0].size(), params[1].size());
    for (size_t i = 0; i < params[0].size(); ++i) EXPECT_TRUE(params[0][i].equal(params[1][i])) << "parameter " << i;
  });
}

// --- training on a GPU --------------------------------------------------------

struct OffloadCase {
  bool offload = false;
  bool pin_memory = true;
  bool mixed_precision = false;
  bool build_on_cpu = false;  // offload only: the model is never moved to the device
};

std::shared_ptr<Transformer> sharded_transformer(testing::RankContext& ctx, const OffloadCase& setup) {
  auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  if (!setup.build_on_cpu) model->to(ctx.device());
  FullyShardOptions fs;
  fs.mesh = ctx.mesh();
  fs.offload_policy.offload_to_cpu = setup.offload;
  fs.offload_policy.pin_memory = setup.pin_memory;
  if (setup.mixed_precision) {
    fs.mp_policy.param_dtype = at::kBFloat16;
    fs.mp_policy.reduce_dtype = at::kFloat;
  }
  for (auto& block : model->blocks()) fully_shard(block, fs);
  fully_shard(model, fs);
  return model;
}

std::unique_ptr<torch::optim::AdamW> adamw(torch::nn::Module& model) {
  return std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

// Forward and backward of `micro_batches` slices of this rank's share of
// step `step`'s batch (gradient accumulation when > 1); the summed loss.
double forward_backward(testing::RankContext& ctx, Transformer& model, int step, int micro_batches) {
  const Batch local = make_batch(ModelKind::kTransformer, step, 12).slice(ctx.rank(), ctx.world_size());
  double total = 0;
  for (int m = 0; m < micro_batches; ++m) {
    const Batch micro = local.slice(m, micro_batches);
    at::Tensor loss = call_module(model, micro.x.to(ctx.device()), micro.y.to(ctx.device()));
    loss.backward();
    total += loss.item<double>();
  }
  return total;
}

// One step of `plain` and `offloaded` on step `step`'s batch (one
// micro-batch each); `between` runs after both backwards, before the
// optimizer steps.
void train_step_both(testing::RankContext& ctx, int step, Transformer& plain, torch::optim::Optimizer& plain_optim,
                     Transformer& offloaded, torch::optim::Optimizer& optim,
                     const std::function<void()>& between = {}) {
  plain_optim.zero_grad();
  optim.zero_grad();
  forward_backward(ctx, plain, step, 1);
  forward_backward(ctx, offloaded, step, 1);
  if (between) between();
  plain_optim.step();
  optim.step();
}

// Where the sharded state of an offloaded model lives, between steps.
void expect_on_host(Transformer& model, torch::optim::AdamW& optim, bool pinned, bool after_backward) {
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& p = item.value();
    EXPECT_TRUE(p.is_cpu()) << item.key() << " is on " << p.device();
    EXPECT_EQ(p.is_pinned(), pinned) << item.key();
    if (!after_backward) continue;
    ASSERT_TRUE(p.grad().defined()) << item.key();
    EXPECT_TRUE(p.grad().is_cpu()) << item.key() << "'s gradient is on " << p.grad().device();
    EXPECT_EQ(p.grad().is_pinned(), pinned) << item.key() << "'s gradient";
    EXPECT_EQ(p.grad().sizes(), p.sizes()) << item.key();
  }
  for (const auto& [impl, state] : optim.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    EXPECT_TRUE(s.exp_avg().is_cpu()) << "AdamW state on " << s.exp_avg().device();
    EXPECT_TRUE(s.exp_avg_sq().is_cpu());
  }
}

// Trains an offloaded model and the same model sharded without offload side
// by side: same losses, same reduced gradients, and the same parameters.
void expect_offload_matches_no_offload(testing::RankContext& ctx, OffloadCase setup, int micro_batches) {
  SCOPED_TRACE(::testing::Message() << "world " << ctx.world_size() << " pin_memory " << setup.pin_memory
                                    << " mixed precision " << setup.mixed_precision << " built on CPU "
                                    << setup.build_on_cpu << " micro-batches " << micro_batches);
  OffloadCase plain_setup = setup;
  plain_setup.offload = false;
  plain_setup.build_on_cpu = false;
  setup.offload = true;
  auto plain = sharded_transformer(ctx, plain_setup);
  auto offloaded = sharded_transformer(ctx, setup);
  auto plain_optim = adamw(*plain);
  auto optim = adamw(*offloaded);
  expect_on_host(*offloaded, *optim, setup.pin_memory, /*after_backward=*/false);
  const double rtol = setup.mixed_precision ? 1e-3 : 1e-5;
  for (int step = 0; step < 4; ++step) {
    plain_optim->zero_grad();
    optim->zero_grad();
    const double plain_loss = forward_backward(ctx, *plain, step, micro_batches);
    const double loss = forward_backward(ctx, *offloaded, step, micro_batches);
    EXPECT_NEAR(loss, plain_loss, rtol * std::abs(plain_loss)) << "step " << step;
    // backward() returned: the host gradients are complete (no further
    // synchronization) and are the device's reduced gradients.
    expect_on_host(*offloaded, *optim, setup.pin_memory, /*after_backward=*/true);
    auto plain_params = plain->named_parameters();
    for (const auto& item : offloaded->named_parameters()) {
      const at::Tensor expected = plain_params[item.key()].grad().cpu();
      expect_close(item.value().grad(), expected, item.key() + " grad, step " + std::to_string(step),
                   setup.mixed_precision ? 1e-2 : 1e-5, setup.mixed_precision ? 1e-4 : 1e-6);
    }
    // The norm over host gradients, all-reduced on the device, and clipping
    // in place on the host.
    const double plain_norm = clip_grad_norm_(*fsdp_module_of(*plain), 0.5);
    const double norm = clip_grad_norm_(*fsdp_module_of(*offloaded), 0.5);
    EXPECT_NEAR(norm, plain_norm, rtol * plain_norm) << "step " << step;
    plain_optim->step();
    optim->step();  // on the CPU
    expect_on_host(*offloaded, *optim, setup.pin_memory, /*after_backward=*/true);
  }
  auto plain_params = plain->named_parameters();
  for (const auto& item : offloaded->named_parameters()) {
    expect_close(item.value().detach(), plain_params[item.key()].detach().cpu(), item.key(),
                 setup.mixed_precision ? 1e-2 : 1e-4, setup.mixed_precision ? 1e-3 : 1e-5);
  }
  // Unsharded, the parameters are on the device (and in param_dtype);
  // resharded, on the host again, with the same values.
  FSDPModule root = *fsdp_module_of(*offloaded);
  const at::Tensor before = offloaded->pos.detach().clone();
  root.unshard();
  EXPECT_EQ(offloaded->pos.device(), ctx.device());
  EXPECT_EQ(offloaded->pos.sizes(), (std::vector<int64_t>{Transformer::kSeq, Transformer::kDim}));
  EXPECT_EQ(offloaded->pos.scalar_type(), setup.mixed_precision ? at::kBFloat16 : at::kFloat);
  root.reshard();
  EXPECT_TRUE(offloaded->pos.is_cpu());
  EXPECT_TRUE(offloaded->pos.equal(before));
}

testing::DistributedTestOptions nccl_one_rank() { return testing::cuda_options(1); }

testing::DistributedTestOptions gloo_on_cuda(int world) {
  return testing::cuda_options(world, collectives::BackendKind::kGloo);
}

TEST(Fsdp2OffloadGpu, NcclAtWorldSizeOneMatchesNoOffload) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(nccl_one_rank(), [](testing::RankContext& ctx) {
    expect_offload_matches_no_offload(ctx, OffloadCase{}, /*micro_batches=*/1);
    OffloadCase unpinned;
    unpinned.pin_memory = false;
    expect_offload_matches_no_offload(ctx, unpinned, /*micro_batches=*/1);
    OffloadCase mixed;
    mixed.mixed_precision = true;
    expect_offload_matches_no_offload(ctx, mixed, /*micro_batches=*/1);
  });
}

TEST(Fsdp2OffloadGpu, GlooOnCudaAtWorldSizesTwoAndThreeMatchesNoOffload) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  for (int world : {2, 3}) {
    testing::run_distributed(gloo_on_cuda(world), [](testing::RankContext& ctx) {
      expect_offload_matches_no_offload(ctx, OffloadCase{}, /*micro_batches=*/1);
    });
  }
}

// Several backwards before a step sum the sharded gradients on the host (the
// second copy is synchronous, then added on the CPU).
TEST(Fsdp2OffloadGpu, GradientAccumulationSumsOnTheHost) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(nccl_one_rank(), [](testing::RankContext& ctx) {
    expect_offload_matches_no_offload(ctx, OffloadCase{}, /*micro_batches=*/2);
  });
  testing::run_distributed(gloo_on_cuda(3), [](testing::RankContext& ctx) {
    OffloadCase unpinned;
    unpinned.pin_memory = false;
    expect_offload_matches_no_offload(ctx, unpinned, /*micro_batches=*/2);
  });
}

// backward() returns only once the reduced gradients are in host memory: an
// all-reduce hook delays the reduction stream (at::cuda::sleep) just before
// the non-blocking copies to the host are enqueued, so without the
// end-of-backward wait the gradients read here would be the pinned buffers'
// old contents.
TEST(Fsdp2OffloadGpu, BackwardReturnsAfterTheGradientCopiesToTheHost) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
#if FSDP2CPP_WITH_CUDA
  testing::run_distributed(nccl_one_rank(), [](testing::RankContext& ctx) {
    OffloadCase offload_setup;
    offload_setup.offload = true;
    auto plain = sharded_transformer(ctx, OffloadCase{});
    auto offloaded = sharded_transformer(ctx, offload_setup);
    for (const auto& m : offloaded->modules()) {
      // About 0.1 s of spinning per group on the stream that then copies.
      if (auto fsdp = fsdp_module_of(*m)) fsdp->set_all_reduce_hook([](at::Tensor&) { at::cuda::sleep(200000000); });
    }
    auto plain_optim = adamw(*plain);
    auto optim = adamw(*offloaded);
    for (int step = 0; step < 2; ++step) {
      train_step_both(ctx, step, *plain, *plain_optim, *offloaded, *optim, [&] {
        auto plain_params = plain->named_parameters();
        for (const auto& item : offloaded->named_parameters()) {
          expect_close(item.value().grad(), plain_params[item.key()].grad().cpu(),
                       item.key() + " grad, step " + std::to_string(step), 1e-5, 1e-6);
        }
      });
    }
  });
#endif
}

// A model too large for the device is built on the CPU and sharded from
// there: with offload fully_shard takes CPU parameters on a CUDA mesh.
TEST(Fsdp2OffloadGpu, ModelBuiltOnTheCpuTrainsOnTheDevice) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(gloo_on_cuda(2), [](testing::RankContext& ctx) {
    OffloadCase on_cpu;
    on_cpu.build_on_cpu = true;
    expect_offload_matches_no_offload(ctx, on_cpu, /*micro_batches=*/1);
    // Without offload the same model is refused, naming what to do.
    auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    FullyShardOptions fs;
    fs.mesh = ctx.mesh();
    EXPECT_THROW_WITH(fully_shard(model, fs), "is on cpu but the mesh's device is cuda", "before sharding");
  });
}

// Model and optimizer state dicts of an offloaded model equal those of the
// same model without offload, and loading them into an offloaded model
// writes its host shards.
TEST(Fsdp2OffloadGpu, StateDictsMatchNoOffloadAndLoadIntoTheHostShards) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(gloo_on_cuda(3), [](testing::RankContext& ctx) {
    OffloadCase plain_setup;
    OffloadCase offload_setup;
    offload_setup.offload = true;
    auto plain = sharded_transformer(ctx, plain_setup);
    auto offloaded = sharded_transformer(ctx, offload_setup);
    auto plain_optim = adamw(*plain);
    auto optim = adamw(*offloaded);
    for (int step = 0; step < 2; ++step) train_step_both(ctx, step, *plain, *plain_optim, *offloaded, *optim);
    // Sharded: DTensors on the mesh's device holding this rank's rows.
    const StateDict sharded = get_model_state_dict(*offloaded);
    auto params = offloaded->named_parameters();
    for (const auto& [key, value] : sharded) {
      ASSERT_TRUE(value.is_dtensor()) << key;
      EXPECT_EQ(value.local().device(), ctx.device()) << key;
      expect_close(value.local().cpu(), params[key].detach(), key + " (sharded state dict)", 0, 0);
    }
    StateDictOptions full;
    full.full_state_dict = true;
    const StateDict full_sd = get_model_state_dict(*offloaded, full);
    const StateDict plain_full_sd = get_model_state_dict(*plain, full);
    ASSERT_EQ(full_sd.keys(), plain_full_sd.keys());
    for (const auto& [key, value] : full_sd) {
      expect_close(value.local().cpu(), plain_full_sd.at(key).local().cpu(), key + " (full state dict)", 1e-4, 1e-5);
    }
    const OptimizerStateDict optim_sd = get_optimizer_state_dict(*offloaded, *optim, full);
    const OptimizerStateDict plain_optim_sd = get_optimizer_state_dict(*plain, *plain_optim, full);
    ASSERT_EQ(optim_sd.state.keys(), plain_optim_sd.state.keys());
    for (const auto& [key, value] : optim_sd.state) {
      expect_close(value.local().cpu(), plain_optim_sd.state.at(key).local().cpu(), key, 1e-4, 1e-5);
    }

    // Load the plain model's state (sharded, on the device) into a fresh
    // offloaded model and optimizer: one more step on both then agrees.
    auto loaded = sharded_transformer(ctx, offload_setup);
    auto loaded_optim = adamw(*loaded);
    set_model_state_dict(*loaded, get_model_state_dict(*plain));
    set_optimizer_state_dict(*loaded, *loaded_optim, get_optimizer_state_dict(*plain, *plain_optim));
    expect_on_host(*loaded, *loaded_optim, /*pinned=*/true, /*after_backward=*/false);
    auto plain_params = plain->named_parameters();
    for (const auto& item : loaded->named_parameters()) {
      expect_close(item.value().detach(), plain_params[item.key()].detach().cpu(), item.key() + " (loaded)", 0, 0);
    }
    plain_optim->zero_grad();
    loaded_optim->zero_grad();
    const double plain_loss = forward_backward(ctx, *plain, 2, 1);
    const double loss = forward_backward(ctx, *loaded, 2, 1);
    EXPECT_NEAR(loss, plain_loss, 1e-5 * std::abs(plain_loss));
    plain_optim->step();
    loaded_optim->step();
    for (const auto& item : loaded->named_parameters()) {
      expect_close(item.value().detach(), plain_params[item.key()].detach().cpu(), item.key() + " (after a step)", 1e-4,
                   1e-5);
    }
  });
}

}  // namespace
}  // namespace fsdp::test
