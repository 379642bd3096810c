#include "fsdp_param.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/variable.h>

#include "device_mesh/placement.h"
#include "stream_check/stream_check.h"

namespace fsdp::detail {
namespace {

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes) return;
  // The allocator allocates on the current device, which need not be the
  // buffer's (a program that switched devices).
  const c10::OptionalDeviceGuard device_guard(t.device().is_cpu() ? std::nullopt : std::optional(t.device()));
  TORCH_INTERNAL_ASSERT(storage->nbytes() == 0, "fsdp2: unsharded storage is partially allocated");
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

// A tensor over `base`'s storage that autograd does not treat as a view.
// LibTorch's Optimizer::zero_grad calls detach_() on every gradient, which
// views refuse; the sharded gradient aliases the reduce-scatter output
// (no copy), so it is made this way.
at::Tensor alias_storage(const at::Tensor& base, int64_t offset, c10::IntArrayRef sizes) {
  c10::NoGradGuard no_grad;
  return at::empty({0}, base.options())
      .set_(base.storage(), base.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.scalar_type() == b.scalar_type();
}

// Points `param` at `view`. On the world size 1 fast path the sharded and
// unsharded views are the same view of the shard, and set_data (a dispatched
// compatibility check and a metadata copy, per parameter four times a step)
// would change nothing.
void point_at(at::Tensor& param, const at::Tensor& view) {
  if (!same_view(param, view)) param.set_data(view);
}

}  // namespace

FSDPParam::FSDPParam(at::Tensor param, std::string fqn, int64_t shard_rank, int64_t shard_world_size,
                     c10::ScalarType param_dtype, const OffloadPolicy& offload, std::optional<c10::Device> device,
                     int64_t shard_dim)
    : param_(std::move(param)),
      fqn_(std::move(fqn)),
      rank_(shard_rank),
      world_size_(shard_world_size),
      shard_dim_(shard_dim),
      offload_to_cpu_(offload.offload_to_cpu),
      pin_memory_(offload.offload_to_cpu && offload.pin_memory),
      host_(pin_memory_, device.value_or(param_.device())) {
  TORCH_INTERNAL_ASSERT(shard_dim_ >= 0 && shard_dim_ < std::max<int64_t>(param_.dim(), 1));
  chunk_cat_ = shard_dim_ != 0 && world_size_ > 1;
  unsharded_shape_ = param_.sizes().vec();
  unsharded_numel_ = param_.numel();
  // A 0-dim parameter is sharded as one row.
  const int64_t rows = param_.dim() == 0 ? 1 : param_.size(shard_dim_);
  const int64_t row_numel = rows == 0 ? 0 : unsharded_numel_ / rows;
  const int64_t chunk_rows = (rows + world_size_ - 1) / world_size_;
  const int64_t offset = std::min(rank_ * chunk_rows, rows);
  const int64_t local_rows = std::max<int64_t>(0, std::min(chunk_rows, rows - offset));
  padded_shard_numel_ = chunk_rows * row_numel;

  sharded_shape_ = param_.dim() == 0 ? std::vector<int64_t>{local_rows} : unsharded_shape_;
  if (param_.dim() > 0) sharded_shape_[shard_dim_] = local_rows;

  const auto options = param_.options().requires_grad(false);
  // See [Note: CPU offload].
  const auto unsharded_options = offload_to_cpu_ && device ? options.device(*device) : options;
  c10::NoGradGuard no_grad;
  const at::Tensor full = param_.dim() == 0 ? param_.detach().reshape({1}) : param_.detach();
  padded_shard_ =
      offload_to_cpu_ ? host_.empty({padded_shard_numel_}, options).zero_() : at::zeros({padded_shard_numel_}, options);
  sharded_view_ = padded_shard_.narrow(0, 0, local_rows * row_numel).view(sharded_shape_);
  sharded_view_.copy_(full.narrow(shard_dim_, offset, local_rows));

  const int64_t buffer_numel = chunk_cat_ ? unsharded_numel_ : world_size_ * padded_shard_numel_;
  unsharded_buffer_ = at::empty({buffer_numel}, unsharded_options.dtype(param_dtype));
  unsharded_view_ = unsharded_buffer_.narrow(0, 0, unsharded_numel_).view(unsharded_shape_);
  free_storage(unsharded_buffer_);
  name_buffers_for_stream_check();

  param_.set_data(sharded_view_);
}

void FSDPParam::set_fqn(std::string fqn) {
  fqn_ = std::move(fqn);
  name_buffers_for_stream_check();
}

void FSDPParam::name_buffers_for_stream_check() const {
  if (!stream_check::active()) return;
  stream_check::name_buffer(padded_shard_, "the shard of " + fqn_);
  stream_check::name_buffer(unsharded_buffer_, "the unsharded parameter " + fqn_);
}

at::Tensor FSDPParam::alloc_all_gather_output_rows() {
  TORCH_INTERNAL_ASSERT(!chunk_cat_);
  alloc_storage(unsharded_buffer_, static_cast<size_t>(unsharded_buffer_.numel()) * unsharded_buffer_.element_size());
  name_buffers_for_stream_check();
  return unsharded_buffer_.view({world_size_, padded_shard_numel_});
}

void FSDPParam::copy_out_chunks(const at::Tensor& rows) {
  TORCH_INTERNAL_ASSERT(chunk_cat_ && rows.dim() == 2 && rows.size(0) == world_size_ &&
                        rows.size(1) == padded_shard_numel_);
  alloc_storage(unsharded_buffer_, static_cast<size_t>(unsharded_buffer_.numel()) * unsharded_buffer_.element_size());
  name_buffers_for_stream_check();
  const int64_t size = unsharded_shape_[shard_dim_];
  std::vector<int64_t> shape = unsharded_shape_;
  std::vector<at::Tensor> chunks;
  chunks.reserve(world_size_);
  for (int64_t r = 0; r < world_size_; ++r) {
    shape[shard_dim_] = chunk_extent(size, world_size_, r).length;
    chunks.push_back(rows.select(0, r).narrow(0, 0, c10::multiply_integers(shape)).view(shape));
  }
  c10::NoGradGuard no_grad;
  at::cat_out(unsharded_view_, chunks, shard_dim_);
}

at::Tensor FSDPParam::padded_chunks(const at::Tensor& full, int64_t first, int64_t count) const {
  TORCH_INTERNAL_ASSERT(chunk_cat_ && full.sizes() == c10::IntArrayRef(unsharded_shape_));
  c10::NoGradGuard no_grad;
  at::Tensor rows = at::zeros({count, padded_shard_numel_}, full.options().requires_grad(false));
  const int64_t size = unsharded_shape_[shard_dim_];
  std::vector<int64_t> shape = unsharded_shape_;
  for (int64_t i = 0; i < count; ++i) {
    const ChunkExtent ext = chunk_extent(size, world_size_, first + i);
    shape[shard_dim_] = ext.length;
    rows.select(0, i)
        .narrow(0, 0, c10::multiply_integers(shape))
        .view(shape)
        .copy_(full.narrow(shard_dim_, ext.offset, ext.length));
  }
  return rows;
}

at::Tensor FSDPParam::post_forward_rows(int64_t first, int64_t count) {
  if (!chunk_cat_) return alloc_all_gather_output_rows().narrow(0, first, count);
  TORCH_INTERNAL_ASSERT(unsharded_storage_bytes() > 0 || unsharded_numel_ == 0);
  return padded_chunks(unsharded_view_, first, count);
}

void FSDPParam::free_unsharded_storage() { free_storage(unsharded_buffer_); }

int64_t FSDPParam::unsharded_storage_bytes() const {
  if (shard_is_unsharded_) return state_ == ShardedState::kUnsharded ? padded_shard_.nbytes() : 0;
  return static_cast<int64_t>(unsharded_buffer_.storage().nbytes());
}

void FSDPParam::share_shard_as_unsharded() {
  TORCH_INTERNAL_ASSERT(state_ == ShardedState::kSharded && world_size_ == 1 &&
                        padded_shard_numel_ == unsharded_numel_ && param_dtype() == orig_dtype());
  unsharded_view_ = padded_shard_.view(unsharded_shape_);
  shard_is_unsharded_ = true;
}

void FSDPParam::unshare_shard() {
  TORCH_INTERNAL_ASSERT(state_ == ShardedState::kSharded && shard_is_unsharded_);
  // A view of a freed storage fails its bounds check: made while allocated,
  // as the constructor makes it.
  alloc_storage(unsharded_buffer_, static_cast<size_t>(unsharded_buffer_.numel()) * unsharded_buffer_.element_size());
  unsharded_view_ = unsharded_buffer_.narrow(0, 0, unsharded_numel_).view(unsharded_shape_);
  free_storage(unsharded_buffer_);
  name_buffers_for_stream_check();
  shard_is_unsharded_ = false;
}

void FSDPParam::to_unsharded() {
  if (state_ == ShardedState::kUnsharded) return;
  TORCH_INTERNAL_ASSERT(shard_is_unsharded_ || unsharded_storage_bytes() > 0 || unsharded_numel_ == 0, "fsdp2: ", fqn_,
                        " is unsharded before its all-gather output exists");
  stash_sharded_grad();
  hide_post_accumulate_grad_hooks();
  point_at(param_, unsharded_view_);
  state_ = ShardedState::kUnsharded;
}

void FSDPParam::to_sharded() {
  if (state_ == ShardedState::kSharded) return;
  const at::Tensor& grad = param_.grad();
  TORCH_CHECK(!grad.defined(), "fsdp2: parameter '", fqn_,
              "' has a full gradient that was never reduced when it is resharded; this happens when reshard() "
              "is called between backward and the end of backward");
  point_at(param_, sharded_view_);
  free_unsharded_storage();
  restore_sharded_grad();
  state_ = ShardedState::kSharded;
  restore_post_accumulate_grad_hooks();
  if (post_acc_grad_hooks_pending_) run_post_accumulate_grad_hooks();
}

void FSDPParam::stash_sharded_grad_for_backward() {
  if (state_ != ShardedState::kSharded || grad_stashed_while_sharded_) return;
  stash_sharded_grad();
  grad_stashed_while_sharded_ = true;
  hide_post_accumulate_grad_hooks();
  if (chunk_cat_) point_at_gapped_copy();
}

void FSDPParam::point_at_gapped_copy() {
  // [Note: full gradients on a sharded parameter] Autograd's AccumulateGrad
  // takes a gradient as P's .grad as it is when its strides agree with P's
  // (the gradient layout contract) or when P is not dense; otherwise it
  // copies it into P's own shape, which fails for a full gradient. A dim-0
  // shard has the full gradient's strides; a shard on another dim does not,
  // so P views, for this backward, a copy of its shard with a gap after the
  // shard dim's last index (not dense), and the full gradient is kept whole.
  // An empty chunk counts as dense whatever its strides: it gets the full
  // gradient's, so that AccumulateGrad takes a fresh gradient as it is.
  if (sharded_view_.numel() == 0) {
    param_.set_data(padded_shard_.as_strided(sharded_shape_, c10::contiguous_strides(unsharded_shape_), 0));
    return;
  }
  std::vector<int64_t> gapped_shape = sharded_shape_;
  gapped_shape[shard_dim_] += 1;
  c10::NoGradGuard no_grad;
  at::Tensor gapped = at::empty(gapped_shape, sharded_view_.options());
  at::Tensor view = gapped.narrow(shard_dim_, 0, sharded_shape_[shard_dim_]);
  view.copy_(sharded_view_);
  param_.set_data(view);
}

void FSDPParam::stash_sharded_grad() {
  at::Tensor& grad = param_.mutable_grad();
  if (!grad.defined()) return;
  TORCH_CHECK(grad.sizes() == c10::IntArrayRef(sharded_shape_), "fsdp2: parameter '", fqn_,
              "' has a gradient of shape ", grad.sizes(), " while sharded; expected the sharded shape ",
              c10::IntArrayRef(sharded_shape_), ". Only fsdp2 should assign gradients to sharded parameters.");
  TORCH_INTERNAL_ASSERT(!sharded_grad_.defined());
  sharded_grad_ = std::move(grad);
  grad = at::Tensor();
}

void FSDPParam::restore_sharded_grad() {
  if (!sharded_grad_.defined()) return;
  param_.mutable_grad() = std::move(sharded_grad_);
  sharded_grad_ = at::Tensor();
}

void FSDPParam::hide_post_accumulate_grad_hooks() {
  if (!param_.requires_grad() || post_acc_grad_hooks_aside_) return;
  post_acc_grad_hooks_aside_ = std::move(torch::autograd::impl::post_acc_grad_hooks(param_));
}

void FSDPParam::restore_post_accumulate_grad_hooks() {
  if (!post_acc_grad_hooks_aside_) return;
  auto& hooks = torch::autograd::impl::post_acc_grad_hooks(param_);
  if (!hooks) hooks = std::move(post_acc_grad_hooks_aside_);
  post_acc_grad_hooks_aside_.reset();
}

void FSDPParam::run_post_accumulate_grad_hooks() {
  if (state_ != ShardedState::kSharded || grad_stashed_while_sharded_) {
    post_acc_grad_hooks_pending_ = true;
    return;
  }
  post_acc_grad_hooks_pending_ = false;
  if (!param_.requires_grad()) return;
  if (auto& hooks = torch::autograd::impl::post_acc_grad_hooks(param_)) {
    // An optimizer step in backward reads the host gradient.
    wait_for_grad_offload();
    (*hooks)(param_);
  }
}

void FSDPParam::wait_for_grad_offload() {
  grad_offload_done_.synchronize();
  grad_offload_done_ = DeviceEvent();
}

at::Tensor FSDPParam::take_autograd_grad() {
  at::Tensor& grad = param_.mutable_grad();
  at::Tensor result;
  if (state_ == ShardedState::kUnsharded) {
    result = std::move(grad);
    grad = at::Tensor();
    return result;
  }
  if (!grad_stashed_while_sharded_) return result;
  if (grad.defined()) {
    TORCH_CHECK(grad.sizes() == c10::IntArrayRef(unsharded_shape_), "fsdp2: parameter '", fqn_,
                "' got a gradient of shape ", grad.sizes(), " in a backward that did not unshard it; expected ",
                c10::IntArrayRef(unsharded_shape_));
    result = std::move(grad);
    grad = at::Tensor();
  }
  grad_stashed_while_sharded_ = false;
  point_at(param_, sharded_view_);
  restore_sharded_grad();
  restore_post_accumulate_grad_hooks();
  if (post_acc_grad_hooks_pending_) run_post_accumulate_grad_hooks();
  return result;
}

at::Tensor FSDPParam::take_unsharded_grad(at::Tensor grad) {
  if (!unsharded_accumulated_grad_.defined()) return grad;
  at::Tensor result = std::move(unsharded_accumulated_grad_);
  unsharded_accumulated_grad_ = at::Tensor();
  if (grad.defined()) {
    c10::NoGradGuard no_grad;
    result.add_(grad);
  }
  return result;
}

void FSDPParam::accumulate_unsharded_grad(at::Tensor grad, c10::ScalarType reduce_dtype) {
  if (!grad.defined()) return;
  c10::NoGradGuard no_grad;
  if (unsharded_accumulated_grad_.defined()) {
    unsharded_accumulated_grad_.add_(grad);
  } else {
    unsharded_accumulated_grad_ = grad.scalar_type() == reduce_dtype ? std::move(grad) : grad.to(reduce_dtype);
  }
}

void FSDPParam::accumulate_sharded_grad(const at::Tensor& reduced_padded_chunk) {
  const int64_t local_numel = c10::multiply_integers(sharded_shape_);
  TORCH_INTERNAL_ASSERT(reduced_padded_chunk.is_contiguous() && reduced_padded_chunk.numel() >= local_numel);
  c10::NoGradGuard no_grad;
  if (offload_to_cpu_ && !host_.holds(reduced_padded_chunk)) {
    accumulate_offloaded_grad(reduced_padded_chunk.view({-1}).narrow(0, 0, local_numel).view(sharded_shape_));
    return;
  }
  at::Tensor reduced = reduced_padded_chunk.scalar_type() == orig_dtype()
                           ? reduced_padded_chunk
                           : reduced_padded_chunk.view({-1}).narrow(0, 0, local_numel).to(orig_dtype());
  // A tensor of its own in the sharded shape (autograd's gradient on the
  // world size 1 fast path) is kept as it is; a chunk of a larger buffer is
  // aliased (see alias_storage).
  if (reduced.is_view() || reduced.sizes() != c10::IntArrayRef(sharded_shape_)) {
    reduced = alias_storage(reduced, 0, sharded_shape_);
  }
  // The sharded gradient lives on P while sharded, aside while unsharded.
  at::Tensor& target = state_ == ShardedState::kSharded ? param_.mutable_grad() : sharded_grad_;
  if (target.defined()) {
    target.add_(reduced);
  } else {
    target = reduced;
  }
}

void FSDPParam::accumulate_offloaded_grad(const at::Tensor& reduced) {
  // FSDP2 (foreach_reduce): the reduced shard is copied to the host on the
  // stream that produced it. Without pinned memory, or when it is added to a
  // gradient already there (the CPU addition needs its values), the copy
  // blocks the host.
  const at::Tensor grad = reduced.scalar_type() == orig_dtype() ? reduced : reduced.to(orig_dtype());
  at::Tensor& target = state_ == ShardedState::kSharded ? param_.mutable_grad() : sharded_grad_;
  if (target.defined()) {
    wait_for_grad_offload();  // the earlier copy into `target`
    target.add_(host_.copy_of(grad, /*non_blocking=*/false));
    return;
  }
  at::Tensor host = host_.copy_of(grad, /*non_blocking=*/true);
  if (stream_check::active()) stream_check::name_buffer(host, "the host gradient of " + fqn_);
  // An empty shard (more ranks than rows) copied nothing to wait for.
  if (pin_memory_ && grad.numel() > 0) {
    const auto* impl = c10::impl::getDeviceGuardImpl(grad.device().type());
    grad_offload_done_ = DeviceEvent::record(impl->getStream(grad.device()));
  }
  target = std::move(host);
}

void FSDPParam::reset_sharded_param(bool adopt) {
  const bool sharded = state_ == ShardedState::kSharded;
  const at::Tensor& expected = sharded ? sharded_view_ : unsharded_view_;
  if (same_view(param_, expected)) return;
  if (sharded && !adopt) {
    param_.set_data(sharded_view_);
    return;
  }
  const char* how =
      " torch::load, Module::to and Tensor::set_data/set_ do not know about sharding: save and load a sharded model "
      "with fsdp::get_model_state_dict / fsdp::set_model_state_dict (fsdp2/state_dict.h), and move or cast a model "
      "before fully_shard.";
  TORCH_CHECK(sharded, "fsdp2: the data of parameter '", fqn_,
              "' was replaced while it was unsharded; the new values would be dropped at the next reshard.", how);
  TORCH_CHECK(
      param_.sizes() == c10::IntArrayRef(sharded_shape_) && param_.scalar_type() == orig_dtype() &&
          param_.device() == padded_shard_.device(),
      "fsdp2: the data of sharded parameter '", fqn_, "' was replaced: it is now ", param_.sizes(), " ",
      param_.scalar_type(), " on ", param_.device(), ", but this rank's shard is ", c10::IntArrayRef(sharded_shape_),
      " ", orig_dtype(), " on ", padded_shard_.device(), " (of the full shape ", c10::IntArrayRef(unsharded_shape_),
      "). A full-shape value (an unsharded checkpoint) or another device or dtype cannot be used in place.", how);
  // Same shape, dtype and device: new values for this rank's rows (e.g.
  // torch::load of a file that torch::save wrote from this rank's shard).
  c10::NoGradGuard no_grad;
  const at::Tensor replaced = param_.detach();
  sharded_view_.copy_(replaced);
  // The copy runs on the caller's stream (the copy-in stream in an unshard)
  // and the replaced data, made on another, is freed as P lets go of it.
  StreamSet::record_stream(replaced, StreamSet::current_stream_of(padded_shard_.device()));
  param_.set_data(sharded_view_);
}

}  // namespace fsdp::detail
