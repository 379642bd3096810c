// Gradient clipping for sharded models.
//
// torch::nn::utils::clip_grad_norm_ over a sharded model would clip each
// rank's shards by that rank's local norm. This computes the total norm over
// all shards (every rank gets the same value) and scales every local gradient
// shard by the same coefficient, so the result equals clipping the unsharded
// model.
#pragma once

#include "fsdp2/fully_shard.h"

namespace fsdp {

// Clips the gradients of every parameter of `root`'s module (sharded by
// fully_shard on `root` or its submodules) so that their total `norm_type`
// norm is at most `max_norm`, and returns the total norm before clipping.
// Parameters without a gradient are skipped. Collective over the mesh's
// shard group: every rank must call it. `norm_type` may be
// std::numeric_limits<double>::infinity(). Throws when a gradient is not
// sharded (call after backward finished), or on a non-positive norm_type.
double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type = 2.0);

}  // namespace fsdp
