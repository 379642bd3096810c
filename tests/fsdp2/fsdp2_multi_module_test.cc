// fully_shard over several modules as one group (FSDP2's
// fully_shard([m0, m1])) and a sharded module used through a method other
// than forward (fsdp::call_module_method, FSDP2's
// register_fsdp_forward_method): training on 1-4 real ranks matches an
// unsharded reference, the group communicates once per forward and backward,
// and misuse gives clear errors.
#include <torch/nn/modules/linear.h>

#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

constexpr int64_t kDim = 9;    // 9 rows: shards of 5+4, 3+3+3 and 3+3+3+0
constexpr int64_t kRows = 12;  // divisible by every world size 1-4

// tanh(x W^T + b), with W given when it is tied to another block's.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(at::Tensor tied_weight = {})
      : weight(register_parameter("weight", tied_weight.defined() ? tied_weight : at::randn({kDim, kDim}) * 0.3)),
        bias(register_parameter("bias", at::randn({kDim}) * 0.1)) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(at::linear(x, weight, bias)); }
  at::Tensor weight, bias;
};
FSDP2CPP_MODULE(Block);

// inp -> b0 -> b1 -> b2 -> head, or b1 before b0 (`swap`), or b0 without b1
// (`skip_b1`). `between` runs after the first of b0/b1, `after_pair` after
// both.
struct Stack : torch::nn::Module {
  explicit Stack(bool tie)
      : inp(register_module("inp", torch::nn::Linear(7, kDim))),
        b0(register_module("b0", Block())),
        b1(register_module("b1", Block(tie ? b0->weight : at::Tensor()))),
        b2(register_module("b2", Block())),
        head(register_module("head", torch::nn::Linear(kDim, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = inp(x);
    h = swap ? b1(h) : b0(h);
    if (between) between();
    if (!skip_b1) h = swap ? b0(h) : b1(h);
    if (after_pair) after_pair();
    return torch::nn::functional::mse_loss(head(b2(h)), y);
  }
  torch::nn::Linear inp;
  Block b0, b1, b2;
  torch::nn::Linear head;
  bool swap = false, skip_b1 = false;
  std::function<void()> between, after_pair;
};

std::shared_ptr<Stack> seeded_stack(bool tie) {
  torch::manual_seed(0);
  return std::make_shared<Stack>(tie);
}

Batch batch_for(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  return {at::randn({kRows, 7}, gen), at::randn({kRows, 3}, gen)};
}

// parameters() lists a tied parameter once per module holding it.
std::vector<at::Tensor> unique_params(torch::nn::Module& module) {
  std::vector<at::Tensor> result;
  for (const auto& p : module.parameters()) {
    bool seen = false;
    for (const auto& q : result) seen |= q.is_same(p);
    if (!seen) result.push_back(p);
  }
  return result;
}

class MultiModule : public ::testing::TestWithParam<int> {};

// Blocks 0 and 1 are one group: AdamW training matches the reference in
// either call order, the group all-gathers once before the first of them,
// stays unsharded until the second finished, and reduce-scatters once.
TEST_P(MultiModule, PairAsOneGroupTrainsLikeTheReferenceWithOneCollectiveEach) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    // At one rank the shards are the parameters: nothing is communicated
    // (RuntimeStats), so every count is 0.
    const int64_t per_group = world > 1 ? 1 : 0;
    for (const bool tie : {false, true}) {
      SCOPED_TRACE(tie ? "b0 and b1 share their weight" : "untied");
      auto reference = seeded_stack(tie);
      auto model = seeded_stack(tie);
      const FullyShardOptions opts = mesh_options(ctx);
      const fsdp::FSDPModule pair = fsdp::fully_shard({model->b0.ptr(), model->b1.ptr()}, opts);  // one group
      fsdp::fully_shard(model->b2, opts);
      fsdp::FSDPModule root = fsdp::fully_shard(model, opts);

      ASSERT_EQ(pair.modules().size(), 2u);
      EXPECT_EQ(pair.modules()[0].get(), model->b0.ptr().get());
      EXPECT_EQ(pair.modules()[1].get(), model->b1.ptr().get());
      EXPECT_EQ(&pair.module(), model->b0.ptr().get()) << "module() is the first of the group";
      for (const auto& m : {model->b0.ptr(), model->b1.ptr()}) {
        auto handle = fsdp_module_of(*m);
        ASSERT_TRUE(handle.has_value());
        EXPECT_EQ(handle->state(), pair.state()) << "one state for every module of the group";
      }
      EXPECT_EQ(root.modules().size(), 1u);

      torch::optim::AdamW optim(unique_params(*model), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
      torch::optim::AdamW ref_optim(unique_params(*reference), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
      std::vector<int64_t> between_bytes, after_bytes;
      model->between = [&] { between_bytes.push_back(pair.unsharded_bytes()); };
      model->after_pair = [&] { after_bytes.push_back(pair.unsharded_bytes()); };
      for (int step = 0; step < 6; ++step) {
        // Steps 0-1 in order, 2-3 swapped, 4 without b1 (its parameters get
        // no gradient), 5 in order again.
        const bool swap = step == 2 || step == 3, skip = step == 4;
        SCOPED_TRACE("step " + std::to_string(step) + (swap ? " (b1 first)" : "") + (skip ? " (b1 skipped)" : ""));
        model->swap = reference->swap = swap;
        model->skip_b1 = reference->skip_b1 = skip;
        const Batch batch = batch_for(step);
        at::Tensor ref_loss = train_reference_step(*reference, ref_optim, batch);

        optim.zero_grad();
        between_bytes.clear();
        after_bytes.clear();
        root.reset_runtime_stats();
        const Batch local = batch.slice(rank, world);
        at::Tensor loss = call_module(*model, local.x, local.y);
        RuntimeStats stats = root.runtime_stats();
        EXPECT_EQ(stats.all_gathers, 3 * per_group) << "forward: root, the pair once, b2";
        ASSERT_EQ(between_bytes.size(), 1u);
        EXPECT_GT(between_bytes[0], 0) << "the pair stays unsharded between its two modules";
        ASSERT_EQ(after_bytes.size(), 1u);
        if (skip) {
          EXPECT_GT(after_bytes[0], 0) << "b1 has not run: the group's post-forward waits for it";
        } else {
          EXPECT_EQ(after_bytes[0], 0) << "resharded after the second module of the pair";
        }
        EXPECT_EQ(pair.unsharded_bytes(), 0) << "resharded by the end of the root's forward";
        loss.backward();
        stats = root.runtime_stats();
        EXPECT_EQ(stats.reduce_scatters, 3 * per_group) << "backward: root, the pair once, b2";
        EXPECT_EQ(stats.all_gathers, 5 * per_group) << "backward re-gathers the pair once and b2";
        optim.step();
        EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(),
                    1e-5 * std::abs(ref_loss.item<double>()) + 1e-7);
      }
      expect_params_match(*model, *reference, ctx.mesh());
    }
  });
}

// Blocks used through a method that is not forward.
struct EncoderImpl : torch::nn::Module {
  EncoderImpl()
      : fc1(register_module("fc1", torch::nn::Linear(7, 13))), fc2(register_module("fc2", torch::nn::Linear(13, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(fc1(x)); }
  at::Tensor encode(const at::Tensor& x, double temperature) {  // what the model calls, not forward
    const at::Tensor hidden = at::relu(fc1(x));
    return at::tanh(fc2(hidden) / temperature);
  }
  torch::nn::Linear fc1, fc2;
};
FSDP2CPP_MODULE(Encoder);

struct EncoderModel : torch::nn::Module {
  EncoderModel() : enc(register_module("enc", Encoder())), head(register_module("head", torch::nn::Linear(5, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    // enc->encode(x, 0.5) computes with the shards.
    if (around_hooks) return torch::nn::functional::mse_loss(head(enc->encode(x, 0.5)), y);
    at::Tensor h = fsdp::call_module_method(enc, &EncoderImpl::encode, x, 0.5);  // through the hooks
    return torch::nn::functional::mse_loss(head(h), y);
  }
  Encoder enc;
  torch::nn::Linear head;
  bool around_hooks = false;
};

std::shared_ptr<EncoderModel> seeded_encoder_model() {
  torch::manual_seed(0);
  return std::make_shared<EncoderModel>();
}

TEST_P(MultiModule, ModuleUsedThroughAnotherMethodTrainsLikeTheReference) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    const int64_t per_group = world > 1 ? 1 : 0;
    auto reference = seeded_encoder_model();
    auto model = seeded_encoder_model();
    const FSDPModule enc = fully_shard(model->enc, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Batch batch = batch_for(step);
      at::Tensor ref_loss = train_reference_step(*reference, ref_optim, batch);

      optim.zero_grad();
      root.reset_runtime_stats();
      const Batch local = batch.slice(rank, world);
      at::Tensor loss = call_module(*model, local.x, local.y);
      EXPECT_EQ(root.runtime_stats().all_gathers, 2 * per_group) << "root and enc, whose encode ran the hooks";
      EXPECT_EQ(enc.unsharded_bytes(), 0) << "enc resharded after encode";
      loss.backward();
      EXPECT_EQ(root.runtime_stats().reduce_scatters, 2 * per_group);
      optim.step();
      EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(),
                  1e-5 * std::abs(ref_loss.item<double>()) + 1e-7);
    }
    expect_params_match(*model, *reference, ctx.mesh());

    // model->enc->encode(x) computes with the shards; the root's forward
    // catches it. (At one rank the shards are the whole parameters, so that
    // call is correct.)
    if (world > 1) {
      model->around_hooks = true;
      const Batch local = batch_for(9).slice(rank, world);
      EXPECT_THROW_WITH(call_module(*model, local.x, local.y), "module 'enc' was", "called around its hooks");
      root.reset_iter_state();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MultiModule, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// Calls b0 and b1 around their hooks.
struct PairAroundHooks : torch::nn::Module {
  PairAroundHooks() : b0(register_module("b0", Block())), b1(register_module("b1", Block())) {}
  at::Tensor forward(const at::Tensor& x) { return b1->forward(b0->forward(x)); }
  Block b0, b1;
};

using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;

TEST(MultiModuleErrors, BadListsAndAGroupAsRootGiveClearErrors) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    const FullyShardOptions o = mesh_options(ctx);
    {
      SCOPED_TRACE("empty, null, repeated, nested");
      auto model = seeded_stack(false);
      EXPECT_THROW_WITH(fully_shard(Modules{}, o), "the list of modules is empty");
      EXPECT_THROW_WITH(fully_shard(Modules{model->b0.ptr(), nullptr}, o), "modules[1] of the list is null");
      // Modules are named by type (Module::name()).
      EXPECT_THROW_WITH(fully_shard(Modules{model->b0.ptr(), model->b0.ptr()}, o), "modules[1] (",
                        "BlockImpl) is listed twice");
      EXPECT_THROW_WITH(fully_shard(Modules{model, model->b1.ptr()}, o), "modules[1] (",
                        "BlockImpl) is inside modules[0] (", "Stack), whose group", "do not contain one another");
      EXPECT_THROW_WITH(fully_shard(Modules{model->b1.ptr(), model}, o), "modules[0] (",
                        "BlockImpl) is inside modules[1] (");
      EXPECT_FALSE(fsdp_module_of(*model->b0).has_value()) << "a refused list shards nothing";
    }
    {
      SCOPED_TRACE("a module sharded already, by itself or through an ancestor");
      auto model = seeded_stack(false);
      fully_shard(model->b1, o);
      EXPECT_THROW_WITH(fully_shard({model->b0.ptr(), model->b1.ptr()}, o), "already applied to",
                        "(modules[1] of the list)");
      EXPECT_FALSE(fsdp_module_of(*model->b0).has_value());
      auto other = seeded_stack(false);
      fully_shard(other, o);
      EXPECT_THROW_WITH(fully_shard({other->b0.ptr(), other->b1.ptr()}, o), "parameter 'modules[0].weight'",
                        "already sharded by fully_shard on an enclosing module");
    }
    {
      SCOPED_TRACE("dtypes and devices of the group's parameters");
      auto model = seeded_stack(false);
      model->b1->to(at::kDouble);
      EXPECT_THROW_WITH(fully_shard({model->b0.ptr(), model->b1.ptr()}, o), "mixes dtypes in one group",
                        "'modules[0].weight' is Float", "'modules[1].weight' is Double");
      Block meta(at::empty({kDim, kDim}, at::TensorOptions().device(c10::kMeta)));
      EXPECT_THROW_WITH(fully_shard({model->b0.ptr(), meta.ptr()}, o), "parameter 'modules[1].weight'", "is on meta");
    }
    {
      SCOPED_TRACE("a group with no sharded ancestor runs forward");
      auto model = seeded_stack(false);
      const FSDPModule pair = fully_shard(std::vector<Block>{model->b0, model->b1}, o);  // the holders' overload
      EXPECT_EQ(pair.modules().size(), 2u);
      const Batch batch = batch_for(0);
      EXPECT_THROW_WITH(model->forward(batch.x, batch.y), "sharded as one group", "cannot be the root",
                        "apply fully_shard to a common ancestor");
    }
    {
      SCOPED_TRACE("the group's modules called around their hooks");
      torch::manual_seed(0);
      auto model = std::make_shared<PairAroundHooks>();
      fully_shard({model->b0.ptr(), model->b1.ptr()}, o);
      fully_shard(model, o);
      // Parameters are named from the root, the group by its modules.
      EXPECT_THROW_WITH(call_module(*model, at::randn({3, kDim})), "parameter 'b0.weight'", "module 'b0+b1' was",
                        "called around its hooks");
    }
  });
}

// The recursive setters of an ancestor reach the group (once), and the
// group's own setters apply to the group.
TEST(MultiModuleSetters, ReshardAfterForwardFromTheRootAndFromTheGroup) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto model = seeded_stack(false);
    FSDPModule pair = fully_shard({model->b0.ptr(), model->b1.ptr()}, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    const Batch batch = batch_for(0).slice(ctx.rank(), ctx.world_size());
    root.set_reshard_after_forward(false);
    at::Tensor loss = call_module(*model, batch.x, batch.y);
    EXPECT_GT(pair.unsharded_bytes(), 0) << "root.set_reshard_after_forward(false) keeps the pair unsharded";
    loss.backward();
    pair.set_reshard_after_forward(true, /*recurse=*/false);
    loss = call_module(*model, batch.x, batch.y);
    EXPECT_EQ(pair.unsharded_bytes(), 0) << "the pair's own setting";
    loss.backward();
  });
}

}  // namespace
}  // namespace fsdp::test
