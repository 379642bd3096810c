// Per-parameter meshes (FSDP2's ShardPlacementResult, pytorch#173509;
// [Note: per-parameter meshes], fsdp2/src/fully_shard.cc): a small MoE model
// (an embedding Linear, two MoE layers of a router Linear and three expert
// MLPs, a head) whose experts shard_placement_fn puts on an expert mesh and
// everything else on the data-parallel mesh. Each fully_shard call of a MoE
// layer then holds two FSDPParamGroups. At world sizes 1 to 4 the expert mesh
// spans the same ranks as the data-parallel mesh but with its own process
// groups: the ranks in reverse order (so shard index != rank) at 1 to 3, a
// 2x2 (replicate, shard) HSDP mesh at 4. Training with SGD and AdamW follows
// an unsharded reference computed in the same process; the flight recorder
// shows each group's collectives on its own mesh's communicators; state
// dicts carry each parameter's mesh and round-trip (sharded, full, and a
// safetensors checkpoint saved at 3 ranks and loaded at 2); bad meshes are
// refused, naming the module and the parameter.
#include <sys/stat.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/nn/functional/loss.h>

#include "checkpoint/sharded.h"
#include "collectives/flight_recorder.h"
#include "fsdp2/custom_collectives.h"
#include "fsdp2/state_dict.h"
#include "fsdp2_test_util.h"
#include "shared_test_dir.h"

namespace fsdp::test {
namespace {

constexpr int64_t kDim = 6, kHidden = 5, kExperts = 3;

struct ExpertImpl : torch::nn::Module {
  ExpertImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Expert);

// A dense mixture of experts: every expert runs on every row, weighted by
// the router's softmax (no top-k, so the reference is smooth and exact).
struct MoELayerImpl : torch::nn::Module {
  MoELayerImpl() : router(register_module("router", torch::nn::Linear(kDim, kExperts))) {
    for (int64_t e = 0; e < kExperts; ++e) experts->push_back(Expert());
    register_module("experts", experts);
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor gates = at::softmax(router(x), -1);
    at::Tensor out = x;
    for (int64_t e = 0; e < kExperts; ++e) {
      out = out + gates.narrow(1, e, 1) * experts[e]->as<ExpertImpl>()->forward(x);
    }
    return out;
  }
  torch::nn::Linear router;
  torch::nn::ModuleList experts;
};
FSDP2CPP_MODULE(MoELayer);

// 7 -> 6 -> MoE -> MoE -> 3.
struct MoENet : LossModel {
  MoENet()
      : embed(register_module("embed", torch::nn::Linear(7, kDim))),
        l0(register_module("l0", MoELayer())),
        l1(register_module("l1", MoELayer())),
        head(register_module("head", torch::nn::Linear(kDim, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) override {
    return torch::nn::functional::mse_loss(head(l1(l0(at::tanh(embed(x))))), y);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() override { return {l0.ptr(), l1.ptr()}; }
  torch::nn::Linear embed;
  MoELayer l0, l1;
  torch::nn::Linear head;
};

std::shared_ptr<MoENet> make_moe(int seed = 0) {
  torch::manual_seed(seed);
  return std::make_shared<MoENet>();
}

bool is_expert(const std::string& fqn) { return fqn.find(".experts.") != std::string::npos; }

// The data-parallel mesh and the expert mesh: the same ranks, other groups.
struct Meshes {
  DeviceMesh dense;
  DeviceMesh expert;
};

Meshes make_meshes(testing::RankContext& ctx) {
  const int world = ctx.world_size();
  const DeviceMesh& dense = ctx.mesh();
  if (world == 4) {
    return {dense, init_device_mesh(ctx.world(), dense.device_type(), {2, 2}, {"replicate", "shard"})};
  }
  return {dense, DeviceMesh(ctx.world(), dense.device_type(), at::arange(world - 1, -1, -1, at::kLong), {"ep"})};
}

// Puts the experts' parameters of `model` on `expert`, the rest on the call's
// mesh.
std::function<ShardPlacementResult(const at::Tensor&)> experts_on(torch::nn::Module& model, const DeviceMesh& expert) {
  auto experts = std::make_shared<std::unordered_set<const c10::TensorImpl*>>();
  for (const auto& item : model.named_parameters()) {
    if (is_expert(item.key())) experts->insert(item.value().unsafeGetTensorImpl());
  }
  return [experts, expert](const at::Tensor& p) -> ShardPlacementResult {
    if (experts->count(p.unsafeGetTensorImpl()) != 0) return {Placement::shard(0), expert};
    return std::nullopt;
  };
}

struct ShardedMoE {
  std::shared_ptr<MoENet> model;
  std::vector<FSDPModule> layers;
  std::optional<FSDPModule> root;
};

ShardedMoE shard_moe(const Meshes& meshes, int seed = 0, bool per_param_mesh = true) {
  ShardedMoE s;
  s.model = make_moe(seed);
  FullyShardOptions o;
  o.mesh = meshes.dense;
  if (per_param_mesh) o.shard_placement_fn = experts_on(*s.model, meshes.expert);
  for (auto& b : s.model->blocks()) s.layers.push_back(fully_shard(b, o));
  s.root = fully_shard(s.model, o);
  return s;
}

const DeviceMesh& mesh_of(const std::string& fqn, const Meshes& meshes) {
  return is_expert(fqn) ? meshes.expert : meshes.dense;
}

// Every parameter, gathered over its own mesh, equals the reference's.
void expect_params_match_reference(torch::nn::Module& model, torch::nn::Module& reference, const Meshes& meshes,
                                   const std::string& when) {
  auto params = model.named_parameters();
  for (const auto& item : reference.named_parameters()) {
    const at::Tensor full = item.value().detach();
    expect_close(full_param(params[item.key()], full.sizes().vec(), mesh_of(item.key(), meshes)), full,
                 when + " " + item.key());
  }
}

// This rank's torch.chunk row block of `full` over the last dim of `mesh`.
at::Tensor rows_of(const at::Tensor& full, const DeviceMesh& mesh) {
  return rank_slice(full, mesh.coordinate().back(), mesh.size(mesh.ndim() - 1));
}

Batch moe_batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + step);
  return {at::randn({24, 7}, gen), at::randn({24, 3}, gen)};
}

std::vector<collectives::CollectiveRecord> fsdp_records(testing::RankContext& ctx, const std::string& op,
                                                        const std::string& phase) {
  std::vector<collectives::CollectiveRecord> result;
  for (auto& r : ctx.world()->flight_recorder().snapshot().records) {
    if (r.fingerprint.op == op && r.fingerprint.label.rfind(phase, 0) == 0) result.push_back(r);
  }
  return result;
}

class PerParamMesh : public ::testing::TestWithParam<int> {};

// Each parameter's shard is its rows of the full parameter over its own
// mesh: the reversed expert mesh gives rank r the rows of shard index
// W-1-r, the 2x2 one those of its shard coordinate.
TEST_P(PerParamMesh, ShardsEachParameterOverItsOwnMesh) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const Meshes meshes = make_meshes(ctx);
    ShardedMoE s = shard_moe(meshes);
    // Each parameter is its rows of the full one over its own mesh.
    auto reference = make_moe();
    auto params = s.model->named_parameters();
    for (const auto& item : reference->named_parameters()) {
      expect_close(params[item.key()].detach(), rows_of(item.value().detach(), mesh_of(item.key(), meshes)), item.key(),
                   0, 0);
    }
    // unshard() gathers both groups of a layer, reshard() frees both.
    s.layers[0].unshard();
    auto ref_l0 = reference->l0->named_parameters();
    for (const auto& item : s.model->l0->named_parameters()) {
      expect_close(item.value().detach(), ref_l0[item.key()].detach(), "unsharded l0." + item.key(), 0, 0);
    }
    s.layers[0].reshard();
    for (const auto& item : s.model->l0->named_parameters()) {
      const std::string fqn = "l0." + item.key();
      expect_close(item.value().detach(), rows_of(ref_l0[item.key()].detach(), mesh_of(fqn, meshes)),
                   "resharded " + fqn, 0, 0);
    }
  });
}

// SGD and AdamW steps follow the unsharded reference; every all-gather and
// reduce-scatter of an expert group runs on the expert mesh's shard group
// (its HSDP all-reduce on the replicate group), every other one on the
// data-parallel mesh's.
TEST_P(PerParamMesh, TrainingMatchesReferenceWithCollectivesOnEachMesh) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    const Meshes meshes = make_meshes(ctx);
    const auto& dense_comm = meshes.dense.group(0);
    const auto& expert_comm = meshes.expert.group(meshes.expert.ndim() - 1);
    for (Optim kind : {Optim::kSgd, Optim::kAdamW}) {
      SCOPED_TRACE(kind == Optim::kSgd ? "SGD" : "AdamW");
      auto reference = make_moe();
      ShardedMoE s = shard_moe(meshes);
      auto optim = make_optimizer(kind, s.model->parameters());
      auto ref_optim = make_optimizer(kind, reference->parameters());
      const size_t rs_before = fsdp_records(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter").size();
      const size_t ag_before = fsdp_records(ctx, "all_gather_into_tensor", "FSDP::all_gather").size();
      const int kSteps = 3;
      for (int step = 0; step < kSteps; ++step) {
        const std::string when = "step " + std::to_string(step);
        const Batch batch = moe_batch(step);
        ref_optim->zero_grad();
        const at::Tensor ref_loss = reference->forward(batch.x, batch.y);
        ref_loss.backward();
        ref_optim->step();
        const Batch mine = batch.slice(rank, world);
        optim->zero_grad();
        const at::Tensor loss = call_module(*s.model, mine.x, mine.y);
        loss.backward();
        optim->step();
        EXPECT_NEAR(mean_over_ranks(ctx, loss.item<double>()), ref_loss.item<double>(), 1e-5) << when;
        expect_params_match_reference(*s.model, *reference, meshes, when);
      }
      if (world == 1) continue;  // one rank: no collectives to place
      const auto rs = fsdp_records(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter");
      const auto ag = fsdp_records(ctx, "all_gather_into_tensor", "FSDP::all_gather");
      std::map<std::string, int> rs_on, ag_on;
      for (size_t i = rs_before; i < rs.size(); ++i) ++rs_on[rs[i].communicator];
      for (size_t i = ag_before; i < ag.size(); ++i) ++ag_on[ag[i].communicator];
      // One reduce-scatter per group per step: 3 dense (two routers, the
      // root), 2 expert.
      EXPECT_EQ(rs_on.size(), 2u);
      EXPECT_EQ(rs_on[dense_comm->id()], 3 * kSteps);
      EXPECT_EQ(rs_on[expert_comm->id()], 2 * kSteps);
      EXPECT_EQ(ag_on.size(), 2u);
      // Forward gathers every group, backward the layers' groups again.
      EXPECT_EQ(ag_on[dense_comm->id()], 5 * kSteps);
      EXPECT_EQ(ag_on[expert_comm->id()], 4 * kSteps);
      if (meshes.expert.ndim() == 2) {
        const auto replicate = meshes.expert.group(0);
        int all_reduces = 0;
        for (const auto& r : ctx.world()->flight_recorder().snapshot().records) {
          if (r.fingerprint.op == "all_reduce" && r.fingerprint.label.rfind("FSDP::all_reduce", 0) == 0) {
            EXPECT_EQ(r.communicator, replicate->id()) << r.fingerprint.label;
            ++all_reduces;
          }
        }
        EXPECT_GT(all_reduces, 0) << "the expert groups' HSDP all-reduce";
      }
    }
  });
}

// Sharded state dicts hold DTensors over each parameter's own mesh
// (Shard(0), (Replicate, Shard(0)) on the 2x2 expert mesh); full ones the
// reference's values; both load back into another model.
TEST_P(PerParamMesh, StateDictsCarryEachParametersMesh) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const Meshes meshes = make_meshes(ctx);
    auto reference = make_moe();
    ShardedMoE s = shard_moe(meshes);
    const StateDict sharded = get_model_state_dict(*s.model);
    for (const auto& item : reference->named_parameters()) {
      SCOPED_TRACE(item.key());
      const StateValue& v = sharded.at(item.key());
      ASSERT_TRUE(v.is_dtensor());
      const DeviceMesh& expected = mesh_of(item.key(), meshes);
      const DeviceMesh& mesh = v.dtensor().mesh();
      EXPECT_EQ(mesh.ndim(), expected.ndim());
      EXPECT_TRUE(mesh.mesh().equal(expected.mesh()));
      EXPECT_EQ(mesh.group(mesh.ndim() - 1).get(), expected.group(expected.ndim() - 1).get());
      EXPECT_EQ(v.dtensor().placements().back().to_string(), Placement::shard(0).to_string());
      EXPECT_EQ(v.global_shape(), item.value().sizes().vec());
      expect_close(v.dtensor().full_tensor(), item.value().detach(), "full_tensor", 0, 0);
    }
    StateDictOptions full_opts;
    full_opts.full_state_dict = true;
    const StateDict full = get_model_state_dict(*s.model, full_opts);
    for (const auto& item : reference->named_parameters()) {
      expect_close(full.at(item.key()).local(), item.value().detach(), "full " + item.key(), 0, 0);
    }
    // Into a model of other values: sharded, then full (and broadcast from
    // rank 0, which needs the meshes to span the same ranks).
    for (int how = 0; how < 3; ++how) {
      SCOPED_TRACE(how == 0 ? "sharded" : how == 1 ? "full" : "broadcast_from_rank0");
      ShardedMoE other = shard_moe(meshes, /*seed=*/5);
      if (how == 0) set_model_state_dict(*other.model, sharded);
      if (how == 1) set_model_state_dict(*other.model, full);
      if (how == 2) {
        StateDictOptions b;
        b.full_state_dict = true;
        b.broadcast_from_rank0 = true;
        set_model_state_dict(*other.model, ctx.rank() == 0 ? full : StateDict{}, b);
      }
      expect_params_match_reference(*other.model, *reference, meshes, "loaded");
    }
  });
}

// AdamW state of expert parameters is a DTensor over the expert mesh; a
// model and optimizer loaded from the sharded state dicts (and from full
// ones) continue exactly as the one that saved them.
TEST_P(PerParamMesh, OptimizerStateDictRoundTrips) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    const Meshes meshes = make_meshes(ctx);
    auto step = [&](ShardedMoE& s, torch::optim::Optimizer& optim, int i) {
      const Batch mine = moe_batch(i).slice(rank, world);
      optim.zero_grad();
      call_module(*s.model, mine.x, mine.y).backward();
      optim.step();
    };
    ShardedMoE a = shard_moe(meshes);
    auto optim_a = make_optimizer(Optim::kAdamW, a.model->parameters());
    for (int i = 0; i < 2; ++i) step(a, *optim_a, i);
    for (bool full : {false, true}) {
      SCOPED_TRACE(full ? "full" : "sharded");
      StateDictOptions o;
      o.full_state_dict = full;
      const StateDict model_sd = get_model_state_dict(*a.model, o);
      const OptimizerStateDict optim_sd = get_optimizer_state_dict(*a.model, *optim_a, o);
      if (!full) {
        size_t expert_values = 0;
        for (const auto& [key, value] : optim_sd.state) {
          if (!is_expert(key) || !value.is_dtensor()) continue;
          ++expert_values;
          EXPECT_EQ(value.dtensor().mesh().group(meshes.expert.ndim() - 1).get(),
                    meshes.expert.group(meshes.expert.ndim() - 1).get())
              << key;
        }
        EXPECT_EQ(expert_values, static_cast<size_t>(2 * 2 * 4 * kExperts)) << "exp_avg and exp_avg_sq";
      }
      ShardedMoE b = shard_moe(meshes, /*seed=*/7);
      auto optim_b = make_optimizer(Optim::kAdamW, b.model->parameters());
      set_model_state_dict(*b.model, model_sd, o);
      set_optimizer_state_dict(*b.model, *optim_b, optim_sd, o);
      // Continue both from the same point: a copy of `a` at this step.
      ShardedMoE c = shard_moe(meshes, /*seed=*/9);
      auto optim_c = make_optimizer(Optim::kAdamW, c.model->parameters());
      set_model_state_dict(*c.model, model_sd, o);
      set_optimizer_state_dict(*c.model, *optim_c, optim_sd, o);
      step(b, *optim_b, 5);
      step(c, *optim_c, 5);
      auto pb = b.model->named_parameters();
      auto pc = c.model->named_parameters();
      for (const auto& item : pc) {
        expect_close(pb[item.key()].detach(), item.value().detach(), item.key(), 0, 0);
      }
      // And the loaded state is a's: one more step of a matches.
      if (!full) {
        step(a, *optim_a, 5);
        auto pa = a.model->named_parameters();
        for (const auto& item : pa) {
          expect_close(pb[item.key()].detach(), item.value().detach(), "vs saver " + item.key(), 0, 0);
        }
      }
    }
  });
}

// fully_shard({l0, l1}) with per-parameter meshes: one call, two groups
// (both routers; all six experts), each parameter named from its own module;
// SGD steps follow the reference.
TEST_P(PerParamMesh, SeveralModulesInOneCallGroupByMesh) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int rank = ctx.rank(), world = ctx.world_size();
    const Meshes meshes = make_meshes(ctx);
    auto reference = make_moe();
    auto model = make_moe();
    FullyShardOptions o;
    o.mesh = meshes.dense;
    o.shard_placement_fn = experts_on(*model, meshes.expert);
    fully_shard({model->l0.ptr(), model->l1.ptr()}, o);
    fully_shard(model, o);
    auto optim = make_optimizer(Optim::kSgd, model->parameters());
    auto ref_optim = make_optimizer(Optim::kSgd, reference->parameters());
    for (int step = 0; step < 2; ++step) {
      const Batch batch = moe_batch(step);
      ref_optim->zero_grad();
      reference->forward(batch.x, batch.y).backward();
      ref_optim->step();
      const Batch mine = batch.slice(rank, world);
      optim->zero_grad();
      call_module(*model, mine.x, mine.y).backward();
      optim->step();
      expect_params_match_reference(*model, *reference, meshes, "step " + std::to_string(step));
    }
    if (world == 1) return;
    // Per step: one reduce-scatter for the routers' group, one for the
    // experts', one for the root's.
    std::map<std::string, int> rs_on;
    for (const auto& r : fsdp_records(ctx, "reduce_scatter_tensor", "FSDP::reduce_scatter")) ++rs_on[r.communicator];
    EXPECT_EQ(rs_on[meshes.dense.group(0)->id()], 2 * 2);
    EXPECT_EQ(rs_on[meshes.expert.group(meshes.expert.ndim() - 1)->id()], 2 * 1);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PerParamMesh, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// A safetensors sharded checkpoint saved at 3 ranks (experts on the reversed
// mesh) loads at 2 ranks, with and without per-parameter meshes, and at 4
// ranks into the 2x2 HSDP expert mesh.
TEST(PerParamMeshCheckpoint, ShardedCheckpointAcrossWorldSizes) {
  SharedTestDir dir("FSDP2CPP_PER_PARAM_MESH_TEST_DIR");
  ASSERT_FALSE(dir.path().empty());
  testing::run_distributed(3, [&](testing::RankContext& ctx) {
    ShardedMoE s = shard_moe(make_meshes(ctx));
    checkpoint::save_sharded(get_model_state_dict(*s.model), dir.path(), ctx.rank());
  });
  for (int world : {2, 4}) {
    SCOPED_TRACE("load at " + std::to_string(world));
    testing::run_distributed(world, [&](testing::RankContext& ctx) {
      const Meshes meshes = make_meshes(ctx);
      auto reference = make_moe();
      for (bool per_param_mesh : {true, false}) {
        SCOPED_TRACE(per_param_mesh ? "per-parameter meshes" : "one mesh");
        ShardedMoE s = shard_moe(meshes, /*seed=*/1, per_param_mesh);
        StateDict sd = get_model_state_dict(*s.model);
        checkpoint::load_sharded(sd, dir.path());
        set_model_state_dict(*s.model, sd);
        const Meshes used = per_param_mesh ? meshes : Meshes{meshes.dense, meshes.dense};
        auto params = s.model->named_parameters();
        for (const auto& item : reference->named_parameters()) {
          expect_close(params[item.key()].detach(), rows_of(item.value().detach(), mesh_of(item.key(), used)),
                       item.key(), 0, 0);
        }
      }
    });
  }
}

// A mesh on another device type, or one fully_shard cannot shard over, is
// refused naming the module and the parameter.
TEST(PerParamMeshErrors, BadMeshesAreRefused) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto model = make_moe();
    FullyShardOptions o;
    o.mesh = ctx.mesh();
    // A 1-D mesh named as a replicate dim.
    const DeviceMesh replicate(ctx.world(), ctx.mesh().device_type(), at::arange(2, at::kLong), {"replicate"});
    o.shard_placement_fn = [&](const at::Tensor& p) -> ShardPlacementResult {
      if (p.dim() == 2) return {std::nullopt, replicate};
      return std::nullopt;
    };
    EXPECT_THROW_WITH(fully_shard(model->l0, o), "MoELayerImpl", "'router.weight'", "cannot shard over", "replicate");
    // A 3-D mesh.
    const DeviceMesh three(ctx.world(), ctx.mesh().device_type(), at::arange(2, at::kLong).reshape({1, 1, 2}));
    o.shard_placement_fn = [&](const at::Tensor&) -> ShardPlacementResult { return {Placement::shard(0), three}; };
    EXPECT_THROW_WITH(fully_shard(model->l0, o), "'router.weight'", "1-D (FSDP) or 2-D (HSDP)");
    // A good mesh with a bad placement still names the placement.
    const DeviceMesh other(ctx.world(), ctx.mesh().device_type(), at::arange(2, at::kLong));
    o.shard_placement_fn = [&](const at::Tensor&) -> ShardPlacementResult { return {Placement::shard(3), other}; };
    EXPECT_THROW_WITH(fully_shard(model->l0, o), "'router.weight'", "has no dim 3");
    // None of the failed calls left a state behind.
    o.shard_placement_fn = experts_on(*model, other);
    FSDPModule l0 = fully_shard(model->l0, o);
    // Custom collectives need one group.
    EXPECT_THROW_WITH(l0.set_custom_all_gather(std::make_shared<Int8AllGather>(64)), "set_custom_all_gather",
                      "2 parameter groups", "per-parameter meshes");
  });
}

}  // namespace
}  // namespace fsdp::test
