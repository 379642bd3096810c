// Activation checkpointing for LibTorch modules and callables.
//
// A checkpointed region keeps only its inputs through forward and runs
// again in backward to rebuild what its backward needs: the activation
// memory of a model of N checkpointed blocks drops from N blocks' worth of
// intermediates to N blocks' inputs plus one block's intermediates, for the
// cost of a second forward of each block. What torch.utils.checkpoint
// (use_reentrant=False) guarantees holds here:
//   - gradients equal those of the plain run, bit for bit on CPU (the
//     recomputation runs the same kernels in the same order), for inputs,
//     parameters and buffers that require grad;
//   - random ops replay the numbers they drew in forward: the CPU generator,
//     and the CUDA generator of each device that holds a tensor input, are
//     set to their forward state for the recomputation and put back after;
//     so are the CPU and CUDA autocast settings;
//   - any number of tensor arguments and results (in std::vector,
//     std::tuple, std::pair, std::optional, nested), arguments that are not
//     tensors, inputs that do not require grad, results that are views,
//     nested checkpoints, the same region run several times in one forward,
//     backward run again with retain_graph, torch::autograd::grad with
//     `inputs` (only what is asked for is computed and accumulated);
//   - without autograd (torch::NoGradGuard, InferenceMode) the region just
//     runs: nothing is saved and nothing recomputed.
//
// A module is checkpointed wherever it is called through fsdp::call_module,
// an FSDP2CPP_MODULE holder or fsdp::Sequential (as fully_shard's hooks);
// checkpoint each block, then shard the blocks and the root
// (tests/fsdp2/fsdp2_activation_checkpoint_test.cc):
//
//   for (auto& block : model->blocks()) fsdp::checkpoint_module(*block);
//   for (auto& block : model->blocks()) fsdp::fully_shard(block, options);
//   fsdp::FSDPModule root = fsdp::fully_shard(model, options);
//
// A callable, checkpointed once (tests/fsdp2/fsdp2_activation_checkpoint_test.cc):
//
//   at::Tensor h = fsdp::activation_checkpoint([&](const at::Tensor& in) { return block->forward(in); }, x);
//
// Composed with fully_shard (see docs/fsdp2.md): a checkpointed module runs
// its fully_shard hooks outside the checkpointed region, in either order of
// application, so its recomputation in backward uses the parameters the
// pre-backward unshard gathered (no second all-gather), and its gradients
// reach the reduce-scatter once. A sharded module inside a checkpointed
// region (a checkpointed parent, or fsdp::activation_checkpoint around a call of a
// sharded module) is unsharded when the recomputation reaches it (one
// all-gather, as without checkpointing) and reduced at the end of backward.
//
// How it works: the region runs in forward with autograd on, then its graph
// is replaced by one node whose edges lead to what it reached (the inputs
// that require grad, and the leaves: parameters, buffers), and only the
// inputs are kept. That node's backward runs the region again and computes
// the gradients for those edges with torch::autograd::grad, which the
// enclosing backward then accumulates as it would the plain run's. Forward
// therefore holds one region's intermediates at a time, which its backward
// needs anyway.
//
// Limits (errors say what to do): a tensor that requires grad and was
// computed outside the region must be an argument, not captured by the
// callable; an input modified in place between forward and backward cannot
// be recomputed; the recomputation must produce the same number of results
// with the same shapes, dtypes and devices. In-place updates of buffers in
// forward (BatchNorm's running statistics) happen again in recomputation,
// as in PyTorch.
//
// Threads: a region's forward and backward may run on different threads
// (autograd's device threads); the state of one checkpoint is used by one
// backward at a time.
#pragma once

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "fsdp2/module_call.h"

namespace fsdp {

struct CheckpointOptions {
  // Replay random numbers in the recomputation (PyTorch's
  // preserve_rng_state, default true). False saves a generator state copy
  // per checkpoint and makes dropout draw new numbers in backward.
  bool preserve_rng_state = true;
  // Selective activation checkpointing (torchtitan's "op" SAC): forward
  // keeps the outputs of these ATen operators (dispatcher names, e.g.
  // "aten::mm") and the recomputation reuses them instead of running the op
  // again; every other op is recomputed. Empty: full checkpointing. The
  // operators are matched below autograd, after composite ops decompose
  // (at::linear runs as aten::addmm or aten::mm, at::matmul as aten::mm or
  // aten::bmm). A kept output that forward modified in place afterwards
  // (its version changed) is recomputed instead. See
  // selective_checkpoint_ops().
  std::vector<std::string> save_ops;
  // torchtitan's refinement of its op policy: of the aten::mm outputs
  // save_ops keeps, keep only the 1st, 3rd, 5th, ... of each run of the
  // region and recompute the others: about half the matmul activations for
  // about half the matmuls run again. No effect without "aten::mm" in
  // save_ops.
  bool save_every_other_mm = false;
};

// The default selective policy: the matrix products (aten::mm, addmm, bmm,
// baddbmm) and the fused attention kernels
// (aten::_scaled_dot_product_{flash,efficient,cudnn}_attention and the CPU
// flash kernel). They hold almost all of a transformer block's FLOPs (a
// second forward of them is what makes full checkpointing cost about 1.33x),
// while their outputs are a few [batch, seq, dim]-sized tensors per block;
// the norms, activations, residual adds and dropouts in between are cheap
// to recompute and would cost as much memory to keep. The same choice as
// torchtitan's _save_list (mm and the attention kernels); its "every other
// mm" refinement is CheckpointOptions::save_every_other_mm.
std::vector<std::string> selective_checkpoint_ops();

namespace detail {

// Whether a checkpoint made now records anything (grad mode on, not in
// inference mode).
bool checkpoint_records();

// Runs `region` on `inputs` checkpointed. See the file comment.
std::vector<at::Tensor> checkpoint_region(const CheckpointOptions& options, torch::nn::Module* module,
                                          const TensorRegion& region, std::vector<at::Tensor> inputs);

// True on the thread while a checkpoint recomputes its region in backward.
// fully_shard's pre-forward reads it: a sharded module run by a
// recomputation does its pre-backward work there (see fsdp_state.cc).
bool in_checkpoint_recompute();

}  // namespace detail

// activation_checkpoint(options, fn, args...)
//
// Returns fn(args...), checkpointed: forward keeps `args`, backward calls
// `fn` again on them (with the random state of forward) and differentiates
// that. `fn` is copied and kept with the non-tensor arguments until the
// backward that needs it has run (or the graph is freed): what it references
// must live that long. Tensor arguments are kept as autograd saves them
// (a version check catches in-place changes).
//
// REQUIRES: `fn(args...)` returns a tensor, or tensors in std::vector /
// std::tuple / std::pair / std::optional, or a value holding none.
// Errors: see the file comment; all throw c10::Error at the call (forward)
// or in backward, naming the region.
template <typename Fn, typename... Args>
auto activation_checkpoint(const CheckpointOptions& options, Fn&& fn, Args&&... args) {
  using Result = std::decay_t<std::invoke_result_t<std::decay_t<Fn>&, std::decay_t<Args>&...>>;
  std::tuple<std::decay_t<Args>...> values(std::forward<Args>(args)...);
  if (!detail::checkpoint_records()) return Result(std::apply(fn, values));
  detail::ForwardWrapper wrapper = [options](torch::nn::Module* module, const detail::TensorRegion& region,
                                             std::vector<at::Tensor> inputs) {
    return detail::checkpoint_region(options, module, region, std::move(inputs));
  };
  return detail::call_through_wrapper(wrapper, nullptr, nullptr, std::decay_t<Fn>(std::forward<Fn>(fn)),
                                      std::move(values));
}

// activation_checkpoint(fn, args...): the same with default options.
template <typename Fn, typename... Args,
          typename = std::enable_if_t<!std::is_same_v<std::decay_t<Fn>, CheckpointOptions>>>
auto activation_checkpoint(Fn&& fn, Args&&... args) {
  return activation_checkpoint(CheckpointOptions{}, std::forward<Fn>(fn), std::forward<Args>(args)...);
}

// checkpoint_module(module, options)
//
// Checkpoints every later call of `module` made through fsdp::call_module,
// fsdp::call_module_method, an FSDP2CPP_MODULE holder or fsdp::Sequential
// (the C++ counterpart of PyTorch's checkpoint_wrapper and of the composable
// torch.distributed._composable.checkpoint). Adds no module and changes no
// parameter name: state dicts and FQNs are those of the plain model. Its
// forward hooks (fully_shard's) run around the checkpointed forward.
// REQUIRES: `module` is owned by a std::shared_ptr (any module made by a
// holder or std::make_shared). A call that bypasses the hooks
// (module->forward(x), a TORCH_MODULE holder) is not checkpointed.
// Errors: throws when `module` is checkpointed already.
void checkpoint_module(torch::nn::Module& module, CheckpointOptions options = {});

// Whether checkpoint_module was applied to `module`.
bool is_checkpointed(const torch::nn::Module& module);

}  // namespace fsdp
