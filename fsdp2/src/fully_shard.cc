#include "fsdp2/fully_shard.h"

#include <map>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "collectives/world.h"
#include "fsdp2/module_state.h"
#include "fsdp_state.h"
#include "stream_check/stream_check.h"

namespace fsdp {
namespace detail {
namespace {
constexpr const char* kStateKey = "fsdp2.FSDPState";
}

std::shared_ptr<FSDPState> state_of(const torch::nn::Module& module) {
  return std::static_pointer_cast<FSDPState>(module_state(module, kStateKey));
}

namespace {

std::string describe(const torch::nn::Module& m) { return m.name(); }

}  // namespace

std::vector<std::shared_ptr<FSDPState>> all_states();

// Where `module` is within the outermost sharded module that contains it
// (its FQN), or "" when no enclosing module is sharded yet.
std::string fqn_in_sharded_roots(const torch::nn::Module& module) {
  for (const auto& s : all_states()) {
    if (s->parent()) continue;
    for (const auto& root : s->modules()) {
      for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
        if (item.value().get() == &module) return item.key();
      }
    }
  }
  return "";
}

namespace {

c10::Device mesh_device(const DeviceMesh& mesh) {
  if (mesh.device_type() == c10::kCPU) return c10::Device(c10::kCPU);
  const auto* impl = c10::impl::getDeviceGuardImpl(mesh.device_type());
  return c10::Device(mesh.device_type(), impl->getDevice().index());
}

// Every state in the subtrees of `modules`, excluding theirs, each once.
std::vector<std::shared_ptr<FSDPState>> descendant_states(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<std::shared_ptr<FSDPState>> states;
  std::unordered_set<const FSDPState*> seen;
  for (const auto& module : modules) {
    for (const auto& child : module->modules(/*include_self=*/false)) {
      auto s = state_of(*child);
      if (s && seen.insert(s.get()).second) states.push_back(std::move(s));
    }
  }
  return states;
}

// One parameter of the modules being sharded: named_parameters()'s item
// interface, and the index of the module it comes from.
struct NamedParam {
  std::string name;
  at::Tensor tensor;
  size_t owner;
  std::string relative_name;  // within modules[owner]
  const std::string& key() const { return name; }
  const at::Tensor& value() const { return tensor; }
};

// The parameters of `modules`, in order; with several modules, named
// "modules[i].<name>" for messages.
std::vector<NamedParam> named_params_of(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<NamedParam> result;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string prefix = modules.size() == 1 ? "" : c10::str("modules[", i, "].");
    for (const auto& item : modules[i]->named_parameters(/*recurse=*/true)) {
      result.push_back(NamedParam{prefix + item.key(), item.value(), i, item.key()});
    }
  }
  return result;
}

}  // namespace

std::vector<std::shared_ptr<FSDPState>> all_states() {
  std::vector<std::shared_ptr<FSDPState>> states;
  std::unordered_set<const void*> seen;  // a group of several modules is attached to each
  for (auto& s : module_states(kStateKey)) {
    if (seen.insert(s.get()).second) states.push_back(std::static_pointer_cast<FSDPState>(s));
  }
  return states;
}

}  // namespace detail

using detail::FSDPState;

namespace detail {

bool name_has(const std::string& name, const char* word) { return name.find(word) != std::string::npos; }

// 1-D meshes shard (FSDP); 2-D meshes are (replicate, shard) for HSDP.
void check_mesh(const DeviceMesh& mesh, const std::string& name) {
  const auto& names = mesh.dim_names();
  if (mesh.ndim() == 1) {
    TORCH_CHECK(names.empty() || !name_has(names[0], "replicate"), "fully_shard: module '", name, "': the 1-D mesh ",
                mesh.to_string(),
                " is named as an HSDP replicate dim, but a 1-D mesh shards "
                "(FSDP). For HSDP pass a 2-D mesh with dims (replicate, shard).");
    return;
  }
  TORCH_CHECK(mesh.ndim() == 2, "fully_shard: module '", name, "': expected a 1-D (FSDP) or 2-D (HSDP) mesh, got ",
              mesh.to_string());
  TORCH_CHECK(names.size() == 2, "fully_shard: module '", name, "': the 2-D mesh ", mesh.to_string(),
              " has no dim names; HSDP needs them to tell the dims apart: name them {\"replicate\", \"shard\"}");
  TORCH_CHECK(!(name_has(names[0], "shard") && name_has(names[1], "replicate")), "fully_shard: module '", name,
              "': the 2-D mesh ", mesh.to_string(),
              " has its dims in the wrong order; HSDP meshes are "
              "(replicate, shard): build it with shape {replicas, shards} and names {\"replicate\", \"shard\"}");
  TORCH_CHECK(name_has(names[0], "replicate") && name_has(names[1], "shard"), "fully_shard: module '", name,
              "': the 2-D mesh ", mesh.to_string(),
              " must be named (replicate, shard), e.g. {\"replicate\", "
              "\"shard\"} or {\"dp_replicate\", \"dp_shard\"}");
}

// The group of consecutive shard ranks to reshard to after forward, or null.
std::shared_ptr<collectives::Communicator> post_forward_group(const DeviceMesh& mesh,
                                                              const std::optional<ReshardAfterForward>& option,
                                                              const std::string& name) {
  if (!option || option->is_bool()) return nullptr;
  const auto& shard = mesh.group(mesh.ndim() - 1);
  const int k = option->world_size();
  TORCH_CHECK(k >= 1 && shard->size() % k == 0, "fully_shard: module '", name, "': reshard_after_forward=", k,
              " must divide the shard size ", shard->size(), " (1 means false, ", shard->size(), " means true)");
  if (k == shard->size()) return nullptr;
  const int first = shard->rank() / k * k;
  std::vector<int> ranks(shard->global_ranks().begin() + first, shard->global_ranks().begin() + first + k);
  return mesh.world()->shared_group(ranks, mesh.device_type());
}

// Where FullyShardOptions::shard_placement_fn puts `param`: its shard dim
// and, for a per-parameter mesh (FSDP2's ShardPlacementResult), the mesh.
struct ResolvedPlacement {
  int64_t dim = 0;
  std::optional<DeviceMesh> mesh;  // unset: the call's mesh
};

ResolvedPlacement resolve_shard_placement(const FullyShardOptions& options, const at::Tensor& param,
                                          const std::string& fqn, const std::string& name,
                                          const DeviceMesh& default_mesh) {
  if (!options.shard_placement_fn) return {};
  ShardPlacementResult result = options.shard_placement_fn(param);
  ResolvedPlacement resolved;
  if (result.mesh) {
    const DeviceMesh& m = *result.mesh;
    TORCH_CHECK(m.device_type() == default_mesh.device_type(), "fully_shard: module '", name,
                "': shard_placement_fn returned the mesh ", m.to_string(), " on ", m.device_type(), " for parameter '",
                fqn, "', but the module's mesh ", default_mesh.to_string(), " is on ", default_mesh.device_type(),
                "; every per-parameter mesh must be on the module's device type");
    try {
      check_mesh(m, name);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "fully_shard: module '", name, "': shard_placement_fn returned the mesh ", m.to_string(),
                  " for parameter '", fqn, "', which fully_shard cannot shard over: ", e.msg());
    }
    resolved.mesh = m;
  }
  const std::optional<Placement>& placement = result.placement;
  if (!placement) return resolved;
  TORCH_CHECK(placement->is_shard(), "fully_shard: module '", name, "': shard_placement_fn returned ",
              placement->to_string(), " for parameter '", fqn,
              "'; it must return a Shard placement (fsdp::Placement::shard(dim)), or std::nullopt for Shard(0)");
  // Placement::shard refuses negative dims. A 0-dim parameter is sharded as
  // one row: dim 0 only.
  const int64_t ndim = std::max<int64_t>(param.dim(), 1);
  const int64_t dim = placement->dim();
  TORCH_CHECK(dim < ndim, "fully_shard: module '", name, "': shard_placement_fn returned ", placement->to_string(),
              " for parameter '", fqn, "' of shape ", param.sizes(), ", which has no dim ", dim, "; pick a dim in [0, ",
              ndim - 1, "] (e.g. Placement::shard(param.dim() - 1) for the last)");
  resolved.dim = dim;
  return resolved;
}

// Whether two meshes shard with the same process groups (FSDP2 keys its
// param groups by (shard group, replicate group)).
bool same_groups(const DeviceMesh& a, const DeviceMesh& b) {
  if (a.ndim() != b.ndim()) return false;
  for (int64_t d = 0; d < a.ndim(); ++d) {
    if (a.group(d).get() != b.group(d).get()) return false;
  }
  return true;
}

}  // namespace detail

namespace detail {
namespace {

// The name messages give the call's modules: the module's own, or
// "[a, b, ...]" for a group.
std::string name_of(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::string name = detail::describe(*modules.front());
  if (modules.size() > 1) {
    name = "[" + name;
    for (size_t i = 1; i < modules.size(); ++i) name += ", " + detail::describe(*modules[i]);
    name += "]";
  }
  return name;
}

// fully_shard applies once per module.
void check_not_sharded(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (const auto& m : modules) {
    if (!detail::state_of(*m)) continue;
    const std::string fqn = detail::fqn_in_sharded_roots(*m);
    const std::string what = detail::describe(*m);
    TORCH_CHECK(false, "fully_shard: already applied to ",
                fqn.empty() ? "this " + what + " module" : "module '" + fqn + "' (" + what + ")",
                modules.size() > 1 ? c10::str(" (modules[", &m - modules.data(), "] of the list)") : "",
                "; apply it once per module: to each block, then once to the root");
  }
}

void check_mp_policy(const MixedPrecisionPolicy& mp, const std::string& name) {
  TORCH_CHECK(!mp.param_dtype || c10::isFloatingType(*mp.param_dtype), "fully_shard: module '", name,
              "': MixedPrecisionPolicy::param_dtype must be a floating-point type, got ", *mp.param_dtype);
  TORCH_CHECK(!mp.reduce_dtype || c10::isFloatingType(*mp.reduce_dtype), "fully_shard: module '", name,
              "': MixedPrecisionPolicy::reduce_dtype must be a floating-point type, got ", *mp.reduce_dtype);
}

// The call's mesh: FullyShardOptions::mesh, else a sharded submodule's, else
// one over the whole world on the parameters' device type.
DeviceMesh mesh_of_call(const FullyShardOptions& options, const std::vector<std::shared_ptr<FSDPState>>& children,
                        const std::vector<detail::NamedParam>& named_params, const std::string& name) {
  if (options.mesh) return *options.mesh;
  if (!children.empty()) return children.front()->mesh();
  TORCH_CHECK(options.world, "fully_shard: module '", name,
              "': no mesh. Set FullyShardOptions::mesh (fsdp::init_device_mesh) or FullyShardOptions::world");
  c10::DeviceType type = c10::kCPU;
  for (const auto& item : named_params) {
    if (const at::Tensor& p = item.value(); p.defined()) {
      type = p.device().type();
      break;
    }
  }
  // One group for every module sharded this way, not one per call.
  auto group = options.world->shared_group(options.world->all_ranks(), type);
  return DeviceMesh::from_communicators(options.world, at::arange(options.world->size(), at::kLong), {group});
}

void check_offload(const FullyShardOptions& options, const DeviceMesh& mesh, const c10::Device& device,
                   const torch::nn::Module& module, const std::string& name) {
  // The stream-order checker models a device on CPU, offload included
  // ([Note: offload on the modelled device], host_memory.h).
  if (!options.offload_policy.offload_to_cpu || device.type() != c10::kCPU || stream_check::active()) return;
  const std::string fqn = detail::fqn_in_sharded_roots(module);
  TORCH_CHECK(false, "fully_shard: module ", fqn.empty() ? "" : "'" + fqn + "' ", "(", name,
              "): OffloadPolicy::offload_to_cpu needs a CUDA mesh, but the mesh ", mesh.to_string(), " is on CPU",
              options.mesh ? ""
                           : " (FullyShardOptions::mesh is unset: the default mesh follows the "
                             "parameters' device)",
              ", where the sharded parameters already live in host memory. Pass a CUDA mesh "
              "(fsdp::init_device_mesh(world, c10::kCUDA, ...)) to offload, or leave offload_to_cpu false (under "
              "the stream-order checker, FSDP2CPP_STREAM_CHECK=1, offload runs on CPU to check its order).");
}

using TensorImplSet = std::unordered_set<const c10::TensorImpl*>;

// The parameters the user leaves unsharded.
TensorImplSet ignored_params_of(const FullyShardOptions& options, const std::string& name) {
  TensorImplSet ignored;
  for (const auto& p : options.ignored_params) {
    TORCH_CHECK(p.defined(), "fully_shard: module '", name,
                "': FullyShardOptions::ignored_params has an undefined "
                "tensor; pass the module's parameters to leave unsharded");
    ignored.insert(p.unsafeGetTensorImpl());
  }
  return ignored;
}

// The parameters sharded submodules manage already: they stay theirs.
TensorImplSet managed_params_of(const std::vector<std::shared_ptr<FSDPState>>& children) {
  TensorImplSet managed;
  for (const auto& child : children) {
    for (const auto& g : child->groups()) {
      for (const auto& p : g->params()) managed.insert(p->param().unsafeGetTensorImpl());
    }
  }
  return managed;
}

// Every parameter is defined, and none is managed by a state other than the
// call's submodules': one managed by an enclosing module means the order was
// wrong (root before children), one managed by another module is tied.
void check_params_unclaimed(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                            const std::vector<detail::NamedParam>& named_params, const TensorImplSet& managed,
                            const TensorImplSet& ignored, const std::string& name) {
  for (const auto& item : named_params) {
    const at::Tensor& p = item.value();
    TORCH_CHECK(p.defined(), "fully_shard: parameter '", item.key(), "' of module '", name,
                "' is undefined; initialize every parameter before sharding");
    if (managed.count(p.unsafeGetTensorImpl()) || ignored.count(p.unsafeGetTensorImpl())) continue;
    for (const auto& any : detail::all_states()) {
      for (const auto& fp : any->all_params()) {
        if (fp->param().unsafeGetTensorImpl() != p.unsafeGetTensorImpl()) continue;
        bool enclosing = false;
        for (const auto& top : any->modules()) {
          for (const auto& m : top->modules(/*include_self=*/false)) enclosing |= m.get() == modules[item.owner].get();
        }
        TORCH_CHECK(!enclosing, "fully_shard: parameter '", item.key(), "' of module '", name,
                    "' is already sharded by fully_shard on an enclosing module. Apply fully_shard to submodules "
                    "first, then to their parents and the root.");
        // [Note: ties] A parameter lives in one group: FSDP2 shards it with
        // the first module that takes it, which breaks when another group
        // uses it; here that is refused.
        TORCH_CHECK(false, "fully_shard: parameter '", item.key(), "' of module '", name,
                    "' is shared (tied) with module '", any->module()->name(),
                    "', which fully_shard already sharded as its own group. A tied parameter must belong to one "
                    "group: apply fully_shard to a common ancestor of both modules instead of to each (the root "
                    "takes every parameter not in a sharded submodule), shard both modules as one group with one "
                    "call, fully_shard({a, b}), or untie the parameters.");
      }
    }
  }
}

// A parameter the call shards: no gradient yet, on the mesh's device, of a
// dtype the mixed-precision policy can cast.
void check_param(const detail::NamedParam& item, const c10::Device& device, const FullyShardOptions& options,
                 const std::string& name) {
  const at::Tensor& p = item.value();
  const bool offload = options.offload_policy.offload_to_cpu;
  // An optimizer that stepped before sharding leaves full-shape gradients
  // (and state) that no longer match the sharded parameter.
  TORCH_CHECK(!p.grad().defined(), "fully_shard: parameter '", item.key(), "' of module '", name,
              "' already has a gradient (shape ", p.grad().sizes(),
              "): a backward or an optimizer step ran before fully_shard. Shard first: apply fully_shard before "
              "any backward, then build the optimizer over the sharded parameters (an optimizer built or "
              "stepped before keeps state of the unsharded shape). To keep the model, call "
              "optimizer.zero_grad() (or reset each parameter's grad) before fully_shard.");
  // With CPU offload the shards go to the host anyway, so a model built on
  // the CPU (too large for the device) is sharded from there.
  const bool on_mesh_device =
      p.device().type() == device.type() && (device.type() == c10::kCPU || p.device() == device);
  TORCH_CHECK(on_mesh_device || (offload && p.device().is_cpu()), "fully_shard: parameter '", item.key(),
              "' of module '", name, "' is on ", p.device(), " but the mesh's device is ", device,
              "; move the module to ", device, offload ? " (or to the CPU: offload_to_cpu is set)" : "",
              " before sharding");
  TORCH_CHECK(!options.mp_policy.param_dtype || p.is_floating_point(), "fully_shard: module '", name, "': parameter '",
              item.key(), "' is ", p.scalar_type(),
              "; a MixedPrecisionPolicy::param_dtype needs floating-point parameters");
}

// [Note: per-parameter meshes] shard_placement_fn may put a parameter on
// another mesh (FSDP2's ShardPlacementResult): the call's parameters are
// grouped by mesh, one FSDPParamGroup per distinct (shard, replicate)
// process-group pair, in the order the meshes first appear (the call's
// mesh's group first when it has parameters). The state runs every
// group's hooks in that order.
struct PendingGroup {
  DeviceMesh mesh;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::pair<size_t, std::string>> owners;
  std::vector<int64_t> shard_dims;
};

// The parameters the call shards (not managed, not ignored, tied ones once),
// checked and grouped by mesh.
std::vector<PendingGroup> group_by_mesh(const std::vector<detail::NamedParam>& named_params,
                                        const TensorImplSet& managed, const TensorImplSet& ignored,
                                        const FullyShardOptions& options, const DeviceMesh& mesh,
                                        const c10::Device& device, const std::string& name) {
  std::vector<PendingGroup> pending;
  TensorImplSet seen;
  std::optional<c10::ScalarType> first_dtype;
  std::string first_name;
  for (const auto& item : named_params) {
    const at::Tensor& p = item.value();
    const auto* impl = p.unsafeGetTensorImpl();
    if (managed.count(impl) || ignored.count(impl) || !seen.insert(impl).second) continue;  // tied: once
    check_param(item, device, options, name);
    if (first_dtype) {
      TORCH_CHECK(p.scalar_type() == *first_dtype, "fully_shard: module '", name,
                  "' mixes dtypes in one group: parameter '", first_name, "' is ", *first_dtype, " but '", item.key(),
                  "' is ", p.scalar_type(),
                  ". Give the parameters one dtype, or shard the differing submodule with its own fully_shard call.");
    } else {
      first_dtype = p.scalar_type();
      first_name = item.key();
    }
    ResolvedPlacement placement = detail::resolve_shard_placement(options, p, item.key(), name, mesh);
    const DeviceMesh& param_mesh = placement.mesh ? *placement.mesh : mesh;
    PendingGroup* target = nullptr;
    for (auto& g : pending) {
      if (detail::same_groups(g.mesh, param_mesh)) target = &g;
    }
    if (target == nullptr) target = &pending.emplace_back(PendingGroup{param_mesh, {}, {}, {}, {}});
    target->params.push_back(p);
    target->names.push_back(item.key());
    target->owners.emplace_back(item.owner, item.relative_name);
    target->shard_dims.push_back(placement.dim);
  }
  return pending;
}

// The state of the call: one FSDPParamGroup per pending group, and the
// parent of every sharded submodule that has none yet.
std::shared_ptr<FSDPState> make_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                      std::vector<PendingGroup> pending,
                                      const std::vector<std::shared_ptr<FSDPState>>& children,
                                      const FullyShardOptions& options, const DeviceMesh& mesh,
                                      const c10::Device& device, const std::string& name) {
  std::vector<std::unique_ptr<detail::FSDPParamGroup>> groups;
  std::vector<std::vector<std::pair<size_t, std::string>>> owners;
  for (auto& g : pending) {
    std::shared_ptr<collectives::Communicator> post_forward_comm =
        detail::post_forward_group(g.mesh, options.reshard_after_forward, name);
    groups.push_back(std::make_unique<detail::FSDPParamGroup>(std::move(g.params), std::move(g.names), g.mesh, device,
                                                              options.mp_policy, std::move(post_forward_comm),
                                                              options.offload_policy, g.shard_dims));
    owners.push_back(std::move(g.owners));
  }
  auto state = std::make_shared<FSDPState>(modules, mesh, device, std::move(groups), options.reshard_after_forward,
                                           options.mp_policy);
  if (modules.size() > 1) state->set_param_owners(std::move(owners));
  for (const auto& child : children) {
    if (!child->parent()) child->set_parent(state);
  }
  return state;
}

// The module-call hooks that run the state, and the side table entries that
// own it (the hooks hold it weakly).
void attach_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                  const std::shared_ptr<FSDPState>& state) {
  std::weak_ptr<FSDPState> weak = state;
  for (const auto& m : modules) {
    if (modules.size() == 1) {
      register_forward_pre_hook(*m, [weak](torch::nn::Module&, TensorRefs& inputs) {
        if (auto s = weak.lock()) s->pre_forward(inputs);
      });
      register_forward_hook(*m, [weak](torch::nn::Module&, TensorRefs&, TensorRefs& outputs) {
        if (auto s = weak.lock()) s->post_forward(outputs);
      });
    } else {
      register_forward_pre_hook(*m, [weak](torch::nn::Module& called, TensorRefs& inputs) {
        if (auto s = weak.lock()) s->group_pre_forward(called, inputs);
      });
      register_forward_hook(*m, [weak](torch::nn::Module& called, TensorRefs&, TensorRefs& outputs) {
        if (auto s = weak.lock()) s->group_post_forward(called, outputs);
      });
    }
    register_forward_error_hook(*m, [weak](torch::nn::Module&) {
      if (auto s = weak.lock()) s->explain_forward_error();
    });
    detail::set_module_state(*m, detail::kStateKey, state);
  }
}

// fully_shard of one module or of a group of several.
FSDPModule shard_modules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                         const FullyShardOptions& options) {
  const std::string name = name_of(modules);
  check_not_sharded(modules);
  check_mp_policy(options.mp_policy, name);
  const std::vector<std::shared_ptr<FSDPState>> children = detail::descendant_states(modules);
  const std::vector<detail::NamedParam> named_params = detail::named_params_of(modules);
  const DeviceMesh mesh = mesh_of_call(options, children, named_params, name);
  detail::check_mesh(mesh, name);
  const c10::Device device = detail::mesh_device(mesh);
  check_offload(options, mesh, device, *modules.front(), name);
  const TensorImplSet ignored = ignored_params_of(options, name);
  const TensorImplSet managed = managed_params_of(children);
  check_params_unclaimed(modules, named_params, managed, ignored, name);
  std::vector<PendingGroup> pending = group_by_mesh(named_params, managed, ignored, options, mesh, device, name);
  auto state = make_state(modules, std::move(pending), children, options, mesh, device, name);
  attach_state(modules, state);
  return FSDPModule(state);
}

}  // namespace
}  // namespace detail

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options) {
  TORCH_CHECK(module, "fully_shard: the module is null");
  return detail::shard_modules({module}, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options) {
  TORCH_CHECK(!modules.empty(),
              "fully_shard: the list of modules is empty; pass the modules to shard as one group (at least one)");
  std::unordered_set<const torch::nn::Module*> listed;
  for (size_t i = 0; i < modules.size(); ++i) {
    TORCH_CHECK(modules[i], "fully_shard: modules[", i,
                "] of the list is null; pass the modules to shard as one group");
    TORCH_CHECK(listed.insert(modules[i].get()).second, "fully_shard: modules[", i, "] (",
                detail::describe(*modules[i]), ") is listed twice; list each module of the group once");
  }
  // A module's subtree is already in its group: listing a descendant too
  // would shard those parameters twice.
  for (size_t i = 0; i < modules.size(); ++i) {
    for (const auto& sub : modules[i]->modules(/*include_self=*/false)) {
      if (!listed.count(sub.get())) continue;
      size_t j = 0;
      while (modules[j].get() != sub.get()) ++j;
      TORCH_CHECK(false, "fully_shard: modules[", j, "] (", detail::describe(*modules[j]), ") is inside modules[", i,
                  "] (", detail::describe(*modules[i]),
                  "), whose group takes its parameters already; list only modules that do not contain one another "
                  "(shard the inner one first with its own fully_shard call to give it a group of its own)");
    }
  }
  return detail::shard_modules(modules, options);
}

void release_fsdp_state_of_destroyed_modules() { detail::release_states_of_destroyed_modules(); }

std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto state = detail::state_of(module);
  if (!state) return std::nullopt;
  return FSDPModule(state);
}

// --- FSDPModule ------------------------------------------------------------

FSDPModule::FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {
  TORCH_CHECK(state_, "fsdp2: FSDPModule needs a state");
}

torch::nn::Module& FSDPModule::module() const { return *state_->module(); }
std::shared_ptr<torch::nn::Module> FSDPModule::module_ptr() const { return state_->module(); }
std::vector<std::shared_ptr<torch::nn::Module>> FSDPModule::modules() const { return state_->modules(); }
const DeviceMesh& FSDPModule::mesh() const { return state_->mesh(); }

namespace {

// Applies `f` to the state of every sharded module in `root`'s subtree
// (root included) when `recurse`, else to root's only.
template <typename F>
void for_each_state(const std::shared_ptr<FSDPState>& root, bool recurse, F&& f) {
  if (!recurse) {
    f(*root);
    return;
  }
  std::unordered_set<const FSDPState*> seen;  // a group of several modules is met once per module
  for (const auto& top : root->modules()) {
    for (const auto& m : top->modules(/*include_self=*/true)) {
      auto s = detail::state_of(*m);
      if (s && seen.insert(s.get()).second) f(*s);
    }
  }
}

}  // namespace

UnshardHandle FSDPModule::unshard(bool async_op) {
  state_->top()->lazy_init();
  for (const auto& g : state_->groups()) g->unshard(async_op);
  if (!async_op) {
    for (const auto& g : state_->groups()) g->wait_for_unshard();
  }
  return UnshardHandle(async_op ? state_ : nullptr);
}

void UnshardHandle::wait() {
  if (!state_) return;
  for (const auto& g : state_->groups()) g->wait_for_unshard();
  state_.reset();
}

void FSDPModule::reshard() {
  for (const auto& g : state_->groups()) g->reshard();
}

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) {
      // As FSDP2: for HSDP this controls the all-reduce too.
      g->settings().reduce_grads = requires_gradient_sync;
      g->settings().all_reduce_grads = requires_gradient_sync;
    }
  });
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  for_each_state(state_, recurse, [&](FSDPState& s) {
    // Kept over lazy init's default for the root.
    s.clear_auto_reshard_after_forward();
    for (const auto& g : s.groups()) {
      g->settings().reshard_after_forward = reshard_after_forward;
      g->clear_post_forward_comm();
    }
  });
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) g->settings().all_reduce_grads = requires_all_reduce;
  });
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) g->settings().reshard_after_backward = reshard_after_backward;
  });
}

namespace {
std::vector<std::weak_ptr<FSDPState>> to_weak(const std::vector<FSDPModule>& modules) {
  std::vector<std::weak_ptr<FSDPState>> result;
  result.reserve(modules.size());
  for (const auto& m : modules) result.push_back(m.state());
  return result;
}
}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->forward_prefetch = to_weak(modules);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->backward_prefetch = to_weak(modules);
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  for (const auto& g : state_->groups()) g->settings().unshard_in_backward = unshard_in_backward;
}

void FSDPModule::set_post_optim_event(std::shared_ptr<c10::Event> event) {
  TORCH_CHECK(event, "set_post_optim_event: the event is null");
  state_->top()->post_optim_event = std::move(event);
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0, "set_gradient_divide_factor: the factor must be positive, got ", factor);
  for (const auto& g : state_->groups()) g->settings().gradient_divide_factor = factor;
}

void FSDPModule::set_force_sum_reduction_for_comms(bool force_sum) {
  for (const auto& g : state_->groups()) g->settings().force_sum_reduction = force_sum;
}

void FSDPModule::set_all_reduce_hook(std::function<void(at::Tensor&)> hook, std::optional<c10::Stream> stream) {
  for (const auto& g : state_->groups()) {
    TORCH_CHECK(!stream || g->mesh().ndim() == 1, "set_all_reduce_hook: a stream was given, but module's mesh ",
                g->mesh().to_string(),
                " is 2-D (HSDP), where the hook runs on the HSDP all-reduce stream after the all-reduce; pass no "
                "stream");
  }
  TORCH_CHECK(!stream || state_->mesh().ndim() == 1,
              "set_all_reduce_hook: a stream was given, but module's mesh is 2-D (HSDP), where the hook runs on "
              "the HSDP all-reduce stream after the all-reduce; pass no stream");
  TORCH_CHECK(!stream || stream->device_type() == state_->device().type(), "set_all_reduce_hook: the stream is on ",
              stream->device(), " but the module is sharded on ", state_->device());
  for (const auto& g : state_->groups()) {
    g->settings().reduced_grad_hook = hook;
    g->settings().reduced_grad_hook_stream = stream;
  }
}

void FSDPModule::set_reduce_scatter_unused_params(bool reduce_scatter_unused_params, bool recurse) {
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) g->settings().reduce_scatter_unused_params = reduce_scatter_unused_params;
  });
}

void FSDPModule::set_reduce_scatter_max_input_buffers(int max_input_buffers, bool recurse) {
  TORCH_CHECK(max_input_buffers >= 1, "set_reduce_scatter_max_input_buffers: module '", state_->module()->name(),
              "': max_input_buffers must be at least 1 (1 is the default: one reduce-scatter in flight), got ",
              max_input_buffers);
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) g->settings().reduce_scatter_max_input_buffers = max_input_buffers;
  });
  if (auto* ctx = state_->context()) ctx->comm->invalidate_max_input_buffers();
}

void FSDPModule::set_separate_reduce_scatter_group(bool enable, bool recurse) {
  // One communicator per distinct set of shard ranks in this call, as
  // FSDP2: every module sharded over the same ranks uses the same one.
  std::map<std::vector<int>, std::shared_ptr<collectives::Communicator>> made;
  for_each_state(state_, recurse, [&](FSDPState& s) {
    for (const auto& g : s.groups()) {
      std::shared_ptr<collectives::Communicator>& rs_comm = g->settings().reduce_scatter_comm;
      if (!enable || g->shard_comm()->size() == 1) {
        rs_comm = nullptr;
        continue;
      }
      const std::vector<int>& ranks = g->shard_comm()->global_ranks();
      auto it = made.find(ranks);
      if (it == made.end()) {
        // A module that has one keeps it (no new communicator, the same on
        // every rank since every rank made the same calls).
        it = made.emplace(ranks, rs_comm ? rs_comm : s.mesh().world()->new_group(ranks, g->shard_comm()->device_type()))
                 .first;
      }
      rs_comm = it->second;
    }
  });
}

void share_comm_ctx(const std::vector<FSDPModule>& modules) {
  if (modules.empty()) return;
  for (const auto& m : modules) {
    const auto& s = m.state();
    TORCH_CHECK(s->parent() == nullptr, "share_comm_ctx: module '", s->module()->name(),
                "' is inside the sharded module '", s->top()->module()->name(),
                "'; pass the roots (e.g. each pipeline stage's model chunk), whose trees then share the context");
    TORCH_CHECK(s->device() == modules.front().state()->device(), "share_comm_ctx: module '", s->module()->name(),
                "' is sharded on ", s->device(), " but '", modules.front().state()->module()->name(), "' on ",
                modules.front().state()->device(), "; only roots on one device can share streams");
  }
  const std::shared_ptr<detail::FSDPCommContext> comm_ctx = modules.front().state()->comm_context();
  for (size_t i = 1; i < modules.size(); ++i) modules[i].state()->adopt_comm_context(comm_ctx);
}

void FSDPModule::reset_iter_state() { state_->top()->reset_iter_state(); }

void FSDPModule::set_is_last_backward(bool is_last_backward) { state_->top()->is_last_backward = is_last_backward; }

RuntimeStats FSDPModule::runtime_stats() const {
  auto* ctx = state_->context();
  return ctx ? ctx->comm->stats : RuntimeStats{};
}

void FSDPModule::reset_runtime_stats() {
  if (auto* ctx = state_->context()) ctx->comm->stats = RuntimeStats{};
}

int64_t FSDPModule::unsharded_bytes() const {
  int64_t bytes = 0;
  for (const auto& g : state_->groups()) bytes += g->unsharded_storage_bytes();
  return bytes;
}

}  // namespace fsdp
