// Internal: FSDPState, the runtime of one fully_shard'ed module (FSDP2's
// FSDPState): its forward hooks, the root's lazy init and pre-forward, the
// pre-backward hooks on outputs and the end-of-backward callback
// (fsdp_state.cc), and the checks that name a misuse where it happens
// (fsdp_state_diagnostics.cc).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <torch/nn/module.h>

#include "fsdp2/fully_shard.h"
#include "fsdp_param_group.h"
#include "torch_compat.h"

namespace fsdp::detail {

class FSDPState;

// Shared by every state under one root (FSDP2's FSDPStateContext +
// FSDPCommContext).
struct FSDPStateContext {
  explicit FSDPStateContext(std::shared_ptr<FSDPCommContext> comm_ctx) : comm(std::move(comm_ctx)) {}
  // Every state under the root, the root first, in module pre-order.
  std::vector<std::weak_ptr<FSDPState>> all_states;
  FSDPState* iter_forward_root = nullptr;
  bool post_backward_final_callback_queued = false;
  // This root's own, or the one it shares with other roots (share_comm_ctx).
  std::shared_ptr<FSDPCommContext> comm;
  // [Note: implicit forward prefetch] On CPU (Gloo) the host computes, so no
  // all-gather runs ahead of it unless issued early: at a state's
  // pre-forward, after its own all-gather was waited for, the runtime issues
  // the all-gather of the state that came next in the last completed
  // forward, which then runs on Gloo's thread during this state's compute
  // (two deep: the current group unsharded, the next one in flight). The
  // state at position k of this forward prefetches position k+1 of the last
  // one only while position k there is this same state, so an order that
  // changed prefetches at most one group that will not run; the first
  // forward has no order and prefetches nothing. An explicit
  // set_modules_to_forward_prefetch replaces it for that state (as in
  // backward). Groups with nothing to gather (world size 1 fast path) are
  // not prefetched. Every all-gather issued by a forward prefetch and not
  // used by this forward is waited for and dropped at the root's
  // post-forward (the group stays sharded), so that none outlives the
  // forward, e.g. into an optimizer step that changes the shards. On CUDA the
  // host runs ahead of the device and FSDP2's pipelining of the stream
  // order applies instead (see [Note: all-gather output lifetime]).
  // States with a group, in the order of their pre-forwards in this forward.
  std::vector<std::weak_ptr<FSDPState>> forward_order;
  // The same for the last forward that reached the root's post-forward.
  std::vector<std::weak_ptr<FSDPState>> last_forward_order;
  // Targets whose all-gather a forward prefetch (implicit or explicit)
  // issued in this forward.
  std::vector<std::weak_ptr<FSDPState>> forward_prefetched;
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  // `modules`: the one module of fully_shard(module), or the several modules
  // of fully_shard(list) sharded as one group.
  // `groups`: one per distinct mesh of the call's parameters (see [Note:
  // per-parameter meshes]), none when it shards no parameter.
  FSDPState(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, DeviceMesh mesh, c10::Device device,
            std::vector<std::unique_ptr<FSDPParamGroup>> groups,
            std::optional<ReshardAfterForward> reshard_after_forward, MixedPrecisionPolicy mp_policy);

  // The first of modules().
  std::shared_ptr<torch::nn::Module> module() const;
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
  size_t num_modules() const { return modules_.size(); }
  // Several modules: per group, for each of its parameters, in order, the
  // index of the module that owns it and its FQN within that module (lazy
  // init names the parameters from the root then).
  void set_param_owners(std::vector<std::vector<std::pair<size_t, std::string>>> owners) {
    param_owners_ = std::move(owners);
  }
  // The call's mesh (FullyShardOptions::mesh or its default); a group may
  // shard over another (its own mesh()).
  const DeviceMesh& mesh() const { return mesh_; }
  c10::Device device() const { return device_; }
  // The state's parameter groups, one per mesh, in creation order.
  const std::vector<std::unique_ptr<FSDPParamGroup>>& groups() const { return groups_; }
  // The only group, or null (FSDP2's _fsdp_param_group). Throws when the
  // state has several (per-parameter meshes): use groups() there.
  FSDPParamGroup* group() const;
  // Every group's parameters, group by group.
  std::vector<FSDPParam*> all_params() const;
  // The nearest enclosing sharded module's state (null for a root).
  std::shared_ptr<FSDPState> parent() const { return parent_.lock(); }
  void set_parent(const std::shared_ptr<FSDPState>& parent) { parent_ = parent; }
  // The outermost enclosing state (this when it has no parent).
  std::shared_ptr<FSDPState> top();
  const std::string& fqn() const { return fqn_; }

  // Module hooks.
  void pre_forward(TensorRefs& inputs);
  void post_forward(TensorRefs& outputs);
  void pre_backward();
  // The hooks of a state with several modules (FSDP2's
  // _register_group_forward_hooks): pre_forward when the first of them is
  // called, post_forward after the last of them.
  void group_pre_forward(const torch::nn::Module& module, TensorRefs& inputs);
  void group_post_forward(const torch::nn::Module& module, TensorRefs& outputs);
  // Forward error hook (inside the handler): when this state started the
  // iteration's forward and a sharded module was called around its hooks,
  // throws the runtime's explanation with the original error in it
  // (fsdp_state_diagnostics.cc).
  void explain_forward_error() const;

  // Makes this state the root of its subtree and initializes every state in
  // it (FQNs, shared streams). Idempotent.
  void lazy_init();
  bool initialized() const { return ctx_ != nullptr; }
  // Shared by the tree under this state's root; null before lazy init.
  FSDPStateContext* context() const { return ctx_.get(); }
  // share_comm_ctx: the communication context of this root's tree, made now
  // when lazy init has not made it yet (a root may share it before its
  // first forward).
  std::shared_ptr<FSDPCommContext> comm_context();
  // share_comm_ctx: this root's tree uses `comm_ctx` from now on. REQUIRES:
  // a root, on comm_ctx's device, between iterations.
  void adopt_comm_context(const std::shared_ptr<FSDPCommContext>& comm_ctx);

  // FSDPModule settings.
  std::vector<std::weak_ptr<FSDPState>> forward_prefetch;
  std::vector<std::weak_ptr<FSDPState>> backward_prefetch;
  std::shared_ptr<c10::Event> post_optim_event;
  bool is_last_backward = true;
  // An explicit set_reshard_after_forward: lazy init keeps it for the root.
  void clear_auto_reshard_after_forward() { auto_reshard_after_forward_ = false; }
  // After an exception mid-step: every state of this root's tree back to
  // idle, collectives in flight completed, unreduced gradients dropped.
  void reset_iter_state();

 private:
  // Lazy init: every state under this root joins its context, named by its
  // FQN; returns the FQN of every module under the root that has a state.
  std::unordered_map<const torch::nn::Module*, std::string> collect_states();
  // Lazy init: names every parameter by its FQN from the root and
  // initializes every group under the root.
  void init_groups(const std::unordered_map<const torch::nn::Module*, std::string>& module_fqns);
  void root_pre_forward(TensorRefs& inputs);
  // Whether a group under this root takes the world size 1 fast path.
  bool any_group_on_fast_path() const;
  void register_pre_backward_hooks(TensorRefs& outputs);
  void register_final_callback();
  void root_post_backward_final_callback();
  // End of the root's forward: the post-forward of every group whose modules
  // did not all run.
  void complete_group_forwards();

  // Misuse diagnostics (fsdp_state_diagnostics.cc).
  // Lazy init: throws when this state cannot be the root (it has a parent
  // whose forward ran around its hooks, or it is a group of several modules).
  void check_can_be_root();
  // Lazy init: throws on every rank, naming the first difference, when the
  // ranks' models or fully_shard groups differ ([Note: the model
  // fingerprint]).
  void check_ranks_hold_the_same_model() const;
  void check_no_call_around_hooks() const;
  // A non-root state starts this forward: throws when the root's forward ran
  // around its hooks and used the root's parameters while sharded. See
  // [Note: the root called around its hooks].
  void check_root_called_through_hooks() const;
  // End of a forward of the root in grad mode: remembers its parameters'
  // AccumulateGrad nodes (made while unsharded) and notes this root for
  // warn_if_several_roots().
  void after_root_forward_with_grad();
  // Start of backward: warns once per process when the forwards since the
  // last backward ran several roots (fully_shard forgotten on the model).
  static void warn_if_several_roots();
  // The message that explains a sharded module called around its hooks:
  // for the first sharded parameter autograd used at its sharded shape, else
  // (given the message of the error a forward raised) for the first one
  // whose sharded shape that message shows; empty when none.
  std::string call_around_hooks_message(const std::string* error) const;

  // Whether it issued an all-gather (none when the target is unsharded or
  // has one pending).
  static bool prefetch_unshard(FSDPParamGroup* target, TrainingState state);
  // See [Note: implicit forward prefetch]. `position`: this pre-forward's
  // index in this forward's order.
  void implicit_forward_prefetch(size_t position);
  // Waits for and drops the all-gathers forward prefetches issued that no
  // forward used.
  void discard_unused_forward_prefetches();

  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  std::vector<std::vector<std::pair<size_t, std::string>>> param_owners_;
  // The modules of the group still to run in this forward (FSDP2's
  // _modules_to_run_forward); empty between group forwards.
  std::unordered_set<const torch::nn::Module*> modules_to_run_;
  DeviceMesh mesh_;
  c10::Device device_;
  std::vector<std::unique_ptr<FSDPParamGroup>> groups_;
  bool auto_reshard_after_forward_;
  MixedPrecisionPolicy mp_policy_;
  std::weak_ptr<FSDPState> parent_;
  std::optional<bool> is_root_;
  std::shared_ptr<FSDPStateContext> ctx_;
  // A root's communication context before lazy init moves it into ctx_.
  std::shared_ptr<FSDPCommContext> comm_ctx_;
  TrainingState training_state_ = TrainingState::kIdle;
  std::string fqn_;
  // The root's parameters' AccumulateGrad nodes at the end of its last
  // forward in grad mode, in group order (see check_root_called_through_hooks).
  std::vector<torch_compat::WeakNodePtr> root_param_nodes_;
};

// The state fully_shard attached to `module`, or null.
std::shared_ptr<FSDPState> state_of(const torch::nn::Module& module);

}  // namespace fsdp::detail
