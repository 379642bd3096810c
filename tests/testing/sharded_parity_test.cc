// fsdp_testing/sharded_parity.h on real processes: a model sharded at world
// sizes 1 to 4 (3 and 4 shard unevenly) trained beside its unsharded
// reference passes expect_sharded_parity; a planted difference in one
// parameter, in one gradient, or a missing gradient, fails it and names the
// parameter.
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "fsdp2/fully_shard.h"
#include "fsdp_testing/distributed_test.h"
#include "fsdp_testing/sharded_parity.h"

namespace {

using ::testing::HasSubstr;

struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl()
      : fc1(register_module("fc1", torch::nn::Linear(5, 7))), fc2(register_module("fc2", torch::nn::Linear(7, 2))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
FSDP2CPP_MODULE(TwoLayers);

std::shared_ptr<TwoLayersImpl> make_model() {
  torch::manual_seed(0);
  return std::make_shared<TwoLayersImpl>();
}

// The failures `f` reports, without failing the test.
template <typename F>
std::vector<std::string> failures_of(F&& f) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    f();
  }
  std::vector<std::string> out;
  for (int i = 0; i < results.size(); ++i) out.push_back(results.GetTestPartResult(i).message());
  return out;
}

class ShardedParity : public ::testing::TestWithParam<int> {};

TEST_P(ShardedParity, AShardedModelTrainedBesideItsReferenceMatchesAndAPlantedDifferenceFails) {
  fsdp::testing::run_distributed(GetParam(), [](fsdp::testing::RankContext& ctx) {
    auto reference = make_model();
    auto model = make_model();
    fsdp::FullyShardOptions options;
    options.mesh = ctx.mesh();
    fsdp::fully_shard(model, options);
    torch::optim::SGD ref_optim(reference->parameters(), 0.1);
    torch::optim::SGD optim(model->parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = at::randn({12, 5}), y = at::randn({12, 2});  // the same on every rank (one seed)
      const at::Tensor rows = fsdp::testing::shard_rows(x, ctx.mesh()),
                       targets = fsdp::testing::shard_rows(y, ctx.mesh());
      // reference: the same model, not sharded, trained on the whole batch
      const double ref_loss =
          fsdp::testing::train_reference_step(ref_optim, [&] { return (reference->forward(x) - y).pow(2).mean(); });
      optim.zero_grad();
      at::Tensor loss = (fsdp::call_module(*model, rows) - targets).pow(2).mean();  // equal shares: 12 rows
      loss.backward();
      optim.step();
      EXPECT_NEAR(fsdp::testing::mean_over_ranks(ctx, loss.item<double>()), ref_loss, 1e-6);
      fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh());
    }
    // Planted differences, each undone after it was seen.
    const at::Tensor weight = reference->fc1->weight;
    if (fsdp::testing::shard_rows(weight, ctx.mesh()).numel() > 0) {
      at::NoGradGuard no_grad;
      fsdp::testing::shard_rows(weight, ctx.mesh()).add_(1e-3);
      EXPECT_THAT(failures_of([&] { fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh()); }),
                  ::testing::ElementsAre(HasSubstr("fc1.weight: max abs diff")));
      fsdp::testing::shard_rows(weight, ctx.mesh()).sub_(1e-3);
      fsdp::testing::shard_rows(weight.grad(), ctx.mesh()).mul_(2);
      EXPECT_THAT(failures_of([&] { fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh()); }),
                  ::testing::ElementsAre(HasSubstr("fc1.weight (gradient)")));
      EXPECT_THAT(failures_of([&] {
                    fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh(), {.gradients = false});
                  }),
                  ::testing::IsEmpty());
      fsdp::testing::shard_rows(weight.grad(), ctx.mesh()).div_(2);
    }
    model->fc2->bias.mutable_grad() = at::Tensor();
    EXPECT_THAT(failures_of([&] { fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh()); }),
                ::testing::ElementsAre(HasSubstr("fc2.bias: no gradient where the reference has one")));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardedParity, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "WorldSize" + std::to_string(info.param); });

}  // namespace
