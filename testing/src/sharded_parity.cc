#include "fsdp_testing/sharded_parity.h"

#include <algorithm>
#include <string>

#include <ATen/ops/allclose.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

namespace fsdp::testing {
namespace {

// Fails unless `actual` (this rank's shard) is close to shard_rows(expected).
void expect_rows_close(const at::Tensor& actual, const at::Tensor& expected_full, const DeviceMesh& mesh,
                       const ParityOptions& options, const std::string& what) {
  const at::Tensor expected = shard_rows(expected_full.detach(), mesh).reshape({-1});
  const at::Tensor local = actual.detach().reshape({-1});
  ASSERT_EQ(local.numel(), expected.numel())
      << what << ": this rank holds " << local.numel() << " elements, its rows of the reference " << expected.numel();
  if (local.numel() == 0) return;
  const at::Tensor local_as = local.to(expected.device(), expected.scalar_type());
  EXPECT_TRUE(at::allclose(local_as, expected, options.rtol, options.atol))
      << what << ": max abs diff " << (local_as - expected).abs().max().item<double>() << " (rtol " << options.rtol
      << ", atol " << options.atol << ")";
}

}  // namespace

at::Tensor shard_rows(const at::Tensor& full, const DeviceMesh& mesh) {
  const at::Tensor rows = full.dim() == 0 ? full.reshape({1}) : full;
  const int64_t parts = mesh.size(mesh.ndim() - 1), index = mesh.coordinate().back();
  const int64_t chunk = (rows.size(0) + parts - 1) / parts;
  const int64_t begin = std::min(index * chunk, rows.size(0));
  return rows.narrow(0, begin, std::min(chunk, rows.size(0) - begin));
}

void expect_sharded_parity(const torch::nn::Module& reference, const torch::nn::Module& sharded, const DeviceMesh& mesh,
                           const ParityOptions& options) {
  const auto reference_params = reference.named_parameters();
  const auto sharded_params = sharded.named_parameters();
  for (const auto& item : sharded_params) {
    EXPECT_NE(reference_params.find(item.key()), nullptr)
        << "sharded parameter " << item.key() << " has no parameter of that name in the reference";
  }
  for (const auto& item : reference_params) {
    const at::Tensor* shard = sharded_params.find(item.key());
    if (shard == nullptr) {
      ADD_FAILURE() << "reference parameter " << item.key()
                    << " has no parameter of that name in the sharded model (fully_shard keeps FQNs)";
      continue;
    }
    expect_rows_close(*shard, item.value(), mesh, options, item.key());
    if (!options.gradients) continue;
    const at::Tensor& reference_grad = item.value().grad();
    const at::Tensor& shard_grad = shard->grad();
    if (!reference_grad.defined()) {
      EXPECT_FALSE(shard_grad.defined()) << item.key() << ": a gradient where the reference has none";
      continue;
    }
    if (!shard_grad.defined()) {
      ADD_FAILURE() << item.key() << ": no gradient where the reference has one";
      continue;
    }
    expect_rows_close(shard_grad, reference_grad, mesh, options, item.key() + " (gradient)");
  }
}

double train_reference_step(torch::optim::Optimizer& optim, const std::function<at::Tensor()>& loss) {
  optim.zero_grad();
  const at::Tensor value = loss();
  value.backward();
  optim.step();
  return value.item<double>();
}

double mean_over_ranks(RankContext& ctx, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  ctx.world_group()->all_reduce(t, collectives::ReduceOp::avg()).wait();
  return t.item<double>();
}

}  // namespace fsdp::testing
