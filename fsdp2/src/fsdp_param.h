// Internal: FSDPParam, the owner of one parameter's shard (FSDP2's FSDPParam).
//
// [Note: one parameter object] LibTorch modules cannot swap a registered
// parameter (DESIGN.md section 4), so unlike FSDP2 there is no separate
// sharded and unsharded parameter object: the module's parameter P changes in
// place with Tensor::set_data, which keeps P's autograd meta, version counter,
// .grad and hooks. Its data is
//   SHARDED               a view of this rank's rows of the padded shard;
//   UNSHARDED             a full-shape view of the all-gather output buffer.
//
// [Note: storage freed in place] The all-gather output buffer is one tensor
// made once; its StorageImpl is freed and re-allocated in place (never
// replaced). Autograd saves P itself (unpacked as P's data at backward time)
// and views of P (weight.t()) that hold the buffer's StorageImpl: freeing it
// after forward really releases the memory, and re-filling it before backward
// makes every saved view see the gathered values again (FSDP2's
// "[Note: FSDP and autograd]").
//
// [Note: gradients] During backward P.grad is the full gradient autograd
// accumulates. A sharded gradient from an earlier backward (gradient
// accumulation with sync) is moved aside whenever P is unsharded, so autograd
// never sees a sharded .grad on a full-shape P, and is put back (with the new
// reduced gradient added) when P is sharded again.
//
// [Note: world size 1 fast path] When the shard group has one rank and no
// dtype is cast (FSDPParamGroup decides, see fsdp_param_group.h), the padded
// shard has no padding and holds the whole parameter, so
// share_shard_as_unsharded() makes the unsharded view a full-shape view of
// the shard itself: no all-gather output buffer is ever allocated,
// to_unsharded/to_sharded leave P as it is (the sharded and unsharded views
// are the same view; no copy, no storage freed, no set_data), and the
// gradient autograd accumulates is already this rank's sharded gradient (it
// becomes P's sharded .grad as it is, without an alias). The gradient
// bookkeeping above is unchanged, so gradients, accumulation and hooks
// behave exactly as on the all-gather path. One difference shows: an
// in-place change to the unsharded parameter (under no_grad) writes the
// shard, where the all-gather path drops it at reshard.
//
// [Note: shard dim] A parameter may be sharded on a dim d other than 0
// (FullyShardOptions::shard_placement_fn): rank r holds torch.chunk(P, world,
// d)[r], possibly empty. Its padded shard starts with that chunk, contiguous
// in its own shape, then zeros up to the numel of the largest chunk, so the
// sharded P and its sharded gradient are contiguous prefixes of the shard
// exactly as for dim 0, and the all-gather is unchanged. What differs is the
// unsharded side: a gathered row of rank r is not a block of the full
// parameter, so the copy-out concatenates the ranks' chunks along d into the
// unsharded buffer (copy_out_chunks; the buffer then holds only the full
// parameter), and the gradient is split along d into padded rows for the
// reduce-scatter (padded_chunks). At one shard rank the chunk is the whole
// parameter and both layouts agree: d is then only the placement state
// dicts report (chunk_cat() is false), and the fast path below applies.
//
// [Note: mixed precision] With a param_dtype, the unsharded view is in that
// dtype and set_data switches P's dtype with its state. set_data to another
// dtype drops P's AccumulateGrad node, which is harmless here: fsdp2 hooks
// module inputs and outputs, never the node, and a new node is made (at the
// full shape, in param_dtype) at the next use of the unsharded P.
//
// [Note: CPU offload] With OffloadPolicy::offload_to_cpu the padded shard
// (and so the sharded P, its sharded .grad and the optimizer state) is in
// host memory, pinned when asked, while the all-gather output buffer is on the
// device: P moves between the host and the device with set_data, which, as
// for a dtype change, drops P's AccumulateGrad node (harmless, see above).
// The group copies the shard to the device before the all-gather;
// accumulate_sharded_grad copies the reduced gradient back to the host
// without blocking when the memory is pinned and records an event, which
// wait_for_grad_offload (end of backward, post-accumulate-grad hooks, the
// next accumulation) blocks on.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/autograd/function_hook.h>

#include "fsdp2/fully_shard.h"
#include "host_memory.h"
#include "streams.h"

namespace fsdp::detail {

// A group's state; a parameter is only ever kSharded or kUnsharded (in
// kShardedPostForward its parameters are sharded and the group keeps a
// second, larger shard for the next all-gather).
enum class ShardedState { kSharded, kShardedPostForward, kUnsharded };

class FSDPParam {
 public:
  // Shards `param` (full, on its final device) for `shard_rank` of
  // `shard_world_size` ranks: copies this rank's rows into a zero-padded shard
  // and points the parameter at them.
  // The unsharded parameter (all-gather output) is in `param_dtype`, which
  // may differ from the parameter's own dtype (mixed precision).
  // With `offload.offload_to_cpu` the shard is kept in host memory (pinned
  // when offload.pin_memory) and the unsharded buffer is made on `device`
  // (the param may then be on the CPU or on `device`); otherwise both are on
  // the parameter's device and `device` is unused.
  FSDPParam(at::Tensor param, std::string fqn, int64_t shard_rank, int64_t shard_world_size,
            c10::ScalarType param_dtype, const OffloadPolicy& offload = {},
            std::optional<c10::Device> device = std::nullopt, int64_t shard_dim = 0);

  const at::Tensor& param() const { return param_; }
  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn);
  ShardedState state() const { return state_; }
  // The sharded gradient: the parameter's .grad while sharded, the copy kept
  // aside while the group stays unsharded after backward
  // (reshard_after_backward false). Undefined before the first reduction.
  const at::Tensor& sharded_grad() const { return state_ == ShardedState::kSharded ? param_.grad() : sharded_grad_; }

  // The tensor dim the parameter is sharded on (normalized, 0 for a 0-dim
  // parameter); see [Note: shard dim].
  int64_t shard_dim() const { return shard_dim_; }
  // The unsharded parameter is assembled by copy_out_chunks and the gradient
  // split by padded_chunks instead of the dim-0 row layout: shard_dim() != 0
  // and more than one shard rank.
  bool chunk_cat() const { return chunk_cat_; }
  // Elements of this parameter in each rank's all-gather input (the padded
  // shard): the numel of the largest torch.chunk of the shard dim, i.e.
  // ceil(size(d) / world) * numel / size(d).
  int64_t padded_shard_numel() const { return padded_shard_numel_; }
  const std::vector<int64_t>& unsharded_shape() const { return unsharded_shape_; }
  const std::vector<int64_t>& sharded_shape() const { return sharded_shape_; }
  int64_t unsharded_numel() const { return unsharded_numel_; }
  // This rank's padded shard (1-D, padded_shard_numel() elements).
  const at::Tensor& padded_shard() const { return padded_shard_; }
  int64_t shard_world_size() const { return world_size_; }
  int64_t shard_rank() const { return rank_; }
  // This rank's unpadded rows of padded_shard() in the sharded shape: what P
  // is while sharded, and what state dicts expose.
  const at::Tensor& sharded_view() const { return sharded_view_; }
  // The dtype of the sharded parameter, its gradient and the optimizer.
  c10::ScalarType orig_dtype() const { return padded_shard_.scalar_type(); }
  // The dtype of the unsharded parameter.
  c10::ScalarType param_dtype() const { return unsharded_buffer_.scalar_type(); }
  // See [Note: CPU offload]. pin_memory() is false without offload.
  bool offload_to_cpu() const { return offload_to_cpu_; }
  bool pin_memory() const { return pin_memory_; }
  // Blocks the host until the last non-blocking copy of a reduced gradient
  // into this parameter's host gradient finished. No-op when none is pending.
  void wait_for_grad_offload();

  // Allocates the all-gather output buffer's storage (no-op when allocated)
  // and returns it viewed as (world, padded_shard_numel) for the copy-out.
  // REQUIRES: !chunk_cat().
  at::Tensor alloc_all_gather_output_rows();
  // [Note: shard dim] Allocates the buffer's storage and fills the unsharded
  // parameter from `rows`, the gathered padded shards (world,
  // padded_shard_numel; each row contiguous), by one concatenation along the
  // shard dim. REQUIRES: chunk_cat().
  void copy_out_chunks(const at::Tensor& rows);
  // The padded shards of ranks [first, first + count) cut from `full` (the
  // unsharded shape, any dtype and device) as (count, padded_shard_numel)
  // rows in its dtype, padding zeroed: the reduce-scatter input of a
  // gradient. REQUIRES: chunk_cat().
  at::Tensor padded_chunks(const at::Tensor& full, int64_t first, int64_t count) const;
  // The all-gather input rows of ranks [first, first + count) while
  // unsharded: the all-gather output itself for dim 0, cut from the
  // unsharded parameter otherwise (reshard_after_forward = k).
  at::Tensor post_forward_rows(int64_t first, int64_t count);
  // Frees the buffer's storage in place (see the note above).
  void free_unsharded_storage();
  // Bytes held by the unsharded storage now (0 when freed). On the fast path
  // the unsharded parameter is the shard: its bytes while unsharded, else 0.
  int64_t unsharded_storage_bytes() const;

  // [Note: world size 1 fast path] From now on the unsharded parameter is the
  // shard itself. REQUIRES: sharded, one shard rank, param_dtype() ==
  // orig_dtype().
  void share_shard_as_unsharded();
  // Undoes share_shard_as_unsharded(): the unsharded parameter is the
  // all-gather output again (a group that got a custom collective).
  // REQUIRES: sharded.
  void unshare_shard();
  bool shard_is_unsharded() const { return shard_is_unsharded_; }

  // Points P at the full-shape view of the (filled) buffer.
  void to_unsharded();
  // Points P at the shard and frees the buffer.
  void to_sharded();

  // Takes the gradient autograd accumulated on P in this backward (undefined
  // when none): P.grad while unsharded; while sharded (a group not unsharded
  // in backward), the full-shape .grad autograd set on the sharded P, after
  // which the sharded .grad kept aside by stash_sharded_grad is put back.
  at::Tensor take_autograd_grad();
  // The no-sync accumulated gradient plus `grad` (either may be undefined);
  // nothing is kept afterwards.
  at::Tensor take_unsharded_grad(at::Tensor grad);
  // No-sync mode: keeps `grad` (a full gradient) aside, summed over
  // micro-batches in `reduce_dtype` (seed 001 to_accumulated_grad_if_needed),
  // until a backward that reduces.
  void accumulate_unsharded_grad(at::Tensor grad, c10::ScalarType reduce_dtype);
  // Adds a reduced gradient (this rank's padded chunk, padded_shard_numel()
  // contiguous elements of any shape and dtype) to the sharded gradient, in
  // orig_dtype(); a non-view tensor already in the sharded shape and dtype
  // becomes the sharded gradient itself, any other is aliased. Offload:
  // the chunk is on the device and is copied to the host on the current
  // stream (see [Note: CPU offload]).
  void accumulate_sharded_grad(const at::Tensor& reduced_padded_chunk);
  // Runs P's post-accumulate-grad hooks with the sharded gradient (deferred
  // to the next reshard while P is unsharded). While P holds full gradients
  // (unsharded, or in a backward that does not unshard it) its hooks are kept
  // aside so that autograd's AccumulateGrad does not run them.
  void run_post_accumulate_grad_hooks();
  // For a backward that keeps P sharded: moves P's sharded .grad (and its
  // post-accumulate-grad hooks) aside so that autograd accumulates a fresh
  // full gradient into P; take_autograd_grad puts them back.
  void stash_sharded_grad_for_backward();

  // [Note: replaced parameter data] torch::load (InputArchive::read does
  // P.set_(loaded)), Module::to and set_data can point P away from the shard
  // that the all-gather reads, which would silently drop the new values at
  // the next unshard. Called before the shard is read (copy-in, state
  // dicts): when P no longer views its shard but still has the sharded
  // shape, dtype and device, its values are copied into the shard and P is
  // pointed back (FSDP2's reset_sharded_param); otherwise it throws naming
  // the parameter and fsdp::set_model_state_dict. With `adopt` false (a
  // load is about to overwrite the shard) P is pointed back whatever its
  // data became. Cheap when nothing changed (a few comparisons).
  void reset_sharded_param(bool adopt = true);

 private:
  void stash_sharded_grad();
  // See [Note: full gradients on a sharded parameter] in fsdp_param.cc.
  void point_at_gapped_copy();
  void restore_sharded_grad();
  void accumulate_offloaded_grad(const at::Tensor& reduced);
  void hide_post_accumulate_grad_hooks();
  // Names the shard and the unsharded storage in stream-order reports
  // (stream_check.h) when the checker is active.
  void name_buffers_for_stream_check() const;
  void restore_post_accumulate_grad_hooks();

  at::Tensor param_;  // P, the module's registered parameter
  std::string fqn_;
  int64_t rank_;
  int64_t world_size_;
  int64_t shard_dim_ = 0;
  bool chunk_cat_ = false;  // see [Note: shard dim]
  std::vector<int64_t> unsharded_shape_;
  std::vector<int64_t> sharded_shape_;
  int64_t unsharded_numel_;
  int64_t padded_shard_numel_;
  at::Tensor padded_shard_;  // this rank's rows, zero-padded, 1-D
  at::Tensor sharded_view_;  // padded_shard_ rows as P's sharded shape
  // world * padded_shard_numel_ (unsharded_numel_ when chunk_cat_),
  // storage freed while sharded
  at::Tensor unsharded_buffer_;
  at::Tensor unsharded_view_;              // unsharded_buffer_ prefix as P's full shape
  at::Tensor sharded_grad_;                // a sharded .grad kept aside while unsharded
  at::Tensor unsharded_accumulated_grad_;  // no-sync accumulation
  // The sharded .grad was stashed by a backward that keeps P sharded.
  bool grad_stashed_while_sharded_ = false;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> post_acc_grad_hooks_aside_;
  bool post_acc_grad_hooks_pending_ = false;
  bool shard_is_unsharded_ = false;  // see [Note: world size 1 fast path]
  ShardedState state_ = ShardedState::kSharded;
  bool offload_to_cpu_ = false;
  bool pin_memory_ = false;
  HostMemory host_;                // offload's host memory (host_memory.h)
  DeviceEvent grad_offload_done_;  // after the last non-blocking gradient copy to the host
};

}  // namespace fsdp::detail
