#include "fsdp_param_group.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp_state.h"
#include "phase.h"

namespace fsdp::detail {
namespace {

// The capsule that lets the post-backward node reach its group; it holds a
// weak reference so that an autograd graph outliving the model is harmless.
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(std::weak_ptr<FSDPParamGroup*> g) : group(std::move(g)) {}
  std::weak_ptr<FSDPParamGroup*> group;
};

// [Note: post-backward] FSDP2's RegisterPostBackwardFunction: an identity
// applied to the module's forward inputs that require grad. Its backward runs
// once the gradients with respect to those inputs exist, i.e. after the
// module's own backward computed every parameter gradient, which is the
// earliest point at which the group's reduce-scatter can start. Groups whose
// inputs need no gradient (the first layer) are caught by the root's
// end-of-backward callback.
struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                c10::IValue group_ref) {
    ctx->saved_data["group"] = std::move(group_ref);
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref = c10::static_intrusive_pointer_cast<GroupRef>(ctx->saved_data["group"].toCapsule());
    if (auto group = ref->group.lock()) (*group)->post_backward();
    grads.emplace_back();  // no gradient for the capsule argument
    return grads;
  }
};

}  // namespace

void FSDPCommContext::release_all_gather_state() {
  if (!last_all_gather_output.defined()) return;
  last_all_gather_done.block(streams.all_gather_copy_in());
  last_all_gather_done.block(streams.all_gather());
  last_all_gather_done = DeviceEvent();
  last_all_gather_output = at::Tensor();
}

FSDPCommContext::AllGatherStreams FSDPCommContext::all_gather_streams(bool async_op,
                                                                      TrainingState training_state) const {
  if (!async_op && (training_state == TrainingState::kForward || training_state == TrainingState::kPreBackward)) {
    return {streams.all_gather_copy_in(), streams.all_gather()};
  }
  const std::optional<c10::Stream> current = streams.current_stream();
  return {current, current};
}

void FSDPCommContext::wait_for_reduce_scatters(size_t keep) {
  while (reduce_scatter_states.size() > keep) {
    ReduceScatterState oldest = std::move(reduce_scatter_states.front());
    reduce_scatter_states.pop_front();
    if (oldest.group != nullptr) oldest.group->wait_for_post_backward();
    // The input was made on the current stream; once that stream has waited
    // for the collective, the allocator may reuse it there.
    oldest.done.block(streams.current_stream());
  }
}

void FSDPCommContext::forget_reduce_scatter(const FSDPParamGroup* group) {
  for (auto it = reduce_scatter_states.begin(); it != reduce_scatter_states.end(); ++it) {
    if (it->group == group) {
      reduce_scatter_states.erase(it);
      return;
    }
  }
}

int FSDPCommContext::max_input_buffers() {
  if (max_input_buffers_ > 0) return max_input_buffers_;
  int result = 1;
  for (const auto& w : states) {
    auto s = w.lock();
    if (!s) continue;
    for (const auto& g : s->groups()) result = std::max(result, g->settings().reduce_scatter_max_input_buffers);
  }
  max_input_buffers_ = result;
  return result;
}

ReduceOps gradient_reduce_ops(int64_t shard_size, int64_t replicate_size, c10::ScalarType reduce_dtype,
                              std::optional<double> divide_factor, bool force_sum) {
  ReduceOps ops;
  // fp32 and bf16 do not overflow when summed before dividing; the
  // collective divides (no separate kernel).
  const bool overflow_risk = reduce_dtype != at::kFloat && reduce_dtype != at::kBFloat16;
  const int64_t dp_size = shard_size * replicate_size;
  if (!overflow_risk && !force_sum) {
    if (!divide_factor) {
      if (dp_size == 1) return ops;
      // A one-rank reduce-scatter (HSDP with shard size 1) sums: NCCL's AVG
      // at one rank leaves the output's tail unwritten (pytorch#144045), and
      // the average over one rank is the value itself.
      if (shard_size > 1) ops.reduce_scatter = collectives::ReduceOp::avg();
      ops.all_reduce = collectives::ReduceOp::avg();
      return ops;
    }
    if (shard_size == 1) {
      // Neither AVG nor PREMUL_SUM on a one-rank communicator (as above): the
      // division is a local one after the sum.
      ops.post_divide = *divide_factor;
      return ops;
    }
    ops.reduce_scatter = *divide_factor == static_cast<double>(shard_size)
                             ? collectives::ReduceOp::avg()
                             : collectives::ReduceOp::premul_sum(1.0 / *divide_factor);
    return ops;
  }
  const double factor = divide_factor.value_or(static_cast<double>(dp_size));
  if (overflow_risk) {
    // Divide by about sqrt(factor) before and the rest after the sum, so
    // that neither the sum nor the divided inputs leave fp16's range.
    double pre = 1.0;
    while (std::fmod(factor, pre) == 0.0 && factor / pre > pre) pre *= 2.0;
    ops.pre_divide = pre;
    ops.post_divide = factor / pre;
  } else {
    ops.post_divide = factor;
  }
  return ops;
}

namespace {

// What a one-rank reduce-scatter with `op` makes of its input, done in place:
// SUM, AVG, MIN and MAX of one value are that value; PREMUL_SUM scales it
// (as the Gloo path's finishing step does).
void reduce_one_rank_in_place(const at::Tensor& t, const collectives::ReduceOp& op) {
  if (op.kind() == collectives::ReduceOp::Kind::kPremulSum) t.mul_(op.factor());
}

}  // namespace

FSDPParamGroup::FSDPParamGroup(std::vector<at::Tensor> params, std::vector<std::string> param_names, DeviceMesh mesh,
                               c10::Device device, const MixedPrecisionPolicy& mp_policy,
                               std::shared_ptr<collectives::Communicator> post_forward_comm,
                               const OffloadPolicy& offload_policy, const std::vector<int64_t>& shard_dims)
    : mesh_(std::move(mesh)),
      post_forward_comm_(std::move(post_forward_comm)),
      device_(device),
      offload_to_cpu_(offload_policy.offload_to_cpu),
      self_ref_(std::make_shared<FSDPParamGroup*>(this)) {
  TORCH_INTERNAL_ASSERT(!params.empty());
  shard_comm_ = mesh_.group(mesh_.ndim() - 1);
  if (mesh_.ndim() == 2) replicate_comm_ = mesh_.group(0);
  param_dtype_ = mp_policy.param_dtype.value_or(params.front().scalar_type());
  reduce_dtype_ = mp_policy.reduce_dtype.value_or(param_dtype_);
  TORCH_INTERNAL_ASSERT(shard_dims.empty() || shard_dims.size() == params.size());
  layout_.world = shard_comm_->size();
  for (size_t i = 0; i < params.size(); ++i) {
    params_.push_back(std::make_unique<FSDPParam>(std::move(params[i]), std::move(param_names[i]), shard_comm_->rank(),
                                                  shard_comm_->size(), param_dtype_, offload_policy, device_,
                                                  shard_dims.empty() ? 0 : shard_dims[i]));
    layout_.padded_numels.push_back(params_.back()->padded_shard_numel());
    layout_.padded_total += layout_.padded_numels.back();
    layout_.chunk_cat = layout_.chunk_cat || params_.back()->chunk_cat();
  }
  // See [Note: world size 1 fast path]. Shards kept on the host must be
  // uploaded for a device computation (on the modelled device of the
  // stream-order checker too, where host and device are both the CPU).
  fast_path_eligible_ =
      shard_comm_->size() == 1 && !post_forward_comm_ && reduce_dtype_ == param_dtype_ && !offload_to_cpu_;
  for (const auto& p : params_) fast_path_eligible_ = fast_path_eligible_ && p->orig_dtype() == param_dtype_;
  update_fast_path();
}

void FSDPParamGroup::lazy_init(FSDPCommContext* comm_ctx, std::string module_fqn, int group_index) {
  comm_ctx_ = comm_ctx;
  module_fqn_ = std::move(module_fqn);
  const std::string group =
      group_index < 0 ? "" : "group " + std::to_string(group_index) + ", mesh " + shard_comm_->name();
  phase_labels_ = PhaseLabels(module_fqn_, group);
}

void FSDPParamGroup::unshard(bool async_op) {
  if (all_gather_ || is_unsharded()) return;
  if (!settings_.unshard_in_backward && training_state_ == TrainingState::kPreBackward) return;
  TORCH_CHECK(comm_ctx_ != nullptr, "fsdp2: module '", module_fqn_,
              "' is unsharded before its root's first forward; run a forward through the root module first");
  PhaseScope phase(phase_labels_[Phase::kAllGather]);
  if (fast_path_) {
    // Nothing to gather: an already-completed all-gather, after which
    // wait_for_unshard switches the parameters to their unsharded views.
    // The phase stays, so that profiles show which group unshards when.
    for (const auto& p : params_) p->reset_sharded_param();  // see [Note: replaced parameter data]
    all_gather_.emplace();
    all_gather_->async_op = async_op;
    return;
  }
  const StreamSet& streams = comm_ctx_->streams;
  if (!reshard_after_forward_done_.empty()) {
    // The post-forward shard was made on the caller's stream and is read by
    // the copy-in (and, on Gloo, the all-gather) on theirs.
    reshard_after_forward_done_.block(streams.all_gather_copy_in());
    reshard_after_forward_done_.block(streams.all_gather());
    reshard_after_forward_done_ = DeviceEvent();
  }
  const FSDPCommContext::AllGatherStreams on = comm_ctx_->all_gather_streams(async_op, training_state_);
  // After a reshard to a smaller world, the all-gather runs within the
  // post-forward group, from the shard kept after forward.
  const bool from_post_forward = sharded_state_ == ShardedState::kShardedPostForward;
  collectives::Communicator& comm = from_post_forward ? *post_forward_comm_ : *shard_comm_;
  // Offload: the shards are on the host, the all-gather on `device_`.
  const auto options = params_.front()->padded_shard().options().dtype(param_dtype_).device(device_);
  AllGatherInput input =
      all_gather_copy_in(params_, layout_, from_post_forward ? post_forward_shard_ : at::Tensor(), comm, options,
                         offload_to_cpu_, on.copy_in, *all_gather_comm_, phase_labels_, module_fqn_);
  if (offload_to_cpu_) offload_copy_in_done_ = input.copy_in_done;
  AllGatherResult result = foreach_all_gather(std::move(input), comm, on.all_gather, *all_gather_comm_);
  result.async_op = async_op;
  result.copy_in_stream = on.copy_in;
  comm_ctx_->stats.all_gathers += 1;
  comm_ctx_->stats.all_gather_bytes +=
      all_gather_comm_->received_bytes(result.input.numel(), param_dtype_, comm.size());
  all_gather_ = std::move(result);
}

void FSDPParamGroup::wait_for_unshard() {
  if (!all_gather_) return;
  AllGatherResult result = std::move(*all_gather_);
  all_gather_.reset();
  if (fast_path_) {
    to_unsharded();
    return;
  }
  const StreamSet& streams = comm_ctx_->streams;
  // The previous forward group's output is freed here, after this group's
  // copy-in was issued and before its copy-out (see [Note: all-gather output
  // lifetime]).
  if (training_state_ == TrainingState::kForward) comm_ctx_->release_all_gather_state();
  {
    PhaseScope phase(phase_labels_[Phase::kAllGatherWait]);
    OptionalStreamGuard guard(result.all_gather_stream);
    const auto start = std::chrono::steady_clock::now();
    result.work.wait();
    comm_ctx_->stats.all_gather_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const std::optional<c10::Stream> current = streams.current_stream();
  const DeviceEvent gathered = DeviceEvent::record(result.all_gather_stream);
  gathered.block(current);
  // A separate all-gather input (Gloo's; NCCL gathers in place) was made on
  // the copy-in stream and goes with `result` below: the allocator may reuse
  // it there only after the collective read it.
  if (result.separate_input) gathered.block(streams.all_gather_copy_in());
  foreach_all_gather_copy_out(result.output, params_, layout_, phase_labels_);
  to_unsharded();
  DeviceEvent copy_out_done = DeviceEvent::record(current);
  if (!result.async_op && training_state_ == TrainingState::kForward && streams.enabled()) {
    // Freed at the next group's wait_for_unshard, so that this copy-out
    // overlaps the next all-gather (see [Note: all-gather output lifetime]).
    // On CPU nothing runs behind the host: the output goes now.
    comm_ctx_->last_all_gather_output = std::move(result.output);
    comm_ctx_->last_all_gather_done = std::move(copy_out_done);
  } else {
    // Backward and explicit unshards free the output now (FSDP2 does too):
    // the copy-out already overlaps the previous reduce-scatter.
    copy_out_done.block(streams.all_gather_copy_in());
    copy_out_done.block(streams.all_gather());
  }
}

void FSDPParamGroup::reshard() {
  // An all-gather that was issued but never waited for (a prefetch that was
  // not used): its buffers must outlive the collective on every stream.
  discard_all_gather();
  if (training_state_ == TrainingState::kForward) {
    if (!settings_.reshard_after_forward) return;
    if (post_forward_comm_) {
      to_sharded_post_forward();
      return;
    }
  }
  to_sharded();
}

void FSDPParamGroup::discard_all_gather() {
  if (!all_gather_) return;
  AllGatherResult result = std::move(*all_gather_);
  all_gather_.reset();
  if (fast_path_) return;
  const StreamSet& streams = comm_ctx_->streams;
  const std::optional<c10::Stream> caller = streams.current_stream();
  {
    OptionalStreamGuard guard(result.all_gather_stream);
    result.work.wait();
  }
  // The output was allocated on the copy-in stream (or, for an explicit
  // unshard, the caller's): the allocator may reuse it there only after the
  // collective wrote it.
  const DeviceEvent done = DeviceEvent::record(result.all_gather_stream);
  done.block(streams.all_gather_copy_in());
  done.block(caller);
}

void FSDPParamGroup::to_sharded() {
  if (is_sharded()) return;
  if (sharded_state_ == ShardedState::kUnsharded) {
    for (const auto& p : params_) p->to_sharded();
  }
  post_forward_shard_ = at::Tensor();
  sharded_state_ = ShardedState::kSharded;
}

void FSDPParamGroup::to_sharded_post_forward() {
  if (!is_unsharded()) return;
  // This rank keeps the all-gather output rows of its 1/k of the shard
  // ranks, laid out as those ranks' all-gather inputs (rank-major, then
  // parameter order), so that an all-gather within the post-forward group
  // rebuilds the whole output.
  const int64_t rows_per_rank = shard_comm_->size() / post_forward_comm_->size();
  const int64_t first_row = post_forward_comm_->rank() * rows_per_rank;
  std::vector<at::Tensor> pieces;
  pieces.reserve(params_.size());
  for (const auto& p : params_) pieces.push_back(p->post_forward_rows(first_row, rows_per_rank));
  {
    c10::NoGradGuard no_grad;
    post_forward_shard_ = at::cat(pieces, /*dim=*/1).reshape({-1});
    name_for_stream_check(post_forward_shard_, "the post-forward shard", module_fqn_);
  }
  reshard_after_forward_done_ = DeviceEvent::record(comm_ctx_->streams.current_stream());
  for (const auto& p : params_) p->to_sharded();
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FSDPParamGroup::to_unsharded() {
  if (is_unsharded()) return;
  for (const auto& p : params_) p->to_unsharded();
  post_forward_shard_ = at::Tensor();
  sharded_state_ = ShardedState::kUnsharded;
}

void FSDPParamGroup::pre_forward(TensorRefs& inputs) {
  PhaseScope phase(phase_labels_[Phase::kPreForward]);
  training_state_ = TrainingState::kForward;
  unshard(/*async_op=*/false);
  wait_for_unshard();
  register_post_backward(inputs);
}

void FSDPParamGroup::post_forward() {
  PhaseScope phase(phase_labels_[Phase::kPostForward]);
  reshard();
  post_forward_indices_.push_back(comm_ctx_->post_forward_order.size());
  comm_ctx_->post_forward_order.push_back(this);
  training_state_ = TrainingState::kIdle;
}

void FSDPParamGroup::register_post_backward(TensorRefs& inputs) {
  if (!c10::GradMode::is_enabled()) return;
  std::vector<at::Tensor*> targets;
  std::vector<at::Tensor> tensors;
  for (at::Tensor* t : inputs) {
    if (t->defined() && t->requires_grad()) {
      targets.push_back(t);
      tensors.push_back(*t);
    }
  }
  if (tensors.empty()) return;
  auto ref = c10::IValue::make_capsule(c10::make_intrusive<GroupRef>(self_ref_));
  auto outputs = PostBackwardFunction::apply(at::TensorList(tensors), std::move(ref));
  for (size_t i = 0; i < targets.size(); ++i) *targets[i] = std::move(outputs[i]);
}

void FSDPParamGroup::pre_backward(bool default_prefetch) {
  if (training_state_ == TrainingState::kPreBackward) return;
  PhaseScope phase(phase_labels_[Phase::kPreBackward]);
  training_state_ = TrainingState::kPreBackward;
  if (!settings_.unshard_in_backward && !is_unsharded()) {
    // Autograd may still produce full gradients for these parameters (an
    // embedding needs only its indices): keep the sharded ones aside so that
    // post-backward finds only this backward's gradient on them.
    for (const auto& p : params_) p->stash_sharded_grad_for_backward();
  }
  unshard(/*async_op=*/false);
  wait_for_unshard();
  if (default_prefetch) backward_prefetch();
}

void FSDPParamGroup::backward_prefetch() {
  if (post_forward_indices_.empty()) return;
  const size_t index = post_forward_indices_.back();
  post_forward_indices_.pop_back();
  if (index == 0) return;
  FSDPParamGroup* target = comm_ctx_->post_forward_order[index - 1];
  PhaseScope phase(target->phase_labels_[Phase::kBackwardPrefetch]);
  const TrainingState saved = target->training_state_;
  target->training_state_ = TrainingState::kPreBackward;
  target->unshard(/*async_op=*/false);
  target->training_state_ = saved;
}

ReduceOps FSDPParamGroup::reduce_ops() const {
  return gradient_reduce_ops(shard_comm_->size(), replicate_comm_ ? replicate_comm_->size() : 1, reduce_dtype_,
                             settings_.gradient_divide_factor, settings_.force_sum_reduction);
}

void FSDPParamGroup::post_backward() {
  PhaseScope phase(phase_labels_[Phase::kPostBackward]);
  // The end of backward runs post-backward again for groups still unsharded;
  // unused parameters are reduced once per backward.
  const bool reduce_unused = settings_.reduce_scatter_unused_params && training_state_ != TrainingState::kPostBackward;
  training_state_ = TrainingState::kPostBackward;
  GradsToReduce to_reduce;
  const bool unsharded = is_unsharded();
  // A sharded group has no gradient to reduce (autograd cannot have
  // accumulated into its sharded parameters), except:
  // - pytorch#137922: parameters not unsharded in backward may still get a
  //   gradient (an embedding's needs only the indices); autograd put it,
  //   full-shape, on the sharded parameter. It is reduced like any other.
  // - set_reduce_scatter_unused_params: a group whose backward did not run
  //   on this rank reduces zeros, as the ranks where it ran reduce
  //   gradients.
  if (unsharded || !settings_.unshard_in_backward || reduce_unused) {
    if (!settings_.reduce_grads) {
      for (const auto& p : params_) p->accumulate_unsharded_grad(p->take_autograd_grad(), reduce_dtype_);
      if (unsharded && settings_.reshard_after_backward) to_sharded();
      return;
    }
    to_reduce = take_grads_to_reduce(reduce_unused, unsharded);
    if (unsharded && settings_.reshard_after_backward) to_sharded();
  }
  if (to_reduce.grads.empty()) return;

  PhaseScope reduce_phase(phase_labels_[Phase::kPostBackwardReduce]);
  // See [Note: bounded reductions].
  comm_ctx_->wait_for_reduce_scatters(static_cast<size_t>(comm_ctx_->max_input_buffers() - 1));
  wait_for_post_backward();
  const StreamSet& streams = comm_ctx_->streams;
  const ReduceOps ops = reduce_ops();
  if (fast_path_) {
    reduce_in_place(to_reduce.params, to_reduce.grads, ops);
    return;
  }
  // set_separate_reduce_scatter_group: its own communicator over the same
  // ranks.
  collectives::Communicator& comm = settings_.reduce_scatter_comm ? *settings_.reduce_scatter_comm : *shard_comm_;
  ReduceScatterResult rs =
      foreach_reduce(to_reduce.params, std::move(to_reduce.grads), layout_.world, reduce_dtype_, ops.reduce_scatter,
                     ops.pre_divide, comm, *reduce_scatter_comm_, streams, phase_labels_, module_fqn_);
  comm_ctx_->stats.reduce_scatters += 1;
  comm_ctx_->stats.reduce_scatter_bytes +=
      reduce_scatter_comm_->sent_bytes(rs.input.numel(), reduce_dtype_, layout_.world);
  pending_reduce_ = PendingReduce{std::move(rs.work), std::move(rs.output), std::move(to_reduce.params),
                                  ops.all_reduce,     ops.post_divide,      settings_.all_reduce_grads,
                                  rs.stream};
  FSDPCommContext::ReduceScatterState state{std::move(rs.input)};
  if (streams.enabled()) {
    // Completing it only enqueues work on the reduction streams. The event
    // that frees the input is recorded after it: only then has the
    // reduce-scatter stream followed the collective's own stream (Work's
    // contract), as FSDP2 records its reduce_scatter event after the
    // collective; an event recorded before the wait would let the next
    // group free the input while NCCL could still read it.
    wait_for_post_backward();
    state.done = DeviceEvent::record(rs.stream);
  } else {
    // On CPU the reduce-scatter runs on Gloo's threads while backward goes
    // on; it is completed before a later group's is issued (see [Note:
    // bounded reductions]), or at the end of backward.
    state.group = this;
  }
  comm_ctx_->reduce_scatter_states.push_back(std::move(state));
}

FSDPParamGroup::GradsToReduce FSDPParamGroup::take_grads_to_reduce(bool reduce_unused, bool unsharded) {
  GradsToReduce result;
  for (const auto& p : params_) {
    at::Tensor g = p->take_unsharded_grad(p->take_autograd_grad());
    if (!g.defined()) {
      // Every rank then reduces the same parameters, whatever its control
      // flow used (FSDP2's unsharded_zero_grad_data, in the dtype autograd
      // would have produced).
      if (!reduce_unused || !p->param().requires_grad()) continue;
      g = at::zeros(p->unsharded_shape(), at::TensorOptions().dtype(param_dtype_).device(device_));
    }
    TORCH_CHECK(!unsharded || g.sizes() == c10::IntArrayRef(p->unsharded_shape()), "fsdp2: parameter '", p->fqn(),
                "' has a gradient of shape ", g.sizes(), " at the end of its backward, expected ",
                c10::IntArrayRef(p->unsharded_shape()),
                ". Was the module called around its hooks (not through fsdp::call_module)?");
    result.params.push_back(p.get());
    result.grads.push_back(std::move(g));
  }
  return result;
}

void FSDPParamGroup::reduce_in_place(std::vector<FSDPParam*>& params, std::vector<at::Tensor>& grads,
                                     const ReduceOps& ops) {
  c10::NoGradGuard no_grad;
  auto scale = [&ops](const at::Tensor& t) {
    if (ops.pre_divide != 1.0) t.div_(ops.pre_divide);
    reduce_one_rank_in_place(t, ops.reduce_scatter);
  };
  if (replicate_comm_ || settings_.reduced_grad_hook) {
    // The all-reduce and the hook take the group's gradients as one tensor:
    // the one-rank reduce-scatter's input is its output.
    std::vector<at::Tensor> flat;
    flat.reserve(grads.size());
    for (const at::Tensor& g : grads) flat.push_back(g.reshape({-1}));
    at::Tensor output = at::cat(flat);
    flat.clear();
    grads.clear();
    scale(output);
    pending_reduce_ = PendingReduce{collectives::Work(),
                                    std::move(output),
                                    std::move(params),
                                    ops.all_reduce,
                                    ops.post_divide,
                                    settings_.all_reduce_grads,
                                    comm_ctx_->streams.current_stream()};
    wait_for_post_backward();
    return;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    // Autograd's gradient (or the no-sync sum), which nothing else
    // references, becomes the sharded gradient or is added to the one kept
    // from an earlier backward.
    at::Tensor g = grads[i].requires_grad() ? grads[i].detach() : std::move(grads[i]);
    grads[i] = at::Tensor();
    if (!g.is_contiguous()) g = g.contiguous();
    scale(g);
    if (ops.post_divide != 1.0) g.div_(ops.post_divide);
    params[i]->accumulate_sharded_grad(g);
  }
  // Optimizer-in-backward: the hooks see the sharded gradient, as in FSDP2.
  for (FSDPParam* p : params) p->run_post_accumulate_grad_hooks();
}

void FSDPParamGroup::wait_for_post_backward() {
  if (!pending_reduce_) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  // The reduced chunks become .grad, used on the caller's stream (optimizer).
  const std::optional<c10::Stream> caller = comm_ctx_->streams.current_stream();
  StreamSet::record_stream(pending.output, caller);
  OptionalStreamGuard guard(pending.stream);
  const auto start = std::chrono::steady_clock::now();
  pending.work.wait();
  comm_ctx_->stats.reduce_scatter_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // CPU: its input may go now that the collective read it.
  if (!comm_ctx_->streams.enabled()) comm_ctx_->forget_reduce_scatter(this);
  c10::NoGradGuard no_grad;
  if (replicate_comm_) {
    if (!pending.all_reduce) {
      // set_requires_all_reduce(false): keep the partial sum for the next
      // backward that all-reduces; no gradient is final yet.
      if (partial_reduce_output_.defined()) {
        TORCH_CHECK(partial_reduce_output_.sizes() == pending.output.sizes(), "fsdp2: module '", module_fqn_,
                    "': the parameters with gradients changed between backwards without all-reduce");
        partial_reduce_output_.add_(pending.output);
      } else {
        partial_reduce_output_ = pending.output;
      }
      return;
    }
    if (partial_reduce_output_.defined()) {
      pending.output.add_(partial_reduce_output_);
      partial_reduce_output_ = at::Tensor();
    }
    PhaseScope phase(phase_labels_[Phase::kAllReduce]);
    const std::optional<c10::Stream> ar_stream = comm_ctx_->streams.all_reduce();
    StreamSet::wait_stream(ar_stream, pending.stream);
    StreamSet::record_stream(pending.output, ar_stream);
    OptionalStreamGuard ar_guard(ar_stream);
    collectives::Work ar = replicate_comm_->all_reduce(pending.output, pending.all_reduce_op);
    const auto ar_start = std::chrono::steady_clock::now();
    ar.wait();
    comm_ctx_->stats.reduce_scatter_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - ar_start).count();
    pending.stream = ar_stream;
  }
  if (settings_.reduced_grad_hook) {
    // Before the division, as FSDP2's all-reduce hook: on the user's stream
    // when given, else on the all-reduce stream.
    const std::optional<c10::Stream> hook_stream = settings_.reduced_grad_hook_stream && comm_ctx_->streams.enabled()
                                                       ? settings_.reduced_grad_hook_stream
                                                       : comm_ctx_->streams.all_reduce();
    StreamSet::wait_stream(hook_stream, pending.stream);
    StreamSet::record_stream(pending.output, hook_stream);
    OptionalStreamGuard hook_guard(hook_stream);
    PhaseScope phase(phase_labels_[Phase::kAllReduceHook]);
    settings_.reduced_grad_hook(pending.output);
    pending.stream = hook_stream;
  }
  OptionalStreamGuard post_guard(pending.stream);
  if (pending.post_divide != 1.0) pending.output.div_(pending.post_divide);
  int64_t offset = 0;
  for (FSDPParam* p : pending.params) {
    p->accumulate_sharded_grad(pending.output.narrow(0, offset, p->padded_shard_numel()));
    offset += p->padded_shard_numel();
    // A gradient made here (cast to the parameter's dtype, or a first
    // accumulation) is another block of this stream's, read and freed on the
    // caller's. A group left unsharded keeps it aside, not in .grad.
    const at::Tensor& grad = p->sharded_grad();
    if (caller && grad.defined() && !grad.is_alias_of(pending.output)) StreamSet::record_stream(grad, caller);
  }
  // Optimizer-in-backward: the hooks see the sharded gradient, as in FSDP2.
  for (FSDPParam* p : pending.params) p->run_post_accumulate_grad_hooks();
  // After the hooks, which run on this stream: an optimizer step in a hook
  // writes the shards that the next forward's copy-in reads (FSDP2 records
  // its post_reduce_event after them too).
  post_reduce_done_ = DeviceEvent::record(pending.stream);
}

void FSDPParamGroup::finalize_backward() {
  wait_for_post_backward();
  post_reduce_done_.block(comm_ctx_->streams.current_stream());
  post_reduce_done_ = DeviceEvent();
  // The optimizer steps on the host gradients next (FSDP2 synchronizes its
  // grad_offload_event here).
  wait_for_offload_copies();
  // A backward prefetch that no backward used.
  discard_all_gather();
  post_forward_indices_.clear();
}

void FSDPParamGroup::reset_iter_state() {
  // Collectives in flight must finish before their buffers go; an error they
  // raise belongs to the failed step, not to the recovery.
  auto wait_quietly = [](collectives::Work& work) {
    try {
      work.wait();
    } catch (const c10::Error&) {
    }
  };
  // The buffers are freed by the host below, and the caching allocator hands
  // them to the next allocation on the stream that allocated them: that
  // stream, not only the caller's, must wait for the collective still using
  // them (a prefetch in flight when a forward threw).
  if (all_gather_) {
    OptionalStreamGuard guard(all_gather_->copy_in_stream);
    wait_quietly(all_gather_->work);
  }
  all_gather_.reset();
  wait_for_offload_copies();
  if (pending_reduce_) {
    OptionalStreamGuard guard(pending_reduce_->stream);
    wait_quietly(pending_reduce_->work);
  }
  pending_reduce_.reset();
  if (comm_ctx_ != nullptr) comm_ctx_->forget_reduce_scatter(this);
  partial_reduce_output_ = at::Tensor();
  for (const auto& p : params_) {
    // Unreduced gradients of the failed step.
    p->take_unsharded_grad(p->take_autograd_grad());
  }
  to_sharded();
  post_forward_indices_.clear();
  reshard_after_forward_done_ = DeviceEvent();
  post_reduce_done_ = DeviceEvent();
  training_state_ = TrainingState::kIdle;
}

void FSDPParamGroup::wait_for_offload_copies() {
  if (!offload_to_cpu_) return;
  // A copy-in not followed by a backward that waited for it (a forward
  // without backward, parameters without gradients) may still read a shard.
  offload_copy_in_done_.synchronize();
  offload_copy_in_done_ = DeviceEvent();
  for (const auto& p : params_) p->wait_for_grad_offload();
}

// ---- Custom collectives (fsdp2/custom_collectives.h) ----

void FSDPParamGroup::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  custom_all_gather_ = comm != nullptr;
  if (comm) {
    all_gather_comm_ = std::make_unique<UserAllGather>(std::move(comm), module_fqn_);
  } else {
    all_gather_comm_ = std::make_unique<DefaultAllGather>();
  }
  update_fast_path();
}

void FSDPParamGroup::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  custom_reduce_scatter_ = comm != nullptr;
  if (comm) {
    reduce_scatter_comm_ = std::make_unique<UserReduceScatter>(std::move(comm), module_fqn_);
  } else {
    reduce_scatter_comm_ = std::make_unique<DefaultReduceScatter>();
  }
  update_fast_path();
}

void FSDPParamGroup::update_fast_path() {
  const bool fast = fast_path_eligible_ && !custom_all_gather_ && !custom_reduce_scatter_;
  if (fast == fast_path_) return;
  TORCH_INTERNAL_ASSERT(is_sharded() && !all_gather_ && !pending_reduce_);
  for (const auto& p : params_) {
    if (fast) {
      p->share_shard_as_unsharded();
    } else {
      p->unshare_shard();
    }
  }
  fast_path_ = fast;
}

int64_t FSDPParamGroup::unsharded_storage_bytes() const {
  int64_t total = post_forward_shard_.defined() ? post_forward_shard_.nbytes() : 0;
  for (const auto& p : params_) total += p->unsharded_storage_bytes();
  return total;
}

}  // namespace fsdp::detail
