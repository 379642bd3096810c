// The per-module controls FSDP2 gained after torch 2.11 (2.13's
// set_reduce_scatter_unused_params, set_reduce_scatter_max_input_buffers and
// set_separate_reduce_scatter_group, and share_comm_ctx): training on 1-4
// real ranks (and HSDP on 2x2) matches an unsharded reference, and each
// control has the effect FSDP2 documents on the collectives (which
// parameters are reduced, how many reduce-scatters are in flight, on which
// communicator they run, which context the roots share).
#include <algorithm>
#include <map>
#include <set>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>

#include "collectives/flight_recorder.h"
#include "collectives/world.h"
#include "fsdp2_test_util.h"
#include "stream_check/stream_check.h"

namespace fsdp::test {
namespace {

constexpr int64_t kDim = 9;    // 9 rows: shards of 5+4, 3+3+3 and 3+3+3+0
constexpr int64_t kRows = 12;  // divisible by every world size 1-4
constexpr int kBlocks = 4;

// tanh(x W^T + b).
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : weight(register_parameter("weight", at::randn({kDim, kDim}) * 0.3)),
        bias(register_parameter("bias", at::randn({kDim}) * 0.1)) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(at::linear(x, weight, bias)); }
  at::Tensor weight, bias;
};
FSDP2CPP_MODULE(Block);

// inp -> blocks -> one of two branches (or neither) -> head, plus an
// auxiliary block computed on every rank whose output enters the loss only
// when `use_aux`. The branches stay in the root's group; `aux` is a group of
// its own, whose input needs no gradient: its post-backward, like the
// root's, runs at the end of backward on every rank, reached or not (see
// set_reduce_scatter_unused_params).
struct Net : torch::nn::Module {
  Net()
      : inp(register_module("inp", torch::nn::Linear(7, kDim))),
        branch_a(register_module("branch_a", Block())),
        branch_b(register_module("branch_b", Block())),
        aux(register_module("aux", Block())),
        head(register_module("head", torch::nn::Linear(kDim, 3))) {
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = inp(x);
    for (auto& b : blocks) h = b(h);
    if (branch == 'a') h = branch_a(h);
    if (branch == 'b') h = branch_b(h);
    at::Tensor loss = torch::nn::functional::mse_loss(head(h), y);
    const at::Tensor side = aux(h.detach());
    return use_aux ? loss + side.pow(2).mean() : loss;
  }
  torch::nn::Linear inp;
  std::vector<Block> blocks;
  Block branch_a, branch_b, aux;
  torch::nn::Linear head;
  char branch = 'a';
  bool use_aux = true;
};

std::shared_ptr<Net> seeded_net() {
  torch::manual_seed(0);
  return std::make_shared<Net>();
}

Batch batch_for(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + step);
  return {at::randn({kRows, 7}, gen), at::randn({kRows, 3}, gen)};
}

// The reference step for per-rank behaviours: each rank's loss on its slice
// of the batch, with `configure(rank)` setting the rank's control flow; the
// gradients are their average, as the sharded reduction makes them.
template <typename Configure>
void reference_step(Net& reference, torch::optim::Optimizer& optim, const Batch& batch, int world,
                    Configure&& configure) {
  optim.zero_grad();
  at::Tensor total;
  for (int r = 0; r < world; ++r) {
    configure(reference, r);
    const Batch mine = batch.slice(r, world);
    at::Tensor loss = reference.forward(mine.x, mine.y) / world;
    total = total.defined() ? total + loss : loss;
  }
  total.backward();
  optim.step();
}

class ModuleControls : public ::testing::TestWithParam<int> {};

// Ranks take different branches (and only rank 0 puts `aux` in its loss):
// with set_reduce_scatter_unused_params every rank reduces every parameter,
// the unused ones as zeros, so SGD matches the reference that averages each
// rank's gradient (zero where a rank did not use a parameter).
TEST_P(ModuleControls, UnusedParamsAreReducedAsZerosWhenRanksTakeDifferentBranches) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    auto reference = seeded_net();
    auto model = seeded_net();
    FSDPModule root = [&] {
      const FullyShardOptions opts = mesh_options(ctx);
      for (auto& b : model->blocks) fully_shard(b, opts);
      FullyShardOptions aux_opts = opts;
      aux_opts.reshard_after_forward = false;
      fully_shard(model->aux, aux_opts);
      return fully_shard(model, opts);
    }();
    root.set_reduce_scatter_unused_params(true);
    // Still unsharded at the end of backward, whose callback runs its
    // post-backward again: its unused parameters are reduced once.
    fsdp_module_of(*model->blocks[1])->set_reshard_after_backward(false);
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
    auto configure = [](Net& net, int r, int step) {
      net.branch = (r + step) % 2 == 0 ? 'a' : 'b';
      net.use_aux = r == 0;
    };
    for (int step = 0; step < 4; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Batch batch = batch_for(step);
      reference_step(*reference, ref_optim, batch, world, [&](Net& net, int r) { configure(net, r, step); });
      configure(*model, rank, step);
      const Batch mine = batch.slice(rank, world);
      optim.zero_grad();
      root.reset_runtime_stats();
      call_module(*model, mine.x, mine.y).backward();
      // One reduce-scatter per group (4 blocks, aux, root) on every rank,
      // whichever parameters it used; none at one rank.
      EXPECT_EQ(root.runtime_stats().reduce_scatters, world > 1 ? 6 : 0);
      // Every parameter got a gradient: the ones this rank did not use hold
      // the other ranks' average (or zeros at one rank).
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(item.value().grad().defined()) << item.key() << " has no gradient";
      }
      optim.step();
      expect_params_match(*model, *reference, ctx.mesh());
    }
  });
}

// A parameter that no rank uses: without the control it is left out of the
// reduction and keeps no gradient (as before 2.13); with it, its gradient is
// zeros on every rank.
TEST_P(ModuleControls, AParameterNoRankUsesGetsZerosOnlyWithUnusedParams) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const bool unused_params : {false, true}) {
      SCOPED_TRACE(unused_params ? "set_reduce_scatter_unused_params(true)" : "default");
      auto model = seeded_net();
      const FullyShardOptions opts = mesh_options(ctx);
      for (auto& b : model->blocks) fully_shard(b, opts);
      fully_shard(model->aux, opts);
      FSDPModule root = fully_shard(model, opts);
      root.set_reduce_scatter_unused_params(unused_params);
      model->branch = 'a';
      const Batch mine = batch_for(0).slice(ctx.rank(), ctx.world_size());
      call_module(*model, mine.x, mine.y).backward();
      for (const at::Tensor& p : model->branch_b->parameters()) {
        if (!unused_params) {
          EXPECT_FALSE(p.grad().defined());
          continue;
        }
        ASSERT_TRUE(p.grad().defined());
        EXPECT_EQ(p.grad().sizes(), p.sizes()) << "the sharded gradient has the shard's shape";
        EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
      }
      EXPECT_GT(mean_over_ranks(ctx, model->branch_a->weight.grad().abs().sum().item<double>()), 0.0)
          << "a used parameter";
    }
  });
}

// What fully_shard.h and docs/fsdp2.md say of set_reduce_scatter_unused_params
// for a MoE: the zeros an unused expert (branch_b) gets are a gradient to
// AdamW, whose weight decay and moments from an earlier step (when the
// expert was used) move it; resetting its gradient before the step, as a run
// without the option has none, leaves it as it was.
TEST_P(ModuleControls, AnUnusedExpertMovesUnderAdamWUnlessItsGradientIsReset) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const bool reset : {false, true}) {
      SCOPED_TRACE(reset ? "gradient reset before the step" : "zeros stepped on");
      auto model = seeded_net();
      const FullyShardOptions opts = mesh_options(ctx);
      for (auto& b : model->blocks) fully_shard(b, opts);
      fully_shard(model->aux, opts);
      FSDPModule root = fully_shard(model, opts);
      root.set_reduce_scatter_unused_params(true);
      auto optim = make_optimizer(Optim::kAdamW, model->parameters());
      for (const char branch : {'b', 'a'}) {  // the expert is used, then not
        model->branch = branch;
        const Batch mine = batch_for(branch == 'b' ? 0 : 1).slice(ctx.rank(), ctx.world_size());
        call_module(*model, mine.x, mine.y).backward();
        if (branch == 'a' && reset) {
          for (at::Tensor& p : model->branch_b->parameters()) p.mutable_grad().reset();
        }
        std::vector<at::Tensor> before;
        for (const at::Tensor& p : model->branch_b->parameters()) before.push_back(p.detach().clone());
        optim->step();
        optim->zero_grad();
        if (branch == 'b') continue;
        double moved = 0;
        const auto params = model->branch_b->parameters();
        for (size_t i = 0; i < params.size(); ++i) moved += (params[i].detach() - before[i]).abs().sum().item<double>();
        moved = mean_over_ranks(ctx, moved);
        if (reset) {
          EXPECT_EQ(moved, 0.0) << "an expert without a gradient is not stepped on";
        } else {
          EXPECT_GT(moved, 0.0) << "zeros are a gradient to AdamW";
        }
      }
    }
  });
}

// With K inputs allowed in flight, the reduce-scatter of the group at
// position j in backward is completed when the (j+K+1)-th is about to be
// issued, so its all-reduce hook (which runs at completion) sees j+K issued;
// the last K complete at the end of backward. Training matches the
// reference for every K.
TEST_P(ModuleControls, MaxInputBuffersBoundsTheReduceScattersInFlight) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    for (const int k : {1, 2, 3}) {
      SCOPED_TRACE("max_input_buffers " + std::to_string(k));
      auto reference = seeded_net();
      auto model = seeded_net();
      model->branch = reference->branch = 'a';
      const FullyShardOptions opts = mesh_options(ctx);
      std::vector<FSDPModule> blocks;
      for (auto& b : model->blocks) blocks.push_back(fully_shard(b, opts));
      fully_shard(model->aux, opts);
      FSDPModule root = fully_shard(model, opts);
      // Set on the blocks only: the largest value under the root applies to
      // every group, as in FSDP2.
      blocks[1].set_reduce_scatter_max_input_buffers(k, /*recurse=*/false);
      std::map<std::string, int64_t> issued_at_completion;
      auto record = [&](const std::string& name) {
        return [&issued_at_completion, &root, name](at::Tensor&) {
          issued_at_completion[name] = root.runtime_stats().reduce_scatters;
        };
      };
      for (int i = 0; i < kBlocks; ++i) blocks[i].set_all_reduce_hook(record("block" + std::to_string(i)));
      fsdp_module_of(*model->aux)->set_all_reduce_hook(record("aux"));
      root.set_all_reduce_hook(record("root"));
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 3; ++step) {
        const Batch batch = batch_for(step);
        reference_step(*reference, ref_optim, batch, world, [](Net&, int) {});
        const Batch mine = batch.slice(rank, world);
        optim.zero_grad();
        at::Tensor loss = call_module(*model, mine.x, mine.y);
        root.reset_runtime_stats();
        issued_at_completion.clear();
        loss.backward();
        optim.step();
        expect_params_match(*model, *reference, ctx.mesh());
        if (world == 1) continue;  // one rank reduces in place: nothing is issued
        // The root and aux (whose inputs need no gradient) are reduced at
        // the end of backward, in module order.
        const std::vector<std::string> order = {"block3", "block2", "block1", "block0", "root", "aux"};
        const int64_t groups = static_cast<int64_t>(order.size());
        // With streams (the CUDA path, here under the stream-order checker)
        // each completion is enqueued right after its issue and the bound
        // is an event the compute stream waits on: the hook sees j+1.
        for (int64_t j = 0; j < groups; ++j) {
          const int64_t expected = stream_check::active() ? j + 1 : std::min<int64_t>(j + k, groups);
          EXPECT_EQ(issued_at_completion[order[j]], expected)
              << order[j] << " at backward position " << j << ", step " << step;
        }
      }
    }
  });
}

TEST(ModuleControlsErrors, MaxInputBuffersBelowOneIsRejected) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    auto model = seeded_net();
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    EXPECT_THROW_WITH(root.set_reduce_scatter_max_input_buffers(0), "max_input_buffers must be at least 1", "got 0");
  });
}

// The runtime's collectives `op` labelled `phase` ("FSDP::all_gather (block0)")
// of the whole run, from this rank's flight recorder (the test's own gathers
// of parameters and lazy init's model fingerprint are not).
std::vector<collectives::CollectiveRecord> records_of(testing::RankContext& ctx, const std::string& op,
                                                      const std::string& phase) {
  std::vector<collectives::CollectiveRecord> result;
  for (auto& r : ctx.world()->flight_recorder().snapshot().records) {
    if (r.fingerprint.op == op && r.fingerprint.label.rfind(phase, 0) == 0) result.push_back(r);
  }
  return result;
}

// The reduce-scatters run on a communicator of their own over the shard
// group's ranks (one for all modules), the all-gathers stay on the shard
// group's, training matches the reference, and false goes back. FSDP at 1-4
// ranks; HSDP on 2x2 below.
void expect_separate_reduce_scatter_group(testing::RankContext& ctx, const DeviceMesh& mesh) {
  const int rank = ctx.rank(), world = ctx.world_size();
  auto reference = seeded_net();
  auto model = seeded_net();
  FullyShardOptions opts;
  opts.mesh = mesh;
  for (auto& b : model->blocks) fully_shard(b, opts);
  fully_shard(model->aux, opts);
  FSDPModule root = fully_shard(model, opts);
  const auto shard_comm = mesh.group(mesh.ndim() - 1);
  root.set_separate_reduce_scatter_group();
  root.set_separate_reduce_scatter_group();  // a module that has one keeps it
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
  std::string first_rs_comm;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step == 2) root.set_separate_reduce_scatter_group(false);
    const int64_t rs_before =
        static_cast<int64_t>(records_of(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter").size());
    const Batch batch = batch_for(step);
    reference_step(*reference, ref_optim, batch, world, [](Net&, int) {});
    const Batch mine = batch.slice(rank, world);
    optim.zero_grad();
    call_module(*model, mine.x, mine.y).backward();
    optim.step();
    expect_params_match(*model, *reference, mesh);
    if (shard_comm->size() == 1) continue;  // one rank reduces in place: no reduce-scatter to place
    const auto snapshot = ctx.world()->flight_recorder().snapshot();
    const auto rs = records_of(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter");
    ASSERT_EQ(static_cast<int64_t>(rs.size()), rs_before + 6) << "one reduce-scatter per group";
    std::set<std::string> rs_comms;
    for (size_t i = rs_before; i < rs.size(); ++i) rs_comms.insert(rs[i].communicator);
    ASSERT_EQ(rs_comms.size(), 1u);
    const std::string& rs_comm = *rs_comms.begin();
    if (step < 2) {
      EXPECT_NE(rs_comm, shard_comm->id()) << "reduce-scatters on their own communicator";
      if (step == 1) {
        EXPECT_EQ(rs_comm, first_rs_comm) << "the second call kept the communicator";
      }
      first_rs_comm = rs_comm;
      for (const auto& c : snapshot.communicators) {
        if (c.id == rs_comm) {
          EXPECT_EQ(c.global_ranks, shard_comm->global_ranks());
        }
      }
    } else {
      EXPECT_EQ(rs_comm, shard_comm->id()) << "false goes back to the shard group's";
    }
    for (const auto& ag : records_of(ctx, "all_gather_into_tensor", "FSDP::all_gather")) {
      EXPECT_EQ(ag.communicator, shard_comm->id()) << ag.fingerprint.label << " in " << ag.context;
    }
  }
}

TEST_P(ModuleControls, SeparateReduceScatterGroupRunsReduceScattersOnTheirOwnCommunicator) {
  testing::run_distributed(GetParam(),
                           [](testing::RankContext& ctx) { expect_separate_reduce_scatter_group(ctx, ctx.mesh()); });
}

TEST(ModuleControlsHsdp, SeparateReduceScatterGroupOnTwoByTwo) {
  testing::run_distributed(4, [](testing::RankContext& ctx) {
    const DeviceMesh mesh = init_device_mesh(ctx.world(), c10::kCPU, {2, 2}, {"replicate", "shard"});
    expect_separate_reduce_scatter_group(ctx, mesh);
  });
}

// Two pipeline stages, each its own root, called one after the other in one
// forward and backward: with share_comm_ctx they share one context (the
// stats of both count everything), and training matches the reference.
struct StageImpl : torch::nn::Module {
  StageImpl(int64_t in, int64_t out) : proj(register_module("proj", torch::nn::Linear(in, kDim))) {
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    head = register_module("head", torch::nn::Linear(kDim, out));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = proj(x);
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  torch::nn::Linear proj;
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
FSDP2CPP_MODULE(Stage);

TEST_P(ModuleControls, ShareCommCtxLetsPipelineStagesShareOneContext) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    auto make = [] {
      torch::manual_seed(0);
      return std::make_pair(Stage(7, kDim), Stage(kDim, 3));
    };
    auto [ref0, ref1] = make();
    auto [s0, s1] = make();
    const FullyShardOptions opts = mesh_options(ctx);
    std::vector<FSDPModule> roots;
    for (Stage* s : {&s0, &s1}) {
      for (auto& b : (*s)->blocks) fully_shard(b, opts);
      roots.push_back(fully_shard(*s, opts));
    }
    // Stage 1 runs a forward before sharing: a context made at lazy init is
    // replaced too.
    {
      c10::NoGradGuard no_grad;
      s1(at::zeros({1, kDim}));
    }
    share_comm_ctx(roots);
    std::vector<at::Tensor> params = s0->parameters(), ref_params = ref0->parameters();
    for (const auto& p : s1->parameters()) params.push_back(p);
    for (const auto& p : ref1->parameters()) ref_params.push_back(p);
    torch::optim::SGD optim(params, torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_optim(ref_params, torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      const Batch batch = batch_for(step);
      ref_optim.zero_grad();
      torch::nn::functional::mse_loss(ref1(ref0(batch.x)), batch.y).backward();
      ref_optim.step();
      const Batch mine = batch.slice(rank, world);
      optim.zero_grad();
      roots[0].reset_runtime_stats();
      torch::nn::functional::mse_loss(s1(s0(mine.x)), mine.y).backward();
      optim.step();
      const RuntimeStats a = roots[0].runtime_stats(), b = roots[1].runtime_stats();
      EXPECT_EQ(a.reduce_scatters, b.reduce_scatters) << "one context, one set of counters";
      EXPECT_EQ(a.all_gathers, b.all_gathers);
      // Three groups per stage, each reduced once (none at one rank).
      EXPECT_EQ(a.reduce_scatters, world > 1 ? 6 : 0);
      for (auto [m, r] : {std::pair{s0.ptr(), ref0.ptr()}, std::pair{s1.ptr(), ref1.ptr()}}) {
        expect_params_match(*m, *r, ctx.mesh());
      }
    }
  });
}

TEST(ModuleControlsErrors, ShareCommCtxTakesRootsBetweenIterations) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    auto model = seeded_net();
    const FullyShardOptions opts = mesh_options(ctx);
    FSDPModule block = fully_shard(model->blocks[0], opts);
    FSDPModule root = fully_shard(model, opts);
    auto other = seeded_net();
    FSDPModule other_root = fully_shard(other, opts);
    EXPECT_THROW_WITH(share_comm_ctx({root, block}), "share_comm_ctx: module", "is inside the sharded module",
                      "pass the roots");
    share_comm_ctx({});  // nothing to share
    const Batch mine = batch_for(0);
    at::Tensor loss = call_module(*other, mine.x, mine.y);  // other's backward is pending
    EXPECT_THROW_WITH(share_comm_ctx({root, other_root}), "share_comm_ctx: the root",
                      "in the middle of a forward or backward", "between iterations");
    loss.backward();
    share_comm_ctx({root, other_root});
    at::Tensor l2 = call_module(*model, mine.x, mine.y);
    l2.backward();
    EXPECT_EQ(root.runtime_stats().reduce_scatters, other_root.runtime_stats().reduce_scatters);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ModuleControls, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "World" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace fsdp::test
