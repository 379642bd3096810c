// The models the planner's tests predict and measure, each built, sharded and
// stepped by one function on any mesh and device: the meta device of a dry
// run (prediction) and the CPU with real ranks (measurement) run the same
// code. The trainer's model (tools/train), a deep MLP with uneven widths, and
// an embedding "mixer" with layer norms and GELU. All train in float32: on
// the CPU, bf16 matmuls go through oneDNN, whose scratch buffers (kernel
// workspaces, which a dry run does not model) reach a few hundred KiB.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp_plan/dry_run.h"
#include "trainer_plan.h"

namespace fsdp_plan::test {

using PhaseFn = std::function<void(StepPhase)>;

// A sharded model with its optimizer and one training step.
struct Runner {
  std::string name;
  std::shared_ptr<torch::nn::Module> model;
  std::function<void(const PhaseFn&)> step;
};

// The trainer's configuration with this model shape, every other setting
// fsdp_train's default.
inline fsdp_train::TrainConfig trainer_shape(int64_t layers, int64_t dim, int64_t heads, int64_t seq_len) {
  fsdp_train::TrainConfig c;
  c.layers = layers;
  c.dim = dim;
  c.heads = heads;
  c.seq_len = seq_len;
  return c;
}

// The trainer's model as fsdp_train shards it: 2 blocks, dim 128, 4 heads,
// seq 64, 4 sequences per rank.
inline fsdp_train::TrainConfig trainer_config() { return trainer_shape(2, 128, 4, 64); }

inline Runner trainer_runner(const fsdp::DeviceMesh& mesh, const c10::Device& device) {
  const fsdp_train::TrainConfig c = trainer_config();
  auto t = std::make_shared<fsdp_plan_tool::ShardedTrainer>(fsdp_plan_tool::shard_trainer(c, mesh, device));
  return {"trainer", t->model, [t, c](const PhaseFn& phase) { fsdp_plan_tool::train_step(*t, c, 4, phase); }};
}

struct DenseBlockImpl : torch::nn::Module {
  DenseBlockImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(DenseBlock);

// 6 blocks of widths 700 -> 901 -> 700 -> ... (901 rows shard unevenly at
// 2, 3 and 4 ranks), a head of 10 classes; batch 64 per rank.
struct DeepMLP : torch::nn::Module {
  DeepMLP() {
    for (int i = 0; i < 6; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), DenseBlock(i % 2 ? 901 : 700, i % 2 ? 700 : 901)));
    }
    head = register_module("head", torch::nn::Linear(700, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = b(h);
    return head(h);
  }
  std::vector<DenseBlock> blocks;
  torch::nn::Linear head{nullptr};
};

// `model` on `device`, each of its blocks sharded and then the root, AdamW,
// and a step of cross-entropy on the batch `make_batch` gives (inputs and
// class targets).
template <typename Model>
Runner classifier_runner(std::string name, std::shared_ptr<Model> model, const fsdp::DeviceMesh& mesh,
                         const c10::Device& device,
                         std::function<std::pair<at::Tensor, at::Tensor>(const c10::Device&)> make_batch) {
  model->to(device);
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  for (auto& b : model->blocks) fsdp::fully_shard(b, options);
  fsdp::fully_shard(model, options);
  auto optim = std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  return {std::move(name), model, [model, optim, device, make_batch](const PhaseFn& phase) {
            phase(StepPhase::kForward);
            optim->zero_grad();
            const auto [x, y] = make_batch(device);
            at::Tensor loss = at::cross_entropy_loss(fsdp::call_module(*model, x), y);
            phase(StepPhase::kBackward);
            loss.backward();
            loss.reset();
            phase(StepPhase::kOptimizer);
            optim->step();
          }};
}

inline Runner mlp_runner(const fsdp::DeviceMesh& mesh, const c10::Device& device) {
  return classifier_runner("deep MLP", std::make_shared<DeepMLP>(), mesh, device, [](const c10::Device& d) {
    at::Tensor x = at::randn({64, 700}, at::device(d));
    at::Tensor y = at::randint(10, {64}, at::device(d).dtype(at::kLong));
    return std::make_pair(std::move(x), std::move(y));
  });
}

struct MixerBlockImpl : torch::nn::Module {
  explicit MixerBlockImpl(int64_t dim)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        up(register_module("up", torch::nn::Linear(dim, 3 * dim))),
        down(register_module("down", torch::nn::Linear(3 * dim, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
FSDP2CPP_MODULE(MixerBlock);

// Token embedding (vocab 1000, dim 192), 3 residual blocks, mean over the
// sequence, a classifier; 8 sequences of 32 tokens per rank.
struct Mixer : torch::nn::Module {
  Mixer() {
    embed = register_module("embed", torch::nn::Embedding(1000, 192));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), MixerBlock(192)));
    classify = register_module("classify", torch::nn::Linear(192, 7));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = embed(tokens);
    for (auto& b : blocks) h = b(h);
    return classify(h.mean(1));
  }
  torch::nn::Embedding embed{nullptr};
  std::vector<MixerBlock> blocks;
  torch::nn::Linear classify{nullptr};
};

inline Runner mixer_runner(const fsdp::DeviceMesh& mesh, const c10::Device& device) {
  return classifier_runner("mixer", std::make_shared<Mixer>(), mesh, device, [](const c10::Device& d) {
    at::Tensor tokens = at::randint(1000, {8, 32}, at::device(d).dtype(at::kLong));
    at::Tensor y = at::randint(7, {8}, at::device(d).dtype(at::kLong));
    return std::make_pair(std::move(tokens), std::move(y));
  });
}

using RunnerFactory = Runner (*)(const fsdp::DeviceMesh&, const c10::Device&);

}  // namespace fsdp_plan::test
