// Parity of a sharded model with its unsharded reference: the C++ form of
// PyTorch's check_sharded_parity (torch/testing/_internal/common_fsdp.py),
// for fully_shard's layout, and the side-by-side training step that tests of
// a sharded model repeat (tests/testing/sharded_parity_test.cc):
//
//   // reference: the same model, not sharded, trained on the whole batch
//   const double ref_loss =
//       fsdp::testing::train_reference_step(ref_optim, [&] { return (reference->forward(x) - y).pow(2).mean(); });
//   optim.zero_grad();
//   at::Tensor loss = (fsdp::call_module(*model, rows) - targets).pow(2).mean();  // equal shares: 12 rows
//   loss.backward();
//   optim.step();
//   EXPECT_NEAR(fsdp::testing::mean_over_ranks(ctx, loss.item<double>()), ref_loss, 1e-6);
//   fsdp::testing::expect_sharded_parity(*reference, *model, ctx.mesh());
//
// Nothing here gathers a parameter: each rank compares its own shard with
// the same rows of the reference, so a rank can check alone.
#pragma once

#include <functional>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "device_mesh/device_mesh.h"
#include "fsdp_testing/distributed_test.h"

namespace fsdp::testing {

struct ParityOptions {
  // at::allclose's tolerances for parameters and gradients.
  double rtol = 1e-5;
  double atol = 1e-6;
  // Compare gradients too (as PyTorch's check_sharded_parity does): both
  // absent, or both present and close. Off for a check made where one side's
  // gradients were cleared or never made (after loading a state dict).
  bool gradients = true;
};

// shard_rows
//
// The rows of `full` that fully_shard keeps on this rank: torch.chunk of dim
// 0 into as many chunks as the mesh's last dim (the shard dim) has ranks,
// taking this rank's coordinate on it; empty when the rank is past the last
// chunk. A 0-dim tensor is taken as one row.
at::Tensor shard_rows(const at::Tensor& full, const DeviceMesh& mesh);

// expect_sharded_parity
//
// Every parameter of `sharded` (a model after fully_shard over `mesh`,
// whose parameters hold this rank's dim-0 shard) equals shard_rows() of the
// parameter of the same fully qualified name in `reference`, and, with
// options.gradients, so does its gradient. Reports a GoogleTest failure per
// mismatch, naming the FQN and the largest difference; a parameter missing
// from either side, or of another number of elements, fails as such.
// Communicates nothing.
void expect_sharded_parity(const torch::nn::Module& reference, const torch::nn::Module& sharded, const DeviceMesh& mesh,
                           const ParityOptions& options = {});

// train_reference_step
//
// One optimizer step of an unsharded reference: zero the gradients, call
// `loss` (the forward), backward, step. Returns the loss's value.
double train_reference_step(torch::optim::Optimizer& optim, const std::function<at::Tensor()>& loss);

// mean_over_ranks
//
// The mean over the run's ranks of a per-rank scalar (an all-reduce on
// ctx.world_group(); every rank must call it): a sharded loss computed on
// equal shares of the batch, averaged, is the reference's loss.
double mean_over_ranks(RankContext& ctx, double value);

}  // namespace fsdp::testing
