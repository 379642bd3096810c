// FQN state dicts of sharded models and optimizers (see state_dict.h).
//
// Everything a rank loads goes through one path: a list of Targets (this
// rank's storage for one key: sharded rows or a whole tensor, with the
// global shape and dtype it expects), checked against the keys, shapes and
// dtypes of the incoming state dict on every rank before anything is copied
// or communicated, then filled key by key from DTensors, full tensors, or
// full tensors broadcast from rank 0.
#include "fsdp2/state_dict.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>

#include "collectives/flight_recorder.h"
#include "fsdp_param.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"

namespace fsdp {
namespace detail {
// Every live FSDPState (fully_shard.cc).
std::vector<std::shared_ptr<FSDPState>> all_states();
}  // namespace detail

namespace {

using detail::FSDPParam;
using detail::FSDPParamGroup;
using Json = nlohmann::json;

std::string join(const std::vector<std::string>& items, size_t limit = 20) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size() && i < limit; ++i) out << (i ? ", " : "") << "'" << items[i] << "'";
  if (items.size() > limit) out << ", ... (" << items.size() << " in all)";
  return out.str();
}

// --- which parameters fully_shard manages ----------------------------------

// Where a parameter lives: `param` is null for a parameter no fully_shard
// manages.
struct Slot {
  FSDPParam* param = nullptr;
  FSDPParamGroup* group = nullptr;
};

// Maps parameters to their FSDPParam by TensorImpl over every live state, so
// that it works before lazy init (FQNs not yet set) and on a submodule of a
// sharded root.
class Registry {
 public:
  Registry() {
    for (const auto& state : detail::all_states()) {
      for (const auto& g : state->groups()) {
        for (const auto& p : g->params()) slots_[p->param().unsafeGetTensorImpl()] = Slot{p.get(), g.get()};
      }
    }
  }

  Slot find(const at::Tensor& t) const {
    auto it = slots_.find(t.unsafeGetTensorImpl());
    return it == slots_.end() ? Slot{} : it->second;
  }

 private:
  std::unordered_map<const c10::TensorImpl*, Slot> slots_;
};

bool is_scalar(const FSDPParam& p) { return p.unsharded_shape().empty(); }

// Shard(d) over the group's mesh, d the parameter's shard dim (0 for a 0-dim
// parameter, sharded as one row); (Replicate, Shard(d)) under HSDP.
std::vector<Placement> shard_placements(const Slot& slot) {
  const Placement shard = Placement::shard(slot.param->shard_dim());
  if (slot.group->mesh().ndim() == 2) return {Placement::replicate(), shard};
  return {shard};
}

// `local` on its mesh's device: with CPU offload (OffloadPolicy) the shards
// and the optimizer state are in host memory, but a DTensor's local tensor
// lives on its mesh's device (and the collectives need it there), so such a
// value is a device copy. Loading copies back into the host shards.
at::Tensor on_mesh_device(const at::Tensor& local, const Slot& slot) {
  if (!slot.group->offload_to_cpu() || !local.is_cpu()) return local;
  return local.to(slot.group->device());
}

// A DTensor over `local` (laid out as the parameter's sharded rows).
DTensor sharded_dtensor(const at::Tensor& local, const Slot& slot) {
  return DTensor::from_local(on_mesh_device(local, slot), slot.group->mesh(), shard_placements(slot),
                             slot.param->unsharded_shape());
}

// The full value of `local`, this rank's rows of the sharded parameter in
// `slot` (collective over the group's mesh).
at::Tensor gather_full(const at::Tensor& local, const Slot& slot) {
  c10::NoGradGuard no_grad;
  if (!is_scalar(*slot.param)) return sharded_dtensor(local, slot).full_tensor();
  // A 0-dim parameter is sharded as one row, held by the first shard rank.
  DTensor one = DTensor::from_local(on_mesh_device(local, slot).reshape({-1}), slot.group->mesh(),
                                    shard_placements(slot), std::vector<int64_t>{1});
  return one.full_tensor().reshape({});
}

// Copies the rows this rank owns of `full` into `dest`.
void copy_rows(const at::Tensor& dest, const Slot& slot, const at::Tensor& full) {
  c10::NoGradGuard no_grad;
  if (!slot.param) {
    dest.copy_(full);
    return;
  }
  const FSDPParam& p = *slot.param;
  const at::Tensor rows = is_scalar(p) ? full.reshape({1}) : full;
  const int64_t dim = p.shard_dim();
  const ChunkExtent ext = chunk_extent(rows.size(dim), p.shard_world_size(), p.shard_rank());
  dest.copy_(rows.narrow(dim, ext.offset, ext.length));
}

bool same_mesh(const DeviceMesh& a, const DeviceMesh& b) {
  return a.mesh().sizes() == b.mesh().sizes() && a.mesh().equal(b.mesh());
}

// Copies `value` (any layout) into `dest`, this rank's storage for it. The
// decision to gather depends only on global properties (mesh layout,
// placements), so every rank of the value's mesh takes the same branch.
void load_value(const at::Tensor& dest, const Slot& slot, const StateValue& value) {
  c10::NoGradGuard no_grad;
  if (!value.is_dtensor()) {
    copy_rows(dest, slot, value.local());
    return;
  }
  const DTensor& dt = value.dtensor();
  if (slot.param && !is_scalar(*slot.param) && same_mesh(dt.mesh(), slot.group->mesh()) &&
      dt.placements() == shard_placements(slot)) {
    dest.copy_(dt.to_local());
    return;
  }
  copy_rows(dest, slot, dt.full_tensor());
}

// --- the model's parameters and buffers ------------------------------------

struct Entry {
  std::string fqn;
  at::Tensor tensor;  // the registered parameter or buffer
  Slot slot;
};

// `loading`: the values are about to be overwritten, so a parameter whose
// data was replaced (see [Note: replaced parameter data]) is simply pointed
// back at its shard instead of adopted or refused.
std::vector<Entry> model_entries(torch::nn::Module& model, const Registry& registry, bool loading) {
  std::vector<Entry> entries;
  // LibTorch's named_parameters does not drop tied parameters: every FQN
  // that names one is listed, as Python's state_dict() does.
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    Slot slot = registry.find(item.value());
    if (slot.param) slot.param->reset_sharded_param(/*adopt=*/!loading);
    entries.push_back({item.key(), item.value(), slot});
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) entries.push_back({item.key(), item.value(), Slot{}});
  }
  return entries;
}

// The same ranks, in any layout.
bool same_ranks(const DeviceMesh& a, const DeviceMesh& b) {
  return a.size() == b.size() &&
         std::get<0>(a.mesh().reshape({-1}).sort()).equal(std::get<0>(b.mesh().reshape({-1}).sort()));
}

// The mesh of the model's first group (null without fully_shard), whose
// origin is "rank 0" and over which broadcast_from_rank0 broadcasts. Groups
// over other meshes (per-parameter meshes, or other fully_shard meshes) must
// span the same ranks, in any layout: a full value is then gathered to, or
// broadcast to, every rank, the origin included. Throws otherwise, since
// "rank 0" and the broadcast would be ambiguous.
const DeviceMesh* model_mesh(const std::vector<Entry>& entries) {
  const DeviceMesh* mesh = nullptr;
  std::string first;
  for (const auto& e : entries) {
    if (!e.slot.param) continue;
    if (!mesh) {
      mesh = &e.slot.group->mesh();
      first = e.fqn;
      continue;
    }
    TORCH_CHECK(same_mesh(*mesh, e.slot.group->mesh()) || same_ranks(*mesh, e.slot.group->mesh()),
                "fsdp2 state dict: parameters '", first, "' and '", e.fqn,
                "' are sharded over meshes of different ranks (", mesh->to_string(), " and ",
                e.slot.group->mesh().to_string(),
                "); broadcast_from_rank0 and cpu_offload need meshes that span the same ranks");
  }
  return mesh;
}

// Rank 0 of a mesh: its first rank (coordinate 0 in every dim).
bool is_mesh_origin(const DeviceMesh& mesh) {
  const auto coord = mesh.coordinate();
  return std::all_of(coord.begin(), coord.end(), [](int64_t c) { return c == 0; });
}

// Broadcasts `t` (in place) from the mesh's origin to all its ranks: along
// dim 0 among the ranks at coordinate 0 in the later dims, then along dim 1,
// and so on, with the mesh's own groups.
void broadcast_from_origin(const DeviceMesh& mesh, const at::Tensor& t) {
  if (t.numel() == 0) return;
  const auto coord = mesh.coordinate();
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    bool member = true;
    for (int64_t j = m + 1; j < mesh.ndim(); ++j) member = member && coord[j] == 0;
    if (member && mesh.size(m) > 1) mesh.group(m)->broadcast(t, 0).wait();
  }
}

at::TensorOptions mesh_options(const DeviceMesh& mesh) { return at::TensorOptions().device(mesh.device_type()); }

std::string broadcast_string(const DeviceMesh& mesh, const std::string& s) {
  at::Tensor length = at::full({1}, static_cast<int64_t>(s.size()), mesh_options(mesh).dtype(at::kLong));
  broadcast_from_origin(mesh, length);
  const int64_t n = length.cpu().item<int64_t>();
  at::Tensor bytes = at::empty({n}, at::kByte);
  if (is_mesh_origin(mesh)) std::memcpy(bytes.data_ptr(), s.data(), s.size());
  bytes = bytes.to(mesh_options(mesh).device());
  broadcast_from_origin(mesh, bytes);
  bytes = bytes.cpu();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(n));
}

// --- loading: targets, checks, values --------------------------------------

struct Target {
  std::string key;
  at::Tensor dest;  // this rank's storage: sharded rows or a whole tensor
  Slot slot;
  std::vector<int64_t> shape;  // expected global shape
  c10::ScalarType dtype;
};

// Keys, global shapes and dtypes of an incoming state dict, in its order.
struct KeyInfo {
  std::string key;
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
};

std::vector<KeyInfo> describe(const StateDict& sd) {
  std::vector<KeyInfo> infos;
  for (const auto& [key, value] : sd) infos.push_back({key, value.global_shape(), value.dtype()});
  return infos;
}

// Checks `incoming` against `targets`. Throws on shape/dtype mismatches, on
// missing keys when `missing_is_error` and on unexpected keys when
// `unexpected_is_error`; `what` names the caller.
IncompatibleKeys check_keys(const std::vector<Target>& targets, const std::vector<KeyInfo>& incoming,
                            bool missing_is_error, bool unexpected_is_error, const char* what,
                            const char* missing_hint = "pass strict=false to load the others") {
  std::unordered_map<std::string, const KeyInfo*> by_key;
  for (const auto& info : incoming) by_key[info.key] = &info;
  IncompatibleKeys result;
  std::unordered_set<std::string> wanted;
  std::vector<std::string> mismatches;
  for (const auto& t : targets) {
    if (!wanted.insert(t.key).second) continue;
    auto it = by_key.find(t.key);
    if (it == by_key.end()) {
      result.missing_keys.push_back(t.key);
      continue;
    }
    const KeyInfo& info = *it->second;
    if (info.shape != t.shape || info.dtype != t.dtype) {
      std::ostringstream m;
      m << "'" << t.key << "': the state dict has shape " << c10::IntArrayRef(info.shape) << " " << info.dtype
        << ", the model expects " << c10::IntArrayRef(t.shape) << " " << t.dtype;
      mismatches.push_back(m.str());
    }
  }
  for (const auto& info : incoming) {
    if (!wanted.count(info.key)) result.unexpected_keys.push_back(info.key);
  }
  if (!mismatches.empty()) {
    std::ostringstream m;
    for (const auto& s : mismatches) m << "\n  " << s;
    TORCH_CHECK(false, what, ": ", mismatches.size(), " value(s) do not fit:", m.str(),
                "\nShapes are global (unsharded) shapes; convert dtypes before loading.");
  }
  TORCH_CHECK(!missing_is_error || result.missing_keys.empty(), what, ": missing key(s) ", join(result.missing_keys),
              "; ", missing_hint);
  TORCH_CHECK(!unexpected_is_error || result.unexpected_keys.empty(), what, ": unexpected key(s) ",
              join(result.unexpected_keys), " (not in the model); pass strict=false to ignore them");
  return result;
}

// What rank 0 broadcasts before the values: an error it found, the keys
// with shapes and dtypes, and a string (the optimizer's param groups).
struct Header {
  std::string error;
  std::vector<KeyInfo> keys;
  std::string extra;
};

Header broadcast_header(const DeviceMesh& mesh, const StateDict& sd, const std::string& extra, const char* what) {
  std::string payload;
  if (is_mesh_origin(mesh)) {
    Json j;
    j["error"] = "";
    j["keys"] = Json::array();
    for (const auto& [key, value] : sd) {
      if (value.is_dtensor()) {
        j["error"] = std::string(what) + ": with broadcast_from_rank0 rank 0 must hold full (plain) tensors, but '" +
                     key + "' is a DTensor; load a sharded state dict without broadcast_from_rank0";
        break;
      }
      j["keys"].push_back({key, static_cast<int>(value.dtype()), value.global_shape()});
    }
    j["extra"] = extra;
    payload = j.dump();
  }
  payload = broadcast_string(mesh, payload);
  Json j = Json::parse(payload);
  Header h;
  h.error = j["error"].get<std::string>();
  h.extra = j["extra"].get<std::string>();
  for (const auto& k : j["keys"]) {
    h.keys.push_back(
        {k[0].get<std::string>(), k[2].get<std::vector<int64_t>>(), static_cast<c10::ScalarType>(k[1].get<int>())});
  }
  TORCH_CHECK(h.error.empty(), h.error);
  return h;
}

// Fills every target whose key is in the state dict. Direct: from `sd` on
// this rank. Broadcast: rank 0's values, one tensor at a time, in rank 0's
// key order (which every rank knows from the header).
void fill_targets(const std::vector<Target>& targets, const StateDict& sd, const Header* broadcast,
                  const DeviceMesh* mesh) {
  if (!broadcast) {
    for (const auto& t : targets) {
      if (const StateValue* v = sd.find(t.key)) load_value(t.dest, t.slot, *v);
    }
    return;
  }
  std::unordered_map<std::string, std::vector<const Target*>> by_key;
  for (const auto& t : targets) by_key[t.key].push_back(&t);
  const bool origin = is_mesh_origin(*mesh);
  for (const auto& info : broadcast->keys) {
    auto it = by_key.find(info.key);
    if (it == by_key.end()) continue;
    at::Tensor full = origin ? sd.at(info.key).local().to(mesh_options(*mesh).device()).contiguous()
                             : at::empty(info.shape, mesh_options(*mesh).dtype(info.dtype));
    broadcast_from_origin(*mesh, full);
    for (const Target* t : it->second) copy_rows(t->dest, t->slot, full);
  }
}

// A group must be sharded or unsharded to be loaded into.
void check_loadable(const std::vector<Target>& targets, const char* what) {
  for (const auto& t : targets) {
    if (!t.slot.param) continue;
    TORCH_CHECK(t.slot.group->is_sharded() || t.slot.group->is_unsharded(), what, ": module '",
                t.slot.group->module_fqn(), "' (parameter '", t.key,
                "') is between forward and backward (resharded to a smaller world after forward); load between "
                "steps");
  }
}

// After loading into the shards, groups that are unsharded all-gather again
// so that their unsharded parameters show the new values.
void regather_unsharded(const std::vector<Target>& targets) {
  std::vector<FSDPParamGroup*> groups;
  for (const auto& t : targets) {
    if (t.slot.param && t.slot.group->is_unsharded() &&
        std::find(groups.begin(), groups.end(), t.slot.group) == groups.end()) {
      groups.push_back(t.slot.group);
    }
  }
  c10::NoGradGuard no_grad;
  for (FSDPParamGroup* g : groups) {
    const auto& comm = g->mesh().group(g->mesh().ndim() - 1);
    for (const auto& p : g->params()) {
      if (p->chunk_cat()) {
        // See [Note: shard dim] (fsdp_param.h).
        at::Tensor in = p->padded_shard().to(g->device(), p->param_dtype());
        at::Tensor rows = at::empty({p->shard_world_size(), p->padded_shard_numel()}, in.options());
        comm->all_gather_into_tensor(rows.view({-1}), in).wait();
        p->copy_out_chunks(rows);
        continue;
      }
      at::Tensor out = p->alloc_all_gather_output_rows();
      at::Tensor in = p->padded_shard().to(out.device(), out.scalar_type());
      comm->all_gather_into_tensor(out.reshape({-1}), in).wait();
    }
  }
}

}  // namespace

// --- model ------------------------------------------------------------------

StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options) {
  const collectives::CollectiveLabel label("FSDP::get_model_state_dict");
  Registry registry;
  const std::vector<Entry> entries = model_entries(model, registry, /*loading=*/false);
  const DeviceMesh* mesh = options.cpu_offload ? model_mesh(entries) : nullptr;
  const bool rank0_only = options.full_state_dict && options.cpu_offload;
  TORCH_CHECK(options.full_state_dict || !options.cpu_offload || !mesh || mesh->device_type() == c10::kCPU,
              "get_model_state_dict: cpu_offload without full_state_dict is not supported on the ",
              mesh ? mesh->to_string() : std::string(),
              " mesh: a DTensor's local tensor lives on its mesh's device. Set full_state_dict, or copy the local "
              "tensors to CPU yourself.");
  const bool keep = !rank0_only || !mesh || is_mesh_origin(*mesh);
  c10::NoGradGuard no_grad;
  StateDict sd;
  // A tied parameter is read (and gathered) once and listed under each FQN.
  std::unordered_map<const c10::TensorImpl*, StateValue> seen;
  for (const auto& e : entries) {
    auto it = seen.find(e.tensor.unsafeGetTensorImpl());
    if (it == seen.end()) {
      std::optional<StateValue> value;
      if (!e.slot.param) {
        at::Tensor t = e.tensor.detach();
        value = rank0_only ? t.cpu() : t;
      } else if (options.full_state_dict || is_scalar(*e.slot.param)) {
        at::Tensor full = gather_full(e.slot.param->sharded_view(), e.slot);
        value = rank0_only ? full.cpu() : full;
      } else {
        value = sharded_dtensor(e.slot.param->sharded_view(), e.slot);
      }
      it = seen.emplace(e.tensor.unsafeGetTensorImpl(), *value).first;
    }
    if (keep) sd.insert(e.fqn, it->second);
  }
  return sd;
}

IncompatibleKeys set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict,
                                      const StateDictOptions& options) {
  const collectives::CollectiveLabel label("FSDP::set_model_state_dict");
  constexpr const char* kWhat = "set_model_state_dict";
  Registry registry;
  const std::vector<Entry> entries = model_entries(model, registry, /*loading=*/true);
  std::vector<Target> targets;
  for (const auto& e : entries) {
    const Slot& s = e.slot;
    targets.push_back({e.fqn, s.param ? s.param->sharded_view() : e.tensor.detach(), s,
                       s.param ? s.param->unsharded_shape() : e.tensor.sizes().vec(),
                       s.param ? s.param->orig_dtype() : e.tensor.scalar_type()});
  }
  check_loadable(targets, kWhat);
  for (const auto& t : targets) {
    // CPU offload: no copy may still read a host shard about to be written.
    if (t.slot.param) t.slot.group->wait_for_offload_copies();
  }
  std::optional<Header> header;
  const DeviceMesh* mesh = nullptr;
  if (options.broadcast_from_rank0) {
    TORCH_CHECK(options.full_state_dict, kWhat, ": broadcast_from_rank0 needs full_state_dict=true (as in PyTorch)");
    mesh = model_mesh(entries);
    TORCH_CHECK(mesh, kWhat,
                ": broadcast_from_rank0 needs a model with fully_shard applied (its mesh gives the ranks to "
                "broadcast to)");
    header = broadcast_header(*mesh, state_dict, "", kWhat);
  }
  IncompatibleKeys result =
      check_keys(targets, header ? header->keys : describe(state_dict), options.strict, options.strict, kWhat);
  fill_targets(targets, state_dict, header ? &*header : nullptr, mesh);
  regather_unsharded(targets);
  return result;
}

// --- optimizer --------------------------------------------------------------

namespace {

enum class OptimKind { kAdam, kAdamW, kSgd };

OptimKind optim_kind(torch::optim::Optimizer& optimizer, const char* what) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return OptimKind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return OptimKind::kAdam;
  TORCH_CHECK(dynamic_cast<torch::optim::SGD*>(&optimizer) != nullptr, what, ": optimizer class ",
              c10::demangle(typeid(optimizer).name()),
              " is not supported; supported are torch::optim::Adam, torch::optim::AdamW and torch::optim::SGD");
  return OptimKind::kSgd;
}

// One parameter of the optimizer, with the FQN it is listed under.
struct OptimParam {
  std::string fqn;
  at::Tensor param;
  Slot slot;
  size_t group;
};

std::vector<OptimParam> optim_params(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                     const Registry& registry, const char* what,
                                     std::unordered_map<std::string, size_t>* index_by_fqn) {
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> fqns;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    fqns[item.value().unsafeGetTensorImpl()].push_back(item.key());
  }
  std::vector<OptimParam> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& group_params = groups[g].params();
    for (size_t i = 0; i < group_params.size(); ++i) {
      const at::Tensor& p = group_params[i];
      auto it = fqns.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != fqns.end(), what, ": parameter ", i, " of the optimizer's param group ", g, " (shape ",
                  p.sizes(), ") is not a parameter of the model; build the optimizer over model->parameters()");
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      Slot slot = registry.find(p);
      if (slot.param) slot.param->reset_sharded_param();
      if (index_by_fqn) {
        for (const auto& f : it->second) (*index_by_fqn)[f] = params.size();
      }
      params.push_back({it->second.front(), p, slot, g});
    }
  }
  return params;
}

// This rank's shape of a parameter's state tensors.
at::Tensor local_param(const OptimParam& p) { return p.slot.param ? p.slot.param->sharded_view() : p.param.detach(); }

std::vector<int64_t> global_shape(const OptimParam& p) {
  return p.slot.param ? p.slot.param->unsharded_shape() : p.param.sizes().vec();
}

c10::ScalarType param_dtype(const OptimParam& p) {
  return p.slot.param ? p.slot.param->orig_dtype() : p.param.scalar_type();
}

// Hyperparameters that decide which state tensors exist.
struct StateShape {
  bool amsgrad = false;
  double momentum = 0;
  double dampening = 0;
};

StateShape state_shape(OptimKind kind, const torch::optim::OptimizerOptions& options) {
  StateShape s;
  if (kind == OptimKind::kAdam) s.amsgrad = static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
  if (kind == OptimKind::kAdamW) s.amsgrad = static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
  if (kind == OptimKind::kSgd) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    s.momentum = o.momentum();
    s.dampening = o.dampening();
  }
  return s;
}

std::vector<std::string> tensor_names(OptimKind kind, const StateShape& s) {
  if (kind == OptimKind::kSgd) {
    if (s.momentum == 0) return {};
    return {"momentum_buffer"};
  }
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  if (s.amsgrad) names.emplace_back("max_exp_avg_sq");
  return names;
}

bool has_step(OptimKind kind) { return kind != OptimKind::kSgd; }

// Adam and AdamW state as one interface (their state types differ only in
// name).
template <typename S>
S* find_state(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  auto it = optimizer.state().find(p.unsafeGetTensorImpl());
  return it == optimizer.state().end() ? nullptr : static_cast<S*>(it->second.get());
}

template <typename S>
S& create_adam_state(torch::optim::Optimizer& optimizer, const OptimParam& p, const StateShape& s) {
  // What Adam's and AdamW's first step create (zeros of the parameter's
  // sharded shape, step 0).
  auto state = std::make_unique<S>();
  const at::Tensor like = local_param(p);
  state->step(0);
  state->exp_avg(at::zeros_like(like, at::MemoryFormat::Preserve));
  state->exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
  if (s.amsgrad) state->max_exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
  S& ref = *state;
  optimizer.state()[p.param.unsafeGetTensorImpl()] = std::move(state);
  return ref;
}

template <typename S>
std::vector<at::Tensor*> adam_tensors(S& state, const StateShape& s) {
  std::vector<at::Tensor*> out{&state.exp_avg(), &state.exp_avg_sq()};
  if (s.amsgrad) out.push_back(&state.max_exp_avg_sq());
  return out;
}

// Pointers to a parameter's state tensors (tensor_names order) and step,
// creating the state when `create`; null `step` for SGD. Returns false when
// the parameter has no state (and none was created).
template <typename S>
bool adam_state(torch::optim::Optimizer& optimizer, const OptimParam& p, const StateShape& s, bool create,
                std::vector<at::Tensor*>* tensors, int64_t** step) {
  S* state = find_state<S>(optimizer, p.param);
  if (!state) {
    if (!create) return false;
    state = &create_adam_state<S>(optimizer, p, s);
  }
  if (s.amsgrad && !state->max_exp_avg_sq().defined()) {
    state->max_exp_avg_sq(at::zeros_like(local_param(p), at::MemoryFormat::Preserve));
  }
  *tensors = adam_tensors(*state, s);
  // TORCH_ARG exposes the field by reference.
  *step = &state->step();
  return true;
}

bool sgd_state(torch::optim::Optimizer& optimizer, const OptimParam& p, const StateShape& s, bool create,
               std::vector<at::Tensor*>* tensors) {
  if (s.momentum == 0) return false;
  auto* state = find_state<torch::optim::SGDParamState>(optimizer, p.param);
  if (!state) {
    if (!create) return false;
    auto fresh = std::make_unique<torch::optim::SGDParamState>();
    fresh->momentum_buffer(at::zeros_like(local_param(p), at::MemoryFormat::Preserve));
    state = fresh.get();
    optimizer.state()[p.param.unsafeGetTensorImpl()] = std::move(fresh);
  }
  tensors->push_back(&state->momentum_buffer());
  return true;
}

bool param_state(OptimKind kind, torch::optim::Optimizer& optimizer, const OptimParam& p, const StateShape& s,
                 bool create, std::vector<at::Tensor*>* tensors, int64_t** step) {
  *step = nullptr;
  switch (kind) {
    case OptimKind::kAdam: return adam_state<torch::optim::AdamParamState>(optimizer, p, s, create, tensors, step);
    case OptimKind::kAdamW: return adam_state<torch::optim::AdamWParamState>(optimizer, p, s, create, tensors, step);
    case OptimKind::kSgd: return sgd_state(optimizer, p, s, create, tensors);
  }
  return false;
}

ParamGroupState group_state(OptimKind kind, const torch::optim::OptimizerOptions& options) {
  ParamGroupState g;
  auto adam_like = [&](const auto& o) {
    g.numbers["lr"] = o.lr();
    g.lists["betas"] = {std::get<0>(o.betas()), std::get<1>(o.betas())};
    g.numbers["eps"] = o.eps();
    g.numbers["weight_decay"] = o.weight_decay();
    g.flags["amsgrad"] = o.amsgrad();
  };
  if (kind == OptimKind::kAdam) adam_like(static_cast<const torch::optim::AdamOptions&>(options));
  if (kind == OptimKind::kAdamW) adam_like(static_cast<const torch::optim::AdamWOptions&>(options));
  if (kind == OptimKind::kSgd) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    g.numbers["lr"] = o.lr();
    g.numbers["momentum"] = o.momentum();
    g.numbers["dampening"] = o.dampening();
    g.numbers["weight_decay"] = o.weight_decay();
    g.flags["nesterov"] = o.nesterov();
  }
  return g;
}

void apply_group_state(OptimKind kind, torch::optim::OptimizerOptions& options, const ParamGroupState& g,
                       const char* what) {
  auto number = [&](const char* name, auto setter) {
    if (auto it = g.numbers.find(name); it != g.numbers.end()) setter(it->second);
  };
  auto flag = [&](const char* name, auto setter) {
    if (auto it = g.flags.find(name); it != g.flags.end()) setter(it->second);
  };
  auto maximize = g.flags.find("maximize");
  TORCH_CHECK(maximize == g.flags.end() || !maximize->second, what,
              ": a param group has \"maximize\": true, which LibTorch's optimizers do not support");
  auto adam_like = [&](auto& o) {
    number("lr", [&](double v) { o.lr(v); });
    number("eps", [&](double v) { o.eps(v); });
    number("weight_decay", [&](double v) { o.weight_decay(v); });
    flag("amsgrad", [&](bool v) { o.amsgrad(v); });
    if (auto it = g.lists.find("betas"); it != g.lists.end()) {
      TORCH_CHECK(it->second.size() == 2, what, ": \"betas\" must hold two numbers, got ", it->second.size());
      o.betas(std::make_tuple(it->second[0], it->second[1]));
    }
  };
  if (kind == OptimKind::kAdam) adam_like(static_cast<torch::optim::AdamOptions&>(options));
  if (kind == OptimKind::kAdamW) adam_like(static_cast<torch::optim::AdamWOptions&>(options));
  if (kind == OptimKind::kSgd) {
    auto& o = static_cast<torch::optim::SGDOptions&>(options);
    number("lr", [&](double v) { o.lr(v); });
    number("momentum", [&](double v) { o.momentum(v); });
    number("dampening", [&](double v) { o.dampening(v); });
    number("weight_decay", [&](double v) { o.weight_decay(v); });
    flag("nesterov", [&](bool v) { o.nesterov(v); });
  }
}

}  // namespace

OptimizerStateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                            const StateDictOptions& options) {
  const collectives::CollectiveLabel label("FSDP::get_optimizer_state_dict");
  constexpr const char* kWhat = "get_optimizer_state_dict";
  const OptimKind kind = optim_kind(optimizer, kWhat);
  Registry registry;
  const std::vector<OptimParam> params = optim_params(model, optimizer, registry, kWhat, nullptr);
  const DeviceMesh* mesh = nullptr;
  for (const auto& p : params) {
    if (p.slot.param && !mesh) mesh = &p.slot.group->mesh();
  }
  const bool rank0_only = options.full_state_dict && options.cpu_offload;
  TORCH_CHECK(options.full_state_dict || !options.cpu_offload || !mesh || mesh->device_type() == c10::kCPU, kWhat,
              ": cpu_offload without full_state_dict is not supported on the ", mesh ? mesh->to_string() : "",
              " mesh: a DTensor's local tensor lives on its mesh's device. Set full_state_dict.");
  const bool keep = !rank0_only || !mesh || is_mesh_origin(*mesh);
  c10::NoGradGuard no_grad;
  OptimizerStateDict result;
  for (const auto& p : params) {
    const StateShape shape = state_shape(kind, optimizer.param_groups()[p.group].options());
    const std::vector<std::string> names = tensor_names(kind, shape);
    std::vector<at::Tensor*> tensors;
    int64_t* step = nullptr;
    // SGD with dampening: a created zero buffer would be damped at the first
    // step, which a fresh SGD does not do; return zeros without creating it.
    const bool create = !(kind == OptimKind::kSgd && shape.dampening != 0);
    std::vector<at::Tensor> detached_zeros;
    if (!param_state(kind, optimizer, p, shape, create, &tensors, &step)) {
      if (create || shape.momentum == 0) continue;
      detached_zeros.push_back(at::zeros_like(local_param(p), at::MemoryFormat::Preserve));
      tensors.push_back(&detached_zeros.back());
    }
    if (step) {
      at::Tensor s = at::scalar_tensor(static_cast<double>(*step), at::kFloat);
      if (keep) result.state.insert("state." + p.fqn + ".step", s);
    }
    for (size_t i = 0; i < names.size(); ++i) {
      const at::Tensor& t = *tensors[i];
      const at::Tensor local = local_param(p);
      TORCH_CHECK(t.sizes() == local.sizes(), kWhat, ": optimizer state '", names[i], "' of parameter '", p.fqn,
                  "' has shape ", t.sizes(), " but the parameter is ", local.sizes(),
                  " on this rank; build the optimizer after fully_shard and step it only on sharded parameters");
      std::optional<StateValue> value;
      if (!p.slot.param) {
        value = rank0_only ? t.cpu() : t;
      } else if (options.full_state_dict || is_scalar(*p.slot.param)) {
        at::Tensor full = gather_full(t, p.slot);
        value = rank0_only ? full.cpu() : full;
      } else {
        value = sharded_dtensor(t, p.slot);
      }
      if (keep) result.state.insert("state." + p.fqn + "." + names[i], *value);
    }
  }
  if (!keep) return result;
  std::vector<ParamGroupState> groups;
  for (const auto& g : optimizer.param_groups()) groups.push_back(group_state(kind, g.options()));
  for (const auto& p : params) groups[p.group].params.push_back(p.fqn);
  result.param_groups = param_groups_to_json(groups);
  return result;
}

namespace {

// Param groups: each saved group names the FQNs of one of ours. Returns, for
// each of the optimizer's `num_groups` param groups, the saved group that
// names its parameters (null when none does), pointing into `saved`; adds the
// FQNs no parameter has, and the parameters no saved group names, to
// `result`.
std::vector<const ParamGroupState*> match_param_groups(const std::vector<ParamGroupState>& saved,
                                                       const std::vector<OptimParam>& params,
                                                       const std::unordered_map<std::string, size_t>& index_by_fqn,
                                                       size_t num_groups, IncompatibleKeys& result, const char* what) {
  std::vector<const ParamGroupState*> saved_for_group(num_groups, nullptr);
  std::vector<bool> covered(params.size(), false);
  for (const auto& sg : saved) {
    std::optional<size_t> target;
    for (const auto& fqn : sg.params) {
      auto it = index_by_fqn.find(fqn);
      if (it == index_by_fqn.end()) {
        result.unexpected_keys.push_back("param_groups." + fqn);
        continue;
      }
      const size_t g = params[it->second].group;
      TORCH_CHECK(!target || *target == g, what, ": a saved param group holds '", fqn,
                  "', which is in the optimizer's param group ", g, ", and parameters of param group ", *target,
                  "; build the optimizer with the same grouping as the saved one");
      target = g;
      covered[it->second] = true;
    }
    if (target) saved_for_group[*target] = &sg;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!covered[i] && !saved.empty()) result.missing_keys.push_back("param_groups." + params[i].fqn);
  }
  return saved_for_group;
}

// The indices (into the parameters) of the parameters with any key in
// `incoming`: they get every tensor of their kind.
std::unordered_set<size_t> params_with_state(const std::vector<KeyInfo>& incoming,
                                             const std::unordered_map<std::string, size_t>& index_by_fqn) {
  std::unordered_set<size_t> with_state;
  for (const auto& info : incoming) {
    const size_t dot = info.key.rfind('.');
    if (info.key.rfind("state.", 0) != 0 || dot == std::string::npos || dot <= 6) continue;
    auto it = index_by_fqn.find(info.key.substr(6, dot - 6));
    if (it != index_by_fqn.end()) with_state.insert(it->second);
  }
  return with_state;
}

// The keys to load, each parameter's with a step first, and in `shapes` the
// state each parameter has after loading: it follows the loaded
// hyperparameters (amsgrad, momentum).
std::vector<Target> state_targets(OptimKind kind, const torch::optim::Optimizer& optimizer,
                                  const std::vector<OptimParam>& params,
                                  const std::vector<const ParamGroupState*>& saved_for_group,
                                  const std::unordered_set<size_t>& with_state, std::vector<StateShape>& shapes,
                                  const char* what) {
  std::vector<Target> targets;
  shapes.assign(params.size(), StateShape{});
  for (size_t i = 0; i < params.size(); ++i) {
    const OptimParam& p = params[i];
    auto options_copy = optimizer.param_groups()[p.group].options().clone();
    if (saved_for_group[p.group]) apply_group_state(kind, *options_copy, *saved_for_group[p.group], what);
    shapes[i] = state_shape(kind, *options_copy);
    if (!with_state.count(i)) continue;
    const std::string prefix = "state." + p.fqn + ".";
    if (has_step(kind)) targets.push_back({prefix + "step", at::Tensor(), Slot{}, {}, at::kFloat});
    for (const auto& name : tensor_names(kind, shapes[i])) {
      targets.push_back({prefix + name, at::Tensor(), p.slot, global_shape(p), param_dtype(p)});
    }
  }
  return targets;
}

// Points each target at the optimizer state it fills, creating the state;
// drops the state of the parameters without saved state (as
// Optimizer.load_state_dict: they have none after loading). Returns the
// steps, each a scalar tensor to load and the counter it sets.
std::vector<std::pair<at::Tensor, int64_t*>> bind_state_targets(OptimKind kind, torch::optim::Optimizer& optimizer,
                                                                const std::vector<OptimParam>& params,
                                                                const std::vector<StateShape>& shapes,
                                                                const std::unordered_set<size_t>& with_state,
                                                                std::vector<Target>& targets) {
  std::vector<std::pair<at::Tensor, int64_t*>> steps;
  size_t next = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const OptimParam& p = params[i];
    if (!with_state.count(i)) {
      optimizer.state().erase(p.param.unsafeGetTensorImpl());
      continue;
    }
    std::vector<at::Tensor*> tensors;
    int64_t* step = nullptr;
    param_state(kind, optimizer, p, shapes[i], /*create=*/true, &tensors, &step);
    if (step) {
      targets[next].dest = at::empty({}, at::kFloat);
      steps.emplace_back(targets[next].dest, step);
      ++next;
    }
    for (at::Tensor* t : tensors) targets[next++].dest = *t;
  }
  TORCH_INTERNAL_ASSERT(next == targets.size());
  return steps;
}

}  // namespace

IncompatibleKeys set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                          const OptimizerStateDict& state_dict, const StateDictOptions& options) {
  const collectives::CollectiveLabel label("FSDP::set_optimizer_state_dict");
  constexpr const char* kWhat = "set_optimizer_state_dict";
  const OptimKind kind = optim_kind(optimizer, kWhat);
  Registry registry;
  std::unordered_map<std::string, size_t> index_by_fqn;
  const std::vector<OptimParam> params = optim_params(model, optimizer, registry, kWhat, &index_by_fqn);

  std::optional<Header> header;
  const DeviceMesh* mesh = nullptr;
  if (options.broadcast_from_rank0) {
    TORCH_CHECK(options.full_state_dict, kWhat, ": broadcast_from_rank0 needs full_state_dict=true (as in PyTorch)");
    for (const auto& p : params) {
      if (p.slot.param && !mesh) mesh = &p.slot.group->mesh();
    }
    TORCH_CHECK(mesh, kWhat, ": broadcast_from_rank0 needs a model with fully_shard applied");
    header = broadcast_header(*mesh, state_dict.state, state_dict.param_groups, kWhat);
  }
  const std::vector<KeyInfo> incoming = header ? header->keys : describe(state_dict.state);
  const std::string& groups_json = header ? header->extra : state_dict.param_groups;

  IncompatibleKeys result;
  const size_t num_groups = optimizer.param_groups().size();
  std::vector<ParamGroupState> saved;
  if (!groups_json.empty()) saved = parse_param_groups(groups_json);
  const std::vector<const ParamGroupState*> saved_for_group =
      match_param_groups(saved, params, index_by_fqn, num_groups, result, kWhat);
  const std::unordered_set<size_t> with_state = params_with_state(incoming, index_by_fqn);
  std::vector<StateShape> shapes;
  std::vector<Target> targets = state_targets(kind, optimizer, params, saved_for_group, with_state, shapes, kWhat);
  const bool strict = options.strict;
  IncompatibleKeys keys = check_keys(targets, incoming, /*missing_is_error=*/true, strict, kWhat,
                                     "a parameter's state must be complete (all of it or none)");
  TORCH_CHECK(!strict || result.unexpected_keys.empty(), kWhat, ": the saved param groups name parameters ",
              join(result.unexpected_keys), " that the optimizer does not hold; pass strict=false to ignore them");
  TORCH_CHECK(!strict || result.missing_keys.empty(), kWhat, ": no saved param group holds ", join(result.missing_keys),
              "; pass strict=false to keep their current hyperparameters");
  result.unexpected_keys.insert(result.unexpected_keys.end(), keys.unexpected_keys.begin(), keys.unexpected_keys.end());

  // Everything checked: apply.
  for (size_t g = 0; g < num_groups; ++g) {
    if (saved_for_group[g]) apply_group_state(kind, optimizer.param_groups()[g].options(), *saved_for_group[g], kWhat);
  }
  const std::vector<std::pair<at::Tensor, int64_t*>> steps =
      bind_state_targets(kind, optimizer, params, shapes, with_state, targets);
  fill_targets(targets, state_dict.state, header ? &*header : nullptr, mesh);
  for (const auto& [value, step] : steps) *step = static_cast<int64_t>(std::llround(value.item<double>()));
  return result;
}

// --- param groups JSON -------------------------------------------------------

std::vector<ParamGroupState> parse_param_groups(const std::string& json) {
  Json j;
  try {
    j = Json::parse(json);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "parse_param_groups: invalid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_array(), "parse_param_groups: expected a JSON list of param groups, got ", j.type_name());
  std::vector<ParamGroupState> groups;
  for (size_t i = 0; i < j.size(); ++i) {
    const Json& g = j[i];
    TORCH_CHECK(g.is_object(), "parse_param_groups: param group ", i, " is a ", g.type_name(), ", expected an object");
    ParamGroupState state;
    for (auto item = g.begin(); item != g.end(); ++item) {
      const std::string& name = item.key();
      const Json& value = item.value();
      if (name == "params") {
        TORCH_CHECK(value.is_array(), "parse_param_groups: \"params\" of param group ", i, " is not a list");
        for (const auto& fqn : value) {
          TORCH_CHECK(fqn.is_string(), "parse_param_groups: \"params\" of param group ", i, " holds ", fqn.dump(),
                      "; expected FQNs (strings), as get_optimizer_state_dict writes (a positional "
                      "torch.optim state_dict has integer ids)");
          state.params.push_back(fqn.get<std::string>());
        }
      } else if (value.is_boolean()) {
        state.flags[name] = value.get<bool>();
      } else if (value.is_number()) {
        state.numbers[name] = value.get<double>();
      } else if (value.is_array()) {
        std::vector<double> numbers;
        for (const auto& v : value) {
          TORCH_CHECK(v.is_number(), "parse_param_groups: \"", name, "\" of param group ", i,
                      " holds a non-number: ", v.dump());
          numbers.push_back(v.get<double>());
        }
        state.lists[name] = std::move(numbers);
      } else {
        TORCH_CHECK(value.is_null() || value.is_string(), "parse_param_groups: \"", name, "\" of param group ", i,
                    " has an unsupported value ", value.dump());
      }
    }
    groups.push_back(std::move(state));
  }
  return groups;
}

std::string param_groups_to_json(const std::vector<ParamGroupState>& groups) {
  Json j = Json::array();
  for (const auto& g : groups) {
    Json o = Json::object();
    for (const auto& [k, v] : g.numbers) o[k] = v;
    for (const auto& [k, v] : g.flags) o[k] = v;
    for (const auto& [k, v] : g.lists) o[k] = v;
    o["params"] = g.params;
    j.push_back(std::move(o));
  }
  return j.dump();
}

}  // namespace fsdp
