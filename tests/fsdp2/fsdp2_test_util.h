// Shared helpers of the fsdp2 tests: data, optimizers, and the comparison of
// a sharded model with its unsharded reference.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "device_mesh/dtensor.h"
#include "fsdp_testing/distributed_test.h"
#include "fsdp_testing/expect_error.h"
#include "fsdp_testing/sharded_parity.h"
#include "test_models.h"

// FSDP2CPP_EXPECT_THROW_WITH (fsdp_testing/expect_error.h), under the name
// these tests have always used.
#define EXPECT_THROW_WITH(...) FSDP2CPP_EXPECT_THROW_WITH(__VA_ARGS__)

namespace fsdp::test {

enum class Optim { kSgd, kAdamW };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Optim kind, std::vector<at::Tensor> params) {
  if (kind == Optim::kSgd) {
    return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(std::move(params), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

// Rows [rank's torch.chunk slice] of a global batch.
inline at::Tensor rank_slice(const at::Tensor& global, int64_t index, int64_t parts) {
  const int64_t chunk = (global.size(0) + parts - 1) / parts;
  const int64_t begin = std::min(index * chunk, global.size(0));
  return global.narrow(0, begin, std::min(chunk, global.size(0) - begin));
}

struct Batch {
  at::Tensor x, y;
  Batch slice(int64_t index, int64_t parts) const { return {rank_slice(x, index, parts), rank_slice(y, index, parts)}; }
};

enum class ModelKind { kMlp, kTransformer };

// The same batch on every rank for a given step.
inline Batch make_batch(ModelKind kind, int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  if (kind == ModelKind::kMlp) {
    return {at::randn({rows, 7}, gen), at::randn({rows, 3}, gen)};
  }
  return {at::randint(Transformer::kVocab, {rows, Transformer::kSeq}, gen),
          at::randint(Transformer::kVocab, {rows, Transformer::kSeq}, gen)};
}

// Identical initial parameters on every rank and for every call.
inline std::shared_ptr<LossModel> make_model(ModelKind kind) {
  torch::manual_seed(0);
  if (kind == ModelKind::kMlp) return std::make_shared<MLP>();
  return std::make_shared<Transformer>();
}

// The full value of a sharded parameter (torch.chunk dim-0 sharding over the
// mesh's last dim), gathered on every rank.
inline at::Tensor full_param(const at::Tensor& sharded, const std::vector<int64_t>& full_shape,
                             const DeviceMesh& mesh) {
  std::vector<int64_t> shape = full_shape.empty() ? std::vector<int64_t>{1} : full_shape;
  at::Tensor local = sharded.detach();
  if (full_shape.empty()) local = local.reshape({-1});
  // HSDP meshes (replicate, shard) hold the same shards on every replica.
  std::vector<Placement> placements{Placement::shard(0)};
  if (mesh.ndim() == 2) placements.insert(placements.begin(), Placement::replicate());
  at::Tensor full = DTensor::from_local(local.contiguous(), mesh, placements, shape).full_tensor();
  return full.reshape(full_shape);
}

inline void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                         double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(at::allclose(actual, expected, rtol, atol))
      << what << ": max abs diff " << (actual - expected).abs().max().item<double>();
}

// Every parameter of `sharded` equals the one of the same name in
// `reference`, compared shard by shard (fsdp_testing/sharded_parity.h);
// gradients are not compared (expect_sharded_parity compares them).
inline void expect_params_match(torch::nn::Module& sharded, torch::nn::Module& reference, const DeviceMesh& mesh,
                                double rtol = 1e-5, double atol = 1e-6) {
  testing::expect_sharded_parity(reference, sharded, mesh, {.rtol = rtol, .atol = atol, .gradients = false});
}

// Options that shard over the test's mesh, everything else default.
inline FullyShardOptions mesh_options(testing::RankContext& ctx) {
  FullyShardOptions o;
  o.mesh = ctx.mesh();
  return o;
}

// One optimizer step of an unsharded reference on the whole `batch`: zero
// the gradients, forward, backward, step. Returns the loss.
template <typename Model>
at::Tensor train_reference_step(Model& reference, torch::optim::Optimizer& optim, const Batch& batch) {
  optim.zero_grad();
  at::Tensor loss = reference.forward(batch.x, batch.y);
  loss.backward();
  optim.step();
  return loss;
}

}  // namespace fsdp::test
