// Activation checkpointing (fsdp2/activation_checkpoint.h).
//
// ActivationCheckpoint.*: one process, CPU fp32. Every gradient of a
// checkpointed run (inputs, parameters, a buffer that requires grad) equals
// the plain run's bit for bit; dropout replays its numbers; forward keeps
// no intermediate of the region; the shapes of arguments and results a
// PyTorch user relies on work; misuse fails with a message that says what
// to do.
//
// ActivationCheckpointSharded.*: checkpointed blocks under fully_shard on
// 1-4 real ranks (and HSDP 2x2) train like the unsharded, uncheckpointed
// reference, bit for bit like the same sharded model without checkpointing,
// and issue exactly its all-gathers and reduce-scatters (flight recorder):
// the recomputation reuses the pre-backward unshard and the gradients are
// reduced once.
#include <atomic>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/container/sequential.h>

#include "collectives/flight_recorder.h"
#include "fsdp2/activation_checkpoint.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// A residual block with a LayerNorm, two Linears, optional dropout and a
// buffer that requires grad (a learned scale kept as a buffer). Counts its
// forward runs.
struct ResBlockImpl : torch::nn::Module {
  explicit ResBlockImpl(int64_t dim, double dropout = 0)
      : dropout(dropout),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        up(register_module("up", torch::nn::Linear(dim, 2 * dim))),
        down(register_module("down", torch::nn::Linear(2 * dim, dim))),
        gain(register_buffer("gain", at::full({dim}, 1.5).requires_grad_(true))) {}
  at::Tensor forward(const at::Tensor& x) {
    ++runs;
    at::Tensor h = at::gelu(up(norm(x)));
    if (dropout > 0) h = torch::nn::functional::dropout(h, torch::nn::functional::DropoutFuncOptions().p(dropout));
    return x + down(h) * gain;
  }
  double dropout;
  int runs = 0;
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
  at::Tensor gain;
};
FSDP2CPP_MODULE(ResBlock);

// Two blocks, the second used twice when `reuse` is set.
struct Stack : torch::nn::Module {
  explicit Stack(double dropout = 0, bool reuse = false)
      : reuse(reuse),
        b0(register_module("b0", ResBlock(6, dropout))),
        b1(register_module("b1", ResBlock(6, dropout))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = b1(b0(x));
    if (reuse) h = b1(h);
    return h;
  }
  bool reuse;
  ResBlock b0, b1;
};

std::shared_ptr<Stack> make_stack(double dropout = 0, bool reuse = false) {
  torch::manual_seed(7);
  return std::make_shared<Stack>(dropout, reuse);
}

at::Tensor input(bool requires_grad = true) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return at::randn({5, 3, 6}, gen).requires_grad_(requires_grad);
}

// Gradients of every parameter and buffer that requires grad, by name.
std::map<std::string, at::Tensor> grads_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> result;
  for (const auto& p : m.named_parameters()) result[p.key()] = p.value().grad().clone();
  for (const auto& b : m.named_buffers()) {
    if (b.value().requires_grad()) result["buffer " + b.key()] = b.value().grad().clone();
  }
  return result;
}

void expect_equal_grads(const std::map<std::string, at::Tensor>& actual,
                        const std::map<std::string, at::Tensor>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, g] : expected) {
    ASSERT_TRUE(actual.at(name).defined()) << name;
    EXPECT_TRUE(at::equal(actual.at(name), g))
        << name << ": max abs diff " << (actual.at(name) - g).abs().max().item<double>();
  }
}

struct StackRun {
  at::Tensor out, x_grad;
  std::map<std::string, at::Tensor> grads;
};

// Forward and backward of a fresh stack, blocks checkpointed or not, with
// the global RNG seeded the same way before forward.
StackRun run_stack(bool checkpointed, double dropout = 0, bool reuse = false) {
  auto model = make_stack(dropout, reuse);
  if (checkpointed) {
    checkpoint_module(*model->b0);
    checkpoint_module(*model->b1);
  }
  at::Tensor x = input();
  torch::manual_seed(123);
  at::Tensor out = model->forward(x);
  (out * out).sum().backward();
  return {out.detach(), x.grad().clone(), grads_of(*model)};
}

// The input's and the model's gradients after two backwards through one
// forward of `model` (the first with retain_graph), the global RNG seeded the
// same way before forward.
std::pair<at::Tensor, std::map<std::string, at::Tensor>> grads_of_two_backwards(Stack& model) {
  at::Tensor x = input();
  torch::manual_seed(5);
  at::Tensor loss = model.forward(x).pow(2).sum();
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  return std::make_pair(x.grad().clone(), grads_of(model));
}

TEST(ActivationCheckpoint, GradientsEqualThePlainRunBitForBit) {
  const StackRun plain = run_stack(false);
  const StackRun ckpt = run_stack(true);
  EXPECT_TRUE(at::equal(ckpt.out, plain.out));
  EXPECT_TRUE(at::equal(ckpt.x_grad, plain.x_grad));
  expect_equal_grads(ckpt.grads, plain.grads);
  EXPECT_EQ(ckpt.grads.count("buffer b0.gain"), 1u);
}

TEST(ActivationCheckpoint, BackwardRecomputesEachRegionOnce) {
  auto model = make_stack();
  checkpoint_module(*model->b0);
  at::Tensor out = model->forward(input());
  EXPECT_EQ(model->b0->runs, 1);
  EXPECT_EQ(model->b1->runs, 1);
  out.sum().backward();
  EXPECT_EQ(model->b0->runs, 2);  // recomputed
  EXPECT_EQ(model->b1->runs, 1);  // not checkpointed
}

// Dropout draws the same mask in the recomputation, and the generator is
// where the plain run leaves it afterwards.
TEST(ActivationCheckpoint, DropoutReplaysItsRandomNumbers) {
  const StackRun plain = run_stack(false, /*dropout=*/0.5);
  const at::Tensor plain_next = at::rand({4});
  const StackRun ckpt = run_stack(true, /*dropout=*/0.5);
  const at::Tensor ckpt_next = at::rand({4});
  EXPECT_TRUE(at::equal(ckpt.out, plain.out));
  EXPECT_TRUE(at::equal(ckpt.x_grad, plain.x_grad));
  expect_equal_grads(ckpt.grads, plain.grads);
  EXPECT_TRUE(at::equal(ckpt_next, plain_next)) << "the generator was not put back after the recomputation";
}

TEST(ActivationCheckpoint, WithoutRngPreservationDropoutDrawsAgain) {
  auto model = make_stack(0.5);
  checkpoint_module(*model->b0, CheckpointOptions{.preserve_rng_state = false});
  const StackRun plain = run_stack(false, 0.5);
  at::Tensor x = input();
  torch::manual_seed(123);
  at::Tensor out = model->forward(x);
  (out * out).sum().backward();
  EXPECT_FALSE(at::equal(x.grad(), plain.x_grad));
}

// Selective checkpointing keeps the outputs of the policy's ops through
// forward and the recomputation reuses them: native_dropout's kept mask
// replays the plain run's even with the generator left alone, and the kept
// mm output outlives forward (full checkpointing frees it) until backward.
TEST(ActivationCheckpoint, SelectiveKeepsAndReusesThePolicysOutputs) {
  torch::manual_seed(3);
  auto linear = torch::nn::Linear(torch::nn::LinearOptions(6, 6).bias(false));
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> mm_out;
  auto region = [&](const at::Tensor& x) {
    at::Tensor h = at::mm(x.reshape({-1, 6}), linear->weight.t());
    mm_out.emplace(h.storage().getWeakStorageImpl());
    return std::get<0>(at::native_dropout(at::tanh(h), 0.5, true));
  };
  auto run = [&](std::optional<CheckpointOptions> options) {
    linear->weight.mutable_grad() = at::Tensor();
    at::Tensor x = input();
    torch::manual_seed(123);
    at::Tensor out = options ? activation_checkpoint(*options, region, x) : region(x);
    at::Tensor loss = out.pow(2).sum();
    const bool kept = !mm_out->expired();
    loss.backward();
    return std::make_tuple(x.grad().clone(), linear->weight.grad().clone(), kept, !mm_out->expired());
  };
  const auto plain = run(std::nullopt);
  CheckpointOptions full{.preserve_rng_state = false};
  const auto full_run = run(full);
  EXPECT_FALSE(std::get<2>(full_run)) << "full checkpointing kept the mm output";
  EXPECT_FALSE(at::equal(std::get<0>(full_run), std::get<0>(plain))) << "a new dropout mask was expected";
  CheckpointOptions selective{.preserve_rng_state = false, .save_ops = {"aten::mm", "aten::native_dropout"}};
  const auto sac = run(selective);
  EXPECT_TRUE(std::get<2>(sac)) << "the mm output was not kept";
  EXPECT_FALSE(std::get<3>(sac)) << "backward without retain_graph did not free the kept outputs";
  EXPECT_TRUE(at::equal(std::get<0>(sac), std::get<0>(plain)));
  EXPECT_TRUE(at::equal(std::get<1>(sac), std::get<1>(plain)));
}

// torchtitan's refinement: of two matmuls in a region, the first output is
// kept and the second recomputed, and the gradients stay those of the plain
// run bit for bit.
TEST(ActivationCheckpoint, EveryOtherMatmulKeepsTheFirstAndRecomputesTheSecond) {
  torch::manual_seed(3);
  auto first = torch::nn::Linear(torch::nn::LinearOptions(6, 6).bias(false));
  auto second = torch::nn::Linear(torch::nn::LinearOptions(6, 6).bias(false));
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> outputs;
  auto region = [&](const at::Tensor& x) {
    at::Tensor h = at::mm(x.reshape({-1, 6}), first->weight.t());
    outputs.push_back(h.storage().getWeakStorageImpl());
    at::Tensor g = at::mm(at::tanh(h), second->weight.t());
    outputs.push_back(g.storage().getWeakStorageImpl());
    return at::tanh(g);
  };
  auto run = [&](std::optional<CheckpointOptions> options) {
    first->weight.mutable_grad() = at::Tensor();
    second->weight.mutable_grad() = at::Tensor();
    outputs.clear();
    at::Tensor x = input();
    at::Tensor out = options ? activation_checkpoint(*options, region, x) : region(x);
    at::Tensor loss = out.pow(2).sum();
    const std::pair<bool, bool> kept = {!outputs[0].expired(), !outputs[1].expired()};
    loss.backward();
    return std::make_tuple(x.grad().clone(), first->weight.grad().clone(), second->weight.grad().clone(), kept);
  };
  const auto plain = run(std::nullopt);
  const auto all_mm = run(CheckpointOptions{.save_ops = {"aten::mm"}});
  EXPECT_TRUE(std::get<3>(all_mm).first && std::get<3>(all_mm).second) << "both mm outputs were to be kept";
  const auto alternate = run(CheckpointOptions{.save_ops = {"aten::mm"}, .save_every_other_mm = true});
  EXPECT_TRUE(std::get<3>(alternate).first) << "the first mm output was not kept";
  EXPECT_FALSE(std::get<3>(alternate).second) << "the second mm output was kept";
  EXPECT_TRUE(at::equal(std::get<0>(alternate), std::get<0>(plain)));
  EXPECT_TRUE(at::equal(std::get<1>(alternate), std::get<1>(plain)));
  EXPECT_TRUE(at::equal(std::get<2>(alternate), std::get<2>(plain)));
}

// The default policy on the stack (its Linears run as mm, into whose output
// LibTorch's linear then adds the bias in place, through _unsafe_view's
// own version counter: such a kept output must be recomputed, not replayed;
// dropout recomputed with the generator restored): bit for bit,
// retain_graph twice included.
TEST(ActivationCheckpoint, SelectiveGradientsEqualThePlainRunBitForBit) {
  auto run = [](bool checkpointed) {
    auto model = make_stack(0.5);
    if (checkpointed) {
      checkpoint_module(*model->b0, CheckpointOptions{.save_ops = selective_checkpoint_ops()});
      checkpoint_module(*model->b1, CheckpointOptions{.save_ops = selective_checkpoint_ops()});
    }
    return grads_of_two_backwards(*model);
  };
  const auto plain = run(false);
  const auto sac = run(true);
  EXPECT_TRUE(at::equal(sac.first, plain.first));
  expect_equal_grads(sac.second, plain.second);
}

// The dispatch key selective checkpointing catches ops on holds our
// fallback and no operator's own kernel, so that every op reaches the
// fallback (see [Note: selective checkpointing on the dispatcher]).
TEST(ActivationCheckpoint, SelectiveKeyHasOnlyOurFallback) {
  auto& dispatcher = c10::Dispatcher::singleton();
  EXPECT_TRUE(dispatcher.hasBackendFallbackForDispatchKey(c10::DispatchKey::Fake));
  size_t ops = 0;
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op) continue;
    ++ops;
    EXPECT_FALSE(op->hasKernelForDispatchKey(c10::DispatchKey::Fake)) << name;
  }
  EXPECT_GT(ops, 1000u);
}

// The header's example of a callable.
TEST(ActivationCheckpoint, CallableExampleFromTheHeader) {
  auto block = ResBlock(6);
  auto plain = ResBlock(6);
  torch::NoGradGuard no_grad;
  for (const auto& item : plain->named_parameters()) item.value().copy_(block->named_parameters()[item.key()]);
  {
    torch::AutoGradMode grad(true);
    at::Tensor x = input(), px = input();
    at::Tensor h = fsdp::activation_checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x);
    h.sum().backward();
    plain->forward(px).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), px.grad()));
    EXPECT_EQ(block->runs, 2);
  }
}

// Forward keeps the region's inputs only: an intermediate of the region is
// freed when the checkpointed call returns; the plain graph holds it.
TEST(ActivationCheckpoint, ForwardKeepsNoIntermediate) {
  for (bool checkpointed : {false, true}) {
    auto linear = torch::nn::Linear(6, 6);
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> intermediate;
    auto region = [&](const at::Tensor& x) {
      at::Tensor h = at::tanh(linear(x));  // tanh saves its result: the plain graph keeps h's memory
      intermediate.emplace(h.storage().getWeakStorageImpl());
      return at::tanh(h);
    };
    at::Tensor x = input();
    at::Tensor out = checkpointed ? activation_checkpoint(region, x) : region(x);
    at::Tensor y = out.sum();
    ASSERT_TRUE(intermediate.has_value());
    EXPECT_EQ(intermediate->expired(), checkpointed) << (checkpointed ? "checkpointed" : "plain");
    y.backward();
  }
}

// Tensors and plain values in, a tuple of a vector of views and a tensor
// out; an input that needs no gradient and an integer tensor among them.
TEST(ActivationCheckpoint, SeveralOutputsViewsAndNonTensorArguments) {
  torch::manual_seed(3);
  auto linear = torch::nn::Linear(6, 4);
  auto region = [&linear](const at::Tensor& x, double scale, const at::Tensor& mask, const at::Tensor& index,
                          int64_t chunks) {
    at::Tensor h = linear(x) * scale + mask;
    std::vector<at::Tensor> parts = h.chunk(chunks, -1);  // views of h
    return std::make_tuple(parts, x.index_select(0, index).transpose(0, 1), index + 1, x.select(0, 1));
  };
  auto run = [&](bool checkpointed) {
    for (auto& p : linear->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor x = input();
    at::Tensor mask = at::full({4}, 0.25);  // needs no gradient
    at::Tensor index = at::tensor(std::vector<int64_t>{2, 0, 4});
    auto [parts, picked, shifted, input_view] =
        checkpointed ? activation_checkpoint(region, x, 0.5, mask, index, int64_t{2}) : region(x, 0.5, mask, index, 2);
    EXPECT_TRUE(input_view.requires_grad());
    EXPECT_EQ(parts.size(), 2u);
    EXPECT_FALSE(shifted.requires_grad());
    EXPECT_TRUE(at::equal(shifted, index + 1));
    (parts[0].pow(2).sum() + parts[1].sum() * 3 + picked.pow(3).sum() + input_view.sum() * 2).backward();
    return std::make_tuple(x.grad().clone(), linear->weight.grad().clone(), linear->bias.grad().clone());
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  EXPECT_TRUE(at::equal(std::get<0>(ckpt), std::get<0>(plain)));
  EXPECT_TRUE(at::equal(std::get<1>(ckpt), std::get<1>(plain)));
  EXPECT_TRUE(at::equal(std::get<2>(ckpt), std::get<2>(plain)));
}

// The first block's input needs no gradient (token embeddings computed
// without autograd): the parameters still get theirs.
TEST(ActivationCheckpoint, InputsThatDoNotRequireGrad) {
  auto run = [](bool checkpointed) {
    auto model = make_stack();
    if (checkpointed) checkpoint_module(*model->b0);
    at::Tensor out = model->forward(input(/*requires_grad=*/false));
    EXPECT_TRUE(out.requires_grad());
    out.pow(2).sum().backward();
    return grads_of(*model);
  };
  expect_equal_grads(run(true), run(false));
}

// A region whose result depends on nothing that requires grad gives a
// result that requires none, as the plain run.
TEST(ActivationCheckpoint, RegionWithoutGradientsReturnsPlainResults) {
  auto model = make_stack();
  for (auto& p : model->parameters()) p.requires_grad_(false);
  for (auto& b : model->buffers()) b.requires_grad_(false);
  checkpoint_module(*model->b0);
  at::Tensor out = model->forward(input(false));
  EXPECT_FALSE(out.requires_grad());
}

TEST(ActivationCheckpoint, NestedCheckpoints) {
  auto plain_model = make_stack();
  auto model = make_stack();
  int outer_runs = 0;
  auto outer = [&](const at::Tensor& x) {
    ++outer_runs;
    return model->b1(activation_checkpoint([&](const at::Tensor& y) { return model->b0(y); }, x));
  };
  at::Tensor x = input();
  at::Tensor out = activation_checkpoint(outer, x);
  (out * out).sum().backward();
  at::Tensor px = input();
  at::Tensor pout = plain_model->forward(px);
  (pout * pout).sum().backward();
  EXPECT_TRUE(at::equal(out, pout));
  EXPECT_TRUE(at::equal(x.grad(), px.grad()));
  expect_equal_grads(grads_of(*model), grads_of(*plain_model));
  EXPECT_EQ(outer_runs, 2);
  // b0: forward, the outer recomputation, its own recomputation.
  EXPECT_EQ(model->b0->runs, 3);
  EXPECT_EQ(model->b1->runs, 2);
}

// b1 runs twice in one forward; both uses are recomputed and their
// gradients add up as in the plain run.
TEST(ActivationCheckpoint, RegionCalledTwiceInOneForward) {
  const StackRun plain = run_stack(false, 0, /*reuse=*/true);
  const StackRun ckpt = run_stack(true, 0, /*reuse=*/true);
  EXPECT_TRUE(at::equal(ckpt.x_grad, plain.x_grad));
  expect_equal_grads(ckpt.grads, plain.grads);
}

TEST(ActivationCheckpoint, NoGradForwardJustRuns) {
  auto model = make_stack();
  checkpoint_module(*model->b0);
  int runs = 0;
  at::Tensor out, out2;
  {
    torch::NoGradGuard no_grad;
    out = model->forward(input());
    out2 = activation_checkpoint(
        [&runs](const at::Tensor& x) {
          ++runs;
          return x * 2;
        },
        input());
  }
  EXPECT_FALSE(out.requires_grad());
  EXPECT_EQ(out.grad_fn(), nullptr);
  EXPECT_EQ(model->b0->runs, 1);
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(out2.requires_grad());
}

TEST(ActivationCheckpoint, BackwardTwiceWithRetainGraph) {
  auto run = [](bool checkpointed) {
    auto model = make_stack(0.5);
    if (checkpointed) checkpoint_module(*model->b0);
    return grads_of_two_backwards(*model);
  };
  const auto plain = run(false);
  const auto ckpt = run(true);
  EXPECT_TRUE(at::equal(ckpt.first, plain.first));
  expect_equal_grads(ckpt.second, plain.second);

  auto model = make_stack();
  checkpoint_module(*model->b0);
  checkpoint_module(*model->b1);
  at::Tensor loss = model->forward(input()).sum();
  loss.backward();
  EXPECT_THROW_WITH(loss.backward(), "second time");
}

// torch::autograd::grad with `inputs` computes what it is asked for and
// accumulates nothing into the parameters.
TEST(ActivationCheckpoint, GradWithInputsLeavesParametersAlone) {
  auto model = make_stack();
  auto plain = make_stack();
  checkpoint_module(*model->b0);
  checkpoint_module(*model->b1);
  at::Tensor x = input(), px = input();
  const auto g = torch::autograd::grad({model->forward(x).pow(2).sum()}, {x});
  const auto pg = torch::autograd::grad({plain->forward(px).pow(2).sum()}, {px});
  EXPECT_TRUE(at::equal(g[0], pg[0]));
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(ActivationCheckpoint, InPlaceChangeOfASavedInputFails) {
  auto model = make_stack();
  checkpoint_module(*model->b1);
  at::Tensor h = model->b0(input());
  at::Tensor out = model->b1(h);
  h.mul_(2);
  EXPECT_THROW_WITH(out.sum().backward(), "input 0 of the checkpointed module", "ResBlockImpl' was modified in place",
                    "x.clone()");
}

TEST(ActivationCheckpoint, CapturedTensorThatRequiresGradFails) {
  auto linear = torch::nn::Linear(6, 6);
  at::Tensor outside = linear(input());  // requires grad, computed outside
  EXPECT_THROW_WITH(activation_checkpoint([&](const at::Tensor& x) { return x + outside; }, input()),
                    "computed outside it", "Pass that tensor as an argument");
}

TEST(ActivationCheckpoint, NondeterministicShapesFailInBackward) {
  int calls = 0;
  at::Tensor out = activation_checkpoint(
      [&calls](const at::Tensor& x) {
        ++calls;
        return calls == 1 ? x * 2 : x.narrow(0, 0, 2) * 2;
      },
      input());
  EXPECT_THROW_WITH(out.sum().backward(), "returned output 0 as shape [2, 3, 6]", "must compute the same");
}

// checkpoint_module adds no module and renames nothing; applied twice it
// says so; children of an fsdp::Sequential are checkpointed too.
TEST(ActivationCheckpoint, ModuleKeepsItsNamesAndSequentialChildrenWork) {
  auto model = make_stack();
  const auto before = model->named_parameters().keys();
  checkpoint_module(*model->b0);
  EXPECT_TRUE(is_checkpointed(*model->b0));
  EXPECT_FALSE(is_checkpointed(*model->b1));
  EXPECT_EQ(model->named_parameters().keys(), before);
  EXPECT_THROW_WITH(checkpoint_module(*model->b0), "checkpointed already");

  auto plain = make_stack();
  fsdp::Sequential seq(model->b0, model->b1);
  at::Tensor x = input(), px = input();
  at::Tensor out = seq(x);
  EXPECT_EQ(model->b0->runs, 1);
  out.pow(2).sum().backward();
  EXPECT_EQ(model->b0->runs, 2);
  plain->forward(px).pow(2).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), px.grad()));
  expect_equal_grads(grads_of(*model), grads_of(*plain));
}

// --- Under fully_shard, on real ranks ---

enum class Where {
  kNone,    // no checkpointing
  kBlocks,  // each block checkpointed: fully_shard's hooks outside the regions
  kRoot,    // the whole model checkpointed: the blocks' hooks inside its region
};

struct ShardedCase {
  std::string name;
  ModelKind kind = ModelKind::kTransformer;
  std::optional<bool> reshard_after_forward;
  bool mixed_precision = false;
  int micro_batches = 1;
  bool sync_only_last_micro_batch = false;
};

struct ShardedRun {
  std::vector<double> losses;      // this rank's, per micro-batch
  std::vector<at::Tensor> params;  // full values after training
  size_t all_gathers = 0, reduce_scatters = 0;
};

size_t count_records(testing::RankContext& ctx, const std::string& op, const std::string& label) {
  size_t n = 0;
  for (const auto& r : ctx.world()->flight_recorder().snapshot().records) {
    if (r.fingerprint.op == op && r.fingerprint.label.rfind(label, 0) == 0) ++n;
  }
  return n;
}

// The header's example (fsdp2/activation_checkpoint.h).
FSDPModule checkpoint_and_shard(const std::shared_ptr<LossModel>& model, const FullyShardOptions& options) {
  for (auto& block : model->blocks()) fsdp::checkpoint_module(*block);
  for (auto& block : model->blocks()) fsdp::fully_shard(block, options);
  fsdp::FSDPModule root = fsdp::fully_shard(model, options);
  return root;
}

FSDPModule shard(const std::shared_ptr<LossModel>& model, const FullyShardOptions& options) {
  for (auto& block : model->blocks()) fsdp::fully_shard(block, options);
  return fsdp::fully_shard(model, options);
}

constexpr int kSteps = 3;
constexpr int64_t kRows = 12;  // per micro-batch, divisible by 1-4

ShardedRun train_sharded(testing::RankContext& ctx, const ShardedCase& c, Where where) {
  auto model = make_model(c.kind);
  FullyShardOptions options;
  options.mesh = ctx.mesh();
  options.reshard_after_forward = c.reshard_after_forward;
  if (c.mixed_precision) {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
  }
  if (where == Where::kRoot) fsdp::checkpoint_module(*model);
  FSDPModule root = where == Where::kBlocks ? checkpoint_and_shard(model, options) : shard(model, options);
  auto optim = make_optimizer(Optim::kAdamW, model->parameters());
  const size_t ag_before = count_records(ctx, "all_gather_into_tensor", "FSDP::all_gather");
  const size_t rs_before = count_records(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter");
  ShardedRun run;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(c.kind, step, kRows * c.micro_batches);
    optim->zero_grad();
    for (int m = 0; m < c.micro_batches; ++m) {
      if (c.sync_only_last_micro_batch) root.set_requires_gradient_sync(m == c.micro_batches - 1);
      const Batch local = batch.slice(m, c.micro_batches).slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*model, local.x, local.y) / c.micro_batches;
      loss.backward();
      run.losses.push_back(loss.item<double>());
    }
    optim->step();
  }
  run.all_gathers = count_records(ctx, "all_gather_into_tensor", "FSDP::all_gather") - ag_before;
  run.reduce_scatters = count_records(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter") - rs_before;
  auto shapes = make_model(c.kind)->named_parameters();
  for (const auto& item : model->named_parameters()) {
    run.params.push_back(full_param(item.value(), shapes[item.key()].sizes().vec(), ctx.mesh()));
  }
  return run;
}

// The unsharded, uncheckpointed reference: losses of the global batch.
std::vector<double> reference_losses(const ShardedCase& c, std::vector<at::Tensor>& params) {
  auto model = make_model(c.kind);
  auto optim = make_optimizer(Optim::kAdamW, model->parameters());
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(c.kind, step, kRows * c.micro_batches);
    optim->zero_grad();
    for (int m = 0; m < c.micro_batches; ++m) {
      const Batch mb = batch.slice(m, c.micro_batches);
      at::Tensor loss = model->forward(mb.x, mb.y) / c.micro_batches;
      loss.backward();
      losses.push_back(loss.item<double>());
    }
    optim->step();
  }
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  return losses;
}

void expect_checkpointed_training_matches(testing::RankContext& ctx, const ShardedCase& c, Where where) {
  SCOPED_TRACE(c.name + (where == Where::kBlocks ? ", blocks checkpointed" : ", root checkpointed"));
  const ShardedRun plain = train_sharded(ctx, c, Where::kNone);
  const ShardedRun ckpt = train_sharded(ctx, c, where);
  // Bit for bit the sharded run without checkpointing.
  ASSERT_EQ(ckpt.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) EXPECT_EQ(ckpt.losses[i], plain.losses[i]) << "micro-batch " << i;
  ASSERT_EQ(ckpt.params.size(), plain.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_TRUE(at::equal(ckpt.params[i], plain.params[i])) << "parameter " << i;
  }
  // The recomputation all-gathers nothing the plain backward does not, and
  // every gradient is reduced once.
  EXPECT_EQ(ckpt.all_gathers, plain.all_gathers);
  EXPECT_EQ(ckpt.reduce_scatters, plain.reduce_scatters);
  if (ctx.mesh().size() > 1) {
    EXPECT_GT(ckpt.all_gathers, 0u);
  }
  // And the unsharded, uncheckpointed reference.
  std::vector<at::Tensor> ref_params;
  const std::vector<double> ref = reference_losses(c, ref_params);
  const double tol = c.mixed_precision ? 5e-2 : 1e-5;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(mean_over_ranks(ctx, ckpt.losses[i]), ref[i], tol * std::abs(ref[i]) + 1e-7) << "micro-batch " << i;
  }
  // bf16 compute moves AdamW's sign-like updates of near-zero gradients:
  // parameters are compared with the same sharded run without checkpointing
  // only (exactly, above).
  if (c.mixed_precision) return;
  for (size_t i = 0; i < ref_params.size(); ++i) {
    expect_close(ckpt.params[i], ref_params[i], "parameter " + std::to_string(i), 1e-4, 1e-5);
  }
}

class ActivationCheckpointSharded : public ::testing::TestWithParam<int> {};

TEST_P(ActivationCheckpointSharded, BlocksCheckpointedTrainLikeTheReference) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_checkpointed_training_matches(ctx, {.name = "transformer"}, Where::kBlocks);
    expect_checkpointed_training_matches(
        ctx, {.name = "transformer, reshard_after_forward=false", .reshard_after_forward = false}, Where::kBlocks);
    expect_checkpointed_training_matches(ctx, {.name = "MLP", .kind = ModelKind::kMlp}, Where::kBlocks);
  });
}

TEST_P(ActivationCheckpointSharded, MixedPrecisionAndAccumulationWithoutSync) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_checkpointed_training_matches(ctx, {.name = "bf16 parameters, fp32 reduction", .mixed_precision = true},
                                         Where::kBlocks);
    expect_checkpointed_training_matches(
        ctx, {.name = "3 micro-batches, sync on the last only", .micro_batches = 3, .sync_only_last_micro_batch = true},
        Where::kBlocks);
  });
}

TEST_P(ActivationCheckpointSharded, ShardedBlocksInsideACheckpointedRoot) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_checkpointed_training_matches(ctx, {.name = "transformer"}, Where::kRoot);
    expect_checkpointed_training_matches(ctx, {.name = "MLP", .kind = ModelKind::kMlp}, Where::kRoot);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ActivationCheckpointSharded, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(ActivationCheckpointHsdp, TwoByTwoMeshTrainsLikeTheReference) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    expect_checkpointed_training_matches(ctx, {.name = "HSDP 2x2"}, Where::kBlocks);
    expect_checkpointed_training_matches(ctx, {.name = "HSDP 2x2, MLP", .kind = ModelKind::kMlp}, Where::kRoot);
  });
}

}  // namespace
}  // namespace fsdp::test
