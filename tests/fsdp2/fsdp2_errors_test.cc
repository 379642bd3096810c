// Bad input to fully_shard and misuse of sharded modules: each gives a clear
// error that says what was wrong and what to do.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <c10/util/Exception.h>
#include <torch/optim/sgd.h>

#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// The root's forward calls its block around the hooks.
struct CallsAroundHooks : torch::nn::Module {
  CallsAroundHooks() : block(register_module("block", MLPBlock(7, 13))) {}
  at::Tensor forward(const at::Tensor& x) { return block->forward(x); }
  MLPBlock block;
};

// A block that normalizes first, and a root that calls it through a plain
// TORCH_MODULE holder (around the hooks): on 2+ ranks LayerNorm gets its
// sharded weight and fails on the shapes before the end of the root's
// forward (the case users hit first).
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl()
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})))),
        fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(norm(x)); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc;
};
TORCH_MODULE(NormBlock);

struct CallsNormBlockAroundHooks : torch::nn::Module {
  CallsNormBlockAroundHooks() : block(register_module("block", NormBlock())) {}
  at::Tensor forward(const at::Tensor& x) { return block(x); }
  NormBlock block;
};

// A root with parameters of its own used before its block: at 2+ ranks its
// input projection's sharded weight (4 or 3 of 7 rows) still fits the input,
// so a forward called around the root's hooks reaches the block's hooks.
struct InputProjectionImpl : torch::nn::Module {
  InputProjectionImpl()
      : in(register_module("in", torch::nn::Linear(7, 7))),
        block(register_module("block", MLPBlock(7, 13))),
        head(register_module("head", torch::nn::Linear(13, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return head(block(in(x))); }
  torch::nn::Linear in;
  MLPBlock block;
  torch::nn::Linear head;
};
FSDP2CPP_MODULE(InputProjection);

// Collects the warnings LibTorch's TORCH_WARN hands to this thread's handler.
struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

struct MixedDtypes : torch::nn::Module {
  MixedDtypes()
      : a(register_parameter("a", at::randn({4, 3}))), b(register_parameter("b", at::randn({4}, at::kDouble))) {}
  at::Tensor a, b;
};

struct MetaParam : torch::nn::Module {
  MetaParam() : w(register_parameter("w", at::empty({4, 3}, at::TensorOptions().device(c10::kMeta)))) {}
  at::Tensor w;
};

TEST(FullyShardErrors, MisuseGivesClearErrors) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    {
      SCOPED_TRACE("parent before children");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      fully_shard(model, mesh_options(ctx));
      EXPECT_THROW_WITH(fully_shard(model->b0, mesh_options(ctx)), "already sharded by fully_shard on an enclosing",
                        "submodules first");
    }
    {
      SCOPED_TRACE("twice on one module");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      fully_shard(model->b0, mesh_options(ctx));
      EXPECT_THROW_WITH(fully_shard(model->b0, mesh_options(ctx)), "already applied", "MLPBlockImpl");
      fully_shard(model, mesh_options(ctx));
      // Once the enclosing module is sharded, the message says where it is.
      EXPECT_THROW_WITH(fully_shard(model->b0, mesh_options(ctx)), "already applied to module 'b0'");
    }
    {
      SCOPED_TRACE("an optimizer stepped before fully_shard");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
      const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
      model->forward(batch.x, batch.y).backward();
      optim.step();
      EXPECT_THROW_WITH(fully_shard(model->b0, mesh_options(ctx)), "'fc.weight'", "already has a gradient",
                        "optimizer step ran before fully_shard", "build the optimizer over the sharded parameters");
    }
    {
      SCOPED_TRACE("parameter on the wrong device");
      EXPECT_THROW_WITH(fully_shard(std::make_shared<MetaParam>(), mesh_options(ctx)), "'w'", "is on meta",
                        "mesh's device is cpu");
    }
    {
      SCOPED_TRACE("mixed dtypes in one group");
      EXPECT_THROW_WITH(fully_shard(std::make_shared<MixedDtypes>(), mesh_options(ctx)), "mixes dtypes", "'a'", "'b'",
                        "Double");
    }
    {
      SCOPED_TRACE("offload on a CPU mesh, no mesh");
      FullyShardOptions o = mesh_options(ctx);
      o.offload_policy.offload_to_cpu = true;
      EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), o), "offload");
      EXPECT_THROW_WITH(fully_shard(MLPBlock(7, 5), FullyShardOptions{}), "no mesh");
    }
    {
      SCOPED_TRACE("a module with no parameters is allowed");
      auto act = torch::nn::Tanh();
      FSDPModule m = fully_shard(act, mesh_options(ctx));
      at::Tensor x = at::randn({2, 3});
      EXPECT_TRUE(call_module(act, x).equal(at::tanh(x)));
      EXPECT_EQ(m.unsharded_bytes(), 0);
    }
    {
      SCOPED_TRACE("sharded module called around its hooks");
      auto model = std::make_shared<CallsAroundHooks>();
      fully_shard(model->block, mesh_options(ctx));
      fully_shard(model, mesh_options(ctx));
      // fc.weight has 13 rows: each rank holds 7 or 6, so forward cannot be
      // right; with 7 input features the shapes happen to fit, which is the
      // dangerous case the check exists for.
      at::Tensor x = at::randn({3, 7});
      try {
        call_module(*model, x);
        ADD_FAILURE() << "expected an error";
      } catch (const c10::Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("called around its hooks"), std::string::npos) << e.what_without_backtrace();
        EXPECT_NE(what.find("block"), std::string::npos) << e.what_without_backtrace();
      }
    }
    {
      SCOPED_TRACE("sharded block called around its hooks fails on its shapes");
      auto model = std::make_shared<CallsNormBlockAroundHooks>();
      fully_shard(model->block, mesh_options(ctx));
      fully_shard(model, mesh_options(ctx));
      // The runtime's explanation comes first, with LibTorch's error in it.
      EXPECT_THROW_WITH(call_module(*model, at::randn({3, 8})),
                        "parameter 'block.norm.weight' was used in forward while sharded",
                        "module 'block' was probably called around its hooks", "fsdp::call_module",
                        "The error this caused:", "normalized_shape");
      {
        SCOPED_TRACE("without autograd");
        fsdp_module_of(*model)->reset_iter_state();
        torch::NoGradGuard no_grad;
        EXPECT_THROW_WITH(call_module(*model, at::randn({3, 8})), "module 'block' was probably called around its hooks",
                          "normalized_shape");
      }
      {
        SCOPED_TRACE("an error of a module called through its hooks stays as it is");
        fsdp_module_of(*model)->reset_iter_state();
        try {
          call_module(model->block, at::randn({3, 5}));
          ADD_FAILURE() << "expected LayerNorm's error";
        } catch (const c10::Error& e) {
          EXPECT_EQ(std::string(e.what()).find("fsdp2:"), std::string::npos) << e.what_without_backtrace();
        }
      }
      // The same block through its hooks is fine afterwards.
      fsdp_module_of(*model)->reset_iter_state();
      at::Tensor x = at::randn({3, 8});
      EXPECT_EQ(call_module(model->block, x).sizes(), x.sizes());
    }
    {
      SCOPED_TRACE("backward twice through one graph");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
      fully_shard(model, mesh_options(ctx));
      const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*model, local.x, local.y);
      loss.backward();
      EXPECT_THROW_WITH(loss.backward(), "backward through the graph a second time");
    }
  });
}

TEST(FullyShardErrors, RootCalledAroundItsHooksFailsAtEveryWorldSize) {
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE(world);
    testing::run_distributed(world, [](testing::RankContext& ctx) {
      auto make = [&ctx] {
        torch::manual_seed(0);
        InputProjection model;
        fully_shard(model->block, mesh_options(ctx));
        fully_shard(model.ptr(), mesh_options(ctx));
        return model;
      };
      const at::Tensor x = at::randn({3, 7});
      {
        SCOPED_TRACE("the first forward around the root's hooks");
        InputProjection model = make();
        EXPECT_THROW_WITH(model->forward(x), "MLPBlockImpl' ran its forward hooks before the sharded module",
                          "InputProjectionImpl', the root)", "model->forward(x)", "fsdp::call_module(model, ...)",
                          "FSDP2CPP_MODULE");
      }
      {
        SCOPED_TRACE("a later forward around the root's hooks");
        InputProjection model = make();
        torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
        model(x).sum().backward();  // through the holder: the hooks run
        optim.step();
        optim.zero_grad();
        // torch.chunk rows of in.weight's 7: 7; 4, 3; 3, 3, 1.
        const int64_t chunk = (7 + ctx.world_size() - 1) / ctx.world_size();
        const int64_t rows = std::min<int64_t>(chunk, 7 - ctx.rank() * chunk);
        const std::string shape = c10::str("this rank's shape [", rows, ", 7] of [7, 7]");
        EXPECT_THROW_WITH(model->forward(x), "fsdp2: the root module '",
                          "InputProjectionImpl' was called around its hooks",
                          "parameter 'in.weight' was used while sharded", shape.c_str(), "submodule 'block'",
                          "fsdp::call_module(model, ...)", "FSDP2CPP_MODULE");
        fsdp_module_of(*model)->reset_iter_state();
        // The block called on its own through its hooks is no such call, and
        // the root through its hooks works again.
        EXPECT_EQ(call_module(model->block, x).sizes(), (std::vector<int64_t>{3, 13}));
        model(x).sum().backward();
        optim.step();
        {
          SCOPED_TRACE("while the graph of the root's last forward is alive");
          at::Tensor kept = model(x).sum();
          kept.backward({}, /*retain_graph=*/true);
          // The root is sharded again, and its parameters' nodes are alive in
          // the kept graph: made while unsharded, they are no such call.
          EXPECT_EQ(call_module(model->block, x).sizes(), (std::vector<int64_t>{3, 13}));
        }
      }
    });
  }
}

TEST(FullyShardErrors, ForwardThatRunsSeveralRootsWarnsOnceNamingThem) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    WarningCollector warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    {
      SCOPED_TRACE("blocks and the root sharded: one root, no warning");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
      fully_shard(model, mesh_options(ctx));
      for (int step = 0; step < 2; ++step) call_module(*model, local.x, local.y).backward();
      EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
    }
    {
      SCOPED_TRACE("fully_shard forgotten on the root: each block is a root");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
      for (int step = 0; step < 3; ++step) model->forward(local.x, local.y).backward();
      ASSERT_EQ(warnings.messages.size(), 1u);
      const std::string& w = warnings.messages.front();
      for (const char* fragment :
           {"fsdp2: one forward ran 2 fully_shard roots, the modules [fsdp::test::MLPBlockImpl, "
            "fsdp::test::MLPBlockImpl]",
            "never reduced", "apply fully_shard to the model too, last", "fsdp::call_module", "separate models"}) {
        EXPECT_NE(w.find(fragment), std::string::npos) << "warning lacks '" << fragment << "': " << w;
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::test
