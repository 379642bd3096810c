// Deferred init of the trainer's model (tools/train/init.h): values fixed by
// (seed, parameter FQN) alone, the same after sharding at world sizes 1 to 4
// as built unsharded, and no rank holding all of the model while it is built.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/ones.h>
#include <torch/nn/module.h>
#include <torch/utils.h>

#include "device_mesh/dtensor.h"
#include "fsdp2/fully_shard.h"
#include "fsdp_testing/distributed_test.h"
#include "init.h"
#include "model.h"

namespace fsdp_train_test {
namespace {

using fsdp_train::build_transformer;
using fsdp_train::ModelConfig;

// Small, with rows that do not split evenly at 3 ranks (vocab 256 -> 86, 86,
// 84; hidden 40 -> 14, 14, 12).
ModelConfig small_config() {
  ModelConfig c;
  c.dim = 12;
  c.heads = 2;
  c.hidden = 40;
  c.layers = 3;
  c.max_seq_len = 8;
  return c;
}

TEST(DeferredInit, ValuesComeFromTheSeedAndTheName) {
  const ModelConfig config = small_config();
  auto a = build_transformer(config, /*seed=*/5, c10::Device(c10::kCPU));
  auto b = build_transformer(config, /*seed=*/5, c10::Device(c10::kCPU));
  auto other_seed = build_transformer(config, /*seed=*/6, c10::Device(c10::kCPU));
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = other_seed->named_parameters();
  ASSERT_EQ(pa.size(), static_cast<size_t>(2 + 1 + config.layers * 7));
  int64_t count = 0;
  for (const auto& item : pa) {
    count += item.value().numel();
    EXPECT_TRUE(item.value().equal(pb[item.key()])) << item.key() << ": same seed, different values";
    if (item.key().find("norm") != std::string::npos) {
      EXPECT_TRUE(item.value().equal(at::ones_like(item.value()))) << item.key();
      continue;
    }
    EXPECT_FALSE(item.value().equal(pc[item.key()])) << item.key() << ": the seed does not change it";
  }
  EXPECT_EQ(count, fsdp_train::parameter_count(config));
  // Same shape, different names: different values.
  EXPECT_FALSE(pa["layers.0.attention.qkv.weight"].equal(pa["layers.1.attention.qkv.weight"]));
  EXPECT_FALSE(pa["layers.2.feed_forward.w1.weight"].equal(pa["layers.2.feed_forward.w3.weight"]));
  // LibTorch's default ranges: Linear uniform within 1/sqrt(in), Embedding N(0, 1).
  const at::Tensor w2 = pa["layers.1.feed_forward.w2.weight"];
  EXPECT_LE(w2.abs().max().item<double>(), 1.0 / std::sqrt(40.0));
  EXPECT_GT(w2.abs().max().item<double>(), 0.9 / std::sqrt(40.0));
  const at::Tensor emb = pa["tok_embeddings.weight"];
  EXPECT_NEAR(emb.std().item<double>(), 1.0, 0.1);
  EXPECT_NEAR(emb.mean().item<double>(), 0.0, 0.1);
}

TEST(DeferredInit, DoesNotUseTheGlobalGenerator) {
  const ModelConfig config = small_config();
  torch::manual_seed(1);
  auto a = build_transformer(config, 3, c10::Device(c10::kCPU));
  torch::manual_seed(2);
  auto b = build_transformer(config, 3, c10::Device(c10::kCPU));
  for (const auto& item : a->named_parameters()) EXPECT_TRUE(item.value().equal(b->named_parameters()[item.key()]));
}

TEST(DeferredInit, RejectsAModuleWithoutARule) {
  struct Odd : torch::nn::Module {
    Odd() { register_parameter("w", at::ones({2})); }
  };
  Odd odd;
  try {
    fsdp_train::init_parameters(odd, "odd.", 0);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'odd.w'"), std::string::npos) << e.what();
  }
}

// Sharded at 1 to 4 ranks (block by block, as the trainer does), the
// gathered parameters equal the unsharded build bit for bit; and each block
// is handed over whole and sharded before the next one is built, so the
// earlier blocks are only this rank's rows.
TEST(DeferredInit, ShardedValuesDoNotDependOnTheWorldSize) {
  for (int world_size : {1, 2, 3, 4}) {
    fsdp::testing::run_distributed(world_size, [](fsdp::testing::RankContext& ctx) {
      const ModelConfig config = small_config();
      auto reference = build_transformer(config, /*seed=*/11, c10::Device(c10::kCPU));
      fsdp::FullyShardOptions options;
      options.mesh = ctx.mesh();
      const int64_t block = fsdp_train::block_parameter_count(config);
      std::shared_ptr<fsdp_train::Transformer> model;
      int64_t blocks_seen = 0, earlier_blocks_local = 0;
      model = build_transformer(config, 11, c10::Device(c10::kCPU), [&](fsdp_train::Block& b) {
        int64_t full = 0;
        for (const auto& p : b->parameters()) full += p.numel();
        EXPECT_EQ(full, block) << "block " << blocks_seen << " is handed over whole, before sharding";
        fsdp::fully_shard(b, options);
        for (const auto& p : b->parameters()) earlier_blocks_local += p.numel();
        ++blocks_seen;
      });
      if (ctx.world_size() > 1) {
        EXPECT_LT(earlier_blocks_local, config.layers * block) << "the blocks were not sharded while being built";
      }
      EXPECT_EQ(blocks_seen, config.layers);
      fsdp::fully_shard(model, options);
      const auto ref = reference->named_parameters();
      const auto sharded = model->named_parameters();
      ASSERT_EQ(sharded.size(), ref.size());
      for (const auto& item : ref) {
        const at::Tensor* p = sharded.find(item.key());
        ASSERT_NE(p, nullptr) << item.key();
        const at::Tensor full = fsdp::DTensor::from_local(p->detach().contiguous(), ctx.mesh(),
                                                          {fsdp::Placement::shard(0)}, item.value().sizes().vec())
                                    .full_tensor();
        EXPECT_TRUE(full.equal(item.value())) << item.key() << " at world size " << ctx.world_size();
      }
    });
  }
}

}  // namespace
}  // namespace fsdp_train_test
