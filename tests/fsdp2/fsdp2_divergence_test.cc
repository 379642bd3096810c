// Ranks that stop issuing the same collectives: each way a training program
// makes them diverge (control flow that differs between ranks, models that
// differ, a rank that stalls) must end every rank within seconds, with a
// diagnosis that names where and how they went apart, instead of waiting out
// the communicators' timeout (here 10 minutes, so that a pass cannot come
// from it). collectives/include/collectives/divergence.h describes the
// mechanism; docs/debugging.md how to read the diagnosis.
#include <csignal>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "collectives/flight_recorder.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp_testing/distributed_test.h"

namespace fsdp {
namespace {

using testing::DistributedTestOptions;
using ::testing::HasSubstr;
using testing::RankContext;
using testing::RankOutcome;

struct LayerImpl : torch::nn::Module {
  explicit LayerImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(Layer);

// layer0 ... layer<n-1> of `width`, then a head of 3 outputs in the root's
// own group.
struct Stack : torch::nn::Module {
  Stack(int layers, int64_t width) {
    for (int i = 0; i < layers; ++i) this->layers.push_back(register_module("layer" + std::to_string(i), Layer(width)));
    head = register_module("head", torch::nn::Linear(width, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (!skip(static_cast<int>(i))) h = layers[i](h);
    }
    return head(h);
  }
  std::vector<Layer> layers;
  torch::nn::Linear head{nullptr};
  // Which layers this forward leaves out.
  std::function<bool(int)> skip = [](int) { return false; };
};

// How one rank's program differs from the others'. Every hook defaults to
// "like every other rank".
struct Variation {
  std::function<int(int rank)> layers = [](int) { return 4; };
  std::function<int64_t(int rank, int layer)> width = [](int, int) { return 12; };
  std::function<bool(int rank)> freeze_layer2_weight = [](int) { return false; };
  std::function<bool(int rank, int layer)> shard_layer = [](int, int) { return true; };
  std::function<bool(int rank, int step, int layer)> skip = [](int, int, int) { return false; };
  std::function<int(int rank, int step)> micro_batches = [](int, int) { return 1; };
  std::function<int(int rank)> steps = [](int) { return 3; };
  std::function<void(int rank, int step)> user_code = [](int, int) {};
};

constexpr int kThresholdSeconds = 3;

// Trains a few steps of the stack with the rank's variation, then, as the
// end of a training program does, waits for every rank on a barrier. A
// diagnosis thrown by a wait is printed with a marker the parent looks for.
void train(RankContext& ctx, const Variation& v) {
  const int rank = ctx.rank();
  torch::manual_seed(0);
  const int layers = v.layers(rank);
  auto model = std::make_shared<Stack>(layers, v.width(rank, 0));
  if (v.freeze_layer2_weight(rank)) model->layers.at(2)->fc->weight.set_requires_grad(false);
  FullyShardOptions options;
  options.mesh = ctx.mesh();
  for (int i = 0; i < layers; ++i) {
    if (v.shard_layer(rank, i)) fully_shard(model->layers[i], options);
  }
  fully_shard(model, options);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.1));
  // Made up front, as a program makes its groups: making one is itself a
  // rendezvous of its members.
  const auto& world_group = ctx.world_group();
  try {
    for (int step = 0; step < v.steps(rank); ++step) {
      v.user_code(rank, step);
      for (int micro = 0; micro < v.micro_batches(rank, step); ++micro) {
        at::Tensor x = at::randn({4, v.width(rank, 0)});
        model->skip = [&](int layer) { return v.skip(rank, step, layer); };
        at::Tensor loss = call_module(*model, x).pow(2).mean();
        loss.backward();
      }
      optim.step();
      optim.zero_grad();
    }
    world_group->barrier().wait();
  } catch (const c10::Error& e) {
    std::cout << "DIAGNOSIS(rank " << rank << "): " << e.what_without_backtrace() << std::endl;
    throw;
  }
}

// Runs `v` on `world_size` ranks with a 3-second divergence timeout and a
// 10-minute collective timeout; every rank must fail, on its own, well
// before the latter.
std::vector<RankOutcome> run_diverging(int world_size, const Variation& v) {
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", std::to_string(kThresholdSeconds).c_str(), 1);
  DistributedTestOptions options;
  options.world_size = world_size;
  options.communicator.timeout = std::chrono::minutes(10);
  options.timeout = std::chrono::seconds(240);
  auto outcomes = testing::run_distributed_collect(options, [&](RankContext& ctx) { train(ctx, v); });
  ::unsetenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S");
  if (testing::is_rank_process()) return outcomes;
  EXPECT_EQ(outcomes.size(), static_cast<size_t>(world_size));
  for (const RankOutcome& o : outcomes) {
    EXPECT_TRUE(o.exited && o.exit_code != 0) << o.describe() << "\n" << o.output;
    EXPECT_FALSE(o.timed_out) << o.describe();
    // Threshold, a gather window of at most 3 s and the stalled rank's grace
    // of 3 s more, with room for a loaded machine; the collective timeout
    // (600 s) is far beyond.
    EXPECT_LT(o.seconds, 120.0) << o.describe();
  }
  return outcomes;
}

// The output of every rank, for the assertions on the diagnosis.
std::string all_output(const std::vector<RankOutcome>& outcomes) {
  std::string text;
  for (const auto& o : outcomes) text += "=== " + o.describe() + "\n" + o.output + "\n";
  return text;
}

// The skipped layer is named on both sides of the first collective that
// differs. The forward stays in step by itself (the skipped layer's
// all-gather was already issued as an implicit prefetch, from the order of
// the last forward); the backward does not: the other ranks all-gather the
// skipped layer while this rank, which has no gradient for it, all-gathers
// the layer before it.
TEST(Divergence, ModuleSkippedOnOneRank) {
  for (int world_size : {2, 3}) {
    Variation v;
    const int odd = world_size - 1;
    v.skip = [odd](int rank, int step, int layer) { return rank == odd && step == 1 && layer == 1; };
    auto outcomes = run_diverging(world_size, v);
    if (testing::is_rank_process()) continue;
    const std::string text = all_output(outcomes);
    EXPECT_THAT(text, HasSubstr("ranks diverged at collective #")) << text;
    EXPECT_THAT(text, HasSubstr(std::string(world_size == 2 ? "rank 0" : "ranks 0,1") +
                                " issued all_gather_into_tensor(Float, "))
        << text;
    EXPECT_THAT(text, HasSubstr("for FSDP::all_gather (layer1) [in FSDP::backward_prefetch for layer1]")) << text;
    EXPECT_THAT(text, HasSubstr("rank " + std::to_string(odd) + " issued all_gather_into_tensor(Float, ")) << text;
    EXPECT_THAT(text, HasSubstr("for FSDP::all_gather (layer0) [in FSDP::backward_prefetch for layer0]")) << text;
  }
}

// One rank runs a second micro-batch: its forward all-gathers meet the
// others' next step, or their end-of-training barrier.
TEST(Divergence, OneMoreMicroBatchOnOneRank) {
  Variation v;
  v.micro_batches = [](int rank, int step) { return rank == 1 && step == 1 ? 2 : 1; };
  auto outcomes = run_diverging(2, v);
  if (testing::is_rank_process()) return;
  const std::string text = all_output(outcomes);
  // Same-sized collectives pair up silently; the first that differs is
  // rank 1's next forward against rank 0's end of training.
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #")) << text;
  EXPECT_THAT(text, HasSubstr("rank 1 issued all_gather_into_tensor(Float, 26 elements) for FSDP::all_gather (root) "
                              "[in FSDP::pre_forward (root)]"))
      << text;
  EXPECT_THAT(text, HasSubstr("rank 0 has issued nothing on it since #")) << text;
  EXPECT_THAT(text, HasSubstr("rank 0: waiting")) << text;
  EXPECT_THAT(text, HasSubstr("barrier()")) << text;
}

// One rank's data ends after one step: it waits on the final barrier while
// the others all-gather for the next step.
TEST(Divergence, DataEndsEarlyOnOneRank) {
  Variation v;
  v.steps = [](int rank) { return rank == 2 ? 1 : 3; };
  auto outcomes = run_diverging(4, v);
  if (testing::is_rank_process()) return;
  const std::string text = all_output(outcomes);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #")) << text;
  EXPECT_THAT(text, HasSubstr("rank 2 has issued nothing on it since #")) << text;
  EXPECT_THAT(text, HasSubstr("(it waits for #1 of gloo[0,1,2,3]#1: barrier())")) << text;
}

// A rank stuck in its own code: the others name it, and it is stopped too.
TEST(Divergence, RankSleepsInUserCode) {
  Variation v;
  v.user_code = [](int rank, int step) {
    if (rank == 1 && step == 1) std::this_thread::sleep_for(std::chrono::minutes(10));
  };
  auto outcomes = run_diverging(3, v);
  if (testing::is_rank_process()) return;
  const std::string text = all_output(outcomes);
  EXPECT_THAT(text, HasSubstr("rank 1 has issued nothing on it since #")) << text;
  EXPECT_THAT(text, HasSubstr("stalled in user code")) << text;
  EXPECT_THAT(outcomes[1].output, HasSubstr("fsdp2cpp: rank 1 stops")) << outcomes[1].output;
  EXPECT_EQ(outcomes[1].exit_code, 1) << outcomes[1].describe();
}

// Models that differ are found before the first collective of the model, at
// the root's lazy init, on every rank.
TEST(Divergence, DifferentLayerCount) {
  Variation v;
  v.layers = [](int rank) { return rank == 1 ? 5 : 4; };
  auto outcomes = run_diverging(2, v);
  if (testing::is_rank_process()) return;
  for (const auto& o : outcomes) {
    EXPECT_THAT(o.output, HasSubstr("fsdp2: the sharded model differs between ranks")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("rank 1 has fully_shard group 'layer4'")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("rank 0 has nothing more")) << o.output;
  }
}

TEST(Divergence, DifferentLayerWidth) {
  Variation v;
  v.width = [](int rank, int) -> int64_t { return rank == 2 ? 11 : 12; };
  auto outcomes = run_diverging(3, v);
  if (testing::is_rank_process()) return;
  for (const auto& o : outcomes) {
    // The root's group comes first: its head is the first parameter that differs.
    EXPECT_THAT(o.output, HasSubstr("rank 2 has parameter 'head.weight' of shape [3, 11]")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("rank 0 has parameter 'head.weight' of shape [3, 12]")) << o.output;
  }
}

TEST(Divergence, ParameterFrozenOnOneRank) {
  Variation v;
  v.freeze_layer2_weight = [](int rank) { return rank == 1; };
  auto outcomes = run_diverging(2, v);
  if (testing::is_rank_process()) return;
  for (const auto& o : outcomes) {
    EXPECT_THAT(o.output, HasSubstr("rank 1 has parameter 'layer2.fc.weight' of shape [12, 12], dtype Float, "
                                    "requires_grad false"))
        << o.output;
    EXPECT_THAT(o.output, HasSubstr("requires_grad true")) << o.output;
  }
}

TEST(Divergence, DifferentFullyShardGroups) {
  Variation v;
  v.shard_layer = [](int rank, int layer) { return !(rank == 1 && layer == 3); };
  auto outcomes = run_diverging(2, v);
  if (testing::is_rank_process()) return;
  for (const auto& o : outcomes) {
    EXPECT_THAT(o.output, HasSubstr("fsdp2: the sharded model differs between ranks")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("rank 1 has fully_shard group '' of 1 module(s) with 4 parameter(s)")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("rank 0 has fully_shard group '' of 1 module(s) with 2 parameter(s)")) << o.output;
  }
}

// Two experts in one group, and on rank 1 the second expert gets no token:
// without set_reduce_scatter_unused_params the ranks reduce-scatter the
// group with different sizes (rank 0 both experts, rank 1 one). Gloo aborts
// on the mismatched buffers; every rank must still end within seconds with
// the diagnosis that names both sizes and the unused-parameter hint, in the
// default mode and in strict mode (where the check names them first).
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl()
      : e0(register_module("e0", torch::nn::Linear(8, 8))), e1(register_module("e1", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return use_e1 ? e0(x) + e1(x) : e0(x); }
  torch::nn::Linear e0, e1;
  bool use_e1 = true;
};
FSDP2CPP_MODULE(Experts);

struct MoeImpl : torch::nn::Module {
  MoeImpl() : experts(register_module("experts", Experts())) {}
  at::Tensor forward(const at::Tensor& x) { return experts(x); }
  Experts experts;
};
TORCH_MODULE(Moe);

TEST(Divergence, ReduceScattersThatDifferOnlyInSizeNameBothSizes) {
  for (const char* strict : {"0", "1"}) {
    ::setenv("FSDP2CPP_STRICT_COLLECTIVES", strict, 1);
    ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", std::to_string(kThresholdSeconds).c_str(), 1);
    DistributedTestOptions options;
    options.world_size = 2;
    options.communicator.timeout = std::chrono::minutes(10);
    options.timeout = std::chrono::seconds(240);
    auto outcomes = testing::run_distributed_collect(options, [](RankContext& ctx) {
      torch::manual_seed(0);
      Moe model;
      model->experts->use_e1 = ctx.rank() == 0;
      FullyShardOptions o;
      o.mesh = ctx.mesh();
      fully_shard(model->experts, o);
      fully_shard(model.ptr(), o);
      // Made up front: making a group is itself a rendezvous of its members.
      const auto& world_group = ctx.world_group();
      try {
        call_module(*model, at::randn({4, 8})).pow(2).mean().backward();
        world_group->barrier().wait();
      } catch (const c10::Error& e) {
        std::cout << "DIAGNOSIS(rank " << ctx.rank() << "): " << e.what_without_backtrace() << std::endl;
        throw;
      }
    });
    ::unsetenv("FSDP2CPP_STRICT_COLLECTIVES");
    ::unsetenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S");
    if (testing::is_rank_process()) continue;  // a rank process runs one of the two calls
    ASSERT_EQ(outcomes.size(), 2u);
    for (const RankOutcome& o : outcomes) {
      // Gloo aborts the rank that received the larger message (SIGABRT).
      EXPECT_TRUE((o.exited && o.exit_code != 0) || o.signal == SIGABRT)
          << "strict " << strict << ": " << o.describe() << "\n"
          << o.output;
      EXPECT_FALSE(o.timed_out) << o.describe();
      EXPECT_LT(o.seconds, 120.0) << o.describe();
      // Padded shards at 2 ranks: 36 elements per expert per rank.
      EXPECT_THAT(o.output, HasSubstr("Float, 144 elements) for FSDP::reduce_scatter (experts)"))
          << "strict " << strict << ":\n"
          << o.output;
      EXPECT_THAT(o.output, HasSubstr("Float, 72 elements) for FSDP::reduce_scatter (experts)"))
          << "strict " << strict << ":\n"
          << o.output;
      if (std::string(strict) == "0") {
        EXPECT_THAT(o.output, HasSubstr("set_reduce_scatter_unused_params(true)")) << o.output;
      } else {
        EXPECT_THAT(o.output, HasSubstr("strict collectives: the members of gloo[0,1]")) << o.output;
      }
    }
  }
}

// Strict mode checks each collective before issuing it: the first one that
// differs (in the backward, as in ModuleSkippedOnOneRank) fails at once on
// every rank, naming both.
TEST(Divergence, StrictModeNamesBothCollectives) {
  ::setenv("FSDP2CPP_STRICT_COLLECTIVES", "1", 1);
  Variation v;
  v.skip = [](int rank, int step, int layer) { return rank == 1 && step == 1 && layer == 1; };
  auto outcomes = run_diverging(2, v);
  ::unsetenv("FSDP2CPP_STRICT_COLLECTIVES");
  if (testing::is_rank_process()) return;
  for (const auto& o : outcomes) {
    EXPECT_THAT(o.output, HasSubstr("strict collectives: the members of gloo[0,1]")) << o.output;
    EXPECT_THAT(o.output, HasSubstr("issues all_gather_into_tensor(Float, 78 elements) for FSDP::all_gather (layer1)"))
        << o.output;
    EXPECT_THAT(o.output, HasSubstr("issues all_gather_into_tensor(Float, 78 elements) for FSDP::all_gather (layer0)"))
        << o.output;
  }
}

// The same training with no variation completes on every rank: the
// recorder and the watchdog change nothing when ranks agree, and strict mode
// passes a correct program.
TEST(Divergence, AgreeingRanksTrainNormally) {
  for (const char* strict : {"0", "1"}) {
    ::setenv("FSDP2CPP_STRICT_COLLECTIVES", strict, 1);
    ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "3", 1);
    DistributedTestOptions options;
    options.world_size = 3;
    testing::run_distributed(options, [](RankContext& ctx) {
      train(ctx, Variation{});
      // Every rank recorded the same sequence on the mesh's group.
      const auto log = ctx.world()->flight_recorder().snapshot();
      ASSERT_FALSE(log.records.empty());
      for (const auto& record : log.records) {
        EXPECT_EQ(record.state, collectives::CollectiveState::kCompleted) << record.fingerprint.describe();
      }
      // A user's own collective, labelled (docs/debugging.md quotes this).
      const auto& group = ctx.world_group();
      at::Tensor loss = at::full({1}, 1.0 + ctx.rank());
      fsdp::collectives::CollectiveLabel label("metrics: mean loss");
      group->all_reduce(loss, fsdp::collectives::ReduceOp::avg()).wait();
      EXPECT_EQ(loss.item<double>(), 2.0);
      const auto last = ctx.world()->flight_recorder().snapshot().records.back();
      EXPECT_EQ(last.fingerprint.describe(), "all_reduce(AVG, Float, 1 element) for metrics: mean loss");
    });
    ::unsetenv("FSDP2CPP_STRICT_COLLECTIVES");
    ::unsetenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S");
  }
}

}  // namespace
}  // namespace fsdp
