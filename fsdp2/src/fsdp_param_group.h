// Internal: FSDPParamGroup, the parameters of one fully_shard call, gathered
// with one all-gather and reduced with one reduce-scatter (FSDP2's
// FSDPParamGroup), and FSDPCommContext, what the groups under one root share.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "collectives/work.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/custom_collectives.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp_collectives.h"
#include "fsdp_param.h"
#include "phase_labels.h"
#include "streams.h"

namespace fsdp::detail {

enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

class FSDPParamGroup;
class FSDPState;

// Shared by all groups under one root (FSDP2's FSDPCommContext).
struct FSDPCommContext {
  explicit FSDPCommContext(c10::Device device) : streams(device) {}
  StreamSet streams;
  RuntimeStats stats;
  // Groups in the order their post-forward ran, for implicit backward
  // prefetch (each backward prefetches the group that ran before it).
  std::vector<FSDPParamGroup*> post_forward_order;
  // [Note: all-gather output lifetime] The last all-gather output copied out
  // in forward and the event after its copy-out (FSDP2's all_gather_state),
  // CUDA only. Forward all-gathers are pipelined two deep, as in FSDP2:
  //   - group i's output (allocated on the copy-in stream) is kept after its
  //     copy-out, which runs on the current stream, until group i+1's
  //     wait_for_unshard; there, before group i+1's copy-out, both
  //     all-gather streams wait for group i's copy-out event and the output
  //     is dropped. The caching allocator reuses a block freed on the
  //     copy-in stream only for work enqueued later on that stream, which
  //     now comes after group i's copy-out read it.
  //   - group i+1's copy-in was enqueued at its unshard, before that wait,
  //     so it waits only for group i-1's copy-out (the wait made at group
  //     i's wait_for_unshard), not for group i's: on the device, group
  //     i+1's all-gather may run while group i's copy-out and compute (and
  //     the end of group i-1's) still run on the current stream.
  //   - without explicit forward prefetch, at most two all-gather outputs
  //     are alive in forward (group i's, held, and group i+1's, in flight):
  //     group i+2's copy-in is enqueued after group i+1's wait_for_unshard
  //     freed group i's. (Freeing at the next copy-in instead, as before,
  //     held one output less there but serialized the all-gathers behind
  //     the copy-outs.)
  // Backward and explicit unshards (async_op) free their output after their
  // own copy-out. Released at the root's post-forward and when backward
  // starts. On CPU (no streams) the output is freed after its copy-out and
  // the forward pipelining is the implicit forward prefetch instead (see
  // [Note: implicit forward prefetch] in fsdp_state.h).
  at::Tensor last_all_gather_output;
  DeviceEvent last_all_gather_done;
  // The streams of a group's all-gather copy-in and collective (FSDP2's
  // get_all_gather_streams): the all-gather streams for the implicit
  // prefetch in forward and backward, so that the collective overlaps
  // compute; the caller's current stream for an explicit unshard
  // (`async_op`) and outside forward and backward. Unset on CPU.
  struct AllGatherStreams {
    std::optional<c10::Stream> copy_in;
    std::optional<c10::Stream> all_gather;
  };
  AllGatherStreams all_gather_streams(bool async_op, TrainingState training_state) const;
  // Makes the all-gather streams wait for the last forward copy-out and
  // frees its all-gather output. No-op when none is held.
  void release_all_gather_state();

  // [Note: bounded reductions] At most K + 1 groups' unreduced gradients are
  // alive: the group in post-backward and the K before it, K being
  // set_reduce_scatter_max_input_buffers (1 by default, FSDP2's "cap-K").
  // CUDA (FSDP2's reduce_scatter_states): the reduce-scatter input is made
  // from the gradients on the current stream; before the next group's
  // copy-in, while K inputs are kept, the current stream waits for the
  // oldest one's reduce-scatter and that input is freed. A larger K lets the
  // copy-in take a fresh block instead of waiting for an exposed
  // reduce-scatter, at the price of K inputs of memory. Gloo: the oldest
  // group's reduce-scatter is completed (waited, divided, its gradients
  // set, its input freed) before the next one is issued.
  struct ReduceScatterState {
    at::Tensor input;
    DeviceEvent done;                 // CUDA: on the reduce-scatter stream, after the collective
    FSDPParamGroup* group = nullptr;  // CPU: the group whose reduce-scatter is not completed yet
  };
  std::deque<ReduceScatterState> reduce_scatter_states;
  // Completes the oldest reduce-scatters (waits on the host on CPU, makes
  // the current stream wait on CUDA) and frees their inputs until at most
  // `keep` remain.
  void wait_for_reduce_scatters(size_t keep);
  void wait_for_last_reduce_scatter() { wait_for_reduce_scatters(0); }
  // Drops `group`'s entry once its reduce-scatter was completed elsewhere.
  void forget_reduce_scatter(const FSDPParamGroup* group);
  // Every state of the trees sharing this context (one root's, or several
  // after share_comm_ctx), for the effective K: the largest of their
  // groups' settings, as FSDP2 resolves it (a group with a smaller K must
  // not undo another's retention). Cached until a setting changes.
  std::vector<std::weak_ptr<FSDPState>> states;
  int max_input_buffers();
  void invalidate_max_input_buffers() { max_input_buffers_ = 0; }

 private:
  int max_input_buffers_ = 0;  // 0: to be computed
};

// A reduce-scatter issued in post-backward, completed later (see
// FSDPParamGroup::wait_for_post_backward).
struct PendingReduce {
  collectives::Work work;
  at::Tensor output;  // this rank's padded chunks, one per parameter in `params`
  std::vector<FSDPParam*> params;
  collectives::ReduceOp all_reduce_op = collectives::ReduceOp::sum();
  double post_divide = 1.0;
  bool all_reduce = true;  // HSDP: set_requires_all_reduce when it was issued
  std::optional<c10::Stream> stream;
};

// Options a user can change on an FSDPModule after fully_shard.
struct GroupSettings {
  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  bool reduce_grads = true;      // set_requires_gradient_sync
  bool all_reduce_grads = true;  // set_requires_all_reduce (HSDP)
  bool unshard_in_backward = true;
  std::optional<double> gradient_divide_factor;
  bool force_sum_reduction = false;
  std::function<void(at::Tensor&)> reduced_grad_hook;
  std::optional<c10::Stream> reduced_grad_hook_stream;
  // set_reduce_scatter_unused_params: parameters that require a gradient and
  // got none in this backward are reduced as zeros.
  bool reduce_scatter_unused_params = false;
  // set_reduce_scatter_max_input_buffers (see [Note: bounded reductions]).
  int reduce_scatter_max_input_buffers = 1;
  // set_separate_reduce_scatter_group: the communicator of the
  // reduce-scatter, over the shard group's ranks; null: the shard group's.
  std::shared_ptr<collectives::Communicator> reduce_scatter_comm;
};

// How a group's gradients are reduced (FSDP2's _get_gradient_divide_factors):
// the collectives' ops and the divisions done before and after them, so that
// gradients are averaged over the data-parallel world (or divided by the
// divide factor). fp32 and bf16 use the collectives' own AVG / PREMUL_SUM;
// other dtypes (fp16) sum with a division split around the collective to
// avoid overflow; a data-parallel world of one sums (NCCL's AVG at one rank
// is unreliable, pytorch#144045).
struct ReduceOps {
  collectives::ReduceOp reduce_scatter = collectives::ReduceOp::sum();
  collectives::ReduceOp all_reduce = collectives::ReduceOp::sum();
  double pre_divide = 1.0;
  double post_divide = 1.0;
};
// `replicate_size` is 1 without HSDP.
ReduceOps gradient_reduce_ops(int64_t shard_size, int64_t replicate_size, c10::ScalarType reduce_dtype,
                              std::optional<double> divide_factor, bool force_sum);

// [Note: world size 1 fast path] A group whose shard group has one rank
// (FSDP at world size 1, HSDP with shard size 1), whose parameters all have
// param_dtype and reduce_dtype as their own dtype and live on the compute
// device, skips what a one-rank all-gather and reduce-scatter would only
// copy: each parameter's unsharded view is its shard (see the note in
// fsdp_param.h), unshard and reshard switch views, and post-backward takes
// the gradients autograd accumulated as the reduce-scatter's output,
// scaled in place as the reduce-scatter and the divisions around it would
// scale them (at a data-parallel world of one: not at all). With an HSDP
// all-reduce or an all-reduce hook, which see the group's gradients as one
// tensor, they are first copied into one buffer (the copy-in at one rank)
// and the reduction goes on as on the general path. No all-gather or
// reduce-scatter is counted in RuntimeStats. A group with a custom all-gather
// or reduce-scatter (custom_collectives.h) does not take it: the custom
// collectives run at one rank too.
class FSDPParamGroup {
 public:
  // `mesh` is 1-D (FSDP) or 2-D (replicate, shard) for HSDP.
  // `post_forward_comm`, when set, is the group of consecutive shard ranks to
  // reshard to after forward (reshard_after_forward = k). `offload_policy`:
  // see OffloadPolicy (the caller checked that `device` is not the CPU).
  // `shard_dims`: each parameter's normalized shard dim (see [Note: shard
  // dim] in fsdp_param.h); empty means dim 0 for all.
  FSDPParamGroup(std::vector<at::Tensor> params, std::vector<std::string> param_names, DeviceMesh mesh,
                 c10::Device device, const MixedPrecisionPolicy& mp_policy,
                 std::shared_ptr<collectives::Communicator> post_forward_comm, const OffloadPolicy& offload_policy = {},
                 const std::vector<int64_t>& shard_dims = {});
  FSDPParamGroup(const FSDPParamGroup&) = delete;
  FSDPParamGroup& operator=(const FSDPParamGroup&) = delete;

  // Set at the root's lazy init. `group_index`: this group's index in its
  // state when the state has several groups (per-parameter meshes), named
  // with its shard mesh in the phase labels; -1 when it is the only one.
  void lazy_init(FSDPCommContext* comm_ctx, std::string module_fqn, int group_index = -1);
  bool initialized() const { return comm_ctx_ != nullptr; }
  // share_comm_ctx: the context of the roots this group's root now shares.
  void set_comm_context(FSDPCommContext* comm_ctx) { comm_ctx_ = comm_ctx; }
  FSDPCommContext* comm_context() const { return comm_ctx_; }
  // The communicator of the shard mesh dim (all-gather and, unless
  // separated, reduce-scatter).
  const std::shared_ptr<collectives::Communicator>& shard_comm() const { return shard_comm_; }
  const std::string& module_fqn() const { return module_fqn_; }
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  GroupSettings& settings() { return settings_; }
  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState s) { training_state_ = s; }
  bool is_unsharded() const { return sharded_state_ == ShardedState::kUnsharded; }
  bool is_sharded() const { return sharded_state_ == ShardedState::kSharded; }
  bool has_post_forward_comm() const { return post_forward_comm_ != nullptr; }
  void clear_post_forward_comm() { post_forward_comm_ = nullptr; }
  const DeviceMesh& mesh() const { return mesh_; }
  c10::Device device() const { return device_; }
  // The shards and sharded gradients live in host memory (OffloadPolicy).
  bool offload_to_cpu() const { return offload_to_cpu_; }
  // Blocks the host until no copy between the host shards (or sharded
  // gradients) and the device is in flight, so that the host may write them.
  // No-op without offload.
  void wait_for_offload_copies();

  // Issues the all-gather (copy-in, collective). No-op when unsharded or
  // already issued. `async_op`: issued for a later wait (explicit prefetch).
  void unshard(bool async_op);
  // Waits for the issued all-gather, copies out, and points every parameter
  // at its unsharded view. No-op when already unsharded.
  void wait_for_unshard();
  // Frees the unsharded parameters (honours reshard_after_forward in forward).
  void reshard();
  // Whether an all-gather was issued and not yet waited for.
  bool has_pending_all_gather() const { return all_gather_.has_value(); }
  // Waits for an issued all-gather that nothing will wait for (a forward
  // prefetch of a module that did not run) and drops its output; the group
  // stays sharded, so its next unshard gathers the shards as they are then.
  // No-op when none is pending.
  void discard_all_gather();

  void pre_forward(TensorRefs& inputs);
  void post_forward();
  void pre_backward(bool default_prefetch);
  void post_backward();
  void finalize_backward();
  // Drops every in-flight operation and per-iteration state (after an
  // exception mid-step): waits for issued collectives, reshards, and clears
  // unreduced gradients.
  void reset_iter_state();
  // Completes a pending reduce-scatter: waits, divides, runs the hook and
  // adds the result to the sharded gradients.
  void wait_for_post_backward();

  // Custom collectives (fsdp2/custom_collectives.h); null restores the
  // communicator's own. A group with either leaves the world size 1 fast
  // path (see the note above), and returns to it when both are null again.
  // REQUIRES: the group is idle and sharded, with no collective in flight
  // (FSDPModule::set_custom_* checks it and names the module).
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);
  bool has_pending_reduce() const { return pending_reduce_.has_value(); }

  int64_t unsharded_storage_bytes() const;
  // This group's label for `phase` (see phase_labels.h).
  const std::string& phase_label(Phase phase) const { return phase_labels_[phase]; }
  // See [Note: world size 1 fast path].
  bool fast_path() const { return fast_path_; }

 private:
  void to_sharded();
  void to_sharded_post_forward();
  void to_unsharded();
  void backward_prefetch();
  void register_post_backward(TensorRefs& inputs);
  ReduceOps reduce_ops() const;
  // Post-backward: the unsharded gradients to reduce, taken off the
  // parameters (see post_backward), with their parameters.
  struct GradsToReduce {
    std::vector<FSDPParam*> params;
    std::vector<at::Tensor> grads;
  };
  GradsToReduce take_grads_to_reduce(bool reduce_unused, bool unsharded);
  // Fast path: the one-rank reduce-scatter of `grads` done in place.
  void reduce_in_place(std::vector<FSDPParam*>& params, std::vector<at::Tensor>& grads, const ReduceOps& ops);

  // Recomputes fast_path_ from fast_path_eligible_ and the custom
  // collectives, switching the parameters' unsharded views.
  void update_fast_path();
  // The all-gather and reduce-scatter this group issues (FSDP2's
  // _all_gather_comm / _reduce_scatter_comm): the communicator's own
  // (DefaultAllGather, DefaultReduceScatter) or the user's, checked and
  // named (UserAllGather, UserReduceScatter; fsdp_collectives.h).
  std::unique_ptr<AllGather> all_gather_comm_ = std::make_unique<DefaultAllGather>();
  std::unique_ptr<ReduceScatter> reduce_scatter_comm_ = std::make_unique<DefaultReduceScatter>();
  bool custom_all_gather_ = false;
  bool custom_reduce_scatter_ = false;
  bool fast_path_eligible_ = false;  // see [Note: world size 1 fast path]

  std::vector<std::unique_ptr<FSDPParam>> params_;
  DeviceMesh mesh_;
  std::shared_ptr<collectives::Communicator> shard_comm_;
  std::shared_ptr<collectives::Communicator> replicate_comm_;  // HSDP only
  std::shared_ptr<collectives::Communicator> post_forward_comm_;
  at::Tensor post_forward_shard_;     // kShardedPostForward: this rank's 1/k of the all-gather output
  at::Tensor partial_reduce_output_;  // HSDP without all-reduce: summed reduce-scatter outputs
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  c10::Device device_;
  bool offload_to_cpu_ = false;
  // Offload: after the last host-to-device copy-in of the shards.
  DeviceEvent offload_copy_in_done_;
  ShardLayout layout_;
  std::string module_fqn_;
  PhaseLabels phase_labels_;
  bool fast_path_ = false;  // see [Note: world size 1 fast path]
  FSDPCommContext* comm_ctx_ = nullptr;
  GroupSettings settings_;
  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kSharded;
  std::optional<AllGatherResult> all_gather_;
  std::vector<size_t> post_forward_indices_;
  std::optional<PendingReduce> pending_reduce_;
  DeviceEvent post_reduce_done_;
  // kShardedPostForward: post_forward_shard_ was made on the current stream
  // and is read by the next copy-in on another stream (seed 003's
  // _reshard_after_forward_event).
  DeviceEvent reshard_after_forward_done_;
  // Lets the post-backward autograd node find this group while it lives.
  std::shared_ptr<FSDPParamGroup*> self_ref_;
};

}  // namespace fsdp::detail
