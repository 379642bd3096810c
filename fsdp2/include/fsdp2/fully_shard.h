// fully_shard: PyTorch FSDP2 for LibTorch modules.
//
// Shards every parameter of a module on dim 0 over a DeviceMesh (torch.chunk
// semantics, zero-padded, uneven sizes allowed) and installs the runtime that
// all-gathers a module's parameters before its forward and backward and
// reduce-scatters its gradients after backward. Apply it to submodules first
// (each becomes one communication group), then to the root, which takes every
// parameter not already sharded (examples/fully_shard_basic.cc):
//
//   auto mesh = fsdp::init_device_mesh(world, c10::kCPU, {world->size()});
//   torch::manual_seed(0);  // the same full model on every rank
//   auto model = std::make_shared<Net>();
//   fsdp::FullyShardOptions opts;
//   opts.mesh = mesh;
//   for (auto& block : model->blocks) fsdp::fully_shard(block, opts);  // submodules first
//   fsdp::FSDPModule root = fsdp::fully_shard(model, opts);            // then the root
//   torch::optim::AdamW optim(model->parameters(), 1e-3);              // after fully_shard
//   ...
//   for (int step = 0; step < 5; ++step) {
//     at::Tensor loss = at::mse_loss(fsdp::call_module(*model, x), y);  // the root through its hooks
//     loss.backward();
//     fsdp::clip_grad_norm_(root, 1.0);  // the norm over all shards
//     optim.step();
//     optim.zero_grad();
//     ...
//   }
//
// `Net` holds its blocks in a std::vector<Block>, Block declared with
// FSDP2CPP_MODULE so that `block(x)` runs the hooks; `model` is a
// std::shared_ptr, so it is called with fsdp::call_module(*model, x).
//
// Parameter FQNs do not change. After fully_shard, `module->parameters()`
// returns the sharded parameters (this rank's rows), which is what the
// optimizer must be built over; gradients after backward are sharded too.
// Modules must be called through fsdp::call_module (or holders declared
// with FSDP2CPP_MODULE, or fsdp::Sequential); see module_call.h. The
// semantics (defaults, state machine, numerics) are those of PyTorch's
// torch.distributed.fsdp.fully_shard.
//
// Threading: a sharded model is used from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "device_mesh/device_mesh.h"
#include "device_mesh/placement.h"
#include "fsdp2/module_call.h"

namespace fsdp {

// Mixed precision as FSDP2's MixedPrecisionPolicy. Sharded (master)
// parameters, their gradients and the optimizer stay in the parameters'
// original dtype; only the all-gathered parameters used in forward and
// backward are in `param_dtype`.
struct MixedPrecisionPolicy {
  // dtype of the unsharded parameters (all-gather and compute). Unset: the
  // original dtype. Must be a floating-point type.
  std::optional<c10::ScalarType> param_dtype;
  // dtype of the gradient reduction. Unset: `param_dtype` (or the original).
  std::optional<c10::ScalarType> reduce_dtype;
  // The root's floating-point outputs are cast to this dtype. Unset: no cast.
  std::optional<c10::ScalarType> output_dtype;
  // Cast floating-point forward inputs to `param_dtype` at each sharded
  // module (when param_dtype is set).
  bool cast_forward_inputs = true;
};

// CPU offload as FSDP2's OffloadPolicy / CPUOffloadPolicy(pin_memory). The
// default (offload_to_cpu false) offloads nothing.
//
// With offload_to_cpu, the sharded state of the module's group lives in host
// memory: the padded shards, so the sharded parameters that
// `module->parameters()` returns (P.device() is CPU between steps), their
// sharded gradients, and therefore the optimizer's state and its step, which
// run on the CPU. Only the unsharded parameters (all-gather output, between
// unshard and reshard) and the unreduced gradients of backward are on the
// mesh's device. The cost is one host-to-device copy of the shard per
// all-gather and one device-to-host copy of the reduced gradient shard per
// backward; device memory then holds no sharded state at all.
//
//   fsdp::FullyShardOptions opts;
//   opts.mesh = fsdp::init_device_mesh(world, c10::kCUDA, {world->size()});
//   opts.offload_policy.offload_to_cpu = true;  // pin_memory stays true
//   for (auto& block : model->blocks) fsdp::fully_shard(block, opts);
//   fsdp::fully_shard(model, opts);
//   torch::optim::AdamW optim(model->parameters(), 1e-3);  // steps on the CPU
//
// Semantics (FSDP2's):
// - Per fully_shard call: each call's group follows its own policy, so a root
//   without offload may hold blocks with it (the optimizer then sees
//   parameters on both devices, which torch::optim handles).
// - The parameters may be on the CPU or on the mesh's device when
//   fully_shard is called (a model too large for the device can be built on
//   the CPU); buffers must already be on the mesh's device.
// - pin_memory: the shards and the gradients copied back are allocated in
//   page-locked memory (LibTorch's caching host allocator), so that the
//   copies are asynchronous and overlap compute. false saves pinned memory
//   (a scarce, per-machine resource) at the price of synchronous copies.
//   Ignored without offload_to_cpu, as FSDP2 (whose OffloadPolicy has no
//   pinning) does.
// - Gradient accumulation (several backwards before a step) sums the
//   sharded gradients on the CPU, as FSDP2 does; set_requires_gradient_sync
//   (false) keeps unsharded gradients on the device, as without offload.
// - State dicts (fsdp2/state_dict.h) work as without offload; a sharded
//   state dict's DTensors then hold device copies of the local rows (a
//   DTensor's local tensor lives on its mesh's device), which the setters
//   copy back into the host shards.
//
// Streams (CUDA): the shard is copied to the device with non_blocking on the
// all-gather copy-in stream (the caller's stream for an explicit unshard),
// just before the all-gather reads it. After the reduce-scatter (and the
// HSDP all-reduce and the all-reduce hook) the reduced gradient shard is
// copied to the host with non_blocking on the stream that produced it, and an
// event is recorded; the root's end-of-backward callback blocks the host on
// those events, so `loss.backward()` returns with every sharded gradient in
// host memory and the optimizer can step at once. A gradient added to an
// existing one (accumulation) is copied synchronously, as in FSDP2, since the
// CPU addition needs it. Post-accumulate-grad hooks run after their
// parameter's copy finished. With set_is_last_backward(false) the callback
// does not wait (the next backward's accumulation does). Writing the sharded
// parameters from the host at other times (outside the optimizer step that
// follows backward, or fsdp::set_model_state_dict, which waits itself) must
// wait for the device first, e.g. after a forward without backward.
//
// REQUIRES (offload_to_cpu): the mesh is on a CUDA (not CPU) device: on a
// CPU mesh parameters already live in host memory, and fully_shard throws,
// except under the stream-order checker (stream_check.h), which models a
// device on CPU so that offload's copies and the host's accesses are checked
// there (docs/gpu.md, "The host as an agent").
struct OffloadPolicy {
  bool offload_to_cpu = false;
  bool pin_memory = true;
};

// reshard_after_forward: true, false, or the size of the smaller world to
// reshard to after forward (FSDP2's `bool | int`): with an integer k, each
// rank keeps a 1/k shard after forward, all-gathered in backward within its
// group of k consecutive shard ranks (e.g. the ranks of one node). k must
// divide the mesh's shard size; k == 1 means false and k == shard size true.
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : value_(reshard ? -1 : 1) {}  // NOLINT: implicit, like FSDP2's bool
  ReshardAfterForward(int world_size) : value_(world_size) {}      // NOLINT: implicit, like FSDP2's int
  bool is_bool() const { return value_ == -1 || value_ == 1; }
  // The world size to keep after forward: 1 (no reshard), or -1 for the
  // whole shard group, or k.
  int world_size() const { return value_; }

 private:
  int value_;
};

// What FullyShardOptions::shard_placement_fn returns for one parameter
// (FSDP2's ShardPlacementResult): the placement to shard it with (unset:
// Shard(0)) and the mesh to shard it over (unset: the fully_shard call's
// mesh). Converts implicitly from a Placement, std::optional<Placement> and
// std::nullopt, so placement-only functions need no change.
struct ShardPlacementResult {
  ShardPlacementResult() = default;
  ShardPlacementResult(std::nullopt_t) {}                                        // NOLINT: implicit, as FSDP2's None
  ShardPlacementResult(Placement p) : placement(std::move(p)) {}                 // NOLINT: implicit, as FSDP2's Shard
  ShardPlacementResult(std::optional<Placement> p) : placement(std::move(p)) {}  // NOLINT: implicit
  ShardPlacementResult(std::optional<Placement> p, std::optional<DeviceMesh> m)
      : placement(std::move(p)), mesh(std::move(m)) {}

  std::optional<Placement> placement;
  // 1-D (FSDP) or 2-D (replicate, shard) as FullyShardOptions::mesh, on the
  // same device type, with this rank in it.
  std::optional<DeviceMesh> mesh;
};

struct FullyShardOptions {
  // The mesh to shard over. 1-D: FSDP. 2-D with dims named (replicate,
  // shard), e.g. {"replicate", "shard"} or {"dp_replicate", "dp_shard"}:
  // HSDP, sharded within the shard dim and replicated across the other.
  // Unset: the mesh of the already-sharded
  // submodules, else a 1-D mesh over `world` on the parameters' device.
  std::optional<DeviceMesh> mesh;
  // Used only to build the default mesh when `mesh` is unset: a 1-D mesh
  // over all of `world`'s ranks, whose group every such call shares.
  std::shared_ptr<collectives::World> world;
  // true: free the unsharded parameters after forward (all-gather again in
  // backward); false: keep them until after backward; an integer: see
  // ReshardAfterForward. Unset: true, except for the root module, which
  // keeps them (its backward starts at once).
  std::optional<ReshardAfterForward> reshard_after_forward;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  // Parameters of the module that fully_shard leaves alone (FSDP2's
  // ignored_params): not sharded, not all-gathered, and their gradients are
  // not reduced (each rank keeps its local gradient; synchronize them
  // yourself if they are trained). They stay full on every rank. Pass them to
  // every fully_shard call whose module contains them, the root's included.
  std::vector<at::Tensor> ignored_params;
  // Which tensor dim, and over which mesh, each parameter is sharded (FSDP2's
  // shard_placement_fn): called once per parameter this call shards, with
  // the full parameter. It returns a ShardPlacementResult (above), which
  // converts implicitly from Placement::shard(d), from std::nullopt and from
  // std::optional<Placement>, so a function that only picks the dim returns
  // those as before. Placement::shard(d) gives rank r torch.chunk(param,
  // shard size, d)[r] (uneven chunks and empty ones allowed); std::nullopt
  // means Shard(0). Placement::shard takes d >= 0 (param.dim() - 1 for the
  // last dim). Unset: every parameter on dim 0 of `mesh`. Sharded state
  // dicts then hold Shard(d) DTensors ((Replicate, Shard(d)) under HSDP). At
  // 2+ shard ranks, d != 0 costs one extra copy of the parameter per
  // all-gather (concatenating the chunks) and of its gradient per
  // reduce-scatter; use it when an optimizer or a checkpoint layout needs
  // the split along d.
  //
  //   opts.shard_placement_fn = [](const at::Tensor& p) -> std::optional<fsdp::Placement> {
  //     if (p.dim() == 2) return fsdp::Placement::shard(1);  // weights by column
  //     return std::nullopt;                                 // the rest by row
  //   };
  //
  // Per-parameter meshes (FSDP2's ShardPlacementResult, PyTorch >= 2.12):
  // a result with a mesh shards that parameter over it instead of `mesh`.
  // The call's parameters are grouped by mesh (by its shard and replicate
  // process groups), one FSDPParamGroup per distinct mesh, in the order the
  // meshes first appear; each group all-gathers and reduce-scatters on its
  // own mesh's groups, and its state-dict DTensors carry its mesh. See
  // docs/fsdp2.md "Per-parameter meshes".
  //
  //   opts.shard_placement_fn = [&](const at::Tensor& p) -> fsdp::ShardPlacementResult {
  //     if (is_expert(p)) return {fsdp::Placement::shard(0), expert_mesh};
  //     return std::nullopt;  // Shard(0) over opts.mesh
  //   };
  //
  // fully_shard throws, naming the module and the parameter, when it returns
  // a placement that is not a Shard or a dim the parameter lacks (a 0-dim
  // parameter, sharded as one row, takes dim 0 only), or a mesh that is
  // neither 1-D nor (replicate, shard) 2-D, or on another device type than
  // `mesh`.
  std::function<ShardPlacementResult(const at::Tensor& param)> shard_placement_fn;
};

namespace detail {
class FSDPState;
}

// fsdp2/custom_collectives.h
class AllGather;
class ReduceScatter;

// Communication counters of one root's FSDP tree, for progress reports and
// benchmarks. "Wait" times are host time blocked waiting for a collective:
// on CPU (Gloo) that is exactly the communication not hidden behind
// compute; on CUDA the host rarely blocks (streams wait instead), so use a
// profiler (the phases are labelled) for exposed GPU communication.
// A module whose shard group has one rank and that casts no dtype (FSDP at
// world size 1, HSDP with shard size 1, no mixed precision) neither
// all-gathers nor reduce-scatters: its parameters are their shards. It adds
// nothing to the counts and bytes (its HSDP all-reduce, which still runs, has
// no counter; its wait is in reduce_scatter_wait_seconds).
struct RuntimeStats {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_gather_bytes = 0;      // bytes received by this rank
  int64_t reduce_scatter_bytes = 0;  // bytes sent by this rank
  double all_gather_wait_seconds = 0;
  double reduce_scatter_wait_seconds = 0;
};

// Waits for an asynchronous unshard (FSDPModule::unshard(true)).
class UnshardHandle {
 public:
  UnshardHandle() = default;
  // Makes the unsharded parameters usable: waits for the all-gather and
  // copies out (on CUDA: the current stream waits, not the host). No-op for
  // an already-completed handle. Call it with the stream current that was
  // current at unshard(), as FSDP2 expects too: the all-gather's buffers were
  // allocated on that stream, and the caching allocator reuses their blocks
  // in that stream's order once they are freed. Waiting on another stream T
  // needs T ordered after that stream first, and that stream ordered after T
  // before the module reshards.
  void wait();

  explicit UnshardHandle(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<detail::FSDPState> state_;
};

// The handle of a module that fully_shard was applied to: FSDP2's FSDPModule
// methods. Cheap to copy; all copies refer to the same state, which lives as
// long as the module does.
//
// Gradients: as in FSDP2, a parameter's post-accumulate-grad hooks
// (torch::autograd::impl::set_post_acc_grad_hooks, e.g. an optimizer step in
// backward) run once its sharded gradient is reduced and set, with the
// sharded parameter; autograd's accumulation of the full gradient does not
// run them. Memory: by default backward keeps at most two groups' unreduced
// gradients alive (the group being reduced and the one before it);
// set_reduce_scatter_max_input_buffers raises that bound.
class FSDPModule {
 public:
  // The sharded module; for a group sharded by one fully_shard call over
  // several modules, the first of them (modules() lists them all).
  torch::nn::Module& module() const;
  std::shared_ptr<torch::nn::Module> module_ptr() const;
  // The modules sharded together as this group, in the order given to
  // fully_shard: one, or several for fully_shard(std::vector<...>).
  std::vector<std::shared_ptr<torch::nn::Module>> modules() const;
  // The mesh the module is sharded over: FullyShardOptions::mesh (or its
  // default). Parameters that shard_placement_fn put on another mesh are
  // sharded over that one (their state-dict DTensors carry it).
  const DeviceMesh& mesh() const;

  // All-gathers the module's parameters so they are unsharded, as before its
  // forward. With async_op the all-gather is only issued; call wait() on the
  // handle before using the parameters.
  UnshardHandle unshard(bool async_op = false);
  // Frees the unsharded parameters; the sharded ones are used again.
  void reshard();

  // Whether backward reduces gradients (false: accumulate unsharded gradients
  // locally, in the reduce dtype, as for gradient accumulation without
  // communication). For HSDP it sets the all-reduce too, as
  // set_requires_all_reduce(requires_gradient_sync) would.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // Whether to free the unsharded parameters after forward. Only for
  // non-root modules in FSDP2's default; allowed on any, and kept for the
  // root when set before its first forward (lazy init then does not apply
  // the root's default).
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  // HSDP: whether backward all-reduces the reduce-scattered gradients across
  // replicas (false: keep the partial result, added to the next backward
  // that does all-reduce; gradients are only set then). A no-op on a 1-D
  // mesh, as in FSDP2.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // Whether to free the unsharded parameters after backward.
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  // Modules whose all-gather is issued at the start of this module's forward
  // (explicit forward prefetch), in order.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  // Modules whose all-gather is issued at the start of this module's backward
  // (replaces the implicit previous-module prefetch).
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  // Whether to unshard in backward (false for modules whose parameters are
  // not needed by their backward, e.g. embeddings). Gradients autograd still
  // computes for them (an embedding's needs only the indices) are reduced as
  // any other (pytorch#137922).
  void set_unshard_in_backward(bool unshard_in_backward);
  // The root waits for this event instead of the whole current stream before
  // the next forward's first all-gather (CUDA; ignored on CPU).
  void set_post_optim_event(std::shared_ptr<c10::Event> event);
  // This module's gradients are divided by `factor` instead of the
  // data-parallel world size. Applies to this module's group only (call it
  // on every module to change them all), as in FSDP2.
  void set_gradient_divide_factor(double factor);
  // Reduce with SUM collectives and divide locally (never AVG/PREMUL_SUM),
  // for the reduce-scatter and the HSDP all-reduce alike. Applies to this
  // module's group only, as in FSDP2.
  void set_force_sum_reduction_for_comms(bool force_sum);
  // Called on each reduced gradient shard buffer of this module's group
  // (reduce dtype, the group's padded chunks) after the reduce-scatter and
  // the HSDP all-reduce, before any division left to do locally (with
  // set_force_sum_reduction_for_comms the hook sees the sum) and before it
  // becomes the parameters' .grad. Applies to this module's group only; an
  // empty hook removes it.
  // Streams (CUDA): the hook runs on `stream` when given, else on the
  // runtime's all-reduce stream, after the reduction. REQUIRES: no `stream`
  // on a 2-D (HSDP) mesh, where the hook runs on the all-reduce's stream; a
  // stream of the module's device type (ignored on CPU). Throws otherwise.
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook, std::optional<c10::Stream> stream = std::nullopt);
  // Whether the next backward is the last before the optimizer step (false
  // skips the end-of-backward waits that only the last backward needs).
  void set_is_last_backward(bool is_last_backward);

  // Whether backward reduces zeros for the parameters that require a
  // gradient and got none (FSDP2 2.13's set_reduce_scatter_unused_params,
  // like DDP's find_unused_parameters): needed when ranks take different
  // control flow (mixture of experts, multi-modal batches), so that every
  // rank still reduce-scatters the same parameters. Such parameters then get
  // a gradient (zeros, or the other ranks' average) instead of none. A group
  // that backward did not reach at all on this rank reduces zeros at the end
  // of backward, as FSDP2 does; that keeps the ranks' collectives in step
  // only where the ranks that did reach it also reduce it at the end (its
  // inputs need no gradient, as the root's) and need no all-gather for it
  // (reshard_after_forward false), since its forward ran on every rank.
  // Default false: parameters without a gradient on every rank are left out
  // of the reduction, and ranks whose control flow differs issue
  // reduce-scatters of different sizes, which the collectives report as a
  // mismatch naming both. Set it on every rank.
  // The optimizer sees those zeros as gradients, unlike a run where the
  // parameters get none (torch::optim skips an undefined .grad): AdamW's
  // weight decay shrinks an expert no token reached, and its moments from
  // earlier steps go on moving it. Where that matters, reset the gradients
  // of the experts that got no token in the global batch (a count the ranks
  // all-reduce) before the step, p.mutable_grad().reset() on every rank.
  void set_reduce_scatter_unused_params(bool reduce_scatter_unused_params, bool recurse = true);
  // How many reduce-scatter inputs (the buffer each group's unreduced
  // gradients are copied into) may be in flight at once in backward (FSDP2
  // 2.13's set_reduce_scatter_max_input_buffers). Default 1: before a group
  // copies its gradients in, the previous group's reduce-scatter is waited
  // for (on CUDA: the compute stream waits), so at most two groups'
  // unreduced gradients are alive. A larger value lets backward go on past
  // reduce-scatters that communication has not finished yet (when they are
  // exposed), at the price of that many inputs' memory. The largest value
  // among the modules under the root (or the roots sharing a context, see
  // share_comm_ctx) applies to all, as in FSDP2. Throws when
  // `max_input_buffers` < 1.
  void set_reduce_scatter_max_input_buffers(int max_input_buffers, bool recurse = true);
  // Gives the reduce-scatter a communicator of its own over the shard
  // group's ranks (FSDP2 2.13's set_separate_reduce_scatter_group), so that
  // a backward's reduce-scatter and the next group's all-gather progress
  // concurrently instead of one after the other on one communicator (NCCL
  // runs one collective at a time per communicator; Gloo one per group).
  // Modules whose shard groups have the same ranks share one new
  // communicator per call; a module that has one keeps it. false goes back
  // to the shard group's communicator. Collective over each shard group: call
  // it on every rank, in the same order, between iterations. A shard group of
  // one rank has no reduce-scatter to overlap and gets no communicator.
  void set_separate_reduce_scatter_group(bool enable = true, bool recurse = true);

  // Recovers the whole FSDP tree this module belongs to after an exception
  // thrown mid-step (in a forward, the loss or backward): completes the
  // collectives in flight, reshards every module, drops the gradients of the
  // failed step that were not reduced yet (also those kept by
  // set_requires_gradient_sync(false)) and resets every module to idle.
  // Sharded gradients already reduced stay: call the optimizer's zero_grad
  // before redoing the step. A no-op before the first forward.
  void reset_iter_state();

  // Counters of the whole FSDP tree this module belongs to (since the last
  // reset_runtime_stats). Zero before the first forward.
  RuntimeStats runtime_stats() const;
  void reset_runtime_stats();

  // Bytes held now by this module's unsharded parameter storage (0 when
  // resharded): for checking that reshard really frees memory. Where the
  // unsharded parameters are the shards themselves (one shard rank, no dtype
  // cast; see RuntimeStats), it counts their bytes while unsharded: memory
  // that the shards hold anyway, which reshard does not free.
  int64_t unsharded_bytes() const;

  // Custom collectives (fsdp2/custom_collectives.h; FSDP2's
  // set_custom_all_gather / set_custom_reduce_scatter): this module's group
  // all-gathers its parameters (reduce-scatters its gradients) with `comm`
  // instead of the communicator's own collective; the copy-in, copy-out,
  // divisions and streams stay the runtime's. nullptr restores the default.
  // Applies to this module's group only (not its sharded submodules). The
  // group then runs the collective at one shard rank too (no world size 1
  // fast path). Shared: one object may serve several modules.
  // REQUIRES: the module has parameters of its own (a group), and it is
  // between steps: idle, sharded, no collective in flight. Throws c10::Error
  // naming the module otherwise.
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);

  // Internal.
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state);
  const std::shared_ptr<detail::FSDPState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::FSDPState> state_;
};

// Shards `module`'s parameters not yet managed by a sharded submodule and
// returns its handle. REQUIRES: every parameter is defined, on the mesh's
// device type, and of one dtype within the module's group; the module is not
// already sharded, and no ancestor is; a 2-D mesh is named (replicate,
// shard); an integer reshard_after_forward divides the shard size; a
// param_dtype is floating point; offload_to_cpu only on a non-CPU mesh (then
// the parameters may also be on the CPU) or under the stream-order checker. Throws c10::Error naming
// the module and parameter otherwise. Collective over the mesh (parameters
// are not communicated, but the default mesh may be created).
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& options = {});

template <typename Impl>
FSDPModule fully_shard(const torch::nn::ModuleHolder<Impl>& module, const FullyShardOptions& options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), options);
}

// Shards the parameters of several modules as ONE group (FSDP2's
// fully_shard(list of modules)): one all-gather before the first of them runs
// in forward, one reshard after the last of them ran, one reduce-scatter in
// backward. For modules that are not each other's ancestors but are best
// communicated together, e.g. two small consecutive blocks, or an embedding
// and the output projection. Each module's parameters not already managed by
// a sharded submodule are taken (a parameter tied between them once), and
// fsdp_module_of(m) returns this same FSDPModule for each of them
// (tests/fsdp2/fsdp2_multi_module_test.cc):
//
//   const fsdp::FSDPModule pair = fsdp::fully_shard({model->b0.ptr(), model->b1.ptr()}, opts);  // one group
//   fsdp::fully_shard(model->b2, opts);
//   fsdp::FSDPModule root = fsdp::fully_shard(model, opts);
//
// Forward (as FSDP2): the group's pre-forward (all-gather, input casts) runs
// when the first of its modules is called, whichever that is; its
// post-forward (reshard, per reshard_after_forward) once every module of the
// group has run since. Until then the parameters stay unsharded, and a module
// of the group called again meanwhile is not all-gathered again. A forward
// that skips a module of the group leaves the group unsharded until the end
// of that forward's root, which completes the group's post-forward. Backward:
// the group is all-gathered again when gradients reach the outputs of any of
// its modules, and reduced once when the gradients reach the first module's
// inputs (or at the end of backward), so the modules should run as a chain
// (each one's output feeding the next) or the inputs need no gradient.
//
// Logs and profiler labels name the group by its modules' FQNs joined by "+"
// ("blocks.0+blocks.1"); its parameters keep their own FQNs.
//
// REQUIRES: what fully_shard(module) requires, of every module and the
// group's parameters (one device type and dtype); a non-empty list without
// null or repeated modules; no module of the list contains another; an
// ancestor of the modules is sharded later (the root): a group of several
// modules cannot be the root of a forward, as in FSDP2 (its first forward
// throws); apply fully_shard to a common ancestor. Throws c10::Error naming
// the module otherwise.
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const FullyShardOptions& options = {});

// The same for holders, e.g. a slice of a std::vector<Block>.
template <typename Holder, typename = std::enable_if_t<torch::detail::is_module_holder<Holder>::value>>
FSDPModule fully_shard(const std::vector<Holder>& modules, const FullyShardOptions& options = {}) {
  std::vector<std::shared_ptr<torch::nn::Module>> impls;
  impls.reserve(modules.size());
  for (const auto& m : modules) impls.push_back(m.is_empty() ? nullptr : m.ptr());
  return fully_shard(impls, options);
}

// Makes several roots share one communication context (FSDP2's
// share_comm_ctx): the runtime's streams, the all-gather and reduce-scatter
// buffers in flight, and RuntimeStats (each root's runtime_stats() then
// counts them all). For pipeline parallelism, where each stage's model chunk
// is its own root: one set of streams instead of one per chunk avoids
// fragmenting the caching allocator between them. The first module's context
// is kept; the others adopt it. REQUIRES: every module is a root (no sharded
// module contains it) on the same device, and none is in the middle of a
// forward or backward. Throws naming the module otherwise. An empty list does
// nothing.
void share_comm_ctx(const std::vector<FSDPModule>& modules);

// The FSDPModule of `module`, or std::nullopt when fully_shard was not
// applied to it.
std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module);

// Releases what fully_shard attached to modules that have been destroyed
// since: their FSDP state, with the sharded parameters and their gradients,
// the buffers and communicators, and the hold on the mesh (and so on its
// World, whose destructor then waits for the other ranks' watchdogs). A
// LibTorch module cannot say it was destroyed, so this happens otherwise at
// the next fully_shard (or hook registration) in the process, or never:
// call it after dropping a model whose memory is needed back, or before
// destroying the World it ran on. Thread-safe; does nothing when no module
// died. A World released here is destroyed as its destructor says (on rank
// 0 it waits, a few seconds at most, for the other ranks to release theirs),
// so a program calls it on every rank.
void release_fsdp_state_of_destroyed_modules();

}  // namespace fsdp
