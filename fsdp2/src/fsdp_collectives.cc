#include "fsdp_collectives.h"

#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "fsdp_common/logging.h"
#include "phase.h"
#include "stream_check/stream_check.h"

namespace fsdp::detail {

// ---- The communicator's own collectives, and a user's, checked ----

collectives::Work DefaultAllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                                               collectives::Communicator& comm) {
  return comm.all_gather_into_tensor(output, input);
}

collectives::Work DefaultReduceScatter::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                                       const collectives::ReduceOp& op,
                                                       collectives::Communicator& comm) {
  return comm.reduce_scatter_tensor(output, input, op);
}

namespace {

std::string group_label(const std::string& module_fqn) {
  return module_fqn.empty() ? "the root module" : "module '" + module_fqn + "'";
}

void check_custom_buffer(const at::Tensor& t, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device,
                         const char* what, const std::string& module_fqn) {
  const int64_t numel = sizes.front();
  TORCH_CHECK(t.defined() && t.dim() == 1 && t.numel() == numel && t.scalar_type() == dtype && t.device() == device &&
                  t.is_contiguous(),
              "fsdp2: ", group_label(module_fqn), ": the custom ", what, "'s allocate returned ",
              t.defined() ? "a tensor of shape " + c10::str(t.sizes()) + ", " + c10::toString(t.scalar_type()) +
                                " on " + t.device().str() + (t.is_contiguous() ? "" : ", not contiguous")
                          : std::string("an undefined tensor"),
              "; expected a contiguous tensor of shape [", numel, "], ", c10::toString(dtype), " on ", device,
              ". allocate must return a buffer of exactly the sizes, dtype and device it is given");
}

// A user collective's allocate, its result checked.
template <typename Collective>
at::Tensor allocate_checked(Collective& user, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device,
                            const char* what, const std::string& module_fqn) {
  at::Tensor buffer = user.allocate(sizes, dtype, device);
  check_custom_buffer(buffer, sizes, dtype, device, what, module_fqn);
  return buffer;
}

// A user collective's call, its error rethrown naming the module.
template <typename Call>
collectives::Work issue_named(const Call& call, const char* what, const collectives::Communicator& comm,
                              const std::string& module_fqn) {
  try {
    return call();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp2: ", group_label(module_fqn), ": the custom ", what, " failed on ", comm.name(), ": ",
                e.what_without_backtrace());
  }
}

}  // namespace

UserAllGather::UserAllGather(std::shared_ptr<AllGather> user, const std::string& module_fqn)
    : user_(std::move(user)), module_fqn_(module_fqn) {}

at::Tensor UserAllGather::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
  return allocate_checked(*user_, sizes, dtype, device, "all-gather", module_fqn_);
}

collectives::Work UserAllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                                            collectives::Communicator& comm) {
  return issue_named([&] { return user_->all_gather(output, input, comm); }, "all-gather", comm, module_fqn_);
}

int64_t UserAllGather::received_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const {
  return user_->received_bytes(input_numel, dtype, world_size);
}

UserReduceScatter::UserReduceScatter(std::shared_ptr<ReduceScatter> user, const std::string& module_fqn)
    : user_(std::move(user)), module_fqn_(module_fqn) {}

at::Tensor UserReduceScatter::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
  return allocate_checked(*user_, sizes, dtype, device, "reduce-scatter", module_fqn_);
}

collectives::Work UserReduceScatter::reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                                    const collectives::ReduceOp& op, collectives::Communicator& comm) {
  return issue_named([&] { return user_->reduce_scatter(output, input, op, comm); }, "reduce-scatter", comm,
                     module_fqn_);
}

int64_t UserReduceScatter::sent_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const {
  return user_->sent_bytes(input_numel, dtype, world_size);
}

std::string describe_reduce(const collectives::ReduceOp& op, collectives::BackendKind backend, int64_t world) {
  if (backend != collectives::BackendKind::kGloo) return op.to_string();
  switch (op.kind()) {
    case collectives::ReduceOp::Kind::kAvg: return "SUM, then a local division by " + std::to_string(world);
    case collectives::ReduceOp::Kind::kPremulSum: return "SUM, then a local " + op.to_string();
    default: return op.to_string();
  }
}

void name_for_stream_check(const at::Tensor& t, const char* what, const std::string& module_fqn) {
  if (!stream_check::active()) return;
  stream_check::name_buffer(t, std::string(what) + " of " + (module_fqn.empty() ? "the root" : "'" + module_fqn + "'"));
}

// ---- All-gather ----

namespace {

// Copies every parameter's padded shard into its slice of `input`, cast to
// input's dtype.
void copy_in_shards(const std::vector<std::unique_ptr<FSDPParam>>& params, const ShardLayout& layout,
                    const at::Tensor& input, bool offload_to_cpu) {
  const c10::Device device = input.device();
  const c10::ScalarType param_dtype = input.scalar_type();
  std::vector<at::Tensor> sources;
  sources.reserve(params.size());
  for (const auto& p : params) {
    p->reset_sharded_param();  // see [Note: replaced parameter data]
    if (offload_to_cpu && p->orig_dtype() != param_dtype) {
      // Cast on the device, not on the host.
      sources.push_back(p->padded_shard().to(device, /*non_blocking=*/true));
      continue;
    }
    // Mixed precision: _foreach_copy_ casts the shard to param_dtype as it
    // copies it in (no cast copy first).
    sources.push_back(p->padded_shard());
  }
  std::vector<at::Tensor> dests = input.split_with_sizes(layout.padded_numels);
  if (offload_to_cpu) {
    // See [Note: CPU offload]: asynchronous from pinned memory, on this
    // copy-in stream.
    for (size_t i = 0; i < dests.size(); ++i) dests[i].copy_(sources[i], /*non_blocking=*/true);
  } else {
    at::_foreach_copy_(dests, sources);
  }
}

}  // namespace

AllGatherInput all_gather_copy_in(const std::vector<std::unique_ptr<FSDPParam>>& params, const ShardLayout& layout,
                                  const at::Tensor& post_forward_shard, const collectives::Communicator& comm,
                                  const at::TensorOptions& options, bool offload_to_cpu,
                                  const std::optional<c10::Stream>& copy_in_stream, AllGather& all_gather_comm,
                                  const PhaseLabels& labels, const std::string& module_fqn) {
  // After a reshard to a smaller world, the all-gather runs within the
  // post-forward group from this rank's larger shard; the output has the same
  // rank-major layout either way, so the copy-out is the same.
  const bool from_post_forward = post_forward_shard.defined();
  AllGatherInput result;
  at::Tensor& output = result.output;
  at::Tensor& input = result.input;
  {
    OptionalStreamGuard guard(copy_in_stream);
    PhaseScope phase(labels[Phase::kAllGatherCopyIn]);
    // No wait for the last forward copy-out here: see [Note: all-gather
    // output lifetime] in fsdp_param_group.h.
    output = all_gather_comm.allocate({layout.world * layout.padded_total}, options.dtype().toScalarType(),
                                      options.device());
    name_for_stream_check(output, "the all-gather output", module_fqn);
    const int64_t input_numel = output.numel() / comm.size();
    c10::NoGradGuard no_grad;
    // NCCL gathers in place from the output's own slice; Gloo gets a
    // separate input, as its all-gather copies the input into the output.
    const bool in_place = comm.backend_kind() == collectives::BackendKind::kNccl;
    if (from_post_forward && !in_place) {
      input = post_forward_shard;
    } else {
      input = in_place ? output.narrow(0, comm.rank() * input_numel, input_numel) : at::empty({input_numel}, options);
      if (!in_place) name_for_stream_check(input, "the all-gather input", module_fqn);
      if (from_post_forward) {
        input.copy_(post_forward_shard);
      } else {
        copy_in_shards(params, layout, input, offload_to_cpu);
      }
    }
  }
  result.separate_input = input.defined() && !input.is_alias_of(output) && !from_post_forward;
  result.copy_in_done = DeviceEvent::record(copy_in_stream);
  return result;
}

AllGatherResult foreach_all_gather(AllGatherInput input, collectives::Communicator& comm,
                                   const std::optional<c10::Stream>& all_gather_stream, AllGather& all_gather_comm) {
  AllGatherResult result;
  result.separate_input = input.separate_input;
  result.copy_in_done = std::move(input.copy_in_done);
  result.all_gather_stream = all_gather_stream;
  {
    OptionalStreamGuard guard(all_gather_stream);
    result.copy_in_done.block(all_gather_stream);
    result.work = all_gather_comm.all_gather(input.output, input.input, comm);
  }
  result.output = std::move(input.output);
  result.input = std::move(input.input);
  return result;
}

void foreach_all_gather_copy_out(const at::Tensor& output, const std::vector<std::unique_ptr<FSDPParam>>& params,
                                 const ShardLayout& layout, const PhaseLabels& labels) {
  PhaseScope phase(labels[Phase::kAllGatherCopyOut]);
  c10::NoGradGuard no_grad;
  const at::Tensor gathered = output.view({layout.world, layout.padded_total});
  if (layout.chunk_cat) {
    // [Note: shard dim] One copy per parameter: rows for dim 0, a
    // concatenation along the shard dim for the others.
    int64_t column = 0;
    for (const auto& p : params) {
      const at::Tensor rows = gathered.narrow(1, column, p->padded_shard_numel());
      column += p->padded_shard_numel();
      if (p->chunk_cat()) {
        p->copy_out_chunks(rows);
      } else {
        p->alloc_all_gather_output_rows().copy_(rows);
      }
    }
    return;
  }
  std::vector<at::Tensor> outs;
  outs.reserve(params.size());
  for (const auto& p : params) outs.push_back(p->alloc_all_gather_output_rows());
  at::split_with_sizes_copy_out(outs, gathered, layout.padded_numels, /*dim=*/1);
}

// ---- Reduce-scatter ----

namespace {

// Copies every rank's rows of every gradient into `input` ({world, total}),
// cast to input's dtype, and frees the gradients.
void reduce_scatter_copy_in(const std::vector<FSDPParam*>& params, std::vector<at::Tensor>& grads, at::Tensor& input,
                            int64_t world) {
  std::vector<at::Tensor> grads_2d;
  grads_2d.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    const int64_t rows = g.dim() == 0 ? 1 : g.size(0);
    if (params[i]->chunk_cat()) {
      // [Note: shard dim] Already one padded row per rank, which _chunk_cat
      // keeps as is.
      grads_2d.push_back(params[i]->padded_chunks(g, 0, world));
      continue;
    }
    grads_2d.push_back(g.reshape({rows, rows == 0 ? 0 : g.numel() / rows}));
  }
  // Mixed precision: _chunk_cat casts each gradient to reduce_dtype as it
  // copies it in (as in FSDP2's foreach_reduce), with no cast copy first.
  at::_chunk_cat_out(input, grads_2d, /*dim=*/0, /*num_chunks=*/world);
  // Only the copy-in reads the gradients: they are freed here, on the stream
  // that made them.
  grads_2d.clear();
  grads.clear();
}

}  // namespace

ReduceScatterResult foreach_reduce(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> grads, int64_t world,
                                   c10::ScalarType reduce_dtype, const collectives::ReduceOp& op, double pre_divide,
                                   collectives::Communicator& comm, ReduceScatter& reduce_scatter_comm,
                                   const StreamSet& streams, const PhaseLabels& labels, const std::string& module_fqn) {
  int64_t total = 0;
  for (FSDPParam* p : params) total += p->padded_shard_numel();
  ReduceScatterResult result;
  const c10::Device device = grads.front().device();
  result.input = reduce_scatter_comm.allocate({world * total}, reduce_dtype, device).view({world, total});
  name_for_stream_check(result.input, "the reduce-scatter input", module_fqn);
  {
    PhaseScope copy_in(labels[Phase::kReduceScatterCopyIn]);
    c10::NoGradGuard no_grad;
    reduce_scatter_copy_in(params, grads, result.input, world);
    if (pre_divide != 1.0) result.input.div_(pre_divide);
  }
  result.stream = streams.reduce_scatter();
  StreamSet::wait_stream(result.stream, streams.current_stream());
  {
    OptionalStreamGuard guard(result.stream);
    result.output = reduce_scatter_comm.allocate({total}, reduce_dtype, device);
    name_for_stream_check(result.output, "the reduce-scatter output", module_fqn);
    FSDP2CPP_LOG_DEBUG(labels[Phase::kReduceScatter] + " op " + describe_reduce(op, comm.backend_kind(), world) +
                       " in " + c10::toString(reduce_dtype) + ", " + std::to_string(total) + " elements per rank");
    PhaseScope rs_phase(labels[Phase::kReduceScatter]);
    result.work = reduce_scatter_comm.reduce_scatter(result.output, result.input.view({-1}), op, comm);
  }
  return result;
}

}  // namespace fsdp::detail
