// The world size 1 fast path ([Note: world size 1 fast path],
// fsdp2/src/fsdp_param_group.h): a group with one shard rank and no dtype
// cast uses its shards as its unsharded parameters, so no all-gather or
// reduce-scatter runs (RuntimeStats counts none: the assertion that the fast
// path was taken) and the parameters never move (same data pointers). Every
// FSDP2 behaviour must stay as it is: training, gradient accumulation with
// and without sync, the divide factor and force-sum, post-accumulate-grad
// hooks and the all-reduce hook, clipping, state dicts, torch::load,
// reset_iter_state and HSDP with shard size 1, each against an unsharded
// LibTorch reference doing the same arithmetic, so the values must be equal
// bit for bit. Mixed precision at world size 1 still takes the all-gather
// path.
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>

#include "fsdp2/clip_grad.h"
#include "fsdp2/state_dict.h"
#include "fsdp2_test_util.h"
#include "torch_save_load.h"

namespace fsdp::test {
namespace {

constexpr int64_t kRows = 12;

// The Transformer (embedding, positions and final norm in the root's own
// group, tied output projection) with each block and the root sharded.
struct ShardedTransformer {
  std::shared_ptr<Transformer> model;
  std::vector<FSDPModule> blocks;
  std::optional<FSDPModule> root;
  std::shared_ptr<LossModel> reference;  // the same model unsharded, with the same initial values
};

ShardedTransformer shard_transformer(testing::RankContext& ctx, const FullyShardOptions& extra = {}) {
  ShardedTransformer s;
  s.model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  FullyShardOptions o = extra;
  o.mesh = ctx.mesh();
  for (auto& b : s.model->blocks()) s.blocks.push_back(fully_shard(b, o));
  s.root = fully_shard(s.model, o);
  s.reference = make_model(ModelKind::kTransformer);
  return s;
}

// Equal to the last bit: at one shard rank the shard is the whole tensor.
void expect_equal(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(actual.equal(expected)) << what << ": max abs diff " << (actual - expected).abs().max().item<double>();
}

void expect_params_equal(torch::nn::Module& model, torch::nn::Module& reference) {
  auto ref = reference.named_parameters();
  auto params = model.named_parameters();
  ASSERT_EQ(params.size(), ref.size());
  for (const auto& item : ref) expect_equal(params[item.key()].detach(), item.value().detach(), item.key());
}

// `scale(name)` times the reference's gradient.
void expect_grads_equal(torch::nn::Module& model, torch::nn::Module& reference,
                        const std::function<double(const std::string&)>& scale = {}) {
  auto params = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    const double s = scale ? scale(item.key()) : 1.0;
    expect_equal(params[item.key()].grad(), item.value().grad() * s, item.key() + ".grad");
  }
}

// Like expect_grads_equal, to rounding (HSDP averages two replicas'
// gradients where the reference has one).
void expect_grads_close(torch::nn::Module& model, torch::nn::Module& reference) {
  auto params = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    expect_close(params[item.key()].grad(), item.value().grad(), item.key() + ".grad");
  }
}

// Bytes of the parameters of `module` whose names do not start with
// `skip_prefix` (the blocks', for the root's own).
int64_t param_bytes(torch::nn::Module& module, const std::string& skip_prefix = "") {
  int64_t bytes = 0;
  for (const auto& item : module.named_parameters()) {
    if (!skip_prefix.empty() && item.key().rfind(skip_prefix, 0) == 0) continue;
    bytes += item.value().nbytes();
  }
  return bytes;
}

void expect_no_collectives(const FSDPModule& root) {
  const RuntimeStats stats = root.runtime_stats();
  EXPECT_EQ(stats.all_gathers, 0);
  EXPECT_EQ(stats.reduce_scatters, 0);
  EXPECT_EQ(stats.all_gather_bytes, 0);
  EXPECT_EQ(stats.reduce_scatter_bytes, 0);
}

// The data pointer of every parameter: fixed on the fast path.
std::map<std::string, const void*> data_pointers(torch::nn::Module& model) {
  std::map<std::string, const void*> result;
  for (const auto& item : model.named_parameters()) result[item.key()] = item.value().const_data_ptr();
  return result;
}

// Several AdamW steps equal the unsharded model's, bit for bit (to
// rounding with clip_grad_norm_, whose norm is summed differently); no
// collective runs and no parameter moves, not even in forward and backward
// (where they are unsharded).
TEST(FastPath, TrainingEqualsUnshardedLibTorchWithoutCollectives) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    for (double clip : {0.0, 0.05}) {
      SCOPED_TRACE(clip > 0 ? "clip_grad_norm_" : "no clipping");
      ShardedTransformer s = shard_transformer(ctx);
      auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
      auto ref_optim = make_optimizer(Optim::kAdamW, s.reference->parameters());
      const auto pointers = data_pointers(*s.model);
      for (int step = 0; step < 4; ++step) {
        const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
        ref_optim->zero_grad();
        at::Tensor ref_loss = s.reference->forward(batch.x, batch.y);
        ref_loss.backward();
        double ref_norm = 0;
        if (clip > 0) ref_norm = torch::nn::utils::clip_grad_norm_(s.reference->parameters(), clip);
        ref_optim->step();

        optim->zero_grad();
        at::Tensor loss = call_module(*s.model, batch.x, batch.y);
        // The root keeps its parameters for backward: unsharded, in place.
        EXPECT_EQ(s.root->unsharded_bytes(), param_bytes(*s.model, "layers."));
        EXPECT_EQ(data_pointers(*s.model), pointers) << "step " << step << " forward";
        loss.backward();
        EXPECT_EQ(s.root->unsharded_bytes(), 0);
        if (clip > 0) {
          // fsdp's norm sums squares where LibTorch's takes a norm of norms.
          EXPECT_NEAR(clip_grad_norm_(*s.root, clip), ref_norm, 1e-6 * ref_norm) << "step " << step;
          EXPECT_LT(clip, ref_norm) << "the test must clip";
        }
        optim->step();
        if (clip > 0) continue;
        EXPECT_EQ(loss.item<double>(), ref_loss.item<double>()) << "step " << step;
        expect_grads_equal(*s.model, *s.reference);
        expect_params_equal(*s.model, *s.reference);
      }
      expect_params_match(*s.model, *s.reference, ctx.mesh(), /*rtol=*/1e-5, /*atol=*/1e-6);
      EXPECT_EQ(data_pointers(*s.model), pointers);
      expect_no_collectives(*s.root);
    }
  });
}

// Explicit unshard and reshard only switch the parameters' views: full
// shape, the shard's memory, which reshard does not free.
TEST(FastPath, UnshardedParametersAreTheShards) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    ShardedTransformer s = shard_transformer(ctx);
    at::Tensor w = s.model->blocks_[0]->fc1->weight;
    const void* shard = w.const_data_ptr();
    UnshardHandle handle = s.blocks[0].unshard(/*async_op=*/true);
    handle.wait();
    EXPECT_EQ(w.const_data_ptr(), shard);
    EXPECT_EQ(s.blocks[0].unsharded_bytes(), param_bytes(*s.model->blocks_[0]));
    expect_equal(w.detach(), s.reference->blocks()[0]->named_parameters()["fc1.weight"].detach(), "fc1.weight");
    s.blocks[0].reshard();
    EXPECT_EQ(s.blocks[0].unsharded_bytes(), 0);
    EXPECT_EQ(w.const_data_ptr(), shard);
    expect_no_collectives(*s.root);
  });
}

// Gradient accumulation over 3 micro-batches, reducing every micro-batch
// (sharded gradients add up) or only the last (set_requires_gradient_sync
// (false) keeps them aside): the gradients and the parameters after each
// step equal autograd's own accumulation in the reference.
TEST(FastPath, GradientAccumulationWithAndWithoutSync) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    for (bool sync_each : {true, false}) {
      SCOPED_TRACE(sync_each ? "sync every micro-batch" : "sync on the last micro-batch only");
      ShardedTransformer s = shard_transformer(ctx);
      auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
      auto ref_optim = make_optimizer(Optim::kAdamW, s.reference->parameters());
      for (int step = 0; step < 3; ++step) {
        const Batch batch = make_batch(ModelKind::kTransformer, step, 3 * kRows);
        ref_optim->zero_grad();
        optim->zero_grad();
        for (int m = 0; m < 3; ++m) {
          const Batch mb = batch.slice(m, 3);
          s.reference->forward(mb.x, mb.y).backward();
          if (!sync_each) s.root->set_requires_gradient_sync(m == 2);
          call_module(*s.model, mb.x, mb.y).backward();
          if (!sync_each && m < 2) {
            // Kept aside unreduced, not yet a sharded gradient.
            for (const auto& p : s.model->parameters()) EXPECT_FALSE(p.grad().defined());
          }
        }
        expect_grads_equal(*s.model, *s.reference);
        ref_optim->step();
        optim->step();
      }
      expect_params_equal(*s.model, *s.reference);
      expect_no_collectives(*s.root);
    }
  });
}

struct RecordingHook : torch::autograd::PostAccumulateGradHook {
  explicit RecordingHook(std::vector<at::Tensor>* grads) : grads(grads) {}
  void operator()(const torch::autograd::Variable& p) override {
    grads->push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  std::vector<at::Tensor>* grads;
};

// The reduction controls act as on the reduce-scatter path: a divide factor
// (PREMUL_SUM), force-sum with a divide factor (a division after the sum),
// the all-reduce hook (called once per backward with the group's summed
// gradients as one tensor, before the division), and post-accumulate-grad
// hooks, which see the final sharded gradient once per backward and never
// autograd's accumulation.
TEST(FastPath, ReductionControlsAndHooks) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    ShardedTransformer s = shard_transformer(ctx);
    s.blocks[0].set_gradient_divide_factor(4.0);
    s.blocks[1].set_force_sum_reduction_for_comms(true);
    s.blocks[1].set_gradient_divide_factor(2.0);
    std::vector<at::Tensor> hook_inputs;
    s.root->set_gradient_divide_factor(8.0);
    s.root->set_all_reduce_hook([&](at::Tensor& reduced) {
      hook_inputs.push_back(reduced.clone());
      reduced.mul_(0.5);
    });
    std::vector<at::Tensor> block_hook_grads, root_hook_grads;
    at::Tensor block_weight = s.model->blocks_[0]->fc1->weight;
    at::Tensor root_weight = s.model->norm->weight;
    torch::autograd::impl::set_post_acc_grad_hooks(block_weight, std::make_unique<RecordingHook>(&block_hook_grads));
    torch::autograd::impl::set_post_acc_grad_hooks(root_weight, std::make_unique<RecordingHook>(&root_hook_grads));
    auto scale = [](const std::string& name) {
      if (name.rfind("layers.0.", 0) == 0) return 0.25;
      if (name.rfind("layers.1.", 0) == 0) return 0.5;
      return 0.5 / 8.0;
    };
    for (int step = 0; step < 2; ++step) {
      SCOPED_TRACE("backward " + std::to_string(step));
      const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
      // No zero_grad: the second backward adds to the first's gradients.
      s.reference->forward(batch.x, batch.y).backward();
      call_module(*s.model, batch.x, batch.y).backward();
      expect_grads_equal(*s.model, *s.reference, scale);
      ASSERT_EQ(block_hook_grads.size(), static_cast<size_t>(step + 1));
      ASSERT_EQ(root_hook_grads.size(), static_cast<size_t>(step + 1));
      expect_equal(block_hook_grads.back(), block_weight.grad(), "block hook's gradient");
      expect_equal(root_hook_grads.back(), root_weight.grad(), "root hook's gradient");
      ASSERT_EQ(hook_inputs.size(), static_cast<size_t>(step + 1));
    }
    // Without a divide factor the hook sees the root's own parameters'
    // gradients, in parameter order, as one tensor.
    ShardedTransformer fresh = shard_transformer(ctx);
    auto ref2 = make_model(ModelKind::kTransformer);
    at::Tensor seen;
    fresh.root->set_all_reduce_hook([&](at::Tensor& reduced) { seen = reduced.clone(); });
    const Batch batch = make_batch(ModelKind::kTransformer, 0, kRows);
    ref2->forward(batch.x, batch.y).backward();
    call_module(*fresh.model, batch.x, batch.y).backward();
    std::vector<at::Tensor> own;
    for (const auto& item : ref2->named_parameters()) {
      if (item.key().rfind("layers.", 0) != 0) own.push_back(item.value().grad().reshape({-1}));
    }
    ASSERT_TRUE(seen.defined());
    expect_equal(seen, at::cat(own), "all-reduce hook input");
    expect_no_collectives(*s.root);
  });
}

// State dicts see the shards (the parameters' own memory); a round trip
// through a sharded and a full state dict, and torch::load of a saved
// module (adopted at the next unshard), give the same values and the same
// training afterwards.
TEST(FastPath, StateDictsAndTorchLoad) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    ShardedTransformer s = shard_transformer(ctx);
    auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
    auto ref_optim = make_optimizer(Optim::kAdamW, s.reference->parameters());
    auto train = [&](int step) {
      const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
      ref_optim->zero_grad();
      s.reference->forward(batch.x, batch.y).backward();
      ref_optim->step();
      optim->zero_grad();
      call_module(*s.model, batch.x, batch.y).backward();
      optim->step();
    };
    for (int step = 0; step < 2; ++step) train(step);
    auto params = s.model->named_parameters();
    auto ref_params = s.reference->named_parameters();
    StateDict sd = get_model_state_dict(*s.model);
    for (const auto& [fqn, value] : sd) {
      ASSERT_TRUE(value.is_dtensor()) << fqn;
      EXPECT_EQ(value.local().const_data_ptr(), params[fqn].const_data_ptr()) << fqn;
      expect_equal(value.local(), ref_params[fqn].detach(), fqn);
    }
    StateDictOptions full;
    full.full_state_dict = true;
    StateDict full_sd = get_model_state_dict(*s.model, full);

    ShardedTransformer loaded = shard_transformer(ctx);
    set_model_state_dict(*loaded.model, sd);
    expect_params_equal(*loaded.model, *s.reference);
    ShardedTransformer loaded_full = shard_transformer(ctx);
    set_model_state_dict(*loaded_full.model, full_sd);
    expect_params_equal(*loaded_full.model, *s.reference);

    // torch::load points the parameters at the loaded tensors: the next
    // unshard copies them into the shards.
    ShardedTransformer from_file = shard_transformer(ctx);
    torch_save_and_load(s.model, from_file.model, "fast_path");
    const Batch batch = make_batch(ModelKind::kTransformer, 7, kRows);
    {
      c10::NoGradGuard no_grad;
      EXPECT_EQ(call_module(*from_file.model, batch.x, batch.y).item<double>(),
                s.reference->forward(batch.x, batch.y).item<double>());
    }
    for (const auto& [fqn, value] : get_model_state_dict(*from_file.model)) {
      EXPECT_EQ(value.local().const_data_ptr(), from_file.model->named_parameters()[fqn].const_data_ptr()) << fqn;
    }
    expect_params_equal(*from_file.model, *s.reference);

    // Training goes on identically from the loaded model (optimizer state
    // restarts, as for the reference's copy).
    for (auto* m : {&loaded, &loaded_full, &from_file}) {
      auto ref_copy = make_model(ModelKind::kTransformer);
      {
        c10::NoGradGuard no_grad;
        auto dst = ref_copy->parameters();
        auto src = s.reference->parameters();
        for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      auto m_optim = make_optimizer(Optim::kAdamW, m->model->parameters());
      auto r_optim = make_optimizer(Optim::kAdamW, ref_copy->parameters());
      for (int step = 2; step < 4; ++step) {
        const Batch b = make_batch(ModelKind::kTransformer, step, kRows);
        r_optim->zero_grad();
        ref_copy->forward(b.x, b.y).backward();
        r_optim->step();
        m_optim->zero_grad();
        call_module(*m->model, b.x, b.y).backward();
        m_optim->step();
      }
      expect_params_equal(*m->model, *ref_copy);
      expect_no_collectives(*m->root);
    }
  });
}

// reset_iter_state after a step abandoned mid-way (forward only, or a
// backward without sync) drops its unreduced gradients and reshards; the
// next step equals the reference's.
TEST(FastPath, ResetIterStateDropsTheAbandonedStep) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    ShardedTransformer s = shard_transformer(ctx);
    auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
    auto ref_optim = make_optimizer(Optim::kAdamW, s.reference->parameters());
    for (int step = 0; step < 2; ++step) {
      const Batch abandoned = make_batch(ModelKind::kTransformer, 100 + step, kRows);
      if (step == 0) {
        at::Tensor loss = call_module(*s.model, abandoned.x, abandoned.y);
      } else {
        s.root->set_requires_gradient_sync(false);
        call_module(*s.model, abandoned.x, abandoned.y).backward();
        s.root->set_requires_gradient_sync(true);
      }
      s.root->reset_iter_state();
      EXPECT_EQ(s.root->unsharded_bytes(), 0);
      for (auto& b : s.blocks) EXPECT_EQ(b.unsharded_bytes(), 0);

      const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
      ref_optim->zero_grad();
      s.reference->forward(batch.x, batch.y).backward();
      ref_optim->step();
      optim->zero_grad();
      call_module(*s.model, batch.x, batch.y).backward();
      expect_grads_equal(*s.model, *s.reference);
      optim->step();
    }
    expect_params_equal(*s.model, *s.reference);
    expect_no_collectives(*s.root);
  });
}

// Mixed precision needs a cast, so world size 1 still all-gathers and
// reduce-scatters (a bf16 compute copy of fp32 shards; or fp32 compute
// with a float64 reduction) and matches the reference doing the same casts.
TEST(FastPath, MixedPrecisionStillAllGathers) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    for (bool bf16 : {true, false}) {
      SCOPED_TRACE(bf16 ? "param_dtype bf16, reduce_dtype fp32" : "reduce_dtype float64 only");
      auto master = make_model(ModelKind::kMlp);
      auto compute = make_model(ModelKind::kMlp);
      if (bf16) compute->to(at::kBFloat16);
      auto model = make_model(ModelKind::kMlp);
      FullyShardOptions fs;
      fs.mesh = ctx.mesh();
      if (bf16) fs.mp_policy.param_dtype = at::kBFloat16;
      fs.mp_policy.reduce_dtype = bf16 ? at::kFloat : at::kDouble;
      fs.mp_policy.output_dtype = at::kFloat;
      for (auto& block : model->blocks()) fully_shard(block, fs);
      FSDPModule root = fully_shard(model, fs);
      torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW ref_optim(master->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        const Batch batch = make_batch(ModelKind::kMlp, step, kRows);
        {
          c10::NoGradGuard no_grad;
          auto src = master->parameters();
          auto dst = compute->parameters();
          for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
        }
        for (auto& p : compute->parameters()) p.mutable_grad() = at::Tensor();
        const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
        compute->forward(batch.x.to(dtype), batch.y.to(dtype)).backward();
        auto masters = master->parameters();
        auto computes = compute->parameters();
        for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
        ref_optim.step();
        optim.zero_grad();
        call_module(*model, batch.x, batch.y).backward();
        optim.step();
      }
      expect_params_match(*model, *master, ctx.mesh(), /*rtol=*/1e-6, /*atol=*/1e-7);
      const RuntimeStats stats = root.runtime_stats();
      EXPECT_GT(stats.all_gathers, 0);
      EXPECT_GT(stats.reduce_scatters, 0);
    }
  });
}

// HSDP with shard size 1 (two replicas of one rank each): no all-gather or
// reduce-scatter, the all-reduce still averages over the replicas, also
// through the all-reduce hook, with a divide factor and when only the last
// micro-batch all-reduces.
TEST(FastPath, HsdpWithShardSizeOne) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 1);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(variant == 0 ? "plain" : variant == 1 ? "hook and divide factor" : "all-reduce on the last only");
      auto reference = make_model(ModelKind::kMlp);
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      FullyShardOptions fs;
      fs.mesh = ctx.mesh();
      std::vector<FSDPModule> modules;
      for (auto& block : model->blocks()) modules.push_back(fully_shard(block, fs));
      FSDPModule root = fully_shard(model, fs);
      modules.push_back(root);
      int hook_calls = 0;
      double grad_scale = 1.0;
      if (variant == 1) {
        for (auto& m : modules) {
          m.set_gradient_divide_factor(4.0);
          m.set_all_reduce_hook([&hook_calls](at::Tensor& reduced) {
            ++hook_calls;
            reduced.mul_(0.5);
          });
        }
        grad_scale = 2.0 / 4.0 * 0.5;
      }
      const int micro_batches = variant == 2 ? 2 : 1;
      torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
      torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        const Batch batch = make_batch(ModelKind::kMlp, step, kRows * micro_batches);
        ref_optim.zero_grad();
        optim.zero_grad();
        for (int m = 0; m < micro_batches; ++m) {
          const Batch mb = batch.slice(m, micro_batches);
          (reference->forward(mb.x, mb.y) * (grad_scale / micro_batches)).backward();
          if (variant == 2) root.set_requires_all_reduce(m == micro_batches - 1);
          const Batch local = mb.slice(ctx.rank(), ctx.world_size());
          (call_module(*model, local.x, local.y) / micro_batches).backward();
        }
        expect_grads_close(*model, *reference);
        ref_optim.step();
        optim.step();
      }
      expect_params_match(*model, *reference, ctx.mesh());
      if (variant == 1) {
        EXPECT_EQ(hook_calls, 3 * static_cast<int>(modules.size()));
      }
      expect_no_collectives(root);
    }
  });
}

}  // namespace
}  // namespace fsdp::test
