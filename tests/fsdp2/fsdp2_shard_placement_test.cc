// FullyShardOptions::shard_placement_fn ([Note: shard dim],
// fsdp2/src/fsdp_param.h): weights sharded on dim 1 and biases on dim 0 in
// the same groups, on world sizes 1 to 4 (uneven chunks; the head's weight
// has 3 columns, so at 4 ranks one rank's chunk is empty), against an
// unsharded reference: every rank's sharded parameter and gradient are
// torch.chunk(reference, world, dim)[rank] of the reference's, training
// with AdamW (gradient accumulation with and without sync, clipping,
// reshard_after_forward = k, HSDP 2x2, bf16 compute with fp32 reduction)
// follows the reference, state dicts expose Shard(dim) DTensors and load
// back from sharded and full values and from a safetensors checkpoint, and
// bad placements are refused.
#include <sys/stat.h>

#include <cstdlib>
#include <optional>
#include <string>

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include "checkpoint/sharded.h"
#include "fsdp2/clip_grad.h"
#include "fsdp2/state_dict.h"
#include "fsdp2_test_util.h"
#include "shared_test_dir.h"

namespace fsdp::test {
namespace {

// MLP(3): 7 -> 13 -> 3 -> 3. Weights (13, 7), (3, 13), (3, 3) are sharded
// on their columns: 7, 13 and 3 columns, so at 4 ranks the head's weight
// chunks are 1, 1, 1, 0 columns; the biases (13, 3, 3 rows) stay on dim 0.
using ColumnNet = MLP;

std::shared_ptr<ColumnNet> make_net(int seed = 0) {
  torch::manual_seed(seed);
  return std::make_shared<ColumnNet>(/*width=*/3);
}

Batch make_net_batch(int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  return {at::randn({rows, 7}, gen), at::randn({rows, 3}, gen)};
}

// Weights on their last dim, the rest on the default.
std::optional<Placement> weights_by_column(const at::Tensor& p) {
  if (p.dim() == 2) return Placement::shard(p.dim() - 1);
  return std::nullopt;
}

int64_t expected_dim(const at::Tensor& full) { return full.dim() == 2 ? 1 : 0; }

// torch.chunk(full, parts, dim)[index], empty when chunk returns fewer.
at::Tensor chunk_of(const at::Tensor& full, int64_t dim, int64_t index, int64_t parts) {
  const auto chunks = full.chunk(parts, dim);
  if (index < static_cast<int64_t>(chunks.size())) return chunks[index];
  std::vector<int64_t> shape = full.sizes().vec();
  shape[dim] = 0;
  return at::empty(shape, full.options());
}

struct Sharded {
  std::shared_ptr<ColumnNet> model;
  std::vector<FSDPModule> blocks;
  std::optional<FSDPModule> root;
};

Sharded shard_net(const DeviceMesh& mesh, FullyShardOptions o = {}, int seed = 0, bool by_column = true) {
  Sharded s;
  s.model = make_net(seed);
  o.mesh = mesh;
  if (by_column) o.shard_placement_fn = weights_by_column;
  for (auto& b : s.model->blocks()) s.blocks.push_back(fully_shard(b, o));
  s.root = fully_shard(s.model, o);
  return s;
}

// This shard rank's index and the shard group's size (the mesh's last dim).
struct ShardPos {
  int64_t index;
  int64_t parts;
};
ShardPos shard_pos(const DeviceMesh& mesh) { return {mesh.coordinate().back(), mesh.size(mesh.ndim() - 1)}; }

// Each sharded parameter (shape and values) is its chunk of the reference's.
void expect_shards(torch::nn::Module& model, torch::nn::Module& reference, ShardPos pos, const std::string& when,
                   double rtol = 1e-5, double atol = 1e-6) {
  auto params = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    const at::Tensor full = item.value().detach();
    const at::Tensor expected = chunk_of(full, expected_dim(full), pos.index, pos.parts);
    expect_close(params[item.key()].detach(), expected, when + " " + item.key(), rtol, atol);
  }
}

// Each sharded gradient is its chunk of the reference's gradient.
void expect_grad_shards(torch::nn::Module& model, torch::nn::Module& reference, ShardPos pos, const std::string& when) {
  auto params = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    const at::Tensor full = item.value().grad();
    const at::Tensor& grad = params[item.key()].grad();
    ASSERT_TRUE(grad.defined()) << when << " " << item.key();
    expect_close(grad, chunk_of(full, expected_dim(full), pos.index, pos.parts), when + " " + item.key() + ".grad");
  }
}

// The unsharded bytes of `module`'s parameters: the full parameter for a
// column-sharded weight; for a row-sharded one its padded rows (all ranks'
// padded shards, as the all-gather output).
int64_t unsharded_bytes_of(torch::nn::Module& module, int64_t parts) {
  int64_t bytes = 0;
  for (const auto& p : module.parameters()) {
    int64_t numel = p.numel();
    if (expected_dim(p) == 0) numel = parts * ((p.size(0) + parts - 1) / parts) * (numel / p.size(0));
    bytes += numel * static_cast<int64_t>(p.element_size());
  }
  return bytes;
}

// Four AdamW steps of two micro-batches each (reducing every micro-batch on
// even steps, only the last on odd ones), clipping at step 2; the data is
// split over the data-parallel ranks (all of the mesh's).
void expect_training_matches(testing::RankContext& ctx, const DeviceMesh& mesh,
                             std::optional<ReshardAfterForward> reshard_after_forward = std::nullopt) {
  const ShardPos pos = shard_pos(mesh);
  auto reference = make_net();
  FullyShardOptions o;
  o.reshard_after_forward = reshard_after_forward;
  Sharded s = shard_net(mesh, o);
  expect_shards(*s.model, *reference, pos, "after fully_shard");
  torch::optim::AdamW optim(s.model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int step = 0; step < 4; ++step) {
    const std::string when = "step " + std::to_string(step);
    const Batch batch = make_net_batch(step, 24);
    ref_optim.zero_grad();
    optim.zero_grad();
    const bool sync_each = step % 2 == 0;
    for (int m = 0; m < 2; ++m) {
      const Batch mb = batch.slice(m, 2);
      at::Tensor ref_loss = reference->forward(mb.x, mb.y);
      ref_loss.backward();
      s.root->set_requires_gradient_sync(sync_each || m == 1);
      const Batch local = mb.slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*s.model, local.x, local.y);
      loss.backward();
      EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(), 1e-5) << when;
    }
    expect_grad_shards(*s.model, *reference, pos, when);
    if (step == 2) {
      const double norm = clip_grad_norm_(*s.root, 0.05);
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "the norm over every rank's chunks";
      EXPECT_LT(0.05, ref_norm) << "the test must clip";
      expect_grad_shards(*s.model, *reference, pos, "clipped");
    }
    ref_optim.step();
    optim.step();
    expect_shards(*s.model, *reference, pos, when);
  }
  if (pos.parts == 1) {
    // One shard rank: the chunk on any dim is the whole parameter, so the
    // world size 1 fast path applies (no collective).
    EXPECT_EQ(s.root->runtime_stats().all_gathers, 0);
    EXPECT_EQ(s.root->runtime_stats().reduce_scatters, 0);
  }
  // Explicit unshards: the full parameters, in memory sized as them.
  s.root->unshard();
  EXPECT_EQ(s.root->unsharded_bytes(), unsharded_bytes_of(*reference->head, pos.parts));
  expect_close(s.model->head->weight.detach(), reference->named_parameters()["head.weight"].detach(), "head.weight");
  expect_close(s.model->head->bias.detach(), reference->named_parameters()["head.bias"].detach(), "head.bias");
  s.root->reshard();
  EXPECT_EQ(s.root->unsharded_bytes(), 0);
  s.blocks[1].unshard();
  EXPECT_EQ(s.blocks[1].unsharded_bytes(), unsharded_bytes_of(*reference->b1, pos.parts));
  expect_close(s.model->b1->fc->weight.detach(), reference->named_parameters()["b1.fc.weight"].detach(),
               "b1.fc.weight");
  s.blocks[1].reshard();
}

TEST(ShardPlacement, ShardsAndTrainingMatchUnshardedReference) {
  for (int world : {1, 2, 3, 4}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    testing::run_distributed(world, [](testing::RankContext& ctx) { expect_training_matches(ctx, ctx.mesh()); });
  }
}

// reshard_after_forward = 2 at 4 ranks: each rank keeps its pair's padded
// chunks after forward, cut from the unsharded parameter along the dim.
TEST(ShardPlacement, ReshardAfterForwardToSmallerWorld) {
  testing::run_distributed(
      4, [](testing::RankContext& ctx) { expect_training_matches(ctx, ctx.mesh(), ReshardAfterForward(2)); });
}

// HSDP: sharded on dim 1 within each replica pair, replicated across.
TEST(ShardPlacement, Hsdp2x2) {
  testing::run_distributed(4, [](testing::RankContext& ctx) {
    const DeviceMesh mesh = init_device_mesh(ctx.world(), c10::kCPU, {2, 2}, {"replicate", "shard"});
    expect_training_matches(ctx, mesh);
    Sharded s = shard_net(mesh);
    const StateDict sd = get_model_state_dict(*s.model);
    const std::vector<Placement> expected{Placement::replicate(), Placement::shard(1)};
    EXPECT_EQ(sd.at("b0.fc.weight").dtensor().placements(), expected);
    EXPECT_EQ(sd.at("b0.fc.bias").dtensor().placements(),
              (std::vector<Placement>{Placement::replicate(), Placement::shard(0)}));
    auto reference = make_net();
    expect_close(sd.at("head.weight").dtensor().full_tensor(), reference->head->weight.detach(), "head.weight");
  });
}

// bf16 unsharded parameters, fp32 reduction and master weights, against the
// same casts without sharding: each rank's slice computed by a bf16 copy of
// the fp32 masters, the bf16 gradients averaged in fp32.
TEST(ShardPlacement, Bf16ComputeFp32Reduction) {
  for (int world : {3, 4}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    testing::run_distributed(world, [](testing::RankContext& ctx) {
      const ShardPos pos = shard_pos(ctx.mesh());
      auto master = make_net();
      auto compute = make_net();
      compute->to(at::kBFloat16);
      FullyShardOptions o;
      o.mp_policy.param_dtype = at::kBFloat16;
      o.mp_policy.reduce_dtype = at::kFloat;
      o.mp_policy.output_dtype = at::kFloat;
      Sharded s = shard_net(ctx.mesh(), o);
      torch::optim::SGD optim(s.model->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD ref_optim(master->parameters(), torch::optim::SGDOptions(0.1));
      const int world = ctx.world_size();
      for (int step = 0; step < 3; ++step) {
        const Batch batch = make_net_batch(step, 12);
        {
          c10::NoGradGuard no_grad;
          auto src = master->parameters();
          auto dst = compute->parameters();
          for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
        }
        std::vector<at::Tensor> sums;
        for (int r = 0; r < world; ++r) {
          for (auto& p : compute->parameters()) p.mutable_grad() = at::Tensor();
          const Batch b = batch.slice(r, world);
          compute->forward(b.x.to(at::kBFloat16), b.y.to(at::kBFloat16)).backward();
          auto params = compute->parameters();
          sums.resize(params.size());
          for (size_t i = 0; i < params.size(); ++i) {
            const at::Tensor g = params[i].grad().to(at::kFloat);
            sums[i] = sums[i].defined() ? sums[i] + g : g;
          }
        }
        auto masters = master->parameters();
        for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = sums[i] / world;

        optim.zero_grad();
        const Batch local = batch.slice(ctx.rank(), world);
        call_module(*s.model, local.x, local.y).backward();
        for (const auto& p : s.model->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
        auto params = s.model->named_parameters();
        for (const auto& item : master->named_parameters()) {
          const at::Tensor full = item.value().grad();
          expect_close(params[item.key()].grad(), chunk_of(full, expected_dim(full), pos.index, pos.parts),
                       item.key() + ".grad", /*rtol=*/1e-3, /*atol=*/1e-5);
        }
        ref_optim.step();
        optim.step();
        expect_shards(*s.model, *master, pos, "step " + std::to_string(step), 1e-4, 1e-6);
      }
      s.root->unshard();
      EXPECT_EQ(s.model->head->weight.scalar_type(), at::kBFloat16);
      expect_close(s.model->head->weight.detach().to(at::kFloat), master->head->weight.detach(), "bf16 head.weight",
                   1e-2, 1e-3);
      s.root->reshard();
    });
  }
}

// Sharded and full state dicts of the model and the optimizer, and loads
// from both into a model initialized differently, on the same layout and
// on dim 0 (which reshards the Shard(1) values).
TEST(ShardPlacement, StateDictRoundTrip) {
  for (int world : {3, 4}) {
    SCOPED_TRACE("world size " + std::to_string(world));
    testing::run_distributed(world, [](testing::RankContext& ctx) {
      const ShardPos pos = shard_pos(ctx.mesh());
      auto reference = make_net();
      Sharded s = shard_net(ctx.mesh());
      const StateDict sd = get_model_state_dict(*s.model);
      for (const auto& item : reference->named_parameters()) {
        const at::Tensor full = item.value().detach();
        const StateValue& v = sd.at(item.key());
        ASSERT_TRUE(v.is_dtensor()) << item.key();
        EXPECT_EQ(v.dtensor().placements(), std::vector<Placement>{Placement::shard(expected_dim(full))}) << item.key();
        EXPECT_EQ(v.global_shape(), full.sizes().vec()) << item.key();
        expect_close(v.local(), chunk_of(full, expected_dim(full), pos.index, pos.parts), item.key() + " local");
        expect_close(v.dtensor().full_tensor(), full, item.key() + " full_tensor");
      }
      StateDictOptions full_opts;
      full_opts.full_state_dict = true;
      const StateDict full_sd = get_model_state_dict(*s.model, full_opts);
      for (const auto& item : reference->named_parameters()) {
        ASSERT_FALSE(full_sd.at(item.key()).is_dtensor());
        expect_close(full_sd.at(item.key()).local(), item.value().detach(), item.key() + " full");
      }
      for (bool by_column : {true, false}) {
        for (bool from_full : {true, false}) {
          SCOPED_TRACE(std::string(by_column ? "into Shard(1)" : "into Shard(0)") +
                       (from_full ? " from full values" : " from sharded values"));
          Sharded other = shard_net(ctx.mesh(), {}, /*seed=*/1, by_column);
          set_model_state_dict(*other.model, from_full ? full_sd : sd);
          auto params = other.model->named_parameters();
          for (const auto& item : reference->named_parameters()) {
            const at::Tensor full = item.value().detach();
            const int64_t dim = by_column ? expected_dim(full) : 0;
            expect_close(params[item.key()].detach(), chunk_of(full, dim, pos.index, pos.parts), item.key());
          }
          // The unsharded parameters see the loaded values.
          other.root->unshard();
          expect_close(other.model->head->weight.detach(), reference->head->weight.detach(), "unsharded head.weight");
          other.root->reshard();
        }
      }
      // Optimizer state follows the parameter's layout (the step changes
      // the parameters, so `sd`, which shares their storage, is done).
      torch::optim::AdamW optim(s.model->parameters(), torch::optim::AdamWOptions(1e-2));
      const Batch local = make_net_batch(0, 12).slice(ctx.rank(), ctx.world_size());
      call_module(*s.model, local.x, local.y).backward();
      optim.step();
      const OptimizerStateDict osd = get_optimizer_state_dict(*s.model, optim);
      EXPECT_EQ(osd.state.at("state.head.weight.exp_avg").dtensor().placements(),
                std::vector<Placement>{Placement::shard(1)});
      const StateDict trained = get_model_state_dict(*s.model, full_opts);

      // Optimizer state round trip on the trained model.
      Sharded again = shard_net(ctx.mesh(), {}, /*seed=*/1);
      set_model_state_dict(*again.model, trained);
      torch::optim::AdamW again_optim(again.model->parameters(), torch::optim::AdamWOptions(1e-2));
      set_optimizer_state_dict(*again.model, again_optim, osd);
      const OptimizerStateDict back = get_optimizer_state_dict(*again.model, again_optim);
      for (const auto& [key, value] : osd.state) {
        expect_close(back.state.at(key).local(), value.local(), key, 0, 0);
      }
    });
  }
}

// A safetensors sharded checkpoint of Shard(1) parameters (each file holds
// column blocks at their offsets) saved at 3 ranks loads at 2 ranks into
// column-sharded and row-sharded models.
TEST(ShardPlacement, SafetensorsShardedCheckpointAcrossWorldSizes) {
  SharedTestDir dir("FSDP2CPP_PLACEMENT_TEST_DIR");
  ASSERT_FALSE(dir.path().empty());
  testing::run_distributed(3, [&](testing::RankContext& ctx) {
    Sharded s = shard_net(ctx.mesh());
    checkpoint::save_sharded(get_model_state_dict(*s.model), dir.path(), ctx.rank());
  });
  testing::run_distributed(2, [&](testing::RankContext& ctx) {
    const ShardPos pos = shard_pos(ctx.mesh());
    auto reference = make_net();
    for (bool by_column : {true, false}) {
      SCOPED_TRACE(by_column ? "into Shard(1)" : "into Shard(0)");
      Sharded s = shard_net(ctx.mesh(), {}, /*seed=*/1, by_column);
      StateDict sd = get_model_state_dict(*s.model);
      checkpoint::load_sharded(sd, dir.path());
      set_model_state_dict(*s.model, sd);
      auto params = s.model->named_parameters();
      for (const auto& item : reference->named_parameters()) {
        const at::Tensor full = item.value().detach();
        const int64_t dim = by_column ? expected_dim(full) : 0;
        expect_close(params[item.key()].detach(), chunk_of(full, dim, pos.index, pos.parts), item.key(), 0, 0);
      }
    }
  });
}

TEST(ShardPlacement, BadPlacementsAreRefused) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto check = [&](std::function<std::optional<Placement>(const at::Tensor&)> fn, const char* what,
                     const char* placement) {
      auto model = make_net();
      FullyShardOptions o;
      o.mesh = ctx.mesh();
      o.shard_placement_fn = std::move(fn);
      EXPECT_THROW_WITH(fully_shard(model->b1, o), "shard_placement_fn", "'fc.weight'", what, placement);
    };
    check([](const at::Tensor&) { return Placement::replicate(); }, "must return a Shard placement", "Replicate()");
    check([](const at::Tensor&) { return Placement::partial(); }, "must return a Shard placement", "Partial(");
    check([](const at::Tensor&) { return Placement::shard(2); }, "has no dim 2", "[0, 1]");
    check([](const at::Tensor&) { return Placement::shard(5); }, "Shard(5)", "of shape [3, 13]");
    // A 0-dim parameter is one row: dim 0 only.
    auto scalar = std::make_shared<torch::nn::Module>();
    scalar->register_parameter("s", at::ones({}));
    FullyShardOptions o;
    o.mesh = ctx.mesh();
    o.shard_placement_fn = [](const at::Tensor&) { return Placement::shard(1); };
    EXPECT_THROW_WITH(fully_shard(scalar, o), "'s'", "has no dim 1");
    // Nothing was sharded by a refused call: a valid one still works.
    auto model = make_net();
    o.shard_placement_fn = weights_by_column;
    FSDPModule b1 = fully_shard(model->b1, o);
    EXPECT_EQ(model->b1->fc->weight.size(1), ctx.rank() == 0 ? 7 : 6);
  });
}

}  // namespace
}  // namespace fsdp::test
