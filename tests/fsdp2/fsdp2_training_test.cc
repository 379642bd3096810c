// fully_shard training equals unsharded training: losses and final
// parameters of a sharded model over 1-4 real ranks match a single-process
// reference trained on the global batch.
#include <torch/nn/utils/clip_grad.h>

#include "fsdp2/clip_grad.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

struct TrainOptions {
  std::string name;
  ModelKind kind = ModelKind::kMlp;
  bool shard_blocks = true;
  std::optional<bool> reshard_after_forward;
  Optim optim = Optim::kSgd;
  int steps = 5;
  int micro_batches = 1;
  bool sync_only_last_micro_batch = false;
  double clip_max_norm = 0;
  bool optimizer_before_fully_shard = false;
};

constexpr int64_t kRowsPerMicroBatch = 12;  // divisible by every world size 1-4

void expect_training_matches_reference(testing::RankContext& ctx, const TrainOptions& o) {
  SCOPED_TRACE(o.name);
  const int rank = ctx.rank(), world = ctx.world_size();
  auto reference = make_model(o.kind);
  auto model = make_model(o.kind);
  std::unique_ptr<torch::optim::Optimizer> optim;
  // Parameters change in place, so an optimizer without state made before
  // fully_shard sees the shards.
  if (o.optimizer_before_fully_shard) optim = make_optimizer(o.optim, model->parameters());
  FullyShardOptions fs;
  fs.mesh = ctx.mesh();
  fs.reshard_after_forward = o.reshard_after_forward;
  if (o.shard_blocks) {
    for (auto& block : model->blocks()) fully_shard(block, fs);
  }
  FSDPModule root = fully_shard(model, fs);
  if (!optim) optim = make_optimizer(o.optim, model->parameters());
  auto ref_optim = make_optimizer(o.optim, reference->parameters());

  for (int step = 0; step < o.steps; ++step) {
    const Batch batch = make_batch(o.kind, step, kRowsPerMicroBatch * o.micro_batches);
    double ref_loss = 0;
    ref_optim->zero_grad();
    for (int m = 0; m < o.micro_batches; ++m) {
      const Batch mb = batch.slice(m, o.micro_batches);
      at::Tensor loss = reference->forward(mb.x, mb.y) / o.micro_batches;
      loss.backward();
      ref_loss += loss.item<double>();
    }
    double ref_norm = 0;
    if (o.clip_max_norm > 0) ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), o.clip_max_norm);
    ref_optim->step();

    double loss_sum = 0;
    optim->zero_grad();
    for (int m = 0; m < o.micro_batches; ++m) {
      if (o.sync_only_last_micro_batch) root.set_requires_gradient_sync(m == o.micro_batches - 1);
      const Batch local = batch.slice(m, o.micro_batches).slice(rank, world);
      at::Tensor loss = call_module(*model, local.x, local.y) / o.micro_batches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    if (o.clip_max_norm > 0) {
      const double norm = clip_grad_norm_(root, o.clip_max_norm);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << step;
    }
    optim->step();
    const double loss = mean_over_ranks(ctx, loss_sum);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss) + 1e-7) << "step " << step;
  }
  // The last step's gradients too: reduced, clipped, and still held.
  testing::expect_sharded_parity(*reference, *model, ctx.mesh());
}

class TrainingParity : public ::testing::TestWithParam<int> {};

TEST_P(TrainingParity, MlpMatchesUnshardedTraining) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_training_matches_reference(ctx, {.name = "every block + root, SGD"});
    expect_training_matches_reference(ctx, {.name = "root only, AdamW", .shard_blocks = false, .optim = Optim::kAdamW});
    expect_training_matches_reference(
        ctx, {.name = "reshard_after_forward=false, AdamW", .reshard_after_forward = false, .optim = Optim::kAdamW});
    expect_training_matches_reference(
        ctx,
        {.name = "optimizer built before fully_shard", .optim = Optim::kAdamW, .optimizer_before_fully_shard = true});
    expect_training_matches_reference(ctx, {.name = "clip_grad_norm_", .clip_max_norm = 0.05});
  });
}

TEST_P(TrainingParity, TransformerMatchesUnshardedTraining) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_training_matches_reference(
        ctx, {.name = "every block + root, AdamW", .kind = ModelKind::kTransformer, .optim = Optim::kAdamW});
    expect_training_matches_reference(ctx, {.name = "root only, SGD, reshard_after_forward=true",
                                            .kind = ModelKind::kTransformer,
                                            .shard_blocks = false,
                                            .reshard_after_forward = true});
    expect_training_matches_reference(ctx, {.name = "3 micro-batches, sync on each",
                                            .kind = ModelKind::kTransformer,
                                            .optim = Optim::kAdamW,
                                            .micro_batches = 3});
    expect_training_matches_reference(ctx, {.name = "3 micro-batches, sync on the last only",
                                            .kind = ModelKind::kTransformer,
                                            .optim = Optim::kAdamW,
                                            .micro_batches = 3,
                                            .sync_only_last_micro_batch = true});
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, TrainingParity, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
