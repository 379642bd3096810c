// The runtime's memory bounds and FSDP2 semantics that numbers alone do not
// show: which buffers are alive when (counted by an allocator), in which
// dtype gradients are reduced and accumulated, how many bytes a re-gather
// moves, the backward prefetch order, and the setters' scopes. Each against
// an unsharded reference on 1-4 real ranks where a value is involved.
#include <mutex>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "counting_allocator.h"
#include "fsdp2/clip_grad.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// `n` blocks of Linear(64, 64) + tanh; `probe(i)` runs when the gradient
// with respect to block i's input is ready, i.e. right after block i's
// post-backward.
struct Chain : torch::nn::Module {
  explicit Chain(int n) {
    for (int i = 0; i < n; ++i) blocks.push_back(register_module("b" + std::to_string(i), MLPBlock(kDim, kDim)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (probe && h.requires_grad()) h.register_hook([this, i](const at::Tensor&) { probe(static_cast<int>(i)); });
      h = blocks[i](h);
    }
    return h;
  }
  static constexpr int64_t kDim = 64;
  std::vector<MLPBlock> blocks;
  std::function<void(int)> probe;
};

std::shared_ptr<Chain> seeded_chain(int n) {
  torch::manual_seed(0);
  return std::make_shared<Chain>(n);
}

// Bytes of one Chain block's padded parameters over `world` ranks, per
// element of `elem` bytes: what its all-gather output and its
// reduce-scatter input hold.
size_t chain_block_bytes(int64_t world, size_t elem) {
  const int64_t rows = ceil_div(Chain::kDim, world);
  return static_cast<size_t>(world * rows * (Chain::kDim + 1)) * elem;
}

FullyShardOptions bf16_fp32(testing::RankContext& ctx) {
  FullyShardOptions o = mesh_options(ctx);
  o.mp_policy.param_dtype = at::kBFloat16;
  o.mp_policy.reduce_dtype = at::kFloat;
  return o;
}

class Runtime : public ::testing::TestWithParam<int> {};
// World sizes 2 to 4 only (see the test).
class RuntimeMultiRank : public ::testing::TestWithParam<int> {};

// [Note: bounded reductions]. bf16 parameters and an fp32 reduction make a
// block's reduce-scatter input (fp32, world * padded) the only buffer of its
// size, so the allocator counts exactly how many groups' unreduced
// gradients are alive. (At one rank the reduce-scatter output, kept as the
// sharded gradient, has that size too, hence 2 to 4 ranks.)
TEST_P(RuntimeMultiRank, AtMostTwoGroupsOfUnreducedGradientsAreAlive) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    ScopedCountingAllocator counter;
    auto model = seeded_chain(6);
    for (auto& b : model->blocks) fully_shard(b, bf16_fp32(ctx));
    fully_shard(model, bf16_fp32(ctx));
    const size_t rs_input_bytes = chain_block_bytes(ctx.world_size(), sizeof(float));
    std::vector<std::pair<int, int64_t>> alive;
    int64_t base = 0;
    // Once the collectives issued so far are done: Gloo's own buffers are
    // freed and its worker threads dropped their references (see
    // settled_live); what is left is what the runtime holds.
    model->probe = [&](int block) { alive.emplace_back(block, counter.settled_live(rs_input_bytes, base + 1)); };
    for (int step = 0; step < 2; ++step) {
      alive.clear();
      at::Tensor x = at::randn({8, Chain::kDim}).requires_grad_();
      at::Tensor loss = call_module(*model, x).to(at::kFloat).pow(2).mean();
      // Buffers of that size from elsewhere, if any.
      base = counter.settled_live(rs_input_bytes, 0);
      loss.backward();
      ASSERT_EQ(alive.size(), 6u);
      for (const auto& [block, count] : alive) {
        EXPECT_GE(count - base, 1) << "block " << block << "'s reduce-scatter input is alive until it is completed";
        EXPECT_LE(count - base, 2) << "unreduced gradients of " << count - base << " groups alive after block " << block
                                   << "'s post-backward";
      }
      EXPECT_EQ(counter.settled_live(rs_input_bytes, base), base)
          << "every reduce-scatter input is freed by the end of backward";
    }
  });
}

// FSDP2 frees the last all-gather output at the root's post-forward (and
// when backward starts), not through the loss and the optimizer step; a
// sharded submodule called on its own does the root's work, this included.
TEST_P(Runtime, LastAllGatherOutputIsFreedAfterForward) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    ScopedCountingAllocator counter;
    auto model = seeded_chain(3);
    auto reference = seeded_chain(3);
    for (auto& b : model->blocks) fully_shard(b, bf16_fp32(ctx));
    fully_shard(model, bf16_fp32(ctx));
    // bf16 all-gather outputs: no other buffer before backward has the size.
    const size_t ag_output_bytes = chain_block_bytes(ctx.world_size(), 2);
    at::Tensor x = at::randn({8, Chain::kDim});
    at::Tensor out = call_module(*model, x);
    EXPECT_EQ(counter.settled_live(ag_output_bytes, 0), 0) << "after the root's forward";
    out.to(at::kFloat).sum().backward();
    // Reduce-scatter outputs (the sharded gradients) may have that size.
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();

    // An inner block on its own, as in evaluating part of the model.
    at::Tensor z = at::randn({5, Chain::kDim});
    at::Tensor inner = call_module(*model->blocks[1], z);
    EXPECT_EQ(counter.settled_live(ag_output_bytes, 0), 0) << "after an inner block's own forward";
    expect_close(inner.to(at::kFloat), reference->blocks[1]->forward(z), "inner block output (bf16)", 2e-2, 2e-2);
  });
}

// A sharded submodule evaluated on its own after training steps computes
// with the trained parameters (FSDP2 runs the root's pre-forward from
// whichever state is called first).
TEST_P(Runtime, InnerBlockCalledOnItsOwnAfterTrainingMatchesTheReference) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = seeded_chain(3);
    auto reference = seeded_chain(3);
    for (auto& b : model->blocks) fully_shard(b, mesh_options(ctx));
    fully_shard(model, mesh_options(ctx));
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + step);
      at::Tensor x = at::randn({8, Chain::kDim}, gen);
      ref_optim.zero_grad();
      reference->forward(x).pow(2).mean().backward();
      ref_optim.step();
      optim.zero_grad();
      // The global mean's share of this rank's rows (gradients are averaged).
      call_module(*model, rank_slice(x, ctx.rank(), ctx.world_size()))
          .pow(2)
          .sum()
          .mul(static_cast<double>(ctx.world_size()) / static_cast<double>(x.numel()))
          .backward();
      optim.step();
    }
    at::Tensor z = at::randn({5, Chain::kDim});
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE(pass == 0 ? "grad mode" : "no grad");
      std::optional<c10::NoGradGuard> no_grad;
      if (pass == 1) no_grad.emplace();
      expect_close(call_module(*model->blocks[1], z), reference->blocks[1]->forward(z), "blocks[1] alone");
      EXPECT_EQ(fsdp_module_of(*model->blocks[1])->unsharded_bytes(), 0);
    }
    expect_params_match(*model, *reference, ctx.mesh());
  });
}

// The all-gathered embedding is not needed by its backward, so it is not
// unsharded then; its weight still gets a (full) gradient, reduced as any
// other (pytorch#137922).
struct EmbedImpl : torch::nn::Module {
  EmbedImpl() : table(register_module("table", torch::nn::Embedding(17, 6))) {}
  at::Tensor forward(const at::Tensor& tokens) { return table(tokens); }
  torch::nn::Embedding table;
};
FSDP2CPP_MODULE(Embed);

struct EmbedModel : torch::nn::Module {
  EmbedModel() : embed(register_module("embed", Embed())), head(register_module("head", torch::nn::Linear(6, 3))) {}
  at::Tensor forward(const at::Tensor& tokens) { return head(at::tanh(embed(tokens))); }
  Embed embed;
  torch::nn::Linear head;
};

// The table sharded on dim 0, and on dim 1 (shard_placement_fn), where
// autograd's full gradient does not have the sharded parameter's strides (6
// columns: at 4 ranks one rank's chunk is empty).
TEST_P(Runtime, NoUnshardInBackwardStillReducesTheGradientsItGets) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (int64_t dim : {0, 1}) {
      SCOPED_TRACE("table sharded on dim " + std::to_string(dim));
      torch::manual_seed(0);
      auto model = std::make_shared<EmbedModel>();
      torch::manual_seed(0);
      auto reference = std::make_shared<EmbedModel>();
      FullyShardOptions embed_options = mesh_options(ctx);
      embed_options.shard_placement_fn = [dim](const at::Tensor&) -> std::optional<Placement> {
        return Placement::shard(dim);
      };
      FSDPModule embed = fully_shard(model->embed, embed_options);
      embed.set_unshard_in_backward(false);
      fully_shard(model, mesh_options(ctx));
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.5));
      torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.5));
      for (int step = 0; step < 3; ++step) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(70 + step);
        at::Tensor tokens = at::randint(17, {8, 5}, gen);
        at::Tensor y = at::randn({8, 5, 3}, gen);
        ref_optim.zero_grad();
        at::mse_loss(reference->forward(tokens), y).backward();
        ref_optim.step();
        optim.zero_grad();
        const int64_t w = ctx.world_size();
        at::Tensor out = call_module(*model, rank_slice(tokens, ctx.rank(), w));
        // Sum of squares over the global batch's elements, as mse_loss's mean.
        ((out - rank_slice(y, ctx.rank(), w)).pow(2).sum() * (static_cast<double>(w) / y.numel())).backward();
        EXPECT_EQ(embed.unsharded_bytes(), 0);
        optim.step();
      }
      auto ref_params = reference->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const at::Tensor& expected = ref_params[item.key()];
        const at::Tensor full = DTensor::from_local(item.value().detach().contiguous(), ctx.mesh(),
                                                    {Placement::shard(item.key() == "embed.table.weight" ? dim : 0)},
                                                    expected.sizes().vec())
                                    .full_tensor();
        expect_close(full, expected.detach(), item.key());
      }
    }
  });
}

// Reduction dtype: bf16 parameters with an fp32 reduction reduce (and
// accumulate without sync) in fp32, so the sharded gradients equal the
// fp32 average of each rank's bf16 gradients (micro-batches summed in fp32)
// to fp32 rounding; a bf16 reduction or accumulation is off by bf16's
// 2^-8.
TEST_P(Runtime, Bf16ParametersReduceAndAccumulateInFp32) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int64_t world = ctx.world_size();
    for (int micro_batches : {1, 16}) {
      SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
      auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
      auto compute = make_model(ModelKind::kMlp);
      compute->to(at::kBFloat16);
      std::vector<FSDPModule> modules;
      for (auto& b : model->blocks()) modules.push_back(fully_shard(b, bf16_fp32(ctx)));
      FSDPModule root = fully_shard(model, bf16_fp32(ctx));
      modules.push_back(root);
      std::vector<c10::ScalarType> hook_dtypes;
      for (auto& m : modules) m.set_all_reduce_hook([&](at::Tensor& t) { hook_dtypes.push_back(t.scalar_type()); });
      std::map<std::string, at::Tensor> expected;
      for (int mb = 0; mb < micro_batches; ++mb) {
        const Batch local = make_batch(ModelKind::kMlp, mb, 12).slice(ctx.rank(), world);
        for (auto& p : compute->parameters()) p.mutable_grad() = at::Tensor();
        compute->forward(local.x.to(at::kBFloat16), local.y.to(at::kBFloat16)).backward();
        for (const auto& item : compute->named_parameters()) {
          at::Tensor g = item.value().grad().to(at::kFloat);
          expected[item.key()] = expected.count(item.key()) ? expected[item.key()] + g : g;
        }
        const bool last = mb == micro_batches - 1;
        root.set_requires_gradient_sync(last);
        if (last) root.reset_runtime_stats();
        call_module(*model, local.x, local.y).backward();
      }
      int64_t expected_bytes = 0;
      // Groups: b0 (fc 13x7 + 13), b1 (fc 10x13 + 10), root (head 3x10 + 3).
      for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{13, 7}, {10, 13}, {3, 10}}) {
        expected_bytes += world * ceil_div(rows, world) * (cols + 1) * static_cast<int64_t>(sizeof(float));
      }
      EXPECT_EQ(root.runtime_stats().reduce_scatter_bytes, expected_bytes) << "4 bytes per reduced element";
      ASSERT_EQ(hook_dtypes.size(), modules.size());
      for (auto d : hook_dtypes) EXPECT_EQ(d, at::kFloat);
      for (auto& item : expected) {
        ctx.world_group()->all_reduce(item.second, collectives::ReduceOp::sum()).wait();
        item.second.div_(world);
      }
      for (const auto& item : model->named_parameters()) {
        const at::Tensor& ref = expected.at(item.key());
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        EXPECT_EQ(item.value().grad().scalar_type(), at::kFloat);
        expect_close(full_param(item.value().grad(), ref.sizes().vec(), ctx.mesh()), ref, item.key() + ".grad",
                     /*rtol=*/2e-5, /*atol=*/1e-6);
      }
    }
  });
}

// A parameter's post-accumulate-grad hook (optimizer-in-backward) sees the
// sharded parameter with its reduced sharded gradient, once per backward.
struct RecordingHook : torch::autograd::PostAccumulateGradHook {
  explicit RecordingHook(std::vector<std::pair<std::vector<int64_t>, at::Tensor>>* calls) : calls(calls) {}
  void operator()(const torch::autograd::Variable& p) override {
    calls->emplace_back(p.sizes().vec(), p.grad().defined() ? p.grad().clone() : at::Tensor());
  }
  std::vector<std::pair<std::vector<int64_t>, at::Tensor>>* calls;
};

TEST_P(Runtime, PostAccumulateGradHooksSeeTheShardedGradient) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    auto reference = make_model(ModelKind::kMlp);
    for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
    fully_shard(model, mesh_options(ctx));
    std::vector<std::pair<std::vector<int64_t>, at::Tensor>> block_calls, root_calls;
    at::Tensor block_weight = model->b0->fc->weight;
    at::Tensor root_weight = model->head->weight;
    torch::autograd::impl::set_post_acc_grad_hooks(block_weight, std::make_unique<RecordingHook>(&block_calls));
    torch::autograd::impl::set_post_acc_grad_hooks(root_weight, std::make_unique<RecordingHook>(&root_calls));
    const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
    reference->forward(batch.x, batch.y).backward();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    call_module(*model, local.x, local.y).backward();
    auto ref_params = reference->named_parameters();
    for (auto [calls, name, param] : {std::tuple{&block_calls, "b0.fc.weight", block_weight},
                                      std::tuple{&root_calls, "head.weight", root_weight}}) {
      ASSERT_EQ(calls->size(), 1u) << name;
      EXPECT_EQ(calls->front().first, param.sizes().vec()) << name << ": the hook sees the sharded parameter";
      ASSERT_TRUE(calls->front().second.defined()) << name;
      expect_close(calls->front().second, param.grad(), std::string(name) + " hook grad");
      const at::Tensor& ref_grad = ref_params[name].grad();
      expect_close(full_param(calls->front().second, ref_grad.sizes().vec(), ctx.mesh()), ref_grad, name);
    }
  });
}

// Setters as in FSDP2: the divide factor and force-sum apply to the
// module's own group; the all-reduce hook runs before the local division.
TEST_P(Runtime, DivideFactorAppliesToItsOwnGroupAndTheHookSeesTheSum) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int64_t world = ctx.world_size();
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    auto reference = make_model(ModelKind::kMlp);
    FSDPModule b0 = fully_shard(model->b0, mesh_options(ctx));
    FSDPModule b1 = fully_shard(model->b1, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    root.set_gradient_divide_factor(0.5);  // root's group: gradients * 2W
    b1.set_force_sum_reduction_for_comms(true);
    at::Tensor seen;
    b1.set_all_reduce_hook([&](at::Tensor& reduced) { seen = reduced.clone(); });
    const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
    reference->forward(batch.x, batch.y).backward();
    const Batch local = batch.slice(ctx.rank(), world);
    call_module(*model, local.x, local.y).backward();
    for (const auto& item : reference->named_parameters()) {
      const double scale = item.key().rfind("head.", 0) == 0 ? 2.0 * world : 1.0;
      const at::Tensor sharded = model->named_parameters()[item.key()];  // a copy: the dict is a temporary
      expect_close(full_param(sharded.grad(), item.value().sizes().vec(), ctx.mesh()), item.value().grad() * scale,
                   item.key());
    }
    // b1's buffer starts with fc.weight's chunk: the hook saw the sum.
    const at::Tensor& w = model->b1->fc->weight;
    ASSERT_TRUE(seen.defined());
    expect_close(seen.narrow(0, 0, w.numel()), w.grad().reshape({-1}) * static_cast<double>(world),
                 "hook buffer before division");
  });
}

// set_reshard_after_forward on the root before its first forward is kept.
TEST_P(Runtime, RootReshardAfterForwardSetBeforeFirstForwardIsKept) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    root.set_reshard_after_forward(true, /*recurse=*/false);
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    at::Tensor loss = call_module(*model, local.x, local.y);
    EXPECT_EQ(root.unsharded_bytes(), 0);
    loss.backward();
    EXPECT_TRUE(model->head->weight.grad().defined());
  });
}

// The phases of one backward, by their profiler labels.
class PhaseRecorder {
 public:
  PhaseRecorder() {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          std::string name = fn.name();
          if (name.rfind("FSDP::", 0) == 0) {
            std::lock_guard<std::mutex> lock(mutex());
            names().push_back(std::move(name));
          }
          return nullptr;
        }).scopes({at::RecordScope::USER_SCOPE}));
  }
  ~PhaseRecorder() { at::removeCallback(handle_); }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex());
    names().clear();
  }
  // The recorded labels that start with one of `prefixes`, in order.
  std::vector<std::string> filtered(const std::vector<std::string>& prefixes) {
    std::lock_guard<std::mutex> lock(mutex());
    std::vector<std::string> result;
    for (const auto& n : names()) {
      for (const auto& p : prefixes) {
        if (n.rfind(p, 0) == 0) {
          result.push_back(n);
          break;
        }
      }
    }
    return result;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::string>& names() {
    static std::vector<std::string> v;
    return v;
  }
  at::CallbackHandle handle_;
};

// Implicit backward prefetch: each module's backward issues the all-gather
// of the module whose forward ran just before its own.
TEST_P(Runtime, ImplicitBackwardPrefetchOrder) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
    fully_shard(model, mesh_options(ctx));
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    PhaseRecorder recorder;
    at::Tensor loss = call_module(*model, local.x, local.y);
    recorder.clear();
    loss.backward();
    const std::vector<std::string> expected{"FSDP::pre_backward (root)",      "FSDP::backward_prefetch for b1",
                                            "FSDP::all_gather (b1)",          "FSDP::pre_backward (b1)",
                                            "FSDP::backward_prefetch for b0", "FSDP::all_gather (b0)",
                                            "FSDP::pre_backward (b0)"};
    EXPECT_EQ(recorder.filtered({"FSDP::pre_backward", "FSDP::backward_prefetch", "FSDP::all_gather ("}), expected);
  });
}

// clip_grad_norm_ with the infinity norm: the largest gradient element over
// every rank, and the gradients scaled as the unsharded ones.
TEST_P(Runtime, ClipGradNormInfinityNorm) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    auto reference = make_model(ModelKind::kMlp);
    for (auto& b : model->blocks()) fully_shard(b, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
    reference->forward(batch.x, batch.y).backward();
    const Batch local = batch.slice(ctx.rank(), ctx.world_size());
    call_module(*model, local.x, local.y).backward();
    double ref_max = 0;
    for (const auto& p : reference->parameters()) ref_max = std::max(ref_max, p.grad().abs().max().item<double>());
    const double max_norm = ref_max / 4;
    const double total = clip_grad_norm_(root, max_norm, std::numeric_limits<double>::infinity());
    EXPECT_NEAR(total, ref_max, 1e-6 * ref_max);
    const double coef = max_norm / (ref_max + 1e-6);
    for (const auto& item : reference->named_parameters()) {
      const at::Tensor sharded = model->named_parameters()[item.key()];  // a copy: the dict is a temporary
      expect_close(full_param(sharded.grad(), item.value().sizes().vec(), ctx.mesh()), item.value().grad() * coef,
                   item.key());
    }
  });
}

// After an exception inside a block's forward, reset_iter_state() makes the
// next step behave as if the failed one never ran.
struct FailingChain : torch::nn::Module {
  FailingChain()
      : b0(register_module("b0", MLPBlock(7, 13))),
        b1(register_module("b1", MLPBlock(13, 10))),
        head(register_module("head", torch::nn::Linear(10, 3))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = b0(x);
    TORCH_CHECK(!fail, "planted failure after b0");
    return head(b1(h));
  }
  MLPBlock b0, b1;
  torch::nn::Linear head;
  bool fail = false;
};

TEST_P(Runtime, ResetIterStateAfterAnExceptionMidForward) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    torch::manual_seed(0);
    auto model = std::make_shared<FailingChain>();
    torch::manual_seed(0);
    auto reference = std::make_shared<FailingChain>();
    fully_shard(model->b0, mesh_options(ctx));
    fully_shard(model->b1, mesh_options(ctx));
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_optim(reference->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      const Batch batch = make_batch(ModelKind::kMlp, step, 12);
      const Batch local = batch.slice(ctx.rank(), ctx.world_size());
      if (step == 1) {
        model->fail = true;
        EXPECT_THROW_WITH(call_module(*model, local.x), "planted failure");
        model->fail = false;
        root.reset_iter_state();
        for (auto* m : {&*model->b0, &*model->b1}) EXPECT_EQ(fsdp_module_of(*m)->unsharded_bytes(), 0);
        EXPECT_EQ(root.unsharded_bytes(), 0);
      }
      ref_optim.zero_grad();
      at::mse_loss(reference->forward(batch.x), batch.y).backward();
      ref_optim.step();
      optim.zero_grad();
      at::Tensor out = call_module(*model, local.x);
      ((out - local.y).pow(2).sum() * (static_cast<double>(ctx.world_size()) / static_cast<double>(batch.y.numel())))
          .backward();
      optim.step();
    }
    expect_params_match(*model, *reference, ctx.mesh());
  });
}

// ignored_params stay full and keep their local gradient; the rest trains
// as the reference (WithScale: test_models.h).
TEST_P(Runtime, IgnoredParametersAreNeitherShardedNorReduced) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const auto [model, reference] = with_scale_twins();
    FullyShardOptions o = mesh_options(ctx);
    o.ignored_params = {model->scale};
    fully_shard(model->block, o);
    fully_shard(model, o);
    EXPECT_EQ(model->scale.sizes(), c10::IntArrayRef({5}));
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    at::mse_loss(call_module(*model, local.x), local.y).backward();
    at::mse_loss(reference->forward(local.x), local.y).backward();
    expect_close(model->scale.grad(), reference->scale.grad(), "local gradient of the ignored parameter");
    EXPECT_EQ(model->head->weight.size(0),
              std::max<int64_t>(
                  0, std::min<int64_t>(ceil_div(3, ctx.world_size()), 3 - ctx.rank() * ceil_div(3, ctx.world_size()))));
  });
}

// Two sibling modules sharing a parameter cannot be separate groups.
struct Holder : torch::nn::Module {
  explicit Holder(const at::Tensor& w) : w(register_parameter("w", w)) {}
  at::Tensor w;
};

TEST(RuntimeErrors, TiesBetweenSiblingGroupsAreRefusedWithWhatToDo) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    at::Tensor shared = at::randn({4, 3});
    auto root = std::make_shared<torch::nn::Module>();
    auto a = root->register_module("a", std::make_shared<Holder>(shared));
    auto b = root->register_module("b", std::make_shared<Holder>(shared));
    fully_shard(a, mesh_options(ctx));
    EXPECT_THROW_WITH(fully_shard(b, mesh_options(ctx)), "'w'", "shared (tied)", "common ancestor");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Runtime, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });
INSTANTIATE_TEST_SUITE_P(WorldSizes, RuntimeMultiRank, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// reshard_after_forward = k: backward re-gathers each block within its k
// ranks, from the 1/k shard kept after forward: world * padded * (1 - 1/k)
// elements received per block, not (1 - 1/world).
TEST(ReshardAfterForwardToSmallerWorld, BackwardRegathersWithinTheKRankGroup) {
  testing::run_distributed(4, [](testing::RankContext& ctx) {
    auto model = seeded_chain(3);
    FullyShardOptions o = mesh_options(ctx);
    o.reshard_after_forward = 2;
    for (auto& b : model->blocks) fully_shard(b, o);
    FSDPModule root = fully_shard(model, mesh_options(ctx));
    at::Tensor loss = call_module(*model, at::randn({8, Chain::kDim})).pow(2).mean();
    root.reset_runtime_stats();
    loss.backward();
    const RuntimeStats stats = root.runtime_stats();
    EXPECT_EQ(stats.all_gathers, 3);
    EXPECT_EQ(stats.all_gather_bytes, 3 * static_cast<int64_t>(chain_block_bytes(4, sizeof(float))) / 2);
  });
}

// A LibTorch module cannot say it was destroyed, so what fully_shard attached
// to it (its sharded parameters and their gradients, held by its state)
// outlives it until release_fsdp_state_of_destroyed_modules() or the next
// fully_shard. Before that function existed a program could not get that
// memory back, nor destroy its World (fsdp_train's ranks never did).
TEST(StateLifetime, ADestroyedModelsShardsAndGradientsAreReleasedOnRequest) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
    {
      auto model = seeded_chain(2);
      for (auto& b : model->blocks) fully_shard(b, mesh_options(ctx));
      fully_shard(model, mesh_options(ctx));
      call_module(*model, at::randn({4, Chain::kDim})).sum().backward();
      for (const at::Tensor& p : model->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        storages.push_back(p.storage().getWeakStorageImpl());
        storages.push_back(p.grad().storage().getWeakStorageImpl());
      }
    }
    ASSERT_FALSE(storages.empty());
    int64_t alive = 0;
    for (const auto& s : storages) alive += s.expired() ? 0 : 1;
    EXPECT_EQ(alive, static_cast<int64_t>(storages.size())) << "the destroyed model's state holds them";
    release_fsdp_state_of_destroyed_modules();
    for (size_t i = 0; i < storages.size(); ++i) {
      EXPECT_TRUE(storages[i].expired()) << (i % 2 == 0 ? "parameter " : "gradient ") << i / 2 << " is still alive";
    }
    // Nothing else died: a live model keeps its state.
    auto live = seeded_chain(1);
    fully_shard(live, mesh_options(ctx));
    release_fsdp_state_of_destroyed_modules();
    EXPECT_TRUE(fsdp_module_of(*live).has_value());
    call_module(*live, at::randn({4, Chain::kDim})).sum().backward();
  });
}

}  // namespace
}  // namespace fsdp::test
