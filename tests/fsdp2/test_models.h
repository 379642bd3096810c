// Small models for the fsdp2 tests, written the way users write LibTorch
// models, with FSDP2CPP_MODULE holders so that calls go through the hooks.
// Sizes are chosen so that shards are uneven and some ranks hold zero rows
// at world size 4.
#pragma once

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/functional.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/utils.h>

#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"

namespace fsdp::test {

// A model whose forward(x, y) returns a scalar loss and which exposes the
// submodules a test may shard on their own.
struct LossModel : torch::nn::Module {
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& y) = 0;
  virtual std::vector<std::shared_ptr<torch::nn::Module>> blocks() = 0;
};

struct MLPBlockImpl : torch::nn::Module {
  MLPBlockImpl(int64_t in, int64_t out) : fc(register_module("fc", torch::nn::Linear(in, out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(MLPBlock);

// 7 -> 13 -> 10 -> 3: weights of 13, 10 and 3 rows.
// A sharded block and head plus a parameter `scale` that tests leave out of
// sharding (ignored_params): full on every rank, scaling the output.
struct WithScale : torch::nn::Module {
  WithScale()
      : block(register_module("block", MLPBlock(7, 13))),
        head(register_module("head", torch::nn::Linear(13, 3))),
        scale(register_parameter("scale", at::full({5}, 0.5))) {}
  at::Tensor forward(const at::Tensor& x) { return head(block(x)) * scale.sum(); }
  MLPBlock block;
  torch::nn::Linear head;
  at::Tensor scale;
};

// Two WithScale of the same initial values: one to shard, one reference.
inline std::pair<std::shared_ptr<WithScale>, std::shared_ptr<WithScale>> with_scale_twins() {
  torch::manual_seed(0);
  auto model = std::make_shared<WithScale>();
  torch::manual_seed(0);
  return {model, std::make_shared<WithScale>()};
}

// 7 -> 13 -> `width` -> 3.
struct MLP : LossModel {
  explicit MLP(int64_t width = 10)
      : b0(register_module("b0", MLPBlock(7, 13))),
        b1(register_module("b1", MLPBlock(13, width))),
        head(register_module("head", torch::nn::Linear(width, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) override {
    return torch::nn::functional::mse_loss(head(b1(b0(x))), y);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() override { return {b0.ptr(), b1.ptr()}; }
  MLPBlock b0, b1;
  torch::nn::Linear head;
};

struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t dim, int64_t heads, int64_t hidden)
      : heads(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        // No qkv bias: the key bias has a zero true gradient (softmax ignores
        // a per-query constant), whose rounding noise AdamW would amplify.
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(dim, 3 * dim).bias(false)))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}

  at::Tensor forward(const at::Tensor& x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto q_k_v = qkv(ln1(x)).view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto scores = at::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto mask = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
    auto attn = at::softmax(scores.masked_fill(mask, -1e9), -1);
    auto h = x + proj(at::matmul(attn, q_k_v[2]).transpose(1, 2).reshape({b, t, d}));
    return h + fc2(at::gelu(fc1(ln2(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};
FSDP2CPP_MODULE(TransformerBlock);

// Decoder-only LM: vocab 17, dim 12, 2 heads, 2 blocks; the output projection
// is tied to the token embedding.
struct Transformer : LossModel {
  static constexpr int64_t kVocab = 17, kDim = 12, kSeq = 6;
  Transformer()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kDim))),
        pos(register_parameter("pos", at::randn({kSeq, kDim}) * 0.1)),
        layers(register_module("layers", torch::nn::ModuleList())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))) {
    for (int i = 0; i < 2; ++i) {
      blocks_.push_back(TransformerBlock(kDim, 2, 20));
      layers->push_back(blocks_.back());
    }
  }
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& targets) override {
    auto h = tok(tokens) + pos.narrow(0, 0, tokens.size(1));
    for (auto& block : blocks_) h = block(h);
    auto logits = at::linear(norm(h), tok->weight);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() override {
    std::vector<std::shared_ptr<torch::nn::Module>> result;
    for (auto& b : blocks_) result.push_back(b.ptr());
    return result;
  }
  torch::nn::Embedding tok;
  at::Tensor pos;
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm norm;
  std::vector<TransformerBlock> blocks_;
};

}  // namespace fsdp::test
