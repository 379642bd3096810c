// TinyLM: a small language model written the way a LibTorch user writes one,
// with what fully_shard has to cope with in real models: a Sequential stem
// holding a nested container, a ModuleList of residual blocks, and an output
// projection tied to the token embedding. docs/porting.md quotes it.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp2/module_call.h"

namespace tiny_lm {

struct Config {
  int64_t vocab = 32;
  int64_t dim = 16;
  int64_t hidden = 40;
  int64_t blocks = 3;
};

// A torch::nn::Sequential cannot hold another Sequential: AnyModule needs a
// non-template forward() and Sequential's is a template (LibTorch stops with
// a static assertion). A module with a forward of its own that holds the
// inner Sequential nests fine; FSDP2CPP_MODULE (or TORCH_MODULE) makes it a
// holder the outer Sequential takes.
struct NestedImpl : torch::nn::Module {
  explicit NestedImpl(fsdp::Sequential inner) : inner(register_module("inner", std::move(inner))) {}
  at::Tensor forward(const at::Tensor& x) { return inner(x); }
  fsdp::Sequential inner;
};
FSDP2CPP_MODULE(Nested);

// Pre-norm residual MLP block: the unit we shard on its own.
struct ResidualImpl : torch::nn::Module {
  ResidualImpl(int64_t dim, int64_t hidden)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        up(register_module("up", torch::nn::Linear(dim, hidden))),
        down(register_module("down", torch::nn::Linear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
FSDP2CPP_MODULE(Residual);  // block(x) runs fully_shard's hooks

// A Sequential stem: Linear, GELU, and a nested Sequential (through Nested).
inline fsdp::Sequential make_stem(int64_t dim) {
  Nested inner(fsdp::Sequential(torch::nn::Linear(dim, dim), torch::nn::Tanh()));
  return fsdp::Sequential(torch::nn::Linear(dim, dim), torch::nn::GELU(), inner);
}

struct TinyLM : torch::nn::Module {
  explicit TinyLM(const Config& c)
      : embed(register_module("embed", torch::nn::Embedding(c.vocab, c.dim))),
        stem(register_module("stem", make_stem(c.dim))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})))) {
    for (int64_t i = 0; i < c.blocks; ++i) {
      residuals.push_back(Residual(c.dim, c.hidden));
      blocks->push_back(residuals.back());  // FQNs blocks.0.up.weight, ...
    }
  }

  // tokens [batch, seq] -> logits [batch, seq, vocab]
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = stem(embed(tokens));  // fsdp::Sequential: each child through its hooks
    for (auto& block : residuals) h = block(h);
    return at::linear(norm(h), embed->weight);  // the output projection is the embedding, tied
  }

  // Not forward: fully_shard's hooks do not run around it, so on a sharded
  // model it must be called between FSDPModule::unshard() and reshard().
  at::Tensor embedding_norms() const { return embed->weight.norm(2, {1}); }

  torch::nn::Embedding embed;
  fsdp::Sequential stem;
  torch::nn::ModuleList blocks;  // registers the blocks (their names) ...
  torch::nn::LayerNorm norm;
  std::vector<Residual> residuals;  // ... and this keeps them typed, to call and to shard
};

}  // namespace tiny_lm
