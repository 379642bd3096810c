// Gradient clipping over shards (fsdp2/clip_grad.h): the total norm and the
// clipped gradients of a sharded model equal torch::nn::utils::clip_grad_norm_
// on an unsharded reference, for the 1-, 2-, 3- and infinity norms, on 1-4
// real ranks (uneven shards, ranks with no rows), under HSDP, with mixed
// dtypes and with ignored parameters; and the whole model costs exactly one
// all-reduce, counted by an engine wrapper under the mesh's communicators.
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/nn/utils/clip_grad.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp2/clip_grad.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Passes every collective the Communicator issues to the real engine and
// counts them, so that a test can assert which collectives a call issued.
class CountingBackend : public c10d::Backend {
 public:
  explicit CountingBackend(c10::intrusive_ptr<c10d::Backend> inner)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}
  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    ++all_reduces;
    return inner_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    ++others;
    return inner_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    ++others;
    return inner_->barrier(opts);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    ++others;
    return inner_->_allgather_base(out, in, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::AllgatherOptions& opts) override {
    ++others;
    return inner_->allgather_into_tensor_coalesced(outs, ins, opts);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& opts) override {
    ++others;
    return inner_->_reduce_scatter_base(out, in, opts);
  }
  // The Communicator's reduce-scatter on Gloo (see communicator.cc).
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    ++others;
    return inner_->alltoall_base(out, in, out_splits, in_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    ++others;
    return inner_->reduce_scatter_tensor_coalesced(outs, ins, opts);
  }

  std::atomic<int> all_reduces{0};
  std::atomic<int> others{0};

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
};

// `mesh` with every group's engine wrapped in a CountingBackend; `counters`
// gets one per mesh dim.
DeviceMesh counting_mesh(testing::RankContext& ctx, const DeviceMesh& mesh,
                         std::vector<c10::intrusive_ptr<CountingBackend>>& counters) {
  std::vector<std::shared_ptr<collectives::Communicator>> groups;
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    const auto& g = mesh.group(d);
    counters.push_back(c10::make_intrusive<CountingBackend>(g->backend()));
    groups.push_back(std::make_shared<collectives::Communicator>(counters.back(), g->backend_kind(), g->device_type(),
                                                                 g->rank(), g->global_ranks(),
                                                                 collectives::CommunicatorOptions{}));
  }
  return DeviceMesh::from_communicators(ctx.world(), mesh.mesh(), std::move(groups), mesh.dim_names());
}

std::vector<at::Tensor> grads_of(torch::nn::Module& module) {
  std::vector<at::Tensor> grads;
  for (const auto& p : module.parameters()) grads.push_back(p.grad().clone());
  return grads;
}

void restore_grads(torch::nn::Module& module, const std::vector<at::Tensor>& grads) {
  auto params = module.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

// One backward of the same 12 rows: the reference's on all of them, the
// sharded model's on this rank's slice.
template <typename Reference, typename Model>
void backward_on_one_batch(testing::RankContext& ctx, Reference& reference, Model& model) {
  const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
  reference.forward(batch.x, batch.y).backward();
  const Batch local = batch.slice(ctx.rank(), ctx.world_size());
  call_module(model, local.x, local.y).backward();
}

// The reference's total gradient norm without clipping (max_norm infinite:
// coefficient 1); its gradients stay as they were.
double unclipped_norm(torch::nn::Module& reference, double norm_type) {
  const std::vector<at::Tensor> ref_grads = grads_of(reference);
  const double ref_norm = torch::nn::utils::clip_grad_norm_(reference.parameters(), kInf, norm_type);
  restore_grads(reference, ref_grads);
  return ref_norm;
}

struct ClipCase {
  double norm_type;
  bool clips;       // max_norm below the total norm
  bool tensor_api;  // get_total_norm + clip_grads_with_norm_ instead of clip_grad_norm_
};

// Trains one step of the MLP on the mesh `ctx.mesh()` (wrapped to count
// collectives) and on an unsharded reference, clips both, and compares the
// norms, the gradients and the collectives clipping issued.
void expect_clip_matches_reference(testing::RankContext& ctx, const ClipCase& c) {
  SCOPED_TRACE(::testing::Message() << "norm_type " << c.norm_type << (c.clips ? ", clipping" : ", no clipping")
                                    << (c.tensor_api ? ", tensor API" : ", double API"));
  std::vector<c10::intrusive_ptr<CountingBackend>> counters;
  FullyShardOptions fs;
  fs.mesh = counting_mesh(ctx, ctx.mesh(), counters);
  auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
  auto reference = make_model(ModelKind::kMlp);
  for (auto& b : model->blocks()) fully_shard(b, fs);
  FSDPModule root = fully_shard(model, fs);
  backward_on_one_batch(ctx, *reference, *model);

  const double ref_norm = unclipped_norm(*reference, c.norm_type);
  const double max_norm = c.clips ? ref_norm / 3 : ref_norm * 2;
  EXPECT_DOUBLE_EQ(torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm, c.norm_type), ref_norm);

  for (auto& counter : counters) counter->all_reduces = counter->others = 0;
  double total = 0;
  if (c.tensor_api) {
    const at::Tensor norm = get_total_norm(root, c.norm_type);
    EXPECT_EQ(norm.dim(), 0);
    EXPECT_EQ(norm.scalar_type(), at::kFloat);
    clip_grads_with_norm_(root, max_norm, norm);
    total = norm.item<double>();
  } else {
    total = clip_grad_norm_(root, max_norm, c.norm_type);
  }
  EXPECT_NEAR(total, ref_norm, 1e-5 * ref_norm);
  // One all-reduce for the whole model, over the shard group (the last mesh
  // dim); nothing on the replicate group under HSDP.
  EXPECT_EQ(counters.back()->all_reduces.load(), 1);
  for (const auto& counter : counters) EXPECT_EQ(counter->others.load(), 0);
  for (size_t d = 0; d + 1 < counters.size(); ++d) EXPECT_EQ(counters[d]->all_reduces.load(), 0);

  for (const auto& item : reference->named_parameters()) {
    const at::Tensor sharded = model->named_parameters()[item.key()];  // a copy: the dict is a temporary
    expect_close(full_param(sharded.grad(), item.value().sizes().vec(), ctx.mesh()), item.value().grad(), item.key());
  }
}

const std::vector<ClipCase> kCases{
    {2.0, true, false},   {2.0, false, true}, {kInf, true, true},
    {kInf, false, false}, {1.0, true, false}, {3.0, true, true},
};

class ClipGrad : public ::testing::TestWithParam<int> {};

TEST_P(ClipGrad, MatchesUnshardedClipWithOneAllReduce) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const ClipCase& c : kCases) expect_clip_matches_reference(ctx, c);
  });
}

TEST(ClipGradHsdp, TwoByTwoReducesOverTheShardGroupOnly) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    expect_clip_matches_reference(ctx, {2.0, true, true});
    expect_clip_matches_reference(ctx, {kInf, true, false});
    expect_clip_matches_reference(ctx, {1.0, false, false});
  });
}

// Groups of different dtypes (fully_shard needs one dtype per group, not per
// model): one foreach kernel per dtype, norms summed in fp32/fp64. The
// gradients are set (a global gradient per parameter, each rank its rows) so
// that the reference, torch::nn::utils::clip_grad_norm_ over the same values
// in double, is exact; bf16 results are compared at bf16's precision.
struct MixedDtypes : torch::nn::Module {
  MixedDtypes()
      : a(register_module("a", MLPBlock(7, 13))),
        b(register_module("b", MLPBlock(13, 10))),
        c(register_module("c", MLPBlock(10, 5))),
        head(register_module("head", torch::nn::Linear(5, 3))) {
    a->to(at::kDouble);
    c->to(at::kBFloat16);
  }
  MLPBlock a, b, c;
  torch::nn::Linear head;
};

TEST_P(ClipGrad, MixedDtypesMatchTheReferenceInDouble) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const double norm_type : {2.0, kInf, 1.0}) {
      SCOPED_TRACE(::testing::Message() << "norm_type " << norm_type);
      torch::manual_seed(0);
      auto model = std::make_shared<MixedDtypes>();
      std::map<std::string, std::pair<std::vector<int64_t>, at::ScalarType>> shapes;
      for (const auto& item : model->named_parameters()) {
        shapes[item.key()] = {item.value().sizes().vec(), item.value().scalar_type()};
      }
      fully_shard(model->a, FullyShardOptions{.mesh = ctx.mesh()});
      fully_shard(model->b, FullyShardOptions{.mesh = ctx.mesh()});
      fully_shard(model->c, FullyShardOptions{.mesh = ctx.mesh()});
      FSDPModule root = fully_shard(model, FullyShardOptions{.mesh = ctx.mesh()});
      std::map<std::string, at::Tensor> global;  // in each parameter's dtype
      std::vector<at::Tensor> reference;         // the same values in double
      int64_t seed = 0;
      for (const auto& [name, shape_dtype] : shapes) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(++seed);
        at::Tensor g = at::randn(shape_dtype.first, gen).to(shape_dtype.second);
        global[name] = g;
        at::Tensor r = at::zeros(shape_dtype.first, at::kDouble);
        r.mutable_grad() = g.to(at::kDouble);
        reference.push_back(r);
      }
      for (const auto& item : model->named_parameters()) {
        item.value().mutable_grad() = rank_slice(global[item.key()], ctx.rank(), ctx.world_size()).clone();
      }
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference, kInf, norm_type);
      const double max_norm = ref_norm / 4;
      const double coef = max_norm / (ref_norm + 1e-6);
      const at::Tensor norm = get_total_norm(root, norm_type);
      EXPECT_EQ(norm.scalar_type(), at::kDouble);  // a double gradient is in the model
      EXPECT_NEAR(norm.item<double>(), ref_norm, 1e-5 * ref_norm);
      clip_grads_with_norm_(root, max_norm, norm);
      for (const auto& item : model->named_parameters()) {
        const at::Tensor& p = item.value();
        ASSERT_EQ(p.grad().scalar_type(), shapes[item.key()].second) << item.key();
        const at::Tensor expected = (global[item.key()].to(at::kDouble) * coef).to(p.scalar_type());
        const bool bf16 = p.scalar_type() == at::kBFloat16;
        expect_close(full_param(p.grad(), shapes[item.key()].first, ctx.mesh()).to(at::kDouble),
                     expected.to(at::kDouble), item.key(), bf16 ? 1e-2 : 1e-5, bf16 ? 1e-3 : 1e-7);
      }
    }
  });
}

// An ignored parameter is full on every rank: once its gradient is
// synchronized (the caller's job), it counts once in the norm, not once per
// rank, and the sharded ones count once as always (WithScale: test_models.h).
TEST_P(ClipGrad, IgnoredParametersCountOnce) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const double norm_type : {2.0, kInf}) {
      SCOPED_TRACE(::testing::Message() << "norm_type " << norm_type);
      const auto [model, reference] = with_scale_twins();
      FullyShardOptions o = mesh_options(ctx);
      o.ignored_params = {model->scale};
      fully_shard(model->block, o);
      FSDPModule root = fully_shard(model, o);
      const Batch batch = make_batch(ModelKind::kMlp, 0, 12);
      at::mse_loss(reference->forward(batch.x), batch.y).backward();
      const Batch local = batch.slice(ctx.rank(), ctx.world_size());
      at::mse_loss(call_module(*model, local.x), local.y).backward();
      // Equal rows per rank: the mean of the local gradients is the global one.
      ctx.world_group()->all_reduce(model->scale.mutable_grad(), collectives::ReduceOp::avg()).wait();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 1e-3, norm_type);
      EXPECT_NEAR(clip_grad_norm_(root, 1e-3, norm_type), ref_norm, 1e-5 * ref_norm);
      expect_close(model->scale.grad(), reference->scale.grad(), "scale (ignored)");
      for (const auto& item : reference->named_parameters()) {
        if (item.key() == "scale") continue;
        const at::Tensor sharded = model->named_parameters()[item.key()];  // a copy: the dict is a temporary
        expect_close(full_param(sharded.grad(), item.value().sizes().vec(), ctx.mesh()), item.value().grad(),
                     item.key());
      }
    }
  });
}

// A NaN on one rank's shard makes the total non-finite on every rank: with
// error_if_nonfinite all of them throw (after the one collective, so none
// hangs); without it the norm is returned as NaN.
TEST(ClipGradErrors, NonFiniteNormThrowsOnEveryRankWhenAsked) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    for (auto& b : model->blocks()) fully_shard(b, FullyShardOptions{.mesh = ctx.mesh()});
    FSDPModule root = fully_shard(model, FullyShardOptions{.mesh = ctx.mesh()});
    const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
    call_module(*model, local.x, local.y).backward();
    if (ctx.rank() == 1) model->b0->fc->weight.grad()[0][0] = std::numeric_limits<double>::quiet_NaN();
    EXPECT_THROW_WITH(get_total_norm(root, 2.0, /*error_if_nonfinite=*/true), "non-finite", "error_if_nonfinite");
    EXPECT_THROW_WITH(clip_grad_norm_(root, 1.0, 1.0, /*error_if_nonfinite=*/true), "non-finite");
    EXPECT_TRUE(std::isnan(get_total_norm(root, 2.0).item<double>()));
  });
}

TEST(ClipGradErrors, BadArgumentsAreRefused) {
  testing::run_distributed(1, [](testing::RankContext& ctx) {
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    FSDPModule root = fully_shard(model, FullyShardOptions{.mesh = ctx.mesh()});
    EXPECT_THROW_WITH(get_total_norm(root, 0.0), "norm_type must be positive", "got 0");
    EXPECT_THROW_WITH(clip_grad_norm_(root, 1.0, -2.0), "norm_type must be positive");
    EXPECT_THROW_WITH(clip_grads_with_norm_(root, 1.0, at::Tensor()), "one-element tensor", "undefined");
    EXPECT_THROW_WITH(clip_grads_with_norm_(root, 1.0, at::ones({2})), "one-element tensor", "[2]");
    // Before any backward there is nothing to clip: the norm is 0, as in PyTorch.
    EXPECT_EQ(get_total_norm(root).item<double>(), 0.0);
  });
}

// A mixture of experts whose experts shard_placement_fn puts on a mesh of
// their own (fully_shard.h, "Per-parameter meshes"): a block then holds a
// dense and an expert FSDPParamGroup, each sharded and reduced over its own
// shard group. Dense gating (every expert on every row), so the unsharded
// reference is exact. Expert rows of 5 are uneven at 2-4 ranks.
struct ClipExpertImpl : torch::nn::Module {
  ClipExpertImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 5))), fc2(register_module("fc2", torch::nn::Linear(5, 6))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ClipExpert);

struct ClipMoEBlockImpl : torch::nn::Module {
  static constexpr int64_t kExperts = 2;
  ClipMoEBlockImpl() : router(register_module("router", torch::nn::Linear(6, kExperts))) {
    for (int64_t e = 0; e < kExperts; ++e) experts->push_back(ClipExpert());
    register_module("experts", experts);
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor gates = at::softmax(router(x), -1);
    at::Tensor out = x;
    for (int64_t e = 0; e < kExperts; ++e) {
      out = out + gates.narrow(1, e, 1) * experts[e]->as<ClipExpertImpl>()->forward(x);
    }
    return out;
  }
  torch::nn::Linear router;
  torch::nn::ModuleList experts;
};
FSDP2CPP_MODULE(ClipMoEBlock);

// 7 -> 6 -> MoE block -> 3.
struct ClipMoE : torch::nn::Module {
  ClipMoE()
      : embed(register_module("embed", torch::nn::Linear(7, 6))),
        block(register_module("block", ClipMoEBlock())),
        head(register_module("head", torch::nn::Linear(6, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    return at::mse_loss(head(block(at::tanh(embed(x)))), y);
  }
  torch::nn::Linear embed;
  ClipMoEBlock block;
  torch::nn::Linear head;
};

bool is_expert_param(const std::string& fqn) { return fqn.find(".experts.") != std::string::npos; }

// The dense and the expert mesh of one case, both over every rank.
struct MoEMeshes {
  std::string name;
  DeviceMesh dense;
  DeviceMesh expert;
};

// The layouts a MoE user meets, each with shard groups that differ between
// the dense and the expert parameters on some rank: the experts' ranks in
// reverse order (shard index != rank), the experts replicated (W x 1 HSDP:
// a shard group of one rank), and at 4 ranks HSDP 2x2 for one kind and
// plain FSDP over all 4 for the other. Every rank makes the meshes in the
// same order (each makes process groups).
std::vector<MoEMeshes> moe_meshes(testing::RankContext& ctx) {
  const int w = ctx.world_size();
  const c10::DeviceType device = ctx.mesh().device_type();
  std::vector<MoEMeshes> cases;
  cases.push_back({"experts over the ranks reversed", ctx.mesh(),
                   DeviceMesh(ctx.world(), device, at::arange(w - 1, -1, -1, at::kLong), {"ep"})});
  cases.push_back(
      {"experts replicated (Wx1)", ctx.mesh(), init_device_mesh(ctx.world(), device, {w, 1}, {"replicate", "shard"})});
  if (w == 4) {
    const DeviceMesh hsdp = init_device_mesh(ctx.world(), device, {2, 2}, {"replicate", "shard"});
    cases.push_back({"dense HSDP 2x2, experts over 4", hsdp, ctx.mesh()});
    cases.push_back({"dense over 4, experts HSDP 2x2", ctx.mesh(), hsdp});
  }
  return cases;
}

// One step of the MoE with its experts on `meshes.expert`, clipped, against
// torch::nn::utils::clip_grad_norm_ on the unsharded model: the norm, and
// every gradient gathered over its own mesh.
void expect_moe_clip_matches_reference(testing::RankContext& ctx, const MoEMeshes& meshes, double norm_type,
                                       bool tensor_api) {
  SCOPED_TRACE(::testing::Message() << meshes.name << ", norm_type " << norm_type);
  torch::manual_seed(0);
  auto model = std::make_shared<ClipMoE>();
  torch::manual_seed(0);
  auto reference = std::make_shared<ClipMoE>();
  auto experts = std::make_shared<std::unordered_set<const c10::TensorImpl*>>();
  for (const auto& item : model->named_parameters()) {
    if (is_expert_param(item.key())) experts->insert(item.value().unsafeGetTensorImpl());
  }
  FullyShardOptions o;
  o.mesh = meshes.dense;
  o.shard_placement_fn = [experts, expert = meshes.expert](const at::Tensor& p) -> ShardPlacementResult {
    if (experts->count(p.unsafeGetTensorImpl()) != 0) return {Placement::shard(0), expert};
    return std::nullopt;
  };
  fully_shard(model->block.ptr(), o);
  FSDPModule root = fully_shard(model, o);

  backward_on_one_batch(ctx, *reference, *model);
  const double ref_norm = unclipped_norm(*reference, norm_type);
  const double max_norm = ref_norm / 3;
  torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm, norm_type);

  double total = 0;
  if (tensor_api) {
    const at::Tensor norm = get_total_norm(root, norm_type);
    clip_grads_with_norm_(root, max_norm, norm);
    total = norm.item<double>();
  } else {
    total = clip_grad_norm_(root, max_norm, norm_type);
  }
  EXPECT_NEAR(total, ref_norm, 1e-5 * ref_norm);
  for (const auto& item : reference->named_parameters()) {
    const at::Tensor sharded = model->named_parameters()[item.key()];  // a copy: the dict is a temporary
    const DeviceMesh& mesh = is_expert_param(item.key()) ? meshes.expert : meshes.dense;
    expect_close(full_param(sharded.grad(), item.value().sizes().vec(), mesh), item.value().grad(), item.key());
  }
}

class ClipGradExpertMesh : public ::testing::TestWithParam<int> {};

TEST_P(ClipGradExpertMesh, EachGroupIsReducedOverItsOwnShardGroupAndMatchesTheReference) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    for (const MoEMeshes& meshes : moe_meshes(ctx)) {
      expect_moe_clip_matches_reference(ctx, meshes, 2.0, /*tensor_api=*/true);
      expect_moe_clip_matches_reference(ctx, meshes, kInf, /*tensor_api=*/false);
      expect_moe_clip_matches_reference(ctx, meshes, 1.0, /*tensor_api=*/false);
    }
  });
}

// The test's own mesh is HSDP 2x2 (the root's): experts over all 4 ranks.
TEST(ClipGradExpertMeshHsdp, TwoByTwoRootWithExpertsOverFourRanks) {
  const testing::DistributedTestOptions options = testing::hsdp_options(2, 2);
  testing::run_distributed(options, [](testing::RankContext& ctx) {
    const DeviceMesh flat = init_device_mesh(ctx.world(), ctx.mesh().device_type(), {4}, {"ep"});
    const MoEMeshes meshes{"root HSDP 2x2, experts over 4", ctx.mesh(), flat};
    expect_moe_clip_matches_reference(ctx, meshes, 2.0, /*tensor_api=*/false);
    expect_moe_clip_matches_reference(ctx, meshes, kInf, /*tensor_api=*/true);
    expect_moe_clip_matches_reference(ctx, meshes, 3.0, /*tensor_api=*/true);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ClipGradExpertMesh, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

INSTANTIATE_TEST_SUITE_P(WorldSizes, ClipGrad, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
