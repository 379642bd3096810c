#include "model.h"

#include <string>
#include <utility>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/outer.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>

namespace fsdp_train {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps(eps) { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  // In fp32 whatever the compute dtype, as Llama does: the mean of squares
  // loses too much in bf16.
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * (xf.pow(2).mean({-1}, /*keepdim=*/true) + eps).rsqrt();
  return normed.to(x.scalar_type()) * weight;
}

RotaryTables rotary_tables(int64_t max_seq_len, int64_t head_dim, double theta) {
  TORCH_CHECK(head_dim % 2 == 0, "rotary_tables: head_dim must be even, got ", head_dim);
  const at::Tensor exponents = at::arange(0, head_dim, 2, at::kDouble) / static_cast<double>(head_dim);
  const at::Tensor inv_freq = at::pow(theta, -exponents);                               // [head_dim / 2]
  const at::Tensor angles = at::outer(at::arange(max_seq_len, at::kDouble), inv_freq);  // [seq, head_dim / 2]
  return {angles.cos().to(at::kFloat), angles.sin().to(at::kFloat)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t seq = x.size(-2), half = x.size(-1) / 2;
  const at::Tensor c = cos.narrow(0, 0, seq).to(x.scalar_type());
  const at::Tensor s = sin.narrow(0, 0, seq).to(x.scalar_type());
  const at::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, -1);
}

int64_t kv_head_count(const ModelConfig& config) { return config.kv_heads > 0 ? config.kv_heads : config.heads; }

AttentionImpl::AttentionImpl(const ModelConfig& config) : heads(config.heads), kv_heads(kv_head_count(config)) {
  TORCH_CHECK(heads % kv_heads == 0, "Attention: kv_heads (", kv_heads, ") must divide heads (", heads, ")");
  const int64_t d = config.dim, kv_dim = kv_heads * (d / heads);
  qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(d, d + 2 * kv_dim).bias(false)));
  proj = register_module("proj", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
  // [b, t, heads + 2 * kv_heads, hd] -> [b, heads + 2 * kv_heads, t, hd]: q's heads, k's, v's.
  const at::Tensor q_k_v = qkv(x).view({b, t, heads + 2 * kv_heads, hd}).transpose(1, 2);
  const at::Tensor q = apply_rotary(q_k_v.narrow(1, 0, heads), cos, sin);
  at::Tensor k = apply_rotary(q_k_v.narrow(1, heads, kv_heads), cos, sin);
  at::Tensor v = q_k_v.narrow(1, heads + kv_heads, kv_heads);
  if (kv_heads != heads) {  // key/value head j serves query heads [j * group, (j + 1) * group)
    const int64_t group = heads / kv_heads;
    k = k.repeat_interleave(group, /*dim=*/1);
    v = v.repeat_interleave(group, /*dim=*/1);
  }
  const at::Tensor out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                          /*is_causal=*/true);
  return proj(out.transpose(1, 2).reshape({b, t, d}));
}

FeedForwardImpl::FeedForwardImpl(const ModelConfig& config) {
  const int64_t d = config.dim, h = config.hidden;
  w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(d, h).bias(false)));
  w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(h, d).bias(false)));
  w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(d, h).bias(false)));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }

BlockImpl::BlockImpl(const ModelConfig& config) {
  attention_norm = register_module("attention_norm", RMSNorm(config.dim, config.norm_eps));
  attention = register_module("attention", Attention(config));
  ffn_norm = register_module("ffn_norm", RMSNorm(config.dim, config.norm_eps));
  feed_forward = register_module("feed_forward", FeedForward(config));
}

at::Tensor BlockImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor h = x + attention(attention_norm(x), cos, sin);
  return h + feed_forward(ffn_norm(h));
}

Transformer::Transformer(const ModelConfig& config, bool with_blocks) : config(config) {
  tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(config.vocab, config.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; with_blocks && i < config.layers; ++i) append_block(Block(config));
  norm = register_module("norm", RMSNorm(config.dim, config.norm_eps));
  output = register_module("output", torch::nn::Linear(torch::nn::LinearOptions(config.dim, config.vocab).bias(false)));
  RotaryTables rope = rotary_tables(config.max_seq_len, config.dim / config.heads, config.rope_theta);
  rope_cos = register_buffer("rope_cos", rope.cos);
  rope_sin = register_buffer("rope_sin", rope.sin);
}

void Transformer::append_block(Block block) {
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) < config.layers, "Transformer::append_block: the model already has ",
              blocks.size(), " of its ", config.layers, " blocks");
  blocks.push_back(std::move(block));
  layers->push_back(blocks.back());
}

at::Tensor Transformer::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) <= config.max_seq_len,
              "Transformer: expected tokens [batch, seq<=", config.max_seq_len, "], got ", tokens.sizes());
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == config.layers, "Transformer: built with ", blocks.size(), " of ",
              config.layers, " blocks; append the rest (append_block) before calling it");
  at::Tensor h = tok_embeddings(tokens);
  for (auto& block : blocks) h = block(h, rope_cos, rope_sin);  // through the FSDP hooks
  return output(norm(h));
}

int64_t block_parameter_count(const ModelConfig& c) {
  // qkv (q: dim rows, k and v: kv_heads * head_dim rows each) + proj, w1 + w2
  // + w3, two norms.
  const int64_t kv_dim = kv_head_count(c) * (c.dim / c.heads);
  return c.dim * (c.dim + 2 * kv_dim) + c.dim * c.dim + 3 * c.dim * c.hidden + 2 * c.dim;
}

int64_t parameter_count(const ModelConfig& c) {
  // Embeddings, output projection, final norm, blocks.
  return 2 * c.vocab * c.dim + c.dim + c.layers * block_parameter_count(c);
}

}  // namespace fsdp_train
