// The trainer's model: a small decoder-only transformer in the Llama style,
// written as an ordinary LibTorch model and made ready for fully_shard.
//
//   tokens -> tok_embeddings -> layers[0..N) -> norm -> output -> logits
//   Block(x) = h + feed_forward(ffn_norm(h)),  h = x + attention(attention_norm(x))
//
// RMSNorm, rotary position embeddings (RoPE), causal self-attention (grouped
// query attention when kv_heads < heads) and a SwiGLU MLP, with no biases. The only FSDP-specific line is the holder of
// Block: FSDP2CPP_MODULE instead of TORCH_MODULE, so that `block(x, ...)`
// runs the forward hooks fully_shard installs on each block. Submodules that
// are not sharded on their own (the norms, attention, MLP inside a block)
// keep TORCH_MODULE. See docs/trainer.md.
//
//   fsdp_train::ModelConfig cfg;
//   cfg.dim = 64;
//   cfg.layers = 2;
//   auto model = std::make_shared<fsdp_train::Transformer>(cfg);
//   at::Tensor logits = fsdp::call_module(*model, tokens);   // [batch, seq, vocab]
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "fsdp2/module_call.h"

namespace fsdp_train {

struct ModelConfig {
  int64_t vocab = 256;  // byte-level; a larger vocabulary only adds rows no token uses
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  // Key/value heads (grouped-query attention); 0: `heads` (multi-head
  // attention). REQUIRES: divides heads.
  int64_t kv_heads = 0;
  int64_t hidden = 176;  // SwiGLU hidden size
  int64_t max_seq_len = 64;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
};

// Root-mean-square layer norm: x / rms(x) * weight, computed in fp32.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding tables for positions [0, max_seq_len): cos and
// sin of position * theta^(-2i / head_dim), each [max_seq_len, head_dim / 2].
struct RotaryTables {
  at::Tensor cos;
  at::Tensor sin;
};
RotaryTables rotary_tables(int64_t max_seq_len, int64_t head_dim, double theta);

// Rotates the two halves of the last dim of x [batch, heads, seq, head_dim]
// by the angles of positions [0, seq).
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The key/value heads of `config`: kv_heads, or heads when kv_heads is 0.
int64_t kv_head_count(const ModelConfig& config);

// Causal self-attention with rotary embeddings on q and k. With kv_heads <
// heads it is grouped-query attention (Llama 2 70B, Llama 3): q has `heads`
// heads, k and v have kv_heads, and each key/value head serves heads /
// kv_heads consecutive query heads (repeat_interleave over the head dim, as
// Llama's and torchtitan's repeat_kv do) before scaled dot-product attention.
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  int64_t heads;
  int64_t kv_heads;
  // dim -> (heads + 2 * kv_heads) * head_dim: the rows of q, then k, then v
  // (3 * dim when kv_heads == heads).
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(Attention);

// SwiGLU MLP: w2(silu(w1 x) * w3 x).
struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(const ModelConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

// One transformer block: the unit fully_shard shards (one all-gather and one
// reduce-scatter per block per step).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const ModelConfig& config);
  // x [batch, seq, dim]; cos/sin: the model's rotary tables.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  RMSNorm attention_norm{nullptr};
  Attention attention{nullptr};
  RMSNorm ffn_norm{nullptr};
  FeedForward feed_forward{nullptr};
};
// Calls go through fsdp::call_module, so fully_shard(block) takes effect.
FSDP2CPP_MODULE(Block);

// The whole model. Called through fsdp::call_module(*model, tokens) once the
// root is sharded.
struct Transformer : torch::nn::Module {
  // With with_blocks false, `layers` starts empty and the blocks are added
  // with append_block (deferred init, see init.h).
  explicit Transformer(const ModelConfig& config, bool with_blocks = true);
  // Registers `block` as layers.<blocks.size()>. REQUIRES: fewer than
  // config.layers blocks so far.
  void append_block(Block block);
  // tokens [batch, seq] (int64, seq <= max_seq_len) -> logits [batch, seq, vocab].
  at::Tensor forward(const at::Tensor& tokens);

  ModelConfig config;
  torch::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};  // registers the blocks as layers.0, layers.1, ...
  std::vector<Block> blocks;              // the same blocks, typed, for calls and fully_shard
  RMSNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
  // Rotary tables (buffers: they follow .to(device); fully_shard leaves them alone).
  at::Tensor rope_cos, rope_sin;
};

// Parameters of one block, and of the whole model, of `config` (the counts
// fully_shard divides among the ranks).
int64_t block_parameter_count(const ModelConfig& config);
int64_t parameter_count(const ModelConfig& config);

}  // namespace fsdp_train
