// State dicts of sharded models and their optimizers, keyed by the unsharded
// model's FQNs (torch.distributed.checkpoint.state_dict for fully_shard).
//
// Only fsdp2 knows which rows of a parameter a rank owns; these functions
// turn that into fsdp::StateDict values (device_mesh/state_dict.h) that a
// file layer can save and load without knowing FSDP, and load them back into
// a model sharded over any mesh:
//
//   fsdp::StateDict model_sd = fsdp::get_model_state_dict(*model);        // DTensors over this rank's rows
//   fsdp::OptimizerStateDict optim_sd = fsdp::get_optimizer_state_dict(*model, optim);
//   ... save model_sd / optim_sd; later, in a run at any world size: ...
//   fsdp::set_model_state_dict(*model, model_sd);
//   fsdp::set_optimizer_state_dict(*model, optim, optim_sd);
//
//   fsdp::StateDictOptions full;                                          // one full tensor per FQN
//   full.full_state_dict = true;
//   full.cpu_offload = true;                                              // rank 0 only, on CPU
//   fsdp::StateDict export_sd = fsdp::get_model_state_dict(*model, full);
//
// Values (PyTorch's semantics, docs/checkpoints.md, "From a sharded model"):
// - Keys: every FQN of `model.named_parameters()` in that order (a tied
//   parameter under each FQN that names it, its values sharing storage),
//   then every FQN of `model.named_buffers()`. FSDP adds no prefixes.
// - Sharded mode (default): a parameter sharded by fully_shard is a DTensor
//   whose local tensor is this rank's unpadded rows (torch.chunk arithmetic:
//   with c = ceil(N/W), rank r owns rows [min(r*c, N), min((r+1)*c, N)))
//   sharing storage with the sharded parameter, so writing into it writes the
//   parameter; placements Shard(0), or (Replicate, Shard(0)) under HSDP; the
//   global shape is the unsharded shape. A parameter that
//   FullyShardOptions::shard_placement_fn put on dim d is split the same way
//   along d: Shard(d), or (Replicate, Shard(d)). Parameters that no fully_shard
//   manages, buffers, and 0-dim parameters are plain full tensors (a 0-dim
//   parameter cannot be a Shard(0) DTensor; its value is gathered, which is
//   why the sharded getter is collective).
// - Full mode: every value is a plain full tensor, gathered one parameter at
//   a time. With cpu_offload only rank 0 keeps them, on CPU, and the other
//   ranks get an empty state dict (PyTorch returns {} there).
// - The dtype is the sharded parameter's (the master dtype under mixed
//   precision).
//
// Collectives: every function here may run collectives over the meshes of
// the model's fully_shard groups (gathers for full mode and 0-dim values,
// resharding of DTensors laid out differently, broadcasts); call them on
// every rank of the model, in the same order, with state dicts that have the
// same keys and shapes on every rank (broadcast_from_rank0 excepted). Errors
// that depend only on keys, shapes and dtypes are raised on every rank before
// any collective, so no rank is left waiting.
//
// Threading: like the model, from one thread at a time, not during forward
// or backward.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "device_mesh/state_dict.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

// PyTorch's StateDictOptions (the subset that applies here).
struct StateDictOptions {
  // Get: plain full tensors instead of DTensors. Set: required with
  // broadcast_from_rank0 (full tensors are accepted without it).
  bool full_state_dict = false;
  // With full_state_dict on get: only rank 0 keeps the values, on CPU; the
  // other ranks get an empty state dict. Without full_state_dict: values are
  // moved to CPU, which only a CPU mesh allows (a DTensor's local tensor is on
  // its mesh's device); on another mesh it is an error.
  bool cpu_offload = false;
  // Set only: rank 0 (the first rank of the model's mesh, global rank 0 for
  // init_device_mesh over the world) holds the full values; the keys, shapes
  // and dtypes, then the values one tensor at a time, are broadcast from it.
  // The state dict passed on the other ranks is ignored (pass an empty one).
  // REQUIRES: full_state_dict; a model with at least one fully_shard group.
  bool broadcast_from_rank0 = false;
  // Set only: keys of the model missing from the state dict, or keys of the
  // state dict the model lacks, are an error listing them.
  bool strict = true;
};

// The keys a non-strict set left alone (PyTorch's _IncompatibleKeys).
struct IncompatibleKeys {
  std::vector<std::string> missing_keys;     // in the model, not in the state dict
  std::vector<std::string> unexpected_keys;  // in the state dict, not in the model
};

// get_model_state_dict()
//
// The state dict of `model` (see the top of this file for the values).
// Works before the first forward, between steps, and when groups are
// unsharded (the shard is read, it always holds the current values), and on
// a model without fully_shard (plain tensors sharing the parameters'
// storage).
//
// Errors: a sharded parameter whose data was replaced behind fsdp2's back
// (torch::load, Module::to, set_data) in a way that cannot be re-adopted
// (see set_model_state_dict); cpu_offload without full_state_dict on a
// non-CPU mesh.
StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options = {});

// set_model_state_dict()
//
// Copies `state_dict` into `model`'s parameters and buffers, in place: into
// the existing shard storage for sharded parameters, so the parameter
// objects, and optimizer state keyed on them, stay the same. Accepted values
// per key:
// - a DTensor from any mesh and world size (a state dict of another run,
//   resharded in memory): when its mesh and placements are the parameter's
//   own, the local rows are copied; otherwise its full tensor is assembled
//   (DTensor::full_tensor, collective over its mesh) and this rank's rows
//   copied;
// - a plain full tensor: each rank copies the rows it owns;
// - with broadcast_from_rank0: values on rank 0 only (see the option).
// A group that is unsharded at the call is all-gathered again after the
// copy, so its unsharded parameters show the new values too. A sharded
// parameter whose data torch::load, Module::to or set_data replaced is
// pointed back at its shard first (this is the way out of the error those
// give at the next forward); the loaded value then overwrites it.
//
// Returns the missing and unexpected keys (empty when strict).
//
// Errors (raised on every rank, before any value is copied): missing or
// unexpected keys when strict (listing them); a value whose global shape or
// dtype differs from the parameter's or buffer's, naming the FQN and both
// (this differs from PyTorch, which casts dtypes silently: convert the
// values first); broadcast_from_rank0 without full_state_dict, on a model
// without fully_shard, or with DTensor values on rank 0; a group between
// forward and backward (resharded to a smaller world after forward).
IncompatibleKeys set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict,
                                      const StateDictOptions& options = {});

// The optimizer half of a checkpoint, FQN-keyed.
//
// `state` is PyTorch's flattened form: `state.<fqn>.<name>` for every
// parameter that has state, with
//   Adam, AdamW:  step, exp_avg, exp_avg_sq [, max_exp_avg_sq with amsgrad]
//   SGD:          momentum_buffer (with momentum != 0)
// `step` is a float32 0-dim plain tensor, as Python stores it; the others are
// laid out like their parameter (DTensors sharing storage with the
// optimizer's own state tensors in sharded mode, full tensors in full mode).
// A tied parameter is listed under its first FQN.
//
// `param_groups` is PyTorch's `param_groups` as JSON: a list with one object
// per group holding its hyperparameters under PyTorch's names ("lr",
// "betas", "eps", "weight_decay", "amsgrad"; "lr", "momentum", "dampening",
// "weight_decay", "nesterov") and "params": the FQNs of its parameters.
struct OptimizerStateDict {
  StateDict state;
  std::string param_groups;
};

// get_optimizer_state_dict()
//
// The state of `optimizer` (built over `model`'s parameters, sharded or not),
// keyed by `model`'s FQNs. An optimizer that has not stepped gets its state
// created here, directly, as its first step would create it (zeros, step 0;
// no zero-gradient step is taken, unlike PyTorch's _init_optim_state,
// pytorch#164929), so that a loader has tensors to fill. The one exception
// is SGD with dampening != 0, whose first step copies the gradient instead of
// damping it: there zero tensors are returned without creating state.
// With full_state_dict and cpu_offload, ranks other than 0 get an empty
// OptimizerStateDict (empty state and param_groups).
//
// Errors: an optimizer other than torch::optim::Adam, AdamW or SGD (naming
// its class); an optimizer parameter that is not a parameter of `model`
// (naming its group and index); the errors of get_model_state_dict.
OptimizerStateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                            const StateDictOptions& options = {});

// set_optimizer_state_dict()
//
// Loads `state_dict` into `optimizer`: creates state objects where absent,
// copies each tensor into this rank's rows (from DTensors of any mesh or
// full tensors, as set_model_state_dict), restores each parameter's step,
// and the hyperparameters of each group (matched by the FQNs in
// "params"). A parameter with no `state.<fqn>.*` key at all is left without
// state (it had not stepped when saved). With broadcast_from_rank0 only rank
// 0's `state_dict` is read.
//
// Returns the unexpected keys when not strict (state of FQNs the optimizer
// does not hold); missing_keys lists parameters without a param group entry.
//
// Errors (before anything is copied): an unsupported optimizer class; a
// parameter with some but not all of its state tensors, or a shape or dtype
// mismatch, naming the key; unexpected keys when strict; a param group whose
// FQNs span several of the optimizer's groups; hyperparameters LibTorch
// cannot honour ("maximize": true).
IncompatibleKeys set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                          const OptimizerStateDict& state_dict, const StateDictOptions& options = {});

// One entry of OptimizerStateDict::param_groups, parsed.
struct ParamGroupState {
  std::vector<std::string> params;                   // FQNs
  std::map<std::string, double> numbers;             // "lr", "eps", "weight_decay", "momentum", ...
  std::map<std::string, bool> flags;                 // "amsgrad", "nesterov", "maximize", ...
  std::map<std::string, std::vector<double>> lists;  // "betas"
};

// Parses a param_groups JSON string (ours or PyTorch's; null and string
// values are skipped). Throws naming the position on malformed input.
std::vector<ParamGroupState> parse_param_groups(const std::string& json);
// The JSON string of `groups`, as OptimizerStateDict::param_groups.
std::string param_groups_to_json(const std::vector<ParamGroupState>& groups);

}  // namespace fsdp
