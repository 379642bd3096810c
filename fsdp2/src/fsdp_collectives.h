// Internal: FSDP2's collectives layer (_fsdp_collectives.py): the foreach
// all-gather of a parameter group's shards, the copy-out of its result into
// the unsharded parameters, and the foreach reduce-scatter of the group's
// gradients, as free functions over explicit inputs; and the communicator's
// own all-gather and reduce-scatter (FSDP2's DefaultAllGather /
// DefaultReduceScatter) behind the interface a custom collective implements
// (fsdp2/custom_collectives.h), so that one path issues both.
//
// The group (fsdp_param_group.cc) decides when, on which streams and over
// which communicator; these functions do the copies and the collective on
// the streams they are given and return what the group must keep alive and
// order (the buffers, the Work, the events). Every stream order the CUDA
// path needs is stated where it is made: here for the copy-in, issue and
// copy-out, in the group for the waits and for the buffers' lifetimes
// ([Note: all-gather output lifetime], [Note: bounded reductions] in
// fsdp_param_group.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include "collectives/communicator.h"
#include "collectives/reduce_op.h"
#include "collectives/work.h"
#include "fsdp2/custom_collectives.h"
#include "fsdp_param.h"
#include "phase_labels.h"
#include "streams.h"

namespace fsdp::detail {

// The communicator's own all-gather (FSDP2's DefaultAllGather):
// at::empty buffers and Communicator::all_gather_into_tensor.
class DefaultAllGather final : public AllGather {
 public:
  collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                               collectives::Communicator& comm) override;
};

// The communicator's own reduce-scatter (FSDP2's DefaultReduceScatter):
// at::empty buffers and Communicator::reduce_scatter_tensor.
class DefaultReduceScatter final : public ReduceScatter {
 public:
  collectives::Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, const collectives::ReduceOp& op,
                                   collectives::Communicator& comm) override;
};

// A user's all-gather as the runtime calls it: allocate's result is checked
// against what was asked (custom_collectives.h's REQUIRES), and an error the
// collective throws is rethrown naming the module. `module_fqn` is the
// group's own field, read at each call (the group learns its FQN at lazy
// init, which may come after the collective was set); it must outlive this.
class UserAllGather final : public AllGather {
 public:
  UserAllGather(std::shared_ptr<AllGather> user, const std::string& module_fqn);
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) override;
  collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                               collectives::Communicator& comm) override;
  int64_t received_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const override;

 private:
  std::shared_ptr<AllGather> user_;  // shared: one object may serve several modules
  const std::string& module_fqn_;
};

// The reduce-scatter counterpart of UserAllGather.
class UserReduceScatter final : public ReduceScatter {
 public:
  UserReduceScatter(std::shared_ptr<ReduceScatter> user, const std::string& module_fqn);
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) override;
  collectives::Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, const collectives::ReduceOp& op,
                                   collectives::Communicator& comm) override;
  int64_t sent_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const override;

 private:
  std::shared_ptr<ReduceScatter> user_;  // shared: one object may serve several modules
  const std::string& module_fqn_;
};

// What a reduce-scatter with `op` really runs on `backend` at `world` ranks,
// for the debug log: Gloo computes AVG and PREMUL_SUM as SUM plus a local
// scaling.
std::string describe_reduce(const collectives::ReduceOp& op, collectives::BackendKind backend, int64_t world);

// Names `t` in stream-order reports ("the all-gather output of 'layers.3'").
// No-op unless a stream_check::Checker is active.
void name_for_stream_check(const at::Tensor& t, const char* what, const std::string& module_fqn);

// A parameter group's shards as its collectives lay them out: the
// parameters in the group's order, each padded shard back to back.
struct ShardLayout {
  std::vector<int64_t> padded_numels;  // each parameter's padded shard numel
  int64_t padded_total = 0;            // their sum: one shard rank's all-gather input
  int64_t world = 1;                   // ranks of the shard group
  bool chunk_cat = false;              // some parameter's chunk_cat() (see [Note: shard dim] in fsdp_param.h)
};

// The all-gather's buffers once the copy-in is enqueued.
struct AllGatherInput {
  at::Tensor output;  // layout.world * layout.padded_total elements
  // This rank's chunk: a view of `output` (NCCL gathers in place), a buffer
  // of its own (Gloo), or the post-forward shard (Gloo after a reshard to a
  // smaller world).
  at::Tensor input;
  DeviceEvent copy_in_done;     // on the copy-in stream, after the copy
  bool separate_input = false;  // `input` is a buffer made on the copy-in stream
};

// all_gather_copy_in
//
// Allocates the all-gather output (layout.world * layout.padded_total
// elements of `options`' dtype on its device) through `all_gather_comm`
// and copies this rank's chunk in: every parameter's padded shard back to
// back, cast to the output's dtype (FSDP2's all_gather_copy_in), or, when
// `post_forward_shard` is defined (the group was resharded to the smaller
// world of `comm` after forward), that shard. On NCCL the chunk is copied
// into the output's own slice (`comm`'s rank), elsewhere into a buffer of
// its own. With `offload_to_cpu` the host shards are copied to the device
// without blocking (pinned memory) and cast there.
// Streams: everything runs on `copy_in_stream` (the current stream when
// unset), labelled kAllGatherCopyIn; `copy_in_done` is recorded there after
// the copy. REQUIRES: the parameters are sharded.
AllGatherInput all_gather_copy_in(const std::vector<std::unique_ptr<FSDPParam>>& params, const ShardLayout& layout,
                                  const at::Tensor& post_forward_shard, const collectives::Communicator& comm,
                                  const at::TensorOptions& options, bool offload_to_cpu,
                                  const std::optional<c10::Stream>& copy_in_stream, AllGather& all_gather_comm,
                                  const PhaseLabels& labels, const std::string& module_fqn);

// An issued all-gather.
struct AllGatherResult {
  at::Tensor output;  // world * sum(padded_shard_numel)
  collectives::Work work;
  DeviceEvent copy_in_done;
  // Where the output (and a separate input) were allocated: the stream the
  // caching allocator gives their blocks back to.
  std::optional<c10::Stream> copy_in_stream;
  std::optional<c10::Stream> all_gather_stream;
  bool async_op = false;
  // The input is a buffer of its own, made on the copy-in stream (Gloo).
  bool separate_input = false;
  // Kept until the wait: a custom all-gather may read it on its stream
  // after the call (Int8AllGather quantizes it on the all-gather stream),
  // where no c10d work holds it.
  at::Tensor input;
};

// foreach_all_gather
//
// Issues the all-gather of a copied-in `input` over `comm` through
// `all_gather_comm` (FSDP2's foreach_all_gather, after its copy-in).
// Streams: `all_gather_stream` (the current one when unset) first waits
// for the copy-in's event, then the collective is issued with it current.
// The result holds the output, the input and the Work until the group
// waits (wait_for_unshard) or discards it.
AllGatherResult foreach_all_gather(AllGatherInput input, collectives::Communicator& comm,
                                   const std::optional<c10::Stream>& all_gather_stream, AllGather& all_gather_comm);

// foreach_all_gather_copy_out
//
// Copies the gathered rows of `output` (layout.world * layout.padded_total
// elements, rank-major) into every parameter's unsharded buffer (FSDP2's
// foreach_all_gather_copy_out, without its wait): one
// split_with_sizes_copy for dim-0 shards, one copy per parameter when some
// parameter is sharded on another dim (chunk_cat). Runs on the current
// stream, labelled kAllGatherCopyOut. REQUIRES: the all-gather is complete
// on the current stream.
void foreach_all_gather_copy_out(const at::Tensor& output, const std::vector<std::unique_ptr<FSDPParam>>& params,
                                 const ShardLayout& layout, const PhaseLabels& labels);

// An issued reduce-scatter.
struct ReduceScatterResult {
  at::Tensor input;   // {world, total}, made on the current stream
  at::Tensor output;  // this rank's padded chunks, one per parameter, made on `stream`
  collectives::Work work;
  std::optional<c10::Stream> stream;  // the reduce-scatter stream
};

// foreach_reduce
//
// Reduce-scatters `grads` (each the full unsharded gradient of the
// parameter at the same index of `params`) over `comm` with `op` through
// `reduce_scatter_comm` (the issuing half of FSDP2's foreach_reduce; the
// group completes it in wait_for_post_backward). The copy-in, on the
// current stream and labelled kReduceScatterCopyIn, concatenates every
// rank's rows of every gradient into one input of `reduce_dtype`
// (_chunk_cat, casting as it copies), frees the gradients and divides the
// input by `pre_divide` unless it is 1. Then `streams.reduce_scatter()`
// waits for the current stream, and with it current the output is
// allocated and the collective issued (labelled kReduceScatter).
// `world` is the shard group's size.
ReduceScatterResult foreach_reduce(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> grads, int64_t world,
                                   c10::ScalarType reduce_dtype, const collectives::ReduceOp& op, double pre_divide,
                                   collectives::Communicator& comm, ReduceScatter& reduce_scatter_comm,
                                   const StreamSet& streams, const PhaseLabels& labels, const std::string& module_fqn);

}  // namespace fsdp::detail
