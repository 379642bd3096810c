#include "init.h"

#include <cmath>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace fsdp_train {

namespace {

// splitmix64's finaliser: spreads a 64-bit value over all bits, so that
// nearby seeds give unrelated generator streams.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One parameter's values, drawn on the CPU from its own generator and copied
// into it (on any device).
void fill(at::Tensor& param, const std::string& fqn, int64_t seed, const torch::nn::Module& owner) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(parameter_seed(seed, fqn));
  at::Tensor values = at::empty(param.sizes(), param.options().device(c10::kCPU).dtype(at::kFloat));
  if (dynamic_cast<const torch::nn::LinearImpl*>(&owner) != nullptr && param.dim() == 2) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(param.size(1)));
    values.uniform_(-bound, bound, gen);
  } else if (dynamic_cast<const torch::nn::EmbeddingImpl*>(&owner) != nullptr) {
    values.normal_(0.0, 1.0, gen);
  } else if (dynamic_cast<const RMSNormImpl*>(&owner) != nullptr) {
    values.fill_(1.0);
  } else {
    TORCH_CHECK(false, "init_parameters: no init rule for parameter '", fqn, "' of a ", owner.name(),
                " (rules exist for Linear weights, Embedding and RMSNorm); add one in tools/train/init.cc");
  }
  param.copy_(values);
}

}  // namespace

uint64_t parameter_seed(int64_t seed, const std::string& fqn) {
  // FNV-1a over the name: fixed by the name alone, unlike std::hash.
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char ch : fqn) h = (h ^ ch) * 0x100000001b3ULL;
  return mix(h ^ mix(static_cast<uint64_t>(seed)));
}

void init_parameters(torch::nn::Module& module, const std::string& prefix, int64_t seed) {
  const torch::NoGradGuard no_grad;
  // The module itself, then its descendants (named_modules' include_self
  // would need the module to be owned by a shared_ptr).
  for (auto& param : module.named_parameters(/*recurse=*/false))
    fill(param.value(), prefix + param.key(), seed, module);
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    for (auto& param : item.value()->named_parameters(/*recurse=*/false)) {
      fill(param.value(), prefix + item.key() + "." + param.key(), seed, *item.value());
    }
  }
}

std::shared_ptr<Transformer> build_transformer(const ModelConfig& config, int64_t seed, const c10::Device& device,
                                               const std::function<void(Block&)>& on_block) {
  auto model = std::make_shared<Transformer>(config, /*with_blocks=*/false);
  init_parameters(*model, "", seed);
  model->to(device);
  for (int64_t i = 0; i < config.layers; ++i) {
    Block block(config);
    init_parameters(*block, "layers." + std::to_string(i) + ".", seed);
    block->to(device);
    model->append_block(block);
    if (on_block) on_block(model->blocks.back());
  }
  return model;
}

}  // namespace fsdp_train
