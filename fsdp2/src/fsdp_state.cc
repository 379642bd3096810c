#include "fsdp_state.h"

#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp2/activation_checkpoint.h"
#include "phase.h"

namespace fsdp::detail {

FSDPState::FSDPState(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, DeviceMesh mesh,
                     c10::Device device, std::vector<std::unique_ptr<FSDPParamGroup>> groups,
                     std::optional<ReshardAfterForward> reshard_after_forward, MixedPrecisionPolicy mp_policy)
    : modules_(modules.begin(), modules.end()),
      mesh_(std::move(mesh)),
      device_(device),
      groups_(std::move(groups)),
      auto_reshard_after_forward_(!reshard_after_forward.has_value()),
      mp_policy_(mp_policy) {
  for (const auto& g : groups_) {
    g->settings().reshard_after_forward = !reshard_after_forward || reshard_after_forward->world_size() != 1;
  }
}

FSDPParamGroup* FSDPState::group() const {
  if (groups_.empty()) return nullptr;
  if (groups_.size() > 1) {
    std::string meshes;
    for (const auto& g : groups_) meshes += (meshes.empty() ? "" : ", ") + g->mesh().to_string();
    TORCH_CHECK(false, "fsdp2: module '", fqn_.empty() ? module()->name() : fqn_, "' has ", groups_.size(),
                " parameter groups (per-parameter meshes ", meshes,
                "), but this operation expects one; iterate over FSDPState::groups()");
  }
  return groups_.front().get();
}

std::vector<FSDPParam*> FSDPState::all_params() const {
  std::vector<FSDPParam*> result;
  for (const auto& g : groups_) {
    for (const auto& p : g->params()) result.push_back(p.get());
  }
  return result;
}

std::shared_ptr<torch::nn::Module> FSDPState::module() const {
  auto m = modules_.front().lock();
  TORCH_CHECK(m, "fsdp2: the module of this FSDPModule was destroyed");
  return m;
}

std::vector<std::shared_ptr<torch::nn::Module>> FSDPState::modules() const {
  std::vector<std::shared_ptr<torch::nn::Module>> result;
  for (const auto& weak : modules_) {
    auto m = weak.lock();
    TORCH_CHECK(m, "fsdp2: a module of this FSDPModule was destroyed");
    result.push_back(std::move(m));
  }
  return result;
}

std::shared_ptr<FSDPState> FSDPState::top() {
  std::shared_ptr<FSDPState> s = shared_from_this();
  while (auto p = s->parent()) s = p;
  return s;
}

void FSDPState::lazy_init() {
  if (is_root_.has_value()) return;
  check_can_be_root();
  is_root_ = true;
  ctx_ =
      std::make_shared<FSDPStateContext>(comm_ctx_ ? std::move(comm_ctx_) : std::make_shared<FSDPCommContext>(device_));
  comm_ctx_ = nullptr;
  const std::unordered_map<const torch::nn::Module*, std::string> module_fqns = collect_states();
  if (auto_reshard_after_forward_) {
    // The root's parameters would be freed and all-gathered again at once
    // when backward starts, so the root keeps them (FSDP2's default).
    for (const auto& g : groups_) {
      g->settings().reshard_after_forward = false;
      g->clear_post_forward_comm();
    }
  }
  init_groups(module_fqns);
  ctx_->comm->states.insert(ctx_->comm->states.end(), ctx_->all_states.begin(), ctx_->all_states.end());
  ctx_->comm->invalidate_max_input_buffers();
  check_ranks_hold_the_same_model();
}

std::unordered_map<const torch::nn::Module*, std::string> FSDPState::collect_states() {
  auto root_module = module();
  // A state of several modules is met once per module; it is listed once,
  // named by its modules' FQNs.
  std::unordered_map<const torch::nn::Module*, std::string> module_fqns;
  for (const auto& item : root_module->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto state = state_of(*item.value());
    if (!state) continue;
    module_fqns.emplace(item.value().get(), item.key());
    if (state->modules_.size() > 1 && state->ctx_ == ctx_) continue;
    if (state.get() != this) {
      TORCH_CHECK(!state->is_root_.has_value(), "fsdp2: module '", item.key(),
                  "' was already initialized by an earlier forward; run forward through the root module first");
      state->is_root_ = false;
      state->ctx_ = ctx_;
    }
    state->fqn_ = item.key();
    ctx_->all_states.push_back(state);
  }
  for (const auto& weak : ctx_->all_states) {
    auto state = weak.lock();
    if (state->modules_.size() == 1) continue;
    state->fqn_.clear();
    for (const auto& m : state->modules()) {
      auto it = module_fqns.find(m.get());
      TORCH_CHECK(it != module_fqns.end(), "fsdp2: a module ", m->name(),
                  " sharded in one group with others by one fully_shard call is not inside the root module ",
                  root_module->name(),
                  " that runs forward, but other modules of its group are. Every module of a group must be inside "
                  "the root: group modules of one model.");
      state->fqn_ += (state->fqn_.empty() ? "" : "+") + it->second;
    }
  }
  return module_fqns;
}

void FSDPState::init_groups(const std::unordered_map<const torch::nn::Module*, std::string>& module_fqns) {
  for (const auto& weak : ctx_->all_states) {
    auto state = weak.lock();
    const std::string prefix = state->fqn_.empty() ? "" : state->fqn_ + ".";
    for (size_t gi = 0; gi < state->groups_.size(); ++gi) {
      FSDPParamGroup* group = state->groups_[gi].get();
      const auto& params = group->params();
      if (state->modules_.size() > 1) {
        // Each parameter is named from the module of the group that owns it.
        const auto group_modules = state->modules();
        for (size_t i = 0; i < params.size(); ++i) {
          const auto& [owner, name] = state->param_owners_.at(gi).at(i);
          const std::string& owner_fqn = module_fqns.at(group_modules.at(owner).get());
          params[i]->set_fqn(owner_fqn.empty() ? name : owner_fqn + "." + name);
        }
      } else {
        for (const auto& p : params) {
          if (p->fqn().rfind(prefix, 0) != 0) p->set_fqn(prefix + p->fqn());
        }
      }
      group->lazy_init(ctx_->comm.get(), state->fqn_, state->groups_.size() > 1 ? static_cast<int>(gi) : -1);
    }
  }
}

void FSDPState::pre_forward(TensorRefs& inputs) {
  // [Note: fully_shard inside a checkpointed region] A checkpoint replaces
  // its region's forward graph by one node (fsdp2/activation_checkpoint.h),
  // so the pre-backward hooks this state put on its outputs in forward are
  // gone; the recomputation reaching the module in backward does that work
  // here instead. Its gradients are returned through the checkpoint's node
  // and reduced at the end of backward.
  if (training_state_ != TrainingState::kPreBackward && ctx_ != nullptr && in_checkpoint_recompute()) pre_backward();
  if (training_state_ == TrainingState::kPreBackward) {
    // Recomputation during backward (activation checkpointing): the
    // pre-backward hook owns the unshard; only make sure it happened.
    for (const auto& g : groups_) {
      if (g->is_unsharded()) continue;
      g->unshard(false);
      g->wait_for_unshard();
    }
    return;
  }
  training_state_ = TrainingState::kForward;
  lazy_init();
  // Whichever state runs forward first in an iteration does the root's
  // pre-forward work, a sharded submodule called on its own included
  // (FSDP2's iter_forward_root).
  if (ctx_->iter_forward_root == nullptr && !*is_root_) check_root_called_through_hooks();
  root_pre_forward(inputs);
  if (mp_policy_.param_dtype && mp_policy_.cast_forward_inputs) {
    PhaseScope cast("FSDP::cast_forward_inputs");
    for (at::Tensor* t : inputs) {
      if (t->defined() && t->is_floating_point() && t->scalar_type() != *mp_policy_.param_dtype) {
        *t = t->to(*mp_policy_.param_dtype);
      }
    }
  }
  for (const auto& g : groups_) g->pre_forward(inputs);
  if (!forward_prefetch.empty()) {
    for (const auto& weak : forward_prefetch) {
      auto target = weak.lock();
      if (!target) continue;
      bool issued = false;
      for (const auto& g : target->groups_) issued |= prefetch_unshard(g.get(), TrainingState::kForward);
      if (issued) ctx_->forward_prefetched.push_back(target);
    }
  } else if (!groups_.empty() && !ctx_->comm->streams.enabled()) {
    implicit_forward_prefetch(ctx_->forward_order.size());
  }
  if (!groups_.empty()) ctx_->forward_order.push_back(weak_from_this());
}

void FSDPState::implicit_forward_prefetch(size_t position) {
  const std::vector<std::weak_ptr<FSDPState>>& last = ctx_->last_forward_order;
  if (position + 1 >= last.size() || last[position].lock().get() != this) return;
  auto target = last[position + 1].lock();
  if (!target) return;
  bool issued = false;
  for (const auto& g : target->groups_) {
    if (!g->fast_path()) issued |= prefetch_unshard(g.get(), TrainingState::kForward);
  }
  if (issued) ctx_->forward_prefetched.push_back(target);
}

void FSDPState::discard_unused_forward_prefetches() {
  for (const auto& weak : ctx_->forward_prefetched) {
    if (auto target = weak.lock()) {
      for (const auto& g : target->groups_) g->discard_all_gather();
    }
  }
  ctx_->forward_prefetched.clear();
}

void FSDPState::group_pre_forward(const torch::nn::Module& /*module*/, TensorRefs& inputs) {
  // Recomputation in backward (activation checkpointing) may rerun any
  // subset of the modules: pre_forward only checks the unshard then.
  if (training_state_ == TrainingState::kPreBackward || in_checkpoint_recompute()) return pre_forward(inputs);
  if (!modules_to_run_.empty()) return;  // a later module of this forward: the group is unsharded
  pre_forward(inputs);
  for (const auto& m : modules()) modules_to_run_.insert(m.get());
}

void FSDPState::group_post_forward(const torch::nn::Module& module, TensorRefs& outputs) {
  if (training_state_ == TrainingState::kPreBackward) return post_forward(outputs);
  modules_to_run_.erase(&module);
  if (modules_to_run_.empty()) return post_forward(outputs);
  // Gradients may reach this module's outputs before the last module's:
  // unshard for backward there too (pre_backward runs once per backward).
  if (c10::GradMode::is_enabled()) register_pre_backward_hooks(outputs);
}

void FSDPState::complete_group_forwards() {
  for (const auto& weak : ctx_->all_states) {
    auto s = weak.lock();
    if (!s || s.get() == this || s->modules_to_run_.empty()) continue;
    s->modules_to_run_.clear();
    TensorRefs none;
    s->post_forward(none);
  }
}

void FSDPState::root_pre_forward(TensorRefs& inputs) {
  if (ctx_->iter_forward_root != nullptr) return;
  ctx_->iter_forward_root = this;
  PhaseScope phase("FSDP::root_pre_forward");
  // Left by a forward that did not reach the root's post-forward.
  discard_unused_forward_prefetches();
  ctx_->forward_order.clear();
  StreamSet& streams = ctx_->comm->streams;
  if (streams.enabled()) {
    // The next all-gathers read the shards the optimizer just updated. The
    // event is the root's, whichever module runs first.
    std::shared_ptr<c10::Event>& event = is_root_.value_or(false) ? post_optim_event : top()->post_optim_event;
    if (event) {
      event->block(*streams.all_gather_copy_in());
      event->block(*streams.all_gather());
      // [Note: world size 1 fast path] groups have no copy-in: the compute
      // reads their shards on the current stream, which must wait too.
      if (any_group_on_fast_path()) event->block(*streams.current_stream());
      event.reset();
    } else {
      StreamSet::wait_stream(streams.all_gather_copy_in(), streams.current_stream());
      StreamSet::wait_stream(streams.all_gather(), streams.current_stream());
    }
  }
  if (device_.type() != c10::kCPU) {
    PhaseScope to_device("FSDP::inputs_to_device");
    for (at::Tensor* t : inputs) {
      // Blocking, as FSDP2 (and DDP): a caller may reuse a pinned input
      // buffer as soon as the forward returns.
      if (t->defined() && t->device() != device_) *t = t->to(device_, /*non_blocking=*/false);
    }
  }
}

bool FSDPState::any_group_on_fast_path() const {
  for (const auto& weak : ctx_->all_states) {
    auto s = weak.lock();
    if (!s) continue;
    for (const auto& g : s->groups_) {
      if (g->fast_path()) return true;
    }
  }
  return false;
}

void FSDPState::post_forward(TensorRefs& outputs) {
  if (training_state_ == TrainingState::kPreBackward) return;
  for (const auto& g : groups_) {
    g->post_forward();
    // Without autograd no backward will come to reshard: free the unsharded
    // parameters of every module now, the root's included.
    if (!c10::GradMode::is_enabled()) g->reshard();
  }
  if (c10::GradMode::is_enabled()) register_pre_backward_hooks(outputs);
  training_state_ = TrainingState::kIdle;
  if (ctx_->iter_forward_root == this) {
    complete_group_forwards();
    // See [Note: implicit forward prefetch].
    discard_unused_forward_prefetches();
    ctx_->last_forward_order = std::move(ctx_->forward_order);
    ctx_->forward_order.clear();
    // The last all-gather output is not needed through the loss and the
    // optimizer step (FSDP2 frees it here too).
    ctx_->comm->release_all_gather_state();
    ctx_->iter_forward_root = nullptr;
    check_no_call_around_hooks();
    if (*is_root_ && c10::GradMode::is_enabled()) after_root_forward_with_grad();
  }
  // Only the root's outputs: inner modules' outputs feed modules computing
  // in param_dtype.
  if (mp_policy_.output_dtype && *is_root_) {
    PhaseScope cast("FSDP::cast_forward_outputs");
    for (at::Tensor* t : outputs) {
      if (t->defined() && t->is_floating_point()) *t = t->to(*mp_policy_.output_dtype);
    }
  }
}

void FSDPState::register_pre_backward_hooks(TensorRefs& outputs) {
  std::weak_ptr<FSDPState> weak = weak_from_this();
  for (at::Tensor* t : outputs) {
    if (!t->defined() || !t->requires_grad()) continue;
    t->register_hook([weak](const at::Tensor&) {
      if (auto s = weak.lock()) s->pre_backward();
    });
  }
}

void FSDPState::pre_backward() {
  // No early return on the state's own training state: a module used twice
  // in forward is unsharded again for the earlier use's backward after its
  // group's post-backward resharded it (the group decides, as in FSDP2).
  training_state_ = TrainingState::kPreBackward;
  register_final_callback();
  const bool default_prefetch = backward_prefetch.empty();
  // Groups in reverse, the order of their backward (FSDP2 goes forward
  // here; either way every group is unsharded before this backward goes on,
  // and each default prefetch issues the group before it in forward order).
  for (auto it = groups_.rbegin(); it != groups_.rend(); ++it) (*it)->pre_backward(default_prefetch);
  if (!default_prefetch) {
    for (const auto& w : backward_prefetch) {
      auto target = w.lock();
      if (!target) continue;
      for (auto it = target->groups_.rbegin(); it != target->groups_.rend(); ++it) {
        prefetch_unshard(it->get(), TrainingState::kPreBackward);
      }
    }
  }
}

bool FSDPState::prefetch_unshard(FSDPParamGroup* target, TrainingState state) {
  PhaseScope phase(
      target->phase_label(state == TrainingState::kForward ? Phase::kForwardPrefetch : Phase::kBackwardPrefetch));
  const bool idle = !target->is_unsharded() && !target->has_pending_all_gather();
  const TrainingState saved = target->training_state();
  target->set_training_state(state);
  target->unshard(/*async_op=*/false);
  target->set_training_state(saved);
  return idle && target->has_pending_all_gather();
}

void FSDPState::register_final_callback() {
  if (ctx_->post_backward_final_callback_queued) return;
  ctx_->post_backward_final_callback_queued = true;
  warn_if_several_roots();
  // Backward starts: a forward that ended outside the root's post-forward
  // (several roots' outputs, an exception) may have left it.
  ctx_->comm->release_all_gather_state();
  std::shared_ptr<FSDPState> root;
  for (const auto& w : ctx_->all_states) {
    if (auto s = w.lock(); s && s->is_root_.value_or(false)) root = s;
  }
  TORCH_INTERNAL_ASSERT(root);
  std::weak_ptr<FSDPState> weak_root = root;
  torch::autograd::Engine::get_default_engine().queue_callback([weak_root] {
    if (auto r = weak_root.lock()) r->root_post_backward_final_callback();
  });
}

void FSDPState::root_post_backward_final_callback() {
  PhaseScope phase("FSDP::root_post_backward");
  // Groups whose post-backward did not run (inputs that need no gradient,
  // outputs not in the loss, parameters unused) are reduced here.
  for (const auto& w : ctx_->all_states) {
    auto s = w.lock();
    if (!s) continue;
    for (const auto& g : s->groups_) {
      // set_reduce_scatter_unused_params: a group that backward did not
      // reach on this rank reduces zeros, as FSDP2's callback runs every
      // group's post-backward.
      if (g->is_unsharded() || !g->settings().unshard_in_backward ||
          (g->settings().reduce_scatter_unused_params && g->training_state() != TrainingState::kPostBackward)) {
        g->post_backward();
      }
      g->set_training_state(TrainingState::kIdle);
    }
    s->training_state_ = TrainingState::kIdle;
  }
  ctx_->post_backward_final_callback_queued = false;
  if (!is_last_backward) return;
  for (const auto& w : ctx_->all_states) {
    auto s = w.lock();
    if (!s) continue;
    for (const auto& g : s->groups_) {
      g->finalize_backward();
      // One parameter object serves the module and the optimizer here, so a
      // group left unsharded by reshard_after_backward=false is resharded
      // once its gradients were reduced: the optimizer must step on the
      // shards. Without gradient sync it stays unsharded for the next
      // micro-batch.
      if (g->is_unsharded() && g->settings().reduce_grads) g->reshard();
    }
  }
  ctx_->comm->wait_for_last_reduce_scatter();
  ctx_->comm->post_forward_order.clear();
}

std::shared_ptr<FSDPCommContext> FSDPState::comm_context() {
  if (ctx_) return ctx_->comm;
  if (!comm_ctx_) comm_ctx_ = std::make_shared<FSDPCommContext>(device_);
  return comm_ctx_;
}

void FSDPState::adopt_comm_context(const std::shared_ptr<FSDPCommContext>& comm_ctx) {
  if (!ctx_) {
    comm_ctx_ = comm_ctx;
    return;
  }
  if (ctx_->comm == comm_ctx) return;
  // Buffers in flight and unsharded parameters were made on the old
  // context's streams and are released against its events.
  const FSDPCommContext& old = *ctx_->comm;
  bool idle = ctx_->iter_forward_root == nullptr && !ctx_->post_backward_final_callback_queued &&
              old.reduce_scatter_states.empty() && !old.last_all_gather_output.defined();
  for (const auto& w : ctx_->all_states) {
    auto s = w.lock();
    if (!s) continue;
    for (const auto& g : s->groups_) idle = idle && g->is_sharded() && !g->has_pending_all_gather();
  }
  TORCH_CHECK(idle, "share_comm_ctx: the root '", fqn_.empty() ? module()->name() : fqn_,
              "' is in the middle of a forward or backward; share contexts between iterations (before the first "
              "forward, or after the optimizer step)");
  ctx_->comm = comm_ctx;
  for (const auto& w : ctx_->all_states) {
    auto s = w.lock();
    if (!s) continue;
    for (const auto& g : s->groups_) g->set_comm_context(comm_ctx.get());
  }
  comm_ctx->states.insert(comm_ctx->states.end(), ctx_->all_states.begin(), ctx_->all_states.end());
  comm_ctx->invalidate_max_input_buffers();
}

void FSDPState::reset_iter_state() {
  if (!ctx_) return;
  for (const auto& w : ctx_->all_states) {
    auto s = w.lock();
    if (!s) continue;
    s->training_state_ = TrainingState::kIdle;
    s->modules_to_run_.clear();
    for (const auto& g : s->groups_) g->reset_iter_state();
  }
  ctx_->comm->release_all_gather_state();
  ctx_->comm->wait_for_last_reduce_scatter();
  ctx_->comm->post_forward_order.clear();
  ctx_->iter_forward_root = nullptr;
  ctx_->post_backward_final_callback_queued = false;
  // The groups' reset waited for their prefetched all-gathers.
  ctx_->forward_order.clear();
  ctx_->forward_prefetched.clear();
}

}  // namespace fsdp::detail
