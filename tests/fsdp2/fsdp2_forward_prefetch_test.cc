// Forward all-gathers pipelined two deep ([Note: implicit forward prefetch],
// fsdp2/src/fsdp_state.h): on CPU each module's pre-forward issues the
// all-gather of the module that came next in the last forward, so that it
// runs during this module's compute. What must hold, on 1-4 real ranks
// against an unsharded reference: training is unchanged, which group is
// unsharded and which has its all-gather in flight when a block's forward
// starts, an order that changes between iterations (a skipped block) stays
// correct and leaves no all-gather behind, no_grad forwards, an explicit
// set_modules_to_forward_prefetch replaces the implicit prefetch, and no
// group is gathered twice (all-gather counts per step), and reset_iter_state
// after a forward that threw with a prefetch in flight. At world size 1 the
// groups take the fast path (nothing to gather) and nothing is prefetched
// implicitly.
#include <algorithm>
#include <functional>
#include <mutex>
#include <set>

#include <ATen/record_function.h>

#include "counting_allocator.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// Linear + tanh whose forward first calls `probe(index)`: inside the
// module's hooks, i.e. after its pre-forward unsharded it.
struct ProbedBlockImpl : torch::nn::Module {
  ProbedBlockImpl(int64_t dim, int index) : fc(register_module("fc", torch::nn::Linear(dim, dim))), index(index) {}
  at::Tensor forward(const at::Tensor& x) {
    if (probe) probe(index);
    return at::tanh(fc(x));
  }
  torch::nn::Linear fc;
  int index;
  std::function<void(int)> probe;
};
FSDP2CPP_MODULE(ProbedBlock);

// Four blocks of width 10 (uneven shards at 3 and 4 ranks) and a head in the
// root's own group; the blocks in `skip` are left out of the forward.
struct Chain : torch::nn::Module {
  static constexpr int kBlocks = 4;
  static constexpr int64_t kDim = 10, kRows = 12;
  Chain() {
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(register_module("b" + std::to_string(i), ProbedBlock(kDim, i)));
    head = register_module("head", torch::nn::Linear(kDim, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (int i = 0; i < kBlocks; ++i) {
      if (skip.count(i) == 0) h = blocks[i](h);
    }
    return head(h);
  }
  void set_probe(const std::function<void(int)>& probe) {
    for (auto& b : blocks) b->probe = probe;
  }
  std::vector<ProbedBlock> blocks;
  torch::nn::Linear head{nullptr};
  std::set<int> skip;
};

std::shared_ptr<Chain> seeded_chain() {
  torch::manual_seed(0);
  return std::make_shared<Chain>();
}

Batch chain_batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  return {at::randn({Chain::kRows, Chain::kDim}, gen), at::randn({Chain::kRows, 3}, gen)};
}

// The sharded chain, its unsharded reference (same initial values) and an
// AdamW for each.
struct Rig {
  explicit Rig(testing::RankContext& ctx) : ctx(ctx), model(seeded_chain()), reference(seeded_chain()) {
    FullyShardOptions o;
    o.mesh = ctx.mesh();
    for (auto& b : model->blocks) blocks.push_back(fully_shard(b, o));
    root = fully_shard(model, o);
    optim = make_optimizer(Optim::kAdamW, model->parameters());
    ref_optim = make_optimizer(Optim::kAdamW, reference->parameters());
  }

  // Forward and backward of `step`'s batch on both (this rank's rows on the
  // sharded model, all rows on the reference), the losses compared; returns
  // the sharded model's all-gathers in the forward and in the backward.
  std::pair<int64_t, int64_t> forward_backward(int step) {
    const Batch global = chain_batch(step);
    const Batch local = global.slice(ctx.rank(), ctx.world_size());
    root->reset_runtime_stats();
    at::Tensor loss = torch::nn::functional::mse_loss(call_module(*model, local.x), local.y);
    const int64_t forward_gathers = root->runtime_stats().all_gathers;
    for (size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(blocks[i].unsharded_bytes(), 0) << "step " << step << ": block " << i << " after forward";
    }
    at::Tensor ref_loss = torch::nn::functional::mse_loss(reference->forward(global.x), global.y);
    // Equal row counts per rank (12 rows): the mean of the ranks' losses is
    // the global batch's loss.
    EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(), 1e-5) << "step " << step;
    loss.backward();
    ref_loss.backward();
    return {forward_gathers, root->runtime_stats().all_gathers - forward_gathers};
  }
  void step() {
    optim->step();
    optim->zero_grad();
    ref_optim->step();
    ref_optim->zero_grad();
  }
  // The all-gathers the runtime must issue per forward and per backward when
  // `ran` blocks run (none at world size 1: the fast path gathers nothing).
  // Forward: the root and each block once; backward: each block again (the
  // root keeps its parameters after forward).
  int64_t forward_gathers(int ran) const { return ctx.world_size() == 1 ? 0 : 1 + ran; }
  int64_t backward_gathers(int ran) const { return ctx.world_size() == 1 ? 0 : ran; }

  testing::RankContext& ctx;
  std::shared_ptr<Chain> model, reference;
  std::vector<FSDPModule> blocks;
  std::optional<FSDPModule> root;
  std::unique_ptr<torch::optim::Optimizer> optim, ref_optim;
};

// The runtime's profiler labels (all-gathers, prefetches) and the test's own
// marks, in order.
class Recorder {
 public:
  Recorder() {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          std::string name = fn.name();
          // The blocks' all-gathers; the root's group is gathered once per
          // forward, before any block, and is not what these tests order.
          if (name.rfind("FSDP::all_gather (", 0) == 0 && name != "FSDP::all_gather (root)") {
            std::lock_guard<std::mutex> lock(mutex());
            events().push_back(name.substr(std::string("FSDP::all_gather (").size(),
                                           name.size() - 1 - std::string("FSDP::all_gather (").size()));
            events().back() = "gather " + events().back();
          }
          return nullptr;
        }).scopes({at::RecordScope::USER_SCOPE}));
  }
  ~Recorder() { at::removeCallback(handle_); }
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;
  void mark(const std::string& event) {
    std::lock_guard<std::mutex> lock(mutex());
    events().push_back(event);
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mutex());
    std::vector<std::string> result = std::move(events());
    events().clear();
    return result;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::string>& events() {
    static std::vector<std::string> v;
    return v;
  }
  at::CallbackHandle handle_;
};

// "gather bI" for each block all-gather issued (not the root's),
// "forward bI" when block I's forward starts.
std::vector<std::string> events(std::initializer_list<const char*> list) { return {list.begin(), list.end()}; }

class ForwardPrefetch : public ::testing::TestWithParam<int> {};

// Training with the implicit forward prefetch matches the unsharded
// reference step by step, and each step gathers each group exactly as often
// as without it (the first step has no order, so prefetches nothing).
TEST_P(ForwardPrefetch, TrainingMatchesTheReferenceAndGathersEachGroupOnce) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    for (int step = 0; step < 4; ++step) {
      const auto [forward, backward] = s.forward_backward(step);
      EXPECT_EQ(forward, s.forward_gathers(Chain::kBlocks)) << "step " << step;
      EXPECT_EQ(backward, s.backward_gathers(Chain::kBlocks)) << "step " << step;
      s.step();
    }
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// When block i's forward starts, block i is unsharded and block i+1's
// all-gather (issued by block i's pre-forward) is in flight: issued, not yet
// copied out. The first forward has no order to follow.
TEST_P(ForwardPrefetch, NextBlockIsInFlightWhenABlockComputes) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    const bool sharded = ctx.world_size() > 1;
    Recorder recorder;
    std::vector<int64_t> gathered;  // all-gathers issued when block i's forward starts
    int step = 0;
    s.model->set_probe([&](int i) {
      recorder.mark("forward b" + std::to_string(i));
      gathered.push_back(s.root->runtime_stats().all_gathers);
      EXPECT_GT(s.blocks[i].unsharded_bytes(), 0) << "step " << step << ": block " << i << " computes unsharded";
      for (int j = 0; j < Chain::kBlocks; ++j) {
        if (j == i) continue;
        EXPECT_EQ(s.blocks[j].unsharded_bytes(), 0) << "step " << step << ": block " << j << " in block " << i;
      }
    });
    for (; step < 3; ++step) {
      recorder.take();
      gathered.clear();
      s.forward_backward(step);
      std::vector<std::string> forward_events = recorder.take();
      // Backward's all-gathers follow the last block's forward mark.
      forward_events.resize(std::find(forward_events.begin(), forward_events.end(), "forward b3") -
                            forward_events.begin() + 1);
      if (step == 0 || !sharded) {
        EXPECT_EQ(forward_events, events({"gather b0", "forward b0", "gather b1", "forward b1", "gather b2",
                                          "forward b2", "gather b3", "forward b3"}))
            << "step " << step;
        const std::vector<int64_t> expected = sharded ? std::vector<int64_t>{2, 3, 4, 5} : std::vector<int64_t>(4, 0);
        EXPECT_EQ(gathered, expected) << "step " << step;
      } else {
        // The root's pre-forward prefetches b0, each block the next one.
        EXPECT_EQ(forward_events, events({"gather b0", "gather b1", "forward b0", "gather b2", "forward b1",
                                          "gather b3", "forward b2", "forward b3"}))
            << "step " << step;
        EXPECT_EQ(gathered, (std::vector<int64_t>{3, 4, 5, 5})) << "step " << step;
      }
      s.step();
    }
  });
}

// Block 2 is skipped in some forwards. The order of the last forward then
// prefetches a block that does not run (b2 after b1) or a block early (b3
// after b1, before b2): results stay equal to the reference, every block is
// resharded after forward, the unused all-gather is dropped at the end of
// the forward (an evaluation forward between backward and the optimizer
// step must not leave a pre-step all-gather for the next forward to use),
// and no group is gathered twice.
TEST_P(ForwardPrefetch, ChangedOrderStaysCorrectAndLeavesNothingInFlight) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    const int all = Chain::kBlocks;
    int step = 0;
    // Forward and backward with `skip` left out; returns the forward's
    // all-gathers.
    auto train = [&](const std::set<int>& skip) {
      s.model->skip = skip;
      s.reference->skip = skip;
      const auto [forward, backward] = s.forward_backward(step);
      EXPECT_EQ(backward, s.backward_gathers(all - static_cast<int>(skip.size()))) << "step " << step;
      return forward;
    };
    auto optimizer_step = [&] {
      s.step();
      ++step;
    };
    train({});
    optimizer_step();
    train({});
    {
      // An evaluation forward without b2 before the optimizer step: b1
      // prefetches b2 (the last order had it next), which does not run.
      s.model->skip = {2};
      s.reference->skip = {2};
      const Batch local = chain_batch(100).slice(ctx.rank(), ctx.world_size());
      torch::NoGradGuard no_grad;
      s.root->reset_runtime_stats();
      at::Tensor out = call_module(*s.model, local.x);
      EXPECT_EQ(s.root->runtime_stats().all_gathers, s.forward_gathers(all)) << "b2 gathered once, unused";
      expect_close(out, s.reference->forward(local.x), "evaluation output without b2");
      for (size_t i = 0; i < s.blocks.size(); ++i) EXPECT_EQ(s.blocks[i].unsharded_bytes(), 0) << "block " << i;
      EXPECT_EQ(s.root->unsharded_bytes(), 0) << "no_grad: the root reshards too";
    }
    // The step changes the shards: the next forward must gather b2's new
    // values, not use the all-gather the evaluation issued. Its order
    // (without b2) has b1 prefetch b3, before b2 runs.
    optimizer_step();
    EXPECT_EQ(train({}), s.forward_gathers(all)) << "b2 gathered anew, b3 prefetched early not gathered again";
    optimizer_step();
    // Training without b2: b1 prefetches b2, dropped at the root's
    // post-forward; b3 gathers its own.
    EXPECT_EQ(train({2}), s.forward_gathers(all)) << "the prefetched b2 is gathered once and dropped";
    optimizer_step();
    EXPECT_EQ(train({}), s.forward_gathers(all));
    optimizer_step();
    EXPECT_EQ(train({}), s.forward_gathers(all));
    optimizer_step();
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// The all-gather of a prefetched block that does not run is waited for and
// its output freed by the root's post-forward, not kept through backward
// and the optimizer step. bf16 parameters make a block's all-gather output
// the only buffer of its size alive after forward (the allocator counts
// them). On CPU the outputs of the blocks that ran are freed after their
// copy-out.
TEST_P(ForwardPrefetch, UnusedPrefetchIsFreedAtTheEndOfForward) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    ScopedCountingAllocator counter;
    auto model = seeded_chain();
    FullyShardOptions o;
    o.mesh = ctx.mesh();
    o.mp_policy.param_dtype = at::kBFloat16;
    o.mp_policy.reduce_dtype = at::kFloat;
    for (auto& b : model->blocks) fully_shard(b, o);
    FSDPModule root = fully_shard(model, o);
    const int64_t world = ctx.world_size(), rows = (Chain::kDim + world - 1) / world;
    const size_t ag_output_bytes = static_cast<size_t>(world * rows * (Chain::kDim + 1) * 2);
    const Batch local = chain_batch(0).slice(ctx.rank(), world);
    for (int step = 0; step < 3; ++step) {
      // Step 1 follows an order in which b1 prefetches b2, which does not
      // run; step 2 one in which b1 prefetches b3.
      model->skip = step == 0 ? std::set<int>{} : std::set<int>{2};
      root.reset_runtime_stats();
      at::Tensor out = call_module(*model, local.x);
      // Mixed precision: the all-gathers run at world size 1 too.
      EXPECT_EQ(root.runtime_stats().all_gathers, step == 0 ? 5 : step == 1 ? 5 : 4) << "step " << step;
      EXPECT_EQ(counter.settled_live(ag_output_bytes, 0), 0) << "step " << step << ": all-gather outputs after forward";
      out.to(at::kFloat).pow(2).mean().backward();
      EXPECT_EQ(root.runtime_stats().all_gathers, (step == 0   ? 5
                                                   : step == 1 ? 5
                                                               : 4) +
                                                      (step == 0 ? 4 : 3))
          << "step " << step;
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    }
  });
}

// no_grad forwards (evaluation) prefetch the same way, match the reference
// and leave every group resharded.
TEST_P(ForwardPrefetch, NoGradForwardsMatchAndReshardEverything) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    s.forward_backward(0);
    s.step();
    Recorder recorder;
    s.model->set_probe([&](int i) { recorder.mark("forward b" + std::to_string(i)); });
    for (int round = 0; round < 2; ++round) {
      const Batch local = chain_batch(50 + round).slice(ctx.rank(), ctx.world_size());
      torch::NoGradGuard no_grad;
      recorder.take();
      s.root->reset_runtime_stats();
      at::Tensor out = call_module(*s.model, local.x);
      EXPECT_EQ(s.root->runtime_stats().all_gathers, s.forward_gathers(Chain::kBlocks)) << "round " << round;
      if (ctx.world_size() > 1) {
        EXPECT_EQ(recorder.take(), events({"gather b0", "gather b1", "forward b0", "gather b2", "forward b1",
                                           "gather b3", "forward b2", "forward b3"}))
            << "round " << round;
      }
      expect_close(out, s.reference->forward(local.x), "no_grad output");
      EXPECT_EQ(s.root->unsharded_bytes(), 0) << "round " << round;
      for (size_t i = 0; i < s.blocks.size(); ++i) EXPECT_EQ(s.blocks[i].unsharded_bytes(), 0) << "block " << i;
    }
    // Training goes on as before.
    s.model->set_probe({});
    s.forward_backward(1);
    s.step();
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// An explicit set_modules_to_forward_prefetch replaces the implicit prefetch
// of the module it is set on (b0 prefetches b2, not b1), the others keep
// theirs, and nothing is gathered twice.
TEST_P(ForwardPrefetch, ExplicitForwardPrefetchReplacesTheImplicitOne) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    s.blocks[0].set_modules_to_forward_prefetch({s.blocks[2]});
    const bool sharded = ctx.world_size() > 1;
    Recorder recorder;
    s.model->set_probe([&](int i) { recorder.mark("forward b" + std::to_string(i)); });
    for (int step = 0; step < 3; ++step) {
      recorder.take();
      const auto [forward, backward] = s.forward_backward(step);
      EXPECT_EQ(forward, s.forward_gathers(Chain::kBlocks)) << "step " << step;
      EXPECT_EQ(backward, s.backward_gathers(Chain::kBlocks)) << "step " << step;
      std::vector<std::string> forward_events = recorder.take();
      forward_events.resize(std::find(forward_events.begin(), forward_events.end(), "forward b3") -
                            forward_events.begin() + 1);
      if (step == 0 || !sharded) {
        // b0's explicit prefetch only; at world size 1 the explicit
        // prefetch still runs (a view switch), the implicit one never.
        EXPECT_EQ(forward_events, events({"gather b0", "gather b2", "forward b0", "gather b1", "forward b1",
                                          "forward b2", "gather b3", "forward b3"}))
            << "step " << step;
      } else {
        // The root prefetches b0 and b2 prefetches b3 implicitly; b0
        // prefetches b2 explicitly; b1's implicit target (b2) is in flight.
        EXPECT_EQ(forward_events, events({"gather b0", "gather b2", "forward b0", "gather b1", "forward b1",
                                          "gather b3", "forward b2", "forward b3"}))
            << "step " << step;
      }
      s.step();
    }
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// A forward that throws inside b1, after b1's pre-forward prefetched b2:
// reset_iter_state completes that all-gather and reshards everything, and
// training goes on equal to the reference, gathering each group once.
TEST_P(ForwardPrefetch, ResetIterStateAfterAThrowWithAPrefetchInFlight) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    s.forward_backward(0);
    s.step();
    s.model->set_probe([](int i) { TORCH_CHECK(i != 1, "planted failure in b1"); });
    const Batch local = chain_batch(1).slice(ctx.rank(), ctx.world_size());
    s.root->reset_runtime_stats();
    EXPECT_THROW_WITH(call_module(*s.model, local.x), "planted failure in b1");
    // The root, b0 and b1 gathered, b2 prefetched (the next in the last
    // order) when b1's forward threw.
    EXPECT_EQ(s.root->runtime_stats().all_gathers, ctx.world_size() == 1 ? 0 : 4);
    s.root->reset_iter_state();
    EXPECT_EQ(s.root->unsharded_bytes(), 0);
    for (size_t i = 0; i < s.blocks.size(); ++i) EXPECT_EQ(s.blocks[i].unsharded_bytes(), 0) << "block " << i;
    s.model->set_probe({});
    for (int step = 1; step < 3; ++step) {
      const auto [forward, backward] = s.forward_backward(step);
      EXPECT_EQ(forward, s.forward_gathers(Chain::kBlocks)) << "step " << step;
      EXPECT_EQ(backward, s.backward_gathers(Chain::kBlocks)) << "step " << step;
      s.step();
    }
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// The same with an explicit prefetch (b0 prefetches b2) in flight when b1
// throws, the case that also holds with streams (the stream-order runs,
// where the implicit prefetch pipelines instead): reset_iter_state must
// order the stream that allocated the all-gather's buffers after the
// collective before they go back to the allocator, not only the caller's.
TEST_P(ForwardPrefetch, ResetIterStateAfterAThrowWithAnExplicitPrefetchInFlight) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    s.forward_backward(0);
    s.step();
    s.blocks[0].set_modules_to_forward_prefetch({s.blocks[2]});
    s.model->set_probe([](int i) { TORCH_CHECK(i != 1, "planted failure in b1"); });
    const Batch local = chain_batch(1).slice(ctx.rank(), ctx.world_size());
    EXPECT_THROW_WITH(call_module(*s.model, local.x), "planted failure in b1");
    s.root->reset_iter_state();
    EXPECT_EQ(s.root->unsharded_bytes(), 0);
    for (size_t i = 0; i < s.blocks.size(); ++i) EXPECT_EQ(s.blocks[i].unsharded_bytes(), 0) << "block " << i;
    s.model->set_probe({});
    for (int step = 1; step < 3; ++step) {
      s.forward_backward(step);
      s.step();
    }
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

// After training with the full order [root, b0, b1, b2, b3], a forward that
// skips the two middle blocks issues exactly these all-gathers: the root's,
// b0 (prefetched by the root), b1 (prefetched by b0, which still stands at
// its position of the last order; b1 does not run and its all-gather is
// dropped) and b3's own. b3 stands at position 2, where the last order had
// b1, so it prefetches nothing: following the last order from there would
// gather b2, another block that does not run. The next full forward
// follows the skipped order (b0 prefetches b3 early) and gathers every
// group once; training matches the reference throughout.
class ForwardPrefetchAfterSkip : public ::testing::TestWithParam<int> {};

TEST_P(ForwardPrefetchAfterSkip, SkippingTwoMiddleBlocksPrefetchesOnlyFromTheUnchangedPrefix) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    Rig s(ctx);
    Recorder recorder;
    s.model->set_probe([&](int i) { recorder.mark("forward b" + std::to_string(i)); });
    // The forward's events, up to the last block's forward mark (backward's
    // all-gathers follow it).
    auto forward_events = [&](const char* last) {
      std::vector<std::string> all = recorder.take();
      all.resize(std::find(all.begin(), all.end(), last) - all.begin() + 1);
      return all;
    };
    int step = 0;
    for (; step < 2; ++step) {
      s.forward_backward(step);
      s.step();
    }

    s.model->skip = {1, 2};
    s.reference->skip = {1, 2};
    recorder.take();
    const auto [forward, backward] = s.forward_backward(step);
    EXPECT_EQ(forward_events("forward b3"),
              events({"gather b0", "gather b1", "forward b0", "gather b3", "forward b3"}));
    EXPECT_EQ(forward, 4) << "root, b0, b1 (prefetched, unused) and b3";
    EXPECT_EQ(backward, 2) << "b0 and b3 again; b1's prefetched all-gather was dropped";
    s.step();
    ++step;

    s.model->skip = {};
    s.reference->skip = {};
    recorder.take();
    const auto [full_forward, full_backward] = s.forward_backward(step);
    EXPECT_EQ(forward_events("forward b3"), events({"gather b0", "gather b3", "forward b0", "gather b1", "forward b1",
                                                    "gather b2", "forward b2", "forward b3"}));
    EXPECT_EQ(full_forward, s.forward_gathers(Chain::kBlocks));
    EXPECT_EQ(full_backward, s.backward_gathers(Chain::kBlocks));
    s.step();
    expect_params_match(*s.model, *s.reference, ctx.mesh());
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ForwardPrefetchAfterSkip, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) { return "ws" + std::to_string(info.param); });

INSTANTIATE_TEST_SUITE_P(WorldSizes, ForwardPrefetch, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "ws" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
