// Gradient clipping for sharded models.
//
// torch::nn::utils::clip_grad_norm_ over a sharded model would clip each
// rank's shards by that rank's local norm. These functions compute the total
// norm over all shards (every rank gets the same value) and scale every local
// gradient shard by the same coefficient, so the result equals clipping the
// unsharded model. They follow torch.nn.utils' split (PyTorch 2.6+):
// get_total_norm, then clip_grads_with_norm_; clip_grad_norm_ does both.
//
//   loss.backward();
//   // No host synchronization (NCCL): the norm stays on the device.
//   at::Tensor norm = fsdp::get_total_norm(root);
//   fsdp::clip_grads_with_norm_(root, 1.0, norm);
//   optim.step();
//   // Or in one call, returning a double (one host synchronization):
//   double n = fsdp::clip_grad_norm_(root, 1.0);
//
// Which gradients count: every parameter of `root`'s module that has a
// gradient, each once (tied parameters too). A parameter sharded by
// fully_shard contributes its rank's shard, so the sum over the shard group
// is the norm of the full gradient; under HSDP the shards are equal across
// replicas, so the norm is reduced over the shard group only. A parameter
// fully_shard left alone (FullyShardOptions::ignored_params) is full on every
// rank and is counted once: its p-th power is averaged over the shard group
// (exact when its gradient is the same on every rank, which is the caller's
// job, see ignored_params), and for the infinity norm its largest element
// over the ranks is taken.
//
// Modules or parameters sharded over other meshes than the root's (a
// module's own FullyShardOptions::mesh, or per-parameter meshes from
// shard_placement_fn, e.g. experts on an expert mesh) are counted as
// torchtitan counts them: the parameters of each shard group (the last mesh
// dim, so replicas count once) have their p-th powers summed (the largest
// element taken) over that group, and the groups' shares are added up (the
// largest taken) on every rank.
//
// Cost: the local norms use ATen's foreach kernels (one _foreach_norm per
// device and dtype, in fp32, fp64 for double gradients), one all-reduce of
// one element per distinct shard group, one for the whole model when every
// module is sharded over the root's mesh (SUM of p-th powers, MAX for the
// infinity norm), and one _foreach_mul_ per device and dtype by a clip coefficient
// computed on the device, min(max_norm / (total + 1e-6), 1), as
// torch.nn.utils.clip_grad_norm_(..., foreach=True) does.
#pragma once

#include <ATen/core/Tensor.h>

#include "fsdp2/fully_shard.h"

namespace fsdp {

// Returns the total `norm_type` norm of the gradients of `root`'s module (see
// above for which gradients count), as a 0-dim tensor on the device of the
// sharded parameters, in float32 (float64 when a gradient is double).
// Gradients are not modified.
//
// Collective over the shard group of every mesh the model is sharded over
// (the root's first, the others in module order): every rank must call it,
// in the same order relative to those groups' other collectives.
// Streams: on NCCL the norm is computed on the current stream and the
// all-reduce is ordered after it; the current stream waits for the
// all-reduce, the host does not. On Gloo (CPU) the host waits for the
// all-reduce. With `error_if_nonfinite` the host reads the norm (one
// synchronization on CUDA) and every rank throws when it is NaN or infinite.
//
// REQUIRES: `norm_type` > 0 (std::numeric_limits<double>::infinity() for the
// largest absolute element); called after the backward that reduced the
// gradients, so that fully_shard's parameters are sharded and hold sharded
// gradients. Throws c10::Error naming the parameter otherwise.
at::Tensor get_total_norm(const FSDPModule& root, double norm_type = 2.0, bool error_if_nonfinite = false);

// Scales the gradients of `root`'s module by min(max_norm / (total_norm +
// 1e-6), 1), computed on the device from `total_norm` (get_total_norm's
// result): no host synchronization, no communication. Gradients are always
// multiplied (by exactly 1 when no clipping is needed), as in PyTorch.
// REQUIRES: `total_norm` has one element. Throws otherwise, and on the
// conditions of get_total_norm.
void clip_grads_with_norm_(const FSDPModule& root, double max_norm, const at::Tensor& total_norm);

// get_total_norm, then clip_grads_with_norm_; returns the total norm before
// clipping as a double, which reads it on the host: on CUDA this is one
// synchronization (as torch::nn::utils::clip_grad_norm_ in C++). Use the two
// calls above to keep the step asynchronous.
double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace fsdp
