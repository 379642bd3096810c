// FQN state dicts of sharded models and optimizers (fsdp2/state_dict.h),
// against unsharded references on real ranks: sharded and full values,
// loading from full, broadcast and resharded state dicts, optimizer
// round trips, strictness errors, and torch::load / Module::to on sharded
// modules.
#include "fsdp2/state_dict.h"

#include <cstdio>
#include <string>

#include <torch/optim/adam.h>
#include <torch/optim/rmsprop.h>
#include <torch/serialize.h>
#include <unistd.h>

#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

enum class Kind { kAdamW, kAdam, kSgd };

std::string kind_name(Kind k) {
  switch (k) {
    case Kind::kAdamW: return "AdamW";
    case Kind::kAdam: return "AdamAmsgrad";
    case Kind::kSgd: return "SgdMomentum";
  }
  return "";
}

std::unique_ptr<torch::optim::Optimizer> make_optim(Kind k, std::vector<at::Tensor> params, double lr) {
  switch (k) {
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(std::move(params),
                                                   torch::optim::AdamWOptions(lr).weight_decay(0.01));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(lr).amsgrad(true));
    case Kind::kSgd:
      return std::make_unique<torch::optim::SGD>(std::move(params),
                                                 torch::optim::SGDOptions(lr).momentum(0.9).nesterov(true));
  }
  return nullptr;
}

// The MLP (weights of 13, 10 and 3 rows) with every block and the root
// sharded over `mesh`; `seed` changes the initial values.
std::shared_ptr<LossModel> sharded_mlp(const DeviceMesh& mesh, uint64_t seed = 0) {
  torch::manual_seed(seed);
  auto model = std::make_shared<MLP>();
  FullyShardOptions fs;
  fs.mesh = mesh;
  for (auto& block : model->blocks()) fully_shard(block, fs);
  fully_shard(model, fs);
  return model;
}

// One training step on this rank's slice of the global batch of `step`.
double train_step(testing::RankContext& ctx, LossModel& model, torch::optim::Optimizer& optim, int step) {
  const Batch batch = make_batch(ModelKind::kMlp, step, 12).slice(ctx.rank(), ctx.world_size());
  optim.zero_grad();
  at::Tensor loss = call_module(model, batch.x, batch.y);
  loss.backward();
  optim.step();
  return loss.item<double>();
}

double reference_step(LossModel& model, torch::optim::Optimizer& optim, int step) {
  const Batch batch = make_batch(ModelKind::kMlp, step, 12);
  optim.zero_grad();
  at::Tensor loss = model.forward(batch.x, batch.y);
  loss.backward();
  optim.step();
  return loss.item<double>();
}

std::vector<Placement> fsdp_placements(const DeviceMesh& mesh) {
  if (mesh.ndim() == 2) return {Placement::replicate(), Placement::shard(0)};
  return {Placement::shard(0)};
}

// This rank's torch.chunk rows of `full` along dim 0 over the mesh's shard dim.
at::Tensor chunk_rows(const at::Tensor& full, const DeviceMesh& mesh) {
  const int64_t shard_dim = mesh.ndim() - 1;
  const ChunkExtent ext = chunk_extent(full.size(0), mesh.size(shard_dim), mesh.local_rank(shard_dim));
  return full.narrow(0, ext.offset, ext.length);
}

StateDict plain_state_dict(torch::nn::Module& model) {
  StateDict sd;
  for (const auto& item : model.named_parameters()) sd.insert(item.key(), item.value().detach().clone());
  return sd;
}

// Checks the sharded state dict of `model` against `reference` (unsharded,
// same values): keys in named_parameters order, DTensor layout, local rows
// equal to the reference's chunk and sharing storage with the (sharded)
// parameter.
void expect_sharded_state_dict(torch::nn::Module& model, torch::nn::Module& reference, const DeviceMesh& mesh,
                               bool check_write_through = true) {
  StateDict sd = get_model_state_dict(model);
  auto ref_params = reference.named_parameters();
  ASSERT_EQ(sd.keys(), ref_params.keys());
  auto params = model.named_parameters();
  for (const auto& [fqn, value] : sd) {
    SCOPED_TRACE(fqn);
    ASSERT_TRUE(value.is_dtensor());
    const DTensor& dt = value.dtensor();
    const at::Tensor& ref = ref_params[fqn];
    EXPECT_EQ(dt.shape(), ref.sizes().vec());
    EXPECT_EQ(dt.placements(), fsdp_placements(mesh));
    EXPECT_TRUE(dt.to_local().equal(chunk_rows(ref.detach(), mesh)));
    // Writing through the state dict writes the sharded parameter.
    at::Tensor p = params[fqn];
    if (!check_write_through || dt.to_local().numel() == 0) continue;
    c10::NoGradGuard no_grad;
    const at::Tensor saved = dt.to_local().clone();
    dt.to_local().add_(1.0);
    EXPECT_TRUE(p.detach().equal(saved + 1.0));
    dt.to_local().copy_(saved);
  }
}

class ModelStateDict : public ::testing::TestWithParam<int> {};

TEST_P(ModelStateDict, ShardedAndFullValuesMatchTheUnshardedModel) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    auto model = sharded_mlp(ctx.mesh());
    // Before the first forward: FQNs come from the model, not lazy init.
    expect_sharded_state_dict(*model, *reference, ctx.mesh());

    // After training both, and while the root group is unsharded.
    auto optim = make_optim(Kind::kAdamW, model->parameters(), 1e-2);
    auto ref_optim = make_optim(Kind::kAdamW, reference->parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) {
      train_step(ctx, *model, *optim, step);
      reference_step(*reference, *ref_optim, step);
    }
    // Copy the (tolerance-equal) trained values into the reference exactly
    // so the rest can compare bit for bit.
    StateDictOptions full;
    full.full_state_dict = true;
    StateDict full_sd = get_model_state_dict(*model, full);
    auto ref_params = reference->named_parameters();
    ASSERT_EQ(full_sd.keys(), ref_params.keys());
    for (const auto& [fqn, value] : full_sd) {
      ASSERT_FALSE(value.is_dtensor()) << fqn;
      expect_close(value.local(), ref_params[fqn].detach(), fqn);
      c10::NoGradGuard no_grad;
      ref_params[fqn].copy_(value.local());
    }
    FSDPModule root = *fsdp_module_of(*model);
    root.unshard();
    EXPECT_EQ(model->named_parameters()["head.weight"].sizes(), reference->named_parameters()["head.weight"].sizes());
    expect_sharded_state_dict(*model, *reference, ctx.mesh(), /*check_write_through=*/false);
    root.reshard();

    // cpu_offload: only rank 0 keeps the full values.
    full.cpu_offload = true;
    StateDict offloaded = get_model_state_dict(*model, full);
    if (ctx.rank() == 0) {
      ASSERT_EQ(offloaded.keys(), ref_params.keys());
      for (const auto& [fqn, value] : offloaded) {
        EXPECT_TRUE(value.local().is_cpu());
        EXPECT_TRUE(value.local().equal(ref_params[fqn])) << fqn;
      }
    } else {
      EXPECT_TRUE(offloaded.empty());
    }
  });
}

TEST_P(ModelStateDict, LoadsFromFullBroadcastAndReshardedStateDicts) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    const StateDict ref_sd = plain_state_dict(*reference);
    const DeviceMesh& mesh = ctx.mesh();
    auto expect_loaded = [&](LossModel& model, const char* what) {
      SCOPED_TRACE(what);
      expect_params_match(model, *reference, mesh, 0, 0);
    };
    auto model = sharded_mlp(mesh, /*seed=*/7);
    const std::vector<at::Tensor> params_before = model->parameters();
    auto optim = make_optim(Kind::kAdamW, model->parameters(), 1e-2);

    IncompatibleKeys keys = set_model_state_dict(*model, ref_sd);
    EXPECT_TRUE(keys.missing_keys.empty() && keys.unexpected_keys.empty());
    expect_loaded(*model, "full tensors");
    // Loaded in place: the same parameter objects.
    const std::vector<at::Tensor> params_after = model->parameters();
    for (size_t i = 0; i < params_before.size(); ++i) {
      EXPECT_EQ(params_after[i].unsafeGetTensorImpl(), params_before[i].unsafeGetTensorImpl());
    }

    // Broadcast from rank 0: the others pass an empty state dict.
    auto model2 = sharded_mlp(mesh, /*seed=*/8);
    StateDictOptions bcast;
    bcast.full_state_dict = true;
    bcast.broadcast_from_rank0 = true;
    set_model_state_dict(*model2, ctx.rank() == 0 ? ref_sd : StateDict(), bcast);
    expect_loaded(*model2, "broadcast from rank 0");

    // DTensors of another layout: Shard(1) over the same mesh (Replicate
    // for 1-D tensors) needs a gather.
    StateDict other;
    for (const auto& [fqn, value] : ref_sd) {
      const at::Tensor& full = value.local();
      other.insert(fqn, distribute_tensor(full, mesh, {full.dim() > 1 ? Placement::shard(1) : Placement::replicate()}));
    }
    auto model3 = sharded_mlp(mesh, /*seed=*/9);
    set_model_state_dict(*model3, other);
    expect_loaded(*model3, "Shard(1) DTensors");

    if (ctx.world_size() == 4) {
      // A state dict sharded over 2 ranks (as saved by a run of world size
      // 2), held here on the "shard" dim of a 2x2 mesh, into a 4-way model.
      DeviceMesh sub = init_device_mesh(ctx.world(), c10::kCPU, {2, 2}, {"replicate", "shard"})["shard"];
      StateDict two_way;
      for (const auto& [fqn, value] : ref_sd)
        two_way.insert(fqn, distribute_tensor(value.local(), sub, {Placement::shard(0)}));
      auto model4 = sharded_mlp(mesh, /*seed=*/10);
      set_model_state_dict(*model4, two_way);
      expect_loaded(*model4, "DTensors of world size 2");
    }

    // A loaded model trains like the reference.
    auto ref_optim = make_optim(Kind::kAdamW, reference->parameters(), 1e-2);
    const double ref_loss = reference_step(*reference, *ref_optim, 0);
    const double loss = train_step(ctx, *model, *optim, 0);
    EXPECT_NEAR(mean_over_ranks(ctx, loss), ref_loss, 1e-6 * std::abs(ref_loss));
    expect_params_match(*model, *reference, mesh);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ModelStateDict, ::testing::Values(1, 2, 3, 4));

TEST(ModelStateDictHsdp, ReplicateShardPlacementsAndLoadFromA1DMesh) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    auto model = sharded_mlp(ctx.mesh());
    expect_sharded_state_dict(*model, *reference, ctx.mesh());
    StateDictOptions full;
    full.full_state_dict = true;
    for (const auto& [fqn, value] : get_model_state_dict(*model, full)) {
      EXPECT_TRUE(value.local().equal(reference->named_parameters()[fqn])) << fqn;
    }
    // From DTensors sharded 4 ways over a 1-D mesh (another mesh).
    auto loaded = sharded_mlp(ctx.mesh(), /*seed=*/3);
    DeviceMesh flat = init_device_mesh(ctx.world(), c10::kCPU, {4});
    StateDict four_way;
    for (const auto& item : reference->named_parameters()) {
      four_way.insert(item.key(), distribute_tensor(item.value().detach(), flat, {Placement::shard(0)}));
    }
    set_model_state_dict(*loaded, four_way);
    expect_params_match(*loaded, *reference, ctx.mesh(), 0, 0);
  });
}

// --- optimizer ---------------------------------------------------------------

struct OptimCase {
  Kind kind;
  int world_size;
};

class OptimizerStateDictTest : public ::testing::TestWithParam<OptimCase> {};

TEST_P(OptimizerStateDictTest, RoundTripIsBitExactAndFullStateMatchesTheReference) {
  const Kind kind = GetParam().kind;
  testing::run_distributed(GetParam().world_size, [kind](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    auto model = sharded_mlp(ctx.mesh());
    auto optim = make_optim(kind, model->parameters(), 1e-2);
    auto ref_optim = make_optim(kind, reference->parameters(), 1e-2);
    const size_t num_params = model->parameters().size();

    // Unstepped: state is created (zeros, step 0) without taking a step.
    StateDictOptions full;
    full.full_state_dict = true;
    const StateDict before = get_model_state_dict(*model, full);
    OptimizerStateDict fresh = get_optimizer_state_dict(*model, *optim);
    EXPECT_EQ(optim->state().size(), num_params);
    for (const auto& [key, value] : fresh.state) {
      EXPECT_EQ(value.local().abs().sum().item<double>(), 0.0) << key;
      if (key.size() > 5 && key.substr(key.size() - 5) == ".step") {
        EXPECT_EQ(value.local().dim(), 0) << key;
      }
    }
    EXPECT_EQ(fresh.state.size(), num_params * (kind == Kind::kSgd ? 1 : kind == Kind::kAdam ? 4 : 3));
    for (const auto& [fqn, value] : get_model_state_dict(*model, full)) {
      EXPECT_TRUE(value.local().equal(before.at(fqn).local())) << "a parameter changed: " << fqn;
    }
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());

    for (int step = 0; step < 3; ++step) {
      train_step(ctx, *model, *optim, step);
      reference_step(*reference, *ref_optim, step);
    }
    // Full state equals the unsharded reference optimizer's (whose state
    // dict is taken on a model without fully_shard).
    OptimizerStateDict full_osd = get_optimizer_state_dict(*model, *optim, full);
    OptimizerStateDict ref_osd = get_optimizer_state_dict(*reference, *ref_optim);
    ASSERT_EQ(full_osd.state.keys(), ref_osd.state.keys());
    for (const auto& [key, value] : ref_osd.state) {
      const at::Tensor& got = full_osd.state.at(key).local();
      expect_close(got, value.local(), key, 1e-4, 1e-7);
      if (key.find(".step") != std::string::npos) {
        EXPECT_EQ(got.item<float>(), 3.0f) << key;
      }
    }
    EXPECT_EQ(full_osd.param_groups, ref_osd.param_groups);
    const auto groups = parse_param_groups(full_osd.param_groups);
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups[0].params, reference->named_parameters().keys());
    EXPECT_EQ(groups[0].numbers.at("lr"), 1e-2);

    // Round trip: a fresh model and optimizer (other values, other lr) load
    // the sharded state dicts and continue exactly as the original.
    const StateDict model_sd = get_model_state_dict(*model);
    const OptimizerStateDict osd = get_optimizer_state_dict(*model, *optim);
    for (const auto& [key, value] : osd.state) {
      if (key.find(".step") == std::string::npos) {
        EXPECT_TRUE(value.is_dtensor()) << key;
      }
    }
    auto model2 = sharded_mlp(ctx.mesh(), /*seed=*/5);
    auto optim2 = make_optim(kind, model2->parameters(), 0.5);
    set_model_state_dict(*model2, model_sd);
    set_optimizer_state_dict(*model2, *optim2, osd);
    EXPECT_EQ(optim2->param_groups()[0].options().get_lr(), 1e-2);
    for (int step = 3; step < 6; ++step) {
      const double a = train_step(ctx, *model, *optim, step);
      const double b = train_step(ctx, *model2, *optim2, step);
      EXPECT_EQ(a, b) << "step " << step;
    }
    const StateDict end1 = get_model_state_dict(*model, full);
    const StateDict end2 = get_model_state_dict(*model2, full);
    for (const auto& [fqn, value] : end1) EXPECT_TRUE(value.local().equal(end2.at(fqn).local())) << fqn;
    const OptimizerStateDict o1 = get_optimizer_state_dict(*model, *optim, full);
    const OptimizerStateDict o2 = get_optimizer_state_dict(*model2, *optim2, full);
    for (const auto& [key, value] : o1.state) EXPECT_TRUE(value.local().equal(o2.state.at(key).local())) << key;

    // From the full (consolidated) state broadcast by rank 0 into a third
    // optimizer: the same state.
    auto model3 = sharded_mlp(ctx.mesh(), /*seed=*/6);
    auto optim3 = make_optim(kind, model3->parameters(), 0.5);
    StateDictOptions bcast = full;
    bcast.broadcast_from_rank0 = true;
    set_optimizer_state_dict(*model3, *optim3, ctx.rank() == 0 ? o1 : OptimizerStateDict{}, bcast);
    const OptimizerStateDict o3 = get_optimizer_state_dict(*model3, *optim3, full);
    for (const auto& [key, value] : o1.state) EXPECT_TRUE(value.local().equal(o3.state.at(key).local())) << key;
    EXPECT_EQ(o3.param_groups, o1.param_groups);
  });
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OptimizerStateDictTest,
                         ::testing::Values(OptimCase{Kind::kAdamW, 3}, OptimCase{Kind::kAdam, 2},
                                           OptimCase{Kind::kSgd, 4}, OptimCase{Kind::kAdamW, 1}),
                         [](const auto& info) {
                           return kind_name(info.param.kind) + "_" + std::to_string(info.param.world_size);
                         });

// What each optimizer-state key means, read from the optimizer itself rather
// than through get_optimizer_state_dict's naming on both sides: after a few
// AdamW steps, the full state dict's state.<fqn>.exp_avg is the unsharded
// reference AdamW's exp_avg() of that parameter, exp_avg_sq its
// exp_avg_sq() and step its step(); in the sharded state dict each rank's
// local rows are its torch.chunk rows of those tensors.
class OptimizerStateKeys : public ::testing::TestWithParam<int> {};

TEST_P(OptimizerStateKeys, AdamWKeysHoldTheReferenceOptimizersOwnMoments) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto reference = make_model(ModelKind::kMlp);
    auto model = sharded_mlp(ctx.mesh());
    torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    constexpr int kSteps = 3;
    for (int step = 0; step < kSteps; ++step) {
      train_step(ctx, *model, optim, step);
      reference_step(*reference, ref_optim, step);
    }
    StateDictOptions full;
    full.full_state_dict = true;
    const OptimizerStateDict full_osd = get_optimizer_state_dict(*model, optim, full);
    const OptimizerStateDict sharded_osd = get_optimizer_state_dict(*model, optim);
    const auto ref_params = reference->named_parameters();
    ASSERT_EQ(full_osd.state.size(), 3 * ref_params.size());
    for (const auto& item : ref_params) {
      const std::string prefix = "state." + item.key() + ".";
      SCOPED_TRACE(prefix);
      auto it = ref_optim.state().find(item.value().unsafeGetTensorImpl());
      ASSERT_NE(it, ref_optim.state().end());
      const auto& ref_state = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      ASSERT_EQ(ref_state.step(), kSteps);
      // The two moments differ by orders of magnitude (exp_avg_sq is about
      // the square of exp_avg), so a swapped name cannot pass.
      expect_close(full_osd.state.at(prefix + "exp_avg").local(), ref_state.exp_avg(), prefix + "exp_avg", 1e-4, 1e-7);
      expect_close(full_osd.state.at(prefix + "exp_avg_sq").local(), ref_state.exp_avg_sq(), prefix + "exp_avg_sq",
                   1e-4, 1e-9);
      const at::Tensor& step = full_osd.state.at(prefix + "step").local();
      EXPECT_EQ(step.dim(), 0);
      EXPECT_EQ(step.scalar_type(), at::kFloat);
      EXPECT_EQ(step.item<float>(), static_cast<float>(ref_state.step()));

      const StateValue& avg = sharded_osd.state.at(prefix + "exp_avg");
      const StateValue& avg_sq = sharded_osd.state.at(prefix + "exp_avg_sq");
      ASSERT_TRUE(avg.is_dtensor() && avg_sq.is_dtensor());
      expect_close(avg.dtensor().to_local(), chunk_rows(ref_state.exp_avg(), ctx.mesh()), prefix + "exp_avg (local)",
                   1e-4, 1e-7);
      expect_close(avg_sq.dtensor().to_local(), chunk_rows(ref_state.exp_avg_sq(), ctx.mesh()),
                   prefix + "exp_avg_sq (local)", 1e-4, 1e-9);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, OptimizerStateKeys, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) { return "ws" + std::to_string(info.param); });

TEST(OptimizerStateDictReshard, SavedAtFourLoadsAtTwoOnTheSubMesh) {
  // Optimizer state saved 4 ways, loaded into a model sharded 2 ways (each
  // replica of a 2x2 mesh's "shard" dim): same full state.
  testing::run_distributed(4, [](testing::RankContext& ctx) {
    auto model = sharded_mlp(ctx.mesh());
    auto optim = make_optim(Kind::kAdamW, model->parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) train_step(ctx, *model, *optim, step);
    const OptimizerStateDict osd = get_optimizer_state_dict(*model, *optim);
    StateDictOptions full;
    full.full_state_dict = true;
    const OptimizerStateDict expected = get_optimizer_state_dict(*model, *optim, full);

    DeviceMesh two = init_device_mesh(ctx.world(), c10::kCPU, {2, 2}, {"replicate", "shard"})["shard"];
    auto model2 = sharded_mlp(two, /*seed=*/4);
    auto optim2 = make_optim(Kind::kAdamW, model2->parameters(), 1.0);
    set_optimizer_state_dict(*model2, *optim2, osd);
    const OptimizerStateDict got = get_optimizer_state_dict(*model2, *optim2, full);
    ASSERT_EQ(got.state.keys(), expected.state.keys());
    for (const auto& [key, value] : expected.state) EXPECT_TRUE(value.local().equal(got.state.at(key).local())) << key;
    EXPECT_EQ(got.param_groups, expected.param_groups);
  });
}

// --- errors and special parameters --------------------------------------------

// A linear layer whose weight is also registered as "alias", and a 0-dim
// parameter.
struct TiedImpl : torch::nn::Module {
  TiedImpl() : fc(register_module("fc", torch::nn::Linear(4, 5))) {
    register_parameter("alias", fc->weight);
    scale = register_parameter("scale", at::full({}, 2.5));
    register_buffer("count", at::arange(3));
  }
  torch::nn::Linear fc;
  at::Tensor scale;
};

TEST(StateDictErrors, StrictMissingUnexpectedShapeDtypeAndOptimizerClass) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto model = sharded_mlp(ctx.mesh(), /*seed=*/11);
    auto reference = make_model(ModelKind::kMlp);
    StateDict sd = plain_state_dict(*reference);
    StateDictOptions full;
    full.full_state_dict = true;
    const StateDict original = get_model_state_dict(*model, full);
    auto expect_unchanged = [&] {
      for (const auto& [fqn, value] : get_model_state_dict(*model, full)) {
        EXPECT_TRUE(value.local().equal(original.at(fqn).local())) << "half-loaded: " << fqn;
      }
    };
    StateDict missing;
    StateDict unexpected = sd;
    unexpected.insert("b9.fc.weight", at::zeros({2}));
    for (const auto& [fqn, value] : sd) {
      if (fqn != "head.bias") missing.insert(fqn, value);
    }
    EXPECT_THROW_WITH(set_model_state_dict(*model, missing), "missing key", "'head.bias'");
    EXPECT_THROW_WITH(set_model_state_dict(*model, unexpected), "unexpected key", "'b9.fc.weight'");
    StateDict bad_shape = sd;
    bad_shape.insert_or_assign("b1.fc.weight", at::zeros({10, 12}));
    EXPECT_THROW_WITH(set_model_state_dict(*model, bad_shape), "'b1.fc.weight'", "[10, 12]", "[10, 13]");
    StateDict bad_dtype = sd;
    bad_dtype.insert_or_assign("b0.fc.bias", at::zeros({13}, at::kDouble));
    EXPECT_THROW_WITH(set_model_state_dict(*model, bad_dtype), "'b0.fc.bias'", "Double", "Float");
    expect_unchanged();

    StateDictOptions lenient;
    lenient.strict = false;
    IncompatibleKeys keys = set_model_state_dict(*model, missing, lenient);
    EXPECT_EQ(keys.missing_keys, std::vector<std::string>{"head.bias"});
    EXPECT_TRUE(keys.unexpected_keys.empty());
    const StateDict partly = get_model_state_dict(*model, full);
    EXPECT_TRUE(partly.at("head.bias").local().equal(original.at("head.bias").local()));
    EXPECT_TRUE(partly.at("head.weight").local().equal(sd.at("head.weight").local()));
    keys = set_model_state_dict(*model, unexpected, lenient);
    EXPECT_EQ(keys.unexpected_keys, std::vector<std::string>{"b9.fc.weight"});
    expect_params_match(*model, *reference, ctx.mesh(), 0, 0);

    torch::optim::RMSprop rmsprop(model->parameters(), torch::optim::RMSpropOptions(1e-2));
    EXPECT_THROW_WITH(get_optimizer_state_dict(*model, rmsprop), "RMSprop", "not supported");
    EXPECT_THROW_WITH(set_optimizer_state_dict(*model, rmsprop, OptimizerStateDict{}), "RMSprop", "not supported");
    torch::optim::SGD stranger({at::zeros({3}, at::requires_grad())}, torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_THROW_WITH(get_optimizer_state_dict(*model, stranger), "parameter 0", "param group 0",
                      "not a parameter of the model");

    auto optim = make_optim(Kind::kAdamW, model->parameters(), 1e-2);
    train_step(ctx, *model, *optim, 0);
    OptimizerStateDict osd = get_optimizer_state_dict(*model, *optim);
    OptimizerStateDict partial = osd;
    partial.state = StateDict();
    for (const auto& [key, value] : osd.state) {
      if (key != "state.head.weight.exp_avg_sq") partial.state.insert(key, value);
    }
    EXPECT_THROW_WITH(set_optimizer_state_dict(*model, *optim, partial), "state.head.weight.exp_avg_sq");
    OptimizerStateDict extra = osd;
    extra.state.insert("state.nothing.exp_avg", at::zeros({1}));
    EXPECT_THROW_WITH(set_optimizer_state_dict(*model, *optim, extra), "unexpected", "state.nothing.exp_avg");
    EXPECT_THROW_WITH(parse_param_groups("[{\"params\": [0, 1]}]"), "FQNs");
    StateDictOptions bcast_only;
    bcast_only.broadcast_from_rank0 = true;
    EXPECT_THROW_WITH(set_model_state_dict(*model, sd, bcast_only), "full_state_dict");
  });
}

TEST(StateDictSpecialParams, TiedZeroDimBuffersAndUnshardedModels) {
  testing::run_distributed(3, [](testing::RankContext& ctx) {
    auto plain = std::make_shared<TiedImpl>();
    StateDict plain_sd = get_model_state_dict(*plain);
    std::vector<std::string> expected_keys = plain->named_parameters().keys();
    EXPECT_EQ(expected_keys.size(), 4u);  // the tied weight under both FQNs
    expected_keys.emplace_back("count");
    EXPECT_EQ(plain_sd.keys(), expected_keys);
    EXPECT_EQ(plain_sd.at("alias").local().data_ptr(), plain->fc->weight.data_ptr());

    torch::manual_seed(1);
    auto model = std::make_shared<TiedImpl>();
    torch::manual_seed(1);
    auto reference = std::make_shared<TiedImpl>();
    fully_shard(model, mesh_options(ctx));
    StateDict sd = get_model_state_dict(*model);
    ASSERT_EQ(sd.keys(), expected_keys);
    // The tied weight: one DTensor's storage under both FQNs.
    EXPECT_EQ(sd.at("alias").local().data_ptr(), sd.at("fc.weight").local().data_ptr());
    // The 0-dim parameter is a plain full tensor on every rank.
    EXPECT_FALSE(sd.at("scale").is_dtensor());
    EXPECT_EQ(sd.at("scale").local().dim(), 0);
    EXPECT_EQ(sd.at("scale").local().item<float>(), 2.5f);
    EXPECT_TRUE(sd.at("count").local().equal(at::arange(3)));

    // Loading sets the 0-dim parameter and the buffer.
    StateDict changed = plain_state_dict(*reference);
    changed.insert_or_assign("scale", at::full({}, -1.0f));
    changed.insert("count", at::arange(3) * 2);
    set_model_state_dict(*model, changed);
    StateDictOptions full;
    full.full_state_dict = true;
    StateDict back = get_model_state_dict(*model, full);
    EXPECT_EQ(back.at("scale").local().item<float>(), -1.0f);
    EXPECT_TRUE(back.at("count").local().equal(at::arange(3) * 2));
    EXPECT_TRUE(back.at("alias").local().equal(reference->fc->weight.detach()));
  });
}

// --- torch::save / torch::load / Module::to on sharded modules -------------------

TEST(ReplacedParameterData, TorchLoadOfTheSameShardsIsAdoptedOtherReplacementsThrow) {
  testing::run_distributed(3, [](testing::RankContext& ctx) {
    const std::string dir = ::testing::TempDir();
    const std::string mine =
        dir + "/sdict_rank" + std::to_string(ctx.rank()) + "_" + std::to_string(::getpid()) + ".pt";
    auto model = sharded_mlp(ctx.mesh());
    auto optim = make_optim(Kind::kAdamW, model->parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) train_step(ctx, *model, *optim, step);
    // torch::save writes this rank's rows; torch::load at the same world
    // size points the parameters at the loaded tensors, which fsdp2 adopts
    // at the next unshard.
    torch::save(std::static_pointer_cast<torch::nn::Module>(model), mine);
    auto model2 = sharded_mlp(ctx.mesh(), /*seed=*/3);
    auto model2_base = std::static_pointer_cast<torch::nn::Module>(model2);
    torch::load(model2_base, mine);
    std::remove(mine.c_str());
    const Batch batch = make_batch(ModelKind::kMlp, 9, 12).slice(ctx.rank(), ctx.world_size());
    {
      c10::NoGradGuard no_grad;
      EXPECT_EQ(call_module(*model, batch.x, batch.y).item<double>(),
                call_module(*model2, batch.x, batch.y).item<double>());
    }
    fsdp_module_of(*model2)->reshard();
    // The sharded state dict views the shard again (and holds the values).
    StateDict sd2 = get_model_state_dict(*model2);
    auto params2 = model2->named_parameters();
    for (const auto& [fqn, value] : sd2) {
      EXPECT_TRUE(value.local().equal(get_model_state_dict(*model).at(fqn).local())) << fqn;
      if (value.local().numel() > 0) {
        EXPECT_EQ(value.local().data_ptr(), params2[fqn].data_ptr()) << fqn;
      }
    }

    // An unsharded checkpoint (full shapes) cannot be used in place.
    auto reference = make_model(ModelKind::kMlp);
    torch::save(std::static_pointer_cast<torch::nn::Module>(reference), mine);
    auto model3 = sharded_mlp(ctx.mesh());
    auto model3_base = std::static_pointer_cast<torch::nn::Module>(model3);
    torch::load(model3_base, mine);
    std::remove(mine.c_str());
    if (ctx.world_size() > 1) {
      EXPECT_THROW_WITH(call_module(*model3, batch.x, batch.y), "head.weight", "[3, 10]", "set_model_state_dict");
      EXPECT_THROW_WITH(get_model_state_dict(*model3), "was replaced", "set_model_state_dict");
    }
    // The way out the error names: set_model_state_dict loads the full
    // values into the shards and points the parameters back.
    set_model_state_dict(*model3, plain_state_dict(*reference));
    expect_params_match(*model3, *reference, ctx.mesh(), 0, 0);
    {
      c10::NoGradGuard no_grad;
      EXPECT_EQ(call_module(*model3, batch.x, batch.y).item<double>(),
                call_module(*make_model(ModelKind::kMlp), batch.x, batch.y).item<double>());
    }

    // Module::to changing the dtype of a sharded module.
    auto model4 = sharded_mlp(ctx.mesh());
    model4->to(at::kDouble);
    EXPECT_THROW_WITH(call_module(*model4, batch.x.to(at::kDouble), batch.y.to(at::kDouble)), "was replaced", "Double",
                      "move or cast a model before fully_shard");
  });
}

}  // namespace
}  // namespace fsdp::test
