#include "fsdp_param_group.h"

#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp_common/logging.h"
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

FSDPParamGroup::FSDPParamGroup(std::vector<at::Tensor> params, std::vector<std::string> param_names, DeviceMesh mesh,
                               c10::Device device)
    : mesh_(std::move(mesh)), device_(device), self_ref_(std::make_shared<FSDPParamGroup*>(this)) {
  TORCH_INTERNAL_ASSERT(!params.empty());
  shard_comm_ = mesh_.group(mesh_.ndim() - 1);
  dtype_ = params.front().scalar_type();
  for (size_t i = 0; i < params.size(); ++i) {
    params_.push_back(std::make_unique<FSDPParam>(std::move(params[i]), std::move(param_names[i]),
                                                  shard_comm_->rank(), shard_comm_->size()));
    padded_numels_.push_back(params_.back()->padded_shard_numel());
    padded_total_ += padded_numels_.back();
  }
}

void FSDPParamGroup::lazy_init(FSDPCommContext* comm_ctx, std::string module_fqn) {
  comm_ctx_ = comm_ctx;
  module_fqn_ = std::move(module_fqn);
}

std::string FSDPParamGroup::with_fqn(const char* label) const {
  return module_fqn_.empty() ? std::string(label) : std::string(label) + " (" + module_fqn_ + ")";
}

void FSDPParamGroup::unshard(bool async_op) {
  if (all_gather_ || is_unsharded()) return;
  if (!settings_.unshard_in_backward && training_state_ == TrainingState::kPreBackward) return;
  TORCH_CHECK(comm_ctx_ != nullptr, "fsdp2: module '", module_fqn_,
              "' is unsharded before its root's first forward; run a forward through the root module first");
  PhaseScope phase(with_fqn("FSDP::all_gather"));
  const StreamSet& streams = comm_ctx_->streams;
  // Implicit prefetch in forward/backward uses the all-gather streams so the
  // collective overlaps compute; an explicit unshard runs on the caller's
  // stream (FSDP2's _get_all_gather_streams).
  std::optional<c10::Stream> copy_in_stream = streams.current_stream();
  std::optional<c10::Stream> all_gather_stream = copy_in_stream;
  if (!async_op && (training_state_ == TrainingState::kForward || training_state_ == TrainingState::kPreBackward)) {
    copy_in_stream = streams.all_gather_copy_in();
    all_gather_stream = streams.all_gather();
  }
  const auto options = params_.front()->padded_shard().options();
  const int64_t world = shard_comm_->size();
  at::Tensor output;
  at::Tensor input;
  {
    OptionalStreamGuard guard(copy_in_stream);
    PhaseScope phase(with_fqn("FSDP::all_gather_copy_in"));
    // See [Note: all-gather output lifetime].
    comm_ctx_->last_all_gather_done.block(copy_in_stream);
    comm_ctx_->last_all_gather_done = DeviceEvent();
    comm_ctx_->last_all_gather_output = at::Tensor();
    output = at::empty({world * padded_total_}, options);
    // NCCL gathers in place from the output's own slice; Gloo gets a separate
    // input, as its all-gather copies the input into the output first.
    input = streams.enabled() ? output.narrow(0, shard_comm_->rank() * padded_total_, padded_total_)
                              : at::empty({padded_total_}, options);
    std::vector<at::Tensor> sources;
    sources.reserve(params_.size());
    for (const auto& p : params_) sources.push_back(p->padded_shard());
    at::_foreach_copy_(input.split_with_sizes(padded_numels_), sources);
  }
  AllGatherResult result;
  result.copy_in_done = DeviceEvent::record(copy_in_stream);
  result.all_gather_stream = all_gather_stream;
  {
    OptionalStreamGuard guard(all_gather_stream);
    result.copy_in_done.block(all_gather_stream);
    result.work = shard_comm_->all_gather_into_tensor(output, input);
  }
  comm_ctx_->stats.all_gathers += 1;
  comm_ctx_->stats.all_gather_bytes += (world - 1) * padded_total_ * static_cast<int64_t>(output.element_size());
  result.output = std::move(output);
  all_gather_ = std::move(result);
}

void FSDPParamGroup::wait_for_unshard() {
  if (!all_gather_) return;
  AllGatherResult result = std::move(*all_gather_);
  all_gather_.reset();
  const StreamSet& streams = comm_ctx_->streams;
  {
    PhaseScope phase(with_fqn("FSDP::all_gather_wait"));
    OptionalStreamGuard guard(result.all_gather_stream);
    const auto start = std::chrono::steady_clock::now();
    result.work.wait();
    comm_ctx_->stats.all_gather_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const std::optional<c10::Stream> current = streams.current_stream();
  DeviceEvent::record(result.all_gather_stream).block(current);
  {
    PhaseScope phase(with_fqn("FSDP::all_gather_copy_out"));
    std::vector<at::Tensor> outs;
    outs.reserve(params_.size());
    for (const auto& p : params_) outs.push_back(p->alloc_all_gather_output_rows());
    c10::NoGradGuard no_grad;
    at::split_with_sizes_copy_out(outs, result.output.view({shard_comm_->size(), padded_total_}), padded_numels_,
                                  /*dim=*/1);
  }
  to_unsharded();
  comm_ctx_->last_all_gather_output = std::move(result.output);
  comm_ctx_->last_all_gather_done = DeviceEvent::record(current);
}

void FSDPParamGroup::reshard() {
  if (training_state_ == TrainingState::kForward && !settings_.reshard_after_forward) return;
  if (all_gather_) {
    // An all-gather that was issued but never waited for (a prefetch that
    // was not used): its buffers must outlive the collective.
    all_gather_->work.wait();
    all_gather_.reset();
  }
  to_sharded();
}

void FSDPParamGroup::to_sharded() {
  if (is_sharded()) return;
  for (const auto& p : params_) p->to_sharded();
  sharded_state_ = ShardedState::kSharded;
}

void FSDPParamGroup::to_unsharded() {
  if (is_unsharded()) return;
  for (const auto& p : params_) p->to_unsharded();
  sharded_state_ = ShardedState::kUnsharded;
}

void FSDPParamGroup::pre_forward(TensorRefs& inputs) {
  PhaseScope phase(with_fqn("FSDP::pre_forward"));
  training_state_ = TrainingState::kForward;
  unshard(/*async_op=*/false);
  wait_for_unshard();
  register_post_backward(inputs);
}

void FSDPParamGroup::post_forward() {
  PhaseScope phase(with_fqn("FSDP::post_forward"));
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
  PhaseScope phase(with_fqn("FSDP::pre_backward"));
  training_state_ = TrainingState::kPreBackward;
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
  PhaseScope phase("FSDP::backward_prefetch for " + target->module_fqn_);
  const TrainingState saved = target->training_state_;
  target->training_state_ = TrainingState::kPreBackward;
  target->unshard(/*async_op=*/false);
  target->training_state_ = saved;
}

collectives::ReduceOp FSDPParamGroup::reduce_scatter_op(double* post_divide) const {
  *post_divide = 1.0;
  const double world = static_cast<double>(shard_comm_->size());
  if (settings_.force_sum_reduction) {
    *post_divide = settings_.gradient_divide_factor.value_or(world);
    return collectives::ReduceOp::sum();
  }
  if (settings_.gradient_divide_factor) {
    return collectives::ReduceOp::premul_sum(1.0 / *settings_.gradient_divide_factor);
  }
  return collectives::ReduceOp::avg();
}

void FSDPParamGroup::post_backward() {
  PhaseScope phase(with_fqn("FSDP::post_backward"));
  training_state_ = TrainingState::kPostBackward;
  // A sharded group has no full gradients: autograd cannot have accumulated
  // into its sharded parameters (their .grad, if any, is sharded already).
  if (is_sharded()) return;
  if (!settings_.reduce_grads) {
    for (const auto& p : params_) p->accumulate_unsharded_grad();
    if (settings_.reshard_after_backward) to_sharded();
    return;
  }
  std::vector<FSDPParam*> params_with_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params_) {
    at::Tensor g = p->take_unsharded_grad();
    if (!g.defined()) continue;
    TORCH_CHECK(g.sizes() == c10::IntArrayRef(p->unsharded_shape()), "fsdp2: parameter '", p->fqn(),
                "' has a gradient of shape ", g.sizes(), " at the end of its backward, expected ",
                c10::IntArrayRef(p->unsharded_shape()),
                ". Was the module called around its hooks (not through fsdp::call_module)?");
    params_with_grad.push_back(p.get());
    grads.push_back(std::move(g));
  }
  if (settings_.reshard_after_backward) to_sharded();
  if (grads.empty()) return;

  PhaseScope reduce_phase(with_fqn("FSDP::post_backward_reduce"));
  wait_for_post_backward();
  const StreamSet& streams = comm_ctx_->streams;
  const std::optional<c10::Stream> rs_stream = streams.reduce_scatter();
  StreamSet::wait_stream(rs_stream, streams.current_stream());
  OptionalStreamGuard guard(rs_stream);
  const int64_t world = shard_comm_->size();
  int64_t total = 0;
  std::vector<at::Tensor> grads_2d;
  grads_2d.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    total += params_with_grad[i]->padded_shard_numel();
    const int64_t rows = grads[i].dim() == 0 ? 1 : grads[i].size(0);
    grads_2d.push_back(grads[i].reshape({rows, rows == 0 ? 0 : grads[i].numel() / rows}));
    // The gradients were made on the current stream and are read on the
    // reduce-scatter stream: keep their memory until that stream is done.
    StreamSet::record_stream(grads[i], rs_stream);
  }
  comm_ctx_->last_reduce_scatter_input = at::Tensor();
  at::Tensor input = at::empty({world, total}, grads.front().options());
  {
    c10::NoGradGuard no_grad;
    at::_chunk_cat_out(input, grads_2d, /*dim=*/0, /*num_chunks=*/world);
  }
  at::Tensor output = at::empty({total}, input.options());
  double post_divide = 1.0;
  const collectives::ReduceOp op = reduce_scatter_op(&post_divide);
  FSDP2CPP_LOG_DEBUG(with_fqn("FSDP::reduce_scatter") + " op " + op.to_string() + ", " + std::to_string(total) +
                     " elements per rank");
  collectives::Work work;
  {
    PhaseScope phase(with_fqn("FSDP::reduce_scatter"));
    work = shard_comm_->reduce_scatter_tensor(output, input.view({-1}), op);
  }
  comm_ctx_->stats.reduce_scatters += 1;
  comm_ctx_->stats.reduce_scatter_bytes += input.numel() * static_cast<int64_t>(input.element_size());
  pending_reduce_ = PendingReduce{std::move(work), std::move(output), std::move(params_with_grad), post_divide,
                                  rs_stream};
  comm_ctx_->last_reduce_scatter_input = std::move(input);
  // On CPU the reduce-scatter runs on Gloo's threads while backward goes on;
  // it is completed at the next post-backward of this group or at the end of
  // backward. On CUDA completing it only enqueues work on its stream.
  if (streams.enabled()) wait_for_post_backward();
}

void FSDPParamGroup::wait_for_post_backward() {
  if (!pending_reduce_) return;
  PendingReduce pending = std::move(*pending_reduce_);
  pending_reduce_.reset();
  // The reduced chunks become .grad, used on the caller's stream (optimizer).
  StreamSet::record_stream(pending.output, comm_ctx_->streams.current_stream());
  OptionalStreamGuard guard(pending.stream);
  const auto start = std::chrono::steady_clock::now();
  pending.work.wait();
  comm_ctx_->stats.reduce_scatter_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  c10::NoGradGuard no_grad;
  if (pending.post_divide != 1.0) pending.output.div_(pending.post_divide);
  if (settings_.reduced_grad_hook) settings_.reduced_grad_hook(pending.output);
  int64_t offset = 0;
  for (FSDPParam* p : pending.params) {
    p->accumulate_sharded_grad(pending.output.narrow(0, offset, p->padded_shard_numel()));
    offset += p->padded_shard_numel();
  }
  post_reduce_done_ = DeviceEvent::record(pending.stream);
}

void FSDPParamGroup::finalize_backward() {
  wait_for_post_backward();
  post_reduce_done_.block(comm_ctx_->streams.current_stream());
  post_reduce_done_ = DeviceEvent();
  if (all_gather_) {
    // A backward prefetch that no backward used.
    all_gather_->work.wait();
    all_gather_.reset();
  }
  post_forward_indices_.clear();
}

int64_t FSDPParamGroup::unsharded_storage_bytes() const {
  int64_t total = 0;
  for (const auto& p : params_) total += p->unsharded_storage_bytes();
  return total;
}

}  // namespace fsdp::detail
