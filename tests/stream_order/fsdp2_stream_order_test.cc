// The runtime's CUDA stream order, checked on CPU by the stream-order checker
// (stream_check.h, docs/gpu.md): each test runs the code paths taken with
// streams (copy-in, all-gather, reduce-scatter and all-reduce streams,
// events, record_stream, collectives on their own streams) on real ranks,
// compares the result with an unsharded reference and fails on any access a
// GPU could reorder. Each scenario below reproduced an ordering bug of the
// runtime before it was fixed (docs/gpu.md, "What the checker found").
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdio>

#include "stream_order_util.h"
#include "torch_save_load.h"  // tests/fsdp2

namespace fsdp::test {
namespace {

constexpr int64_t kRows = kStreamOrderRows;

c10::Stream current_stream() {
  const c10::impl::VirtualGuardImpl impl(c10::kCPU);
  return impl.getStream(impl.getDevice());
}

// `waiter` waits for the work enqueued on `stream` so far.
void wait_stream(const c10::Stream& waiter, const c10::Stream& stream) {
  c10::Event e(c10::kCPU);
  e.record(stream);
  e.block(waiter);
}

// Steps of AdamW on the sharded model and on the reference, the losses and
// parameters compared; `step_optim` runs the sharded model's step and
// zero_grad (on a user stream, say).
void train_and_compare(testing::RankContext& ctx, Sharded& s, int steps,
                       const std::function<void(torch::optim::Optimizer&)>& step_optim = {},
                       const std::function<void()>& before_compare = {}) {
  auto reference = make_model(ModelKind::kTransformer);
  auto optim = make_optimizer(Optim::kAdamW, s.model->parameters());
  auto ref_optim = make_optimizer(Optim::kAdamW, reference->parameters());
  for (int step = 0; step < steps; ++step) {
    const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
    ref_optim->zero_grad();
    at::Tensor ref_loss = reference->forward(batch.x, batch.y);
    ref_loss.backward();
    ref_optim->step();
    if (!step_optim) optim->zero_grad();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = call_module(*s.model, local.x, local.y);
    loss.backward();
    if (step_optim) {
      step_optim(*optim);
    } else {
      optim->step();
    }
    EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(), 1e-5) << "step " << step;
  }
  if (before_compare) before_compare();
  expect_params_match(*s.model, *reference, ctx.mesh(), 1e-4, 1e-5);
}

// Three SGD steps of an MLP-shaped model (sharded) and of its reference on
// the global batch, whose loss is scaled by `reference_loss_scale`; the
// parameters compared.
void train_mlp_and_compare(testing::RankContext& ctx, LossModel& model, LossModel& reference,
                           double reference_loss_scale = 1.0) {
  torch::optim::SGD optim(model.parameters(), 0.1);
  torch::optim::SGD ref_optim(reference.parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    const Batch batch = make_batch(ModelKind::kMlp, step, kRows);
    ref_optim.zero_grad();
    (reference.forward(batch.x, batch.y) * reference_loss_scale).backward();
    ref_optim.step();
    optim.zero_grad();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    call_module(model, local.x, local.y).backward();
    optim.step();
  }
  expect_params_match(model, reference, ctx.mesh());
}

class StreamOrder : public ::testing::TestWithParam<int> {};

// Finding 1: the reduce-scatter input was freed against an event recorded
// before the reduce-scatter's stream followed the collective.
TEST_P(StreamOrder, TrainingHasNoRace) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    Sharded s = shard_transformer(ctx);
    train_and_compare(ctx, s, 3);
    expect_no_races(checker);
  });
}

TEST_P(StreamOrder, NoReshardAfterForwardAndMixedPrecisionHaveNoRace) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    FullyShardOptions o;
    o.reshard_after_forward = false;
    o.mp_policy.param_dtype = at::kDouble;  // exact enough to compare, and a cast on every copy-in
    o.mp_policy.reduce_dtype = at::kFloat;
    Sharded s = shard_transformer(ctx, o);
    train_and_compare(ctx, s, 2);
    expect_no_races(checker);
  });
}

// Finding 4: at one shard rank the compute reads the shards directly, so it
// must wait for the optimizer's event too, not only the all-gather streams.
TEST_P(StreamOrder, OptimizerOnAUserStreamWithPostOptimEvent) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    const c10::Stream optim_stream = checker.new_stream("optimizer (user)");
    Sharded s = shard_transformer(ctx);
    train_and_compare(
        ctx, s, 3,
        [&](torch::optim::Optimizer& optim) {
          wait_stream(optim_stream, current_stream());
          {
            c10::StreamGuard guard(optim_stream);
            optim.step();
            // Zeroed in place on this stream: freeing them (set_to_none)
            // on the host would let the reduce-scatter stream, which made
            // them, reuse them while this stream may still read them.
            optim.zero_grad(/*set_to_none=*/false);
          }
          auto event = std::make_shared<c10::Event>(c10::kCPU);
          event->record(optim_stream);
          s.root->set_post_optim_event(event);
        },
        // The program reads the last step's parameters on its own stream.
        [&] { wait_stream(current_stream(), optim_stream); });
    expect_no_races(checker);
  });
}

// SGD on each parameter as soon as its sharded gradient exists (FSDP2's
// optimizer in backward), the gradient then dropped.
struct SgdInBackward : torch::autograd::PostAccumulateGradHook {
  void operator()(const torch::autograd::Variable& p) override {
    c10::NoGradGuard no_grad;
    p.detach().add_(p.grad(), -0.05);
    p.mutable_grad() = at::Tensor();
  }
};

// Finding 2: the hooks' updates ran on the reduction stream after the event
// that the next forward's copy-in waits for was recorded.
void expect_optimizer_in_backward_has_no_race(testing::RankContext& ctx) {
  stream_check::Checker checker;
  auto reference = make_model(ModelKind::kTransformer);
  Sharded s = shard_transformer(ctx);
  for (auto& p : reference->parameters())
    torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<SgdInBackward>());
  for (auto& p : s.model->parameters())
    torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<SgdInBackward>());
  for (int step = 0; step < 3; ++step) {
    const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
    reference->forward(batch.x, batch.y).backward();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    call_module(*s.model, local.x, local.y).backward();
  }
  expect_params_match(*s.model, *reference, ctx.mesh(), 1e-4, 1e-5);
  expect_no_races(checker);
}

TEST_P(StreamOrder, OptimizerInBackward) {
  testing::run_distributed(GetParam(), expect_optimizer_in_backward_has_no_race);
}

// Finding 5: after torch::load the copy-in read the loaded tensor on the
// copy-in stream, and it was then freed on the host with no record_stream.
TEST_P(StreamOrder, TorchLoadIsAdoptedWithoutRace) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    Sharded trained = shard_transformer(ctx);
    train_and_compare(ctx, trained, 1);
    Sharded loaded = shard_transformer(ctx);
    torch_save_and_load(trained.model, loaded.model, "stream_order");
    const Batch batch = make_batch(ModelKind::kTransformer, 5, kRows);
    c10::NoGradGuard no_grad;
    EXPECT_EQ(call_module(*loaded.model, batch.x, batch.y).item<double>(),
              call_module(*trained.model, batch.x, batch.y).item<double>());
    expect_no_races(checker);
  });
}

// b1 computes on b0's output detached: b0's backward never runs, so the
// backward prefetch of b0 (made when b1's backward starts) is never used.
struct DetachedFirstBlock : LossModel {
  DetachedFirstBlock()
      : b0(register_module("b0", MLPBlock(7, 13))),
        b1(register_module("b1", MLPBlock(13, 10))),
        head(register_module("head", torch::nn::Linear(10, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) override {
    return torch::nn::functional::mse_loss(head(b1(b0(x).detach())), y);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() override { return {b0.ptr(), b1.ptr()}; }
  MLPBlock b0, b1;
  torch::nn::Linear head;
};

// Finding 6: an all-gather nothing waited for was completed on the current
// stream and its output (the copy-in stream's block) dropped, with the
// copy-in stream never ordered after the collective.
TEST_P(StreamOrder, UnusedBackwardPrefetchIsReleasedInOrder) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    torch::manual_seed(0);
    auto reference = std::make_shared<DetachedFirstBlock>();
    torch::manual_seed(0);
    auto model = std::make_shared<DetachedFirstBlock>();
    for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
    fully_shard(model, mesh_options(ctx));
    train_mlp_and_compare(ctx, *model, *reference);
    expect_no_races(checker);
  });
}

// The hook runs on the user's stream after the reduction; its write to the
// reduced gradient is ordered before the gradient becomes .grad.
TEST_P(StreamOrder, AllReduceHookOnAUserStream) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    const c10::Stream hook_stream = checker.new_stream("all-reduce hook (user)");
    auto reference = make_model(ModelKind::kMlp);
    auto model = make_model(ModelKind::kMlp);
    std::vector<FSDPModule> modules;
    for (auto& b : model->blocks()) modules.push_back(fully_shard(b, mesh_options(ctx)));
    modules.push_back(fully_shard(model, mesh_options(ctx)));
    for (auto& m : modules) m.set_all_reduce_hook([](at::Tensor& g) { g.mul_(0.5); }, hook_stream);
    train_mlp_and_compare(ctx, *model, *reference, /*reference_loss_scale=*/0.5);
    expect_no_races(checker);
  });
}

// A forward that throws half-way with all-gathers in flight, then
// reset_iter_state and ordinary training.
TEST_P(StreamOrder, ResetIterStateAfterAThrow) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    stream_check::Checker checker;
    Sharded s = shard_transformer(ctx);
    const Batch batch = make_batch(ModelKind::kTransformer, 0, kRows);
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    at::Tensor bad_targets = at::full_like(local.y, Transformer::kVocab + 5);  // cross_entropy throws
    EXPECT_ANY_THROW(call_module(*s.model, local.x, bad_targets));
    s.root->reset_iter_state();
    train_and_compare(ctx, s, 2);
    expect_no_races(checker);
  });
}

// HSDP (the all-reduce stream after the reduce-scatter stream) and
// reshard_after_forward = 2 (the post-forward shard made on the compute
// stream, read by the next copy-in), on 4 ranks.
TEST(StreamOrderFourRanks, HsdpAndReshardToHalfTheWorld) {
  for (bool hsdp : {true, false}) {
    const testing::DistributedTestOptions options =
        rank_options(4, hsdp ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{});
    testing::run_distributed(options, [hsdp](testing::RankContext& ctx) {
      stream_check::Checker checker;
      FullyShardOptions o;
      if (!hsdp) o.reshard_after_forward = ReshardAfterForward(2);
      Sharded s = shard_transformer(ctx, o);
      train_and_compare(ctx, s, 3);
      expect_no_races(checker);
    });
  }
  // HSDP with the optimizer in backward: the hooks run on the all-reduce
  // stream, which only the post-reduce event orders before the next forward.
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, expect_optimizer_in_backward_has_no_race);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StreamOrder, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
