// fully_shard behaviours beyond plain training: unused parameters, modules
// called twice, unused outputs, no-grad forwards, several forwards before a
// backward, explicit prefetching, unshard/reshard by hand, memory freed after
// forward, 0-dim parameters and parameters with fewer rows than ranks. Each
// is checked against an unsharded reference on 1-4 real ranks.
#include <torch/nn/modules/activation.h>

#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// Runs `steps` SGD steps of `model` (sharded per `shard`) and of `reference`
// with `loss_of(module, x, y, is_reference)`, comparing losses and final
// parameters. The batch is an MLP batch (x: [12, 7], y: [12, 3]).
template <typename M, typename ShardFn, typename LossFn>
void expect_matches(testing::RankContext& ctx, std::shared_ptr<M> model, std::shared_ptr<M> reference, ShardFn&& shard,
                    LossFn&& loss_of, int steps = 3) {
  shard(model);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < steps; ++step) {
    const Batch batch = make_batch(ModelKind::kMlp, step, 12);
    ref_optim.zero_grad();
    at::Tensor ref_loss = loss_of(*reference, batch.x, batch.y, true);
    ref_loss.backward();
    ref_optim.step();
    optim.zero_grad();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = loss_of(*model, local.x, local.y, false);
    loss.backward();
    optim.step();
    EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(),
                1e-5 * std::abs(ref_loss.item<double>()) + 1e-7)
        << "step " << step;
  }
  expect_params_match(*model, *reference, ctx.mesh());
}

template <typename M>
std::shared_ptr<M> seeded() {
  torch::manual_seed(0);
  return std::make_shared<M>();
}

// b1 is never called; `spare` is a parameter of the root no forward uses.
struct WithUnused : torch::nn::Module {
  WithUnused()
      : b0(register_module("b0", MLPBlock(7, 5))),
        b1(register_module("b1", MLPBlock(5, 5))),
        head(register_module("head", torch::nn::Linear(5, 3))),
        spare(register_parameter("spare", at::randn({6, 2}))) {}
  at::Tensor forward(const at::Tensor& x) { return head(b0(x)); }
  MLPBlock b0, b1;
  torch::nn::Linear head;
  at::Tensor spare;
};

// One block applied twice in one forward.
struct CalledTwice : torch::nn::Module {
  CalledTwice()
      : inner(register_module("inner", MLPBlock(7, 7))), head(register_module("head", torch::nn::Linear(7, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return head(inner(inner(x))); }
  MLPBlock inner;
  torch::nn::Linear head;
};

// A block with two outputs, one of which the loss ignores.
struct TwoOutputsBlockImpl : torch::nn::Module {
  TwoOutputsBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(7, 6))), aux(register_module("aux", torch::nn::Linear(7, 4))) {}
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) { return {at::tanh(fc(x)), aux(x)}; }
  torch::nn::Linear fc, aux;
};
FSDP2CPP_MODULE(TwoOutputsBlock);

struct UnusedOutput : torch::nn::Module {
  UnusedOutput()
      : block(register_module("block", TwoOutputsBlock())), head(register_module("head", torch::nn::Linear(6, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return head(std::get<0>(block(x))); }
  TwoOutputsBlock block;
  torch::nn::Linear head;
};

// A 0-dim scale, a weight with 2 rows and a bias with 1 row: at world size
// 3 or 4 some ranks hold no rows of them.
struct TinyParams : torch::nn::Module {
  TinyParams()
      : scale(register_parameter("scale", at::full({}, 1.5))),
        w(register_parameter("w", at::randn({2, 7}) * 0.3)),
        b(register_parameter("b", at::randn({1}))),
        head(register_module("head", torch::nn::Linear(2, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return head(at::tanh(scale * at::linear(x, w) + b)); }
  at::Tensor scale, w, b;
  torch::nn::Linear head;
};

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); }

class Behaviors : public ::testing::TestWithParam<int> {};

TEST_P(Behaviors, UnusedParametersHaveNoGradientAndDoNotHang) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = seeded<WithUnused>();
    expect_matches(
        ctx, model, seeded<WithUnused>(),
        [&](auto& m) {
          fully_shard(m->b0, mesh_options(ctx));
          fully_shard(m->b1, mesh_options(ctx));
          fully_shard(m, mesh_options(ctx));
        },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          return mse(ref ? m.forward(x) : call_module(m, x), y);
        });
    EXPECT_FALSE(model->spare.grad().defined());
    EXPECT_FALSE(model->b1->fc->weight.grad().defined());
    EXPECT_TRUE(model->b0->fc->weight.grad().defined());
  });
}

TEST_P(Behaviors, ModuleCalledTwiceInOneForward) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_matches(
        ctx, seeded<CalledTwice>(), seeded<CalledTwice>(),
        [&](auto& m) {
          fully_shard(m->inner, mesh_options(ctx));
          fully_shard(m, mesh_options(ctx));
        },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          return mse(ref ? m.forward(x) : call_module(m, x), y);
        });
  });
}

TEST_P(Behaviors, OutputsNotUsedInTheLoss) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = seeded<UnusedOutput>();
    expect_matches(
        ctx, model, seeded<UnusedOutput>(),
        [&](auto& m) {
          fully_shard(m->block, mesh_options(ctx));
          fully_shard(m, mesh_options(ctx));
        },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          return mse(ref ? m.forward(x) : call_module(m, x), y);
        });
    EXPECT_FALSE(model->block->aux->weight.grad().defined());
  });
}

TEST_P(Behaviors, ZeroDimParametersAndFewerRowsThanRanks) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = seeded<TinyParams>();
    expect_matches(
        ctx, model, seeded<TinyParams>(), [&](auto& m) { fully_shard(m, mesh_options(ctx)); },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          return mse(ref ? m.forward(x) : call_module(m, x), y);
        });
    const int64_t expected_rows = ctx.rank() == 0 ? 1 : 0;
    EXPECT_EQ(model->b.size(0), expected_rows);
    EXPECT_EQ(model->scale.numel(), expected_rows);
  });
}

TEST_P(Behaviors, TwoForwardsBeforeOneBackward) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_matches(
        ctx, std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp)),
        std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp)),
        [&](auto& m) {
          for (auto& b : m->blocks()) fully_shard(b, mesh_options(ctx));
          fully_shard(m, mesh_options(ctx));
        },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          auto f = [&](const at::Tensor& in) { return ref ? m.forward(in, y) : call_module(m, in, y); };
          return f(x) + 0.5 * f(x * 2);
        });
  });
}

TEST_P(Behaviors, ReshardAfterForwardTrueAndFalse) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (bool reshard : {true, false}) {
      SCOPED_TRACE(reshard ? "reshard_after_forward=true" : "reshard_after_forward=false");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      std::vector<FSDPModule> blocks;
      expect_matches(
          ctx, model, std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp)),
          [&](auto& m) {
            FullyShardOptions o = mesh_options(ctx);
            o.reshard_after_forward = reshard;
            for (auto& b : m->blocks()) blocks.push_back(fully_shard(b, o));
            fully_shard(m, o);
          },
          [&](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
            if (ref) return m.forward(x, y);
            at::Tensor loss = call_module(m, x, y);
            for (auto& b : blocks) EXPECT_EQ(b.unsharded_bytes() == 0, reshard);
            return loss;
          });
    }
  });
}

TEST_P(Behaviors, ExplicitPrefetchLists) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    auto reference = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
    std::vector<FSDPModule> blocks;
    for (auto& b : model->blocks()) blocks.push_back(fully_shard(b, mesh_options(ctx)));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    blocks[0].set_modules_to_forward_prefetch({blocks[1]});
    blocks[1].set_modules_to_backward_prefetch({blocks[0]});
    torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const Batch batch = make_batch(ModelKind::kTransformer, step, 12);
      at::Tensor ref_loss = train_reference_step(*reference, ref_optim, batch);
      optim.zero_grad();
      const Batch local = batch.slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*model, local.x, local.y);
      loss.backward();
      optim.step();
      EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(), 1e-5);
    }
    expect_params_match(*model, *reference, ctx.mesh());
  });
}

TEST_P(Behaviors, NoGradForwardFreesEveryUnshardedParameter) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    auto reference = make_model(ModelKind::kMlp);
    std::vector<FSDPModule> modules;
    for (auto& b : model->blocks()) modules.push_back(fully_shard(b, mesh_options(ctx)));
    modules.push_back(fully_shard(model, mesh_options(ctx)));
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    c10::NoGradGuard no_grad;
    at::Tensor loss = call_module(*model, local.x, local.y);
    EXPECT_FALSE(loss.requires_grad());
    EXPECT_NEAR(loss.item<double>(), reference->forward(local.x, local.y).item<double>(), 1e-6);
    for (auto& m : modules) EXPECT_EQ(m.unsharded_bytes(), 0) << "the root included";
  });
}

TEST_P(Behaviors, ReshardAfterForwardFreesNonRootGroups) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    std::vector<FSDPModule> blocks;
    for (auto& b : model->blocks()) blocks.push_back(fully_shard(b, mesh_options(ctx)));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = call_module(*model, local.x, local.y);
    for (auto& b : blocks) EXPECT_EQ(b.unsharded_bytes(), 0);
    // The root keeps its parameters for backward (FSDP2's default): head is
    // 3x10 + 3 floats, padded to ceil(3/W) rows per rank, times W ranks.
    const int64_t w = ctx.world_size(), rows = (3 + w - 1) / w;
    EXPECT_EQ(root.unsharded_bytes(), static_cast<int64_t>(sizeof(float)) * w * rows * (10 + 1));
    loss.backward();
    EXPECT_EQ(root.unsharded_bytes(), 0);
    for (auto& b : blocks) EXPECT_EQ(b.unsharded_bytes(), 0);
  });
}

TEST_P(Behaviors, UnshardAndReshardByHand) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    auto reference = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    FSDPModule block = fully_shard(model->b0, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    root.unshard();
    expect_close(model->head->weight.detach(), reference->head->weight.detach(), "head.weight unsharded");
    UnshardHandle handle = block.unshard(/*async_op=*/true);
    handle.wait();
    expect_close(model->b0->fc->weight.detach(), reference->b0->fc->weight.detach(), "b0.fc.weight unsharded");
    EXPECT_GT(block.unsharded_bytes(), 0);
    block.reshard();
    root.reshard();
    EXPECT_EQ(block.unsharded_bytes(), 0);
    EXPECT_EQ(root.unsharded_bytes(), 0);
    const int64_t w = ctx.world_size(), rows = (13 + w - 1) / w;
    EXPECT_EQ(model->b0->fc->weight.size(0), std::max<int64_t>(0, std::min(rows, 13 - ctx.rank() * rows)));
    expect_params_match(*model, *reference, ctx.mesh());
  });
}

TEST_P(Behaviors, DefaultMeshOverTheWorldIsSharedByEveryModule) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    std::vector<FSDPModule> modules;
    expect_matches(
        ctx, std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp)),
        std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp)),
        [&](auto& m) {
          FullyShardOptions o;
          o.world = ctx.world();
          for (auto& b : m->blocks()) modules.push_back(fully_shard(b, o));
          modules.push_back(fully_shard(m, FullyShardOptions{}));  // the root takes its children's mesh
        },
        [](auto& m, const at::Tensor& x, const at::Tensor& y, bool ref) {
          return ref ? m.forward(x, y) : call_module(m, x, y);
        });
    for (auto& m : modules) EXPECT_EQ(m.mesh().group(0), modules.front().mesh().group(0));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Behaviors, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
