// Stateful adapters (checkpoint/training_state.h) for a model and an
// optimizer, sharded with fully_shard or not: the items that make
// save_training_state / load_training_state a one-call resume.
//
// The trainer registers them so (tools/train/checkpointing.cc):
//
//   items.add("model", model_state)
//       .add("optim", optim_state)
//
// They are thin: state_dict() is fsdp::get_model_state_dict /
// get_optimizer_state_dict (fsdp2/state_dict.h), load_state_dict() the
// matching set_*. So the files are the ones those state dicts make with
// save_sharded, which PyTorch's HuggingFaceStorageReader reads:
//   model/  <fqn>                                  each rank's rows
//   optim/  state.<fqn>.{step, exp_avg, exp_avg_sq, momentum_buffer}
// and OptimizerState's JSON member "param_groups" (PyTorch's param_groups
// with FQNs), stored in the manifest's extra as the trainer always has.
//
// Library: fsdp2cpp::checkpoint_fsdp (header-only; it brings
// fsdp2cpp::checkpoint and fsdp2cpp::fsdp2). It is not part of
// fsdp2cpp::checkpoint, which knows no FSDP (as torch.distributed.checkpoint's
// storage layer does not).
#pragma once

#include <utility>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "checkpoint/training_state.h"
#include "fsdp2/state_dict.h"

namespace fsdp::checkpoint {

// ModelState: `model`'s parameters and buffers, keyed by FQN.
// state_dict(): get_model_state_dict(model, options) (DTensors sharing
// storage with the shards). load_state_dict(): set_model_state_dict, which
// copies into the existing shards (the optimizer's keys stay valid).
// REQUIRES: `model` outlives this object. Errors: those of the fsdp2 calls.
class ModelState : public Stateful {
 public:
  explicit ModelState(torch::nn::Module& model, StateDictOptions options = {})
      : model_(model), options_(std::move(options)) {}
  StatefulState state_dict() override { return {get_model_state_dict(model_, options_), {}}; }
  void load_state_dict(const StatefulState& state) override { set_model_state_dict(model_, state.tensors, options_); }

 private:
  torch::nn::Module& model_;
  StateDictOptions options_;
};

// OptimizerState: `optimizer`'s state (Adam, AdamW, SGD) keyed by `model`'s
// FQNs, with its param groups. state_dict() creates the state of an
// optimizer that has not stepped (zeros, step 0), so a load into a fresh
// optimizer has tensors to fill. load_state_dict() restores each
// parameter's state and step and the groups' hyperparameters.
// REQUIRES: `model` and `optimizer` outlive this object; the optimizer was
// built over `model`'s parameters after fully_shard.
// Errors: those of get/set_optimizer_state_dict; a saved JSON without
// "param_groups".
class OptimizerState : public Stateful {
 public:
  OptimizerState(torch::nn::Module& model, torch::optim::Optimizer& optimizer, StateDictOptions options = {})
      : model_(model), optimizer_(optimizer), options_(std::move(options)) {}
  StatefulState state_dict() override {
    OptimizerStateDict osd = get_optimizer_state_dict(model_, optimizer_, options_);
    StatefulState out;
    out.tensors = std::move(osd.state);
    // Empty on ranks that hold nothing (full_state_dict with cpu_offload).
    out.json["param_groups"] = osd.param_groups.empty() ? "[]" : std::move(osd.param_groups);
    return out;
  }
  void load_state_dict(const StatefulState& state) override {
    const auto groups = state.json.find("param_groups");
    TORCH_CHECK(groups != state.json.end(), "OptimizerState: the saved state has no \"param_groups\"; it was ",
                "not saved from an OptimizerState: register this item under the name its optimizer was saved as");
    OptimizerStateDict osd;
    osd.state = state.tensors;
    osd.param_groups = groups->second;
    set_optimizer_state_dict(model_, optimizer_, osd, options_);
  }

 private:
  torch::nn::Module& model_;
  torch::optim::Optimizer& optimizer_;
  StateDictOptions options_;
};

}  // namespace fsdp::checkpoint
