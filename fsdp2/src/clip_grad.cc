#include "fsdp2/clip_grad.h"

#include <cmath>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "collectives/communicator.h"
#include "collectives/flight_recorder.h"
#include "fsdp_state.h"

namespace fsdp {
namespace {

// Gradients of one device and dtype: one foreach kernel each.
struct GradBucket {
  c10::Device device;
  c10::ScalarType dtype;
  std::vector<at::Tensor> grads;
};

void add_to_bucket(std::vector<GradBucket>& buckets, const at::Tensor& grad) {
  for (auto& b : buckets) {
    if (b.device == grad.device() && b.dtype == grad.scalar_type()) {
      b.grads.push_back(grad);
      return;
    }
  }
  buckets.push_back({grad.device(), grad.scalar_type(), {grad}});
}

// The gradients whose rows are split over one shard group: the parameters
// of every FSDPParamGroup whose mesh's last dim has these ranks on this rank
// (under HSDP the replicas hold equal shards, so the replicate dim is left
// out). Groups over equal ranks are merged: every member of a shard group
// sees the same ranks, so all members merge alike and issue the same
// collectives.
struct ShardSet {
  std::shared_ptr<collectives::Communicator> comm;
  std::vector<GradBucket> sharded;
  // Parameters fully_shard left alone (ignored_params), full on every rank;
  // only in the root's set.
  std::vector<GradBucket> replicated;
};

// The gradients of `root`'s module by shard group, the root's first, then
// the others in the order of named_modules (the same on every rank, so the
// all-reduces of get_total_norm are issued in the same order everywhere).
struct ModelGrads {
  std::vector<ShardSet> sets;
  c10::Device device{c10::kCPU};
  bool any_double = false;
};

size_t set_of(std::vector<ShardSet>& sets, const std::shared_ptr<collectives::Communicator>& comm) {
  for (size_t i = 0; i < sets.size(); ++i) {
    if (sets[i].comm->global_ranks() == comm->global_ranks()) return i;
  }
  sets.push_back(ShardSet{comm, {}, {}});
  return sets.size() - 1;
}

ModelGrads collect_grads(const FSDPModule& root, const char* api) {
  ModelGrads out;
  out.sets.push_back(ShardSet{root.mesh().group(root.mesh().ndim() - 1), {}, {}});
  out.device = root.state()->device();
  struct Managed {
    const detail::FSDPParam* param;
    size_t set;
  };
  std::unordered_map<const c10::TensorImpl*, Managed> managed;
  for (const auto& item : root.module().named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto state = detail::state_of(*item.value());
    if (!state) continue;
    for (const auto& group : state->groups()) {
      const size_t set = set_of(out.sets, group->mesh().group(group->mesh().ndim() - 1));
      for (const auto& p : group->params()) managed.emplace(p->param().unsafeGetTensorImpl(), Managed{p.get(), set});
    }
  }
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.module().named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second || !p.grad().defined()) continue;
    const at::Tensor& g = p.grad();
    auto it = managed.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it == managed.end() || it->second.param->state() == detail::ShardedState::kSharded, "fsdp2: ", api,
                ": parameter '", item.key(),
                "' is unsharded, so its gradient is not reduced yet; call it after the backward that reduces the "
                "gradients (gradient sync on, set_is_last_backward(true)) has finished");
    TORCH_CHECK(g.sizes() == p.sizes(), "fsdp2: ", api, ": the gradient of parameter '", item.key(), "' has shape ",
                g.sizes(), ", which does not match the parameter's shape ", p.sizes(),
                "; call it after backward has finished");
    out.any_double = out.any_double || g.scalar_type() == at::kDouble;
    if (it == managed.end()) {
      add_to_bucket(out.sets.front().replicated, g);
    } else {
      add_to_bucket(out.sets[it->second.set].sharded, g);
    }
  }
  return out;
}

// This rank's contribution from `buckets`: the largest absolute element (inf
// norm) or the sum of the p-th powers of the gradients' norms, as a 0-dim
// `acc` tensor on `device`, or undefined when there is nothing to count.
at::Tensor local_contribution(const std::vector<GradBucket>& buckets, double norm_type, at::ScalarType acc,
                              c10::Device device) {
  const bool inf_norm = std::isinf(norm_type);
  at::Tensor result;
  for (const auto& b : buckets) {
    std::vector<at::Tensor> grads;
    // A rank may hold no rows of a parameter; the infinity norm of an empty
    // tensor is an error in ATen, and it contributes nothing anyway.
    for (const auto& g : b.grads) {
      if (g.numel() > 0) grads.push_back(g);
    }
    if (grads.empty()) continue;
    // fp32 at least, so that bf16/fp16 norms are not rounded before summing.
    const at::ScalarType norm_dtype = b.dtype == at::kDouble ? at::kDouble : at::kFloat;
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, norm_type, norm_dtype);
    at::Tensor stacked = at::stack(norms).to(device, acc);
    at::Tensor part = inf_norm ? stacked.max() : stacked.pow(norm_type).sum();
    if (!result.defined()) {
      result = part;
    } else {
      result = inf_norm ? at::maximum(result, part) : result + part;
    }
  }
  return result;
}

std::vector<GradBucket> all_buckets(ModelGrads grads) {
  std::vector<GradBucket> all;
  for (auto& set : grads.sets) {
    for (auto& b : set.sharded) all.push_back(std::move(b));
    for (auto& b : set.replicated) all.push_back(std::move(b));
  }
  return all;
}

at::Tensor combine(const at::Tensor& a, const at::Tensor& b, bool inf_norm) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return inf_norm ? at::maximum(a, b) : a + b;
}

}  // namespace

at::Tensor get_total_norm(const FSDPModule& root, double norm_type, bool error_if_nonfinite) {
  constexpr const char* kApi = "get_total_norm";
  TORCH_CHECK(norm_type > 0, "fsdp2: ", kApi, ": norm_type must be positive (or infinity), got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  ModelGrads grads = collect_grads(root, kApi);
  c10::NoGradGuard no_grad;
  const at::ScalarType acc = grads.any_double ? at::kDouble : at::kFloat;
  // Per shard group: the sum of the p-th powers (the largest element for the
  // infinity norm) of its parameters' rows, reduced over the group, is that
  // group's share of the whole model's, the same on every rank; the shares
  // are then combined here, without another collective (torchtitan's
  // clipping of expert-parallel models does the same per mesh).
  at::Tensor total;
  for (const ShardSet& set : grads.sets) {
    at::Tensor local = local_contribution(set.sharded, norm_type, acc, grads.device);
    at::Tensor replicated = local_contribution(set.replicated, norm_type, acc, grads.device);
    // Full on every rank: counted once over the group (see clip_grad.h).
    if (replicated.defined() && !inf_norm) replicated = replicated / static_cast<double>(set.comm->size());
    local = combine(local, replicated, inf_norm);
    // Norms are >= 0, so zero is the neutral element of both reductions.
    local = local.defined() ? local.reshape({1}).contiguous()
                            : at::zeros({1}, at::TensorOptions().dtype(acc).device(grads.device));
    // One collective per shard group; the current stream waits on NCCL.
    const collectives::CollectiveLabel label("FSDP::clip_grad_norm_ (total norm)");
    set.comm->all_reduce(local, inf_norm ? collectives::ReduceOp::max() : collectives::ReduceOp::sum()).wait();
    total = combine(total, local.reshape({}), inf_norm);
  }
  total = inf_norm ? total : total.pow(1.0 / norm_type);
  if (error_if_nonfinite) {
    const double value = total.item<double>();
    TORCH_CHECK(std::isfinite(value), "fsdp2: ", kApi, ": the total norm of order ", norm_type,
                " of the gradients over every rank's shards is non-finite (", value,
                "), so it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, pass error_if_nonfinite=false");
  }
  return total;
}

void clip_grads_with_norm_(const FSDPModule& root, double max_norm, const at::Tensor& total_norm) {
  constexpr const char* kApi = "clip_grads_with_norm_";
  TORCH_CHECK(total_norm.defined() && total_norm.numel() == 1, "fsdp2: ", kApi,
              ": total_norm must be a one-element tensor (get_total_norm's result), got ",
              total_norm.defined() ? c10::str("shape ", total_norm.sizes()) : std::string("an undefined tensor"));
  c10::NoGradGuard no_grad;
  const at::Tensor coef = at::clamp_max(max_norm / (total_norm.reshape({}) + 1e-6), 1.0);
  for (auto& b : all_buckets(collect_grads(root, kApi))) {
    at::_foreach_mul_(b.grads, coef.to(b.device));
  }
}

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type, bool error_if_nonfinite) {
  const at::Tensor total = get_total_norm(root, norm_type, error_if_nonfinite);
  clip_grads_with_norm_(root, max_norm, total);
  return total.item<double>();
}

}  // namespace fsdp
