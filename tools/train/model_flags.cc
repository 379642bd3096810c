#include "model_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

namespace {
const fsdp_train::TrainConfig kDefaults;
}  // namespace

ABSL_FLAG(int64_t, global_batch, kDefaults.global_batch,
          "Sequences per step over all ranks; must be divisible by the world size.");
ABSL_FLAG(int64_t, seq_len, kDefaults.seq_len, "Tokens per sequence.");
ABSL_FLAG(int64_t, layers, kDefaults.layers, "Transformer blocks (each one fully_shard group).");
ABSL_FLAG(int64_t, dim, kDefaults.dim, "Model width.");
ABSL_FLAG(int64_t, heads, kDefaults.heads, "Attention heads; must divide --dim into an even head size.");
ABSL_FLAG(int64_t, kv_heads, kDefaults.kv_heads,
          "Key/value heads (grouped-query attention); must divide --heads; 0: as many as --heads.");
ABSL_FLAG(int64_t, hidden, kDefaults.hidden, "SwiGLU hidden size; 0: 8/3 * dim rounded up to 16.");
ABSL_FLAG(int64_t, vocab, kDefaults.vocab,
          "Vocabulary size, at least 256 (the byte-level corpus's); a larger one (e.g. 128256, Llama 3's) only adds "
          "embedding and output rows that no byte token uses.");
ABSL_FLAG(double, clip, kDefaults.clip, "Max global gradient norm (fsdp::clip_grad_norm_); 0: no clipping.");
ABSL_FLAG(bool, reshard_after_forward, kDefaults.reshard_after_forward,
          "fully_shard's reshard_after_forward for the blocks (false: keep their parameters gathered until "
          "backward).");
ABSL_FLAG(int64_t, prefetch, kDefaults.prefetch,
          "Explicit prefetch: each block all-gathers the next N blocks when its forward starts and the previous N "
          "when its backward starts; 0: FSDP2's implicit prefetching (one block ahead in backward).");
ABSL_FLAG(std::string, mesh, "", "RxS: replicate x shard ranks (HSDP when R > 1); default 1 x world size.");
ABSL_FLAG(std::string, param_dtype, kDefaults.param_dtype, "fp32, bf16 or fp16: MixedPrecisionPolicy.param_dtype.");
ABSL_FLAG(std::string, reduce_dtype, kDefaults.reduce_dtype, "fp32, bf16 or fp16: MixedPrecisionPolicy.reduce_dtype.");
ABSL_FLAG(std::string, ac, kDefaults.ac,
          "Activation checkpointing of the blocks: none, full (each checkpointed block keeps only its input "
          "through forward and is recomputed in backward), selective (full, but the outputs of the matmuls and "
          "attention are kept, not recomputed) or torchtitan (selective with torchtitan's refinement: every other "
          "matmul output is recomputed).");
ABSL_FLAG(bool, cpu_offload, kDefaults.cpu_offload,
          "CUDA: keep the sharded parameters, gradients and AdamW state in pinned host memory (fully_shard's "
          "OffloadPolicy::offload_to_cpu; the optimizer steps on the CPU).");
ABSL_FLAG(int64_t, ac_every, kDefaults.ac_every, "With --ac: checkpoint every this many blocks (0, N, 2N, ...).");
ABSL_FLAG(int64_t, threads, kDefaults.threads,
          "Intra-op threads per rank; 0: the cores divided among the local ranks.");

namespace fsdp_train {

void apply_model_flags(TrainConfig& config) {
  config.global_batch = absl::GetFlag(FLAGS_global_batch);
  config.seq_len = absl::GetFlag(FLAGS_seq_len);
  config.layers = absl::GetFlag(FLAGS_layers);
  config.dim = absl::GetFlag(FLAGS_dim);
  config.heads = absl::GetFlag(FLAGS_heads);
  config.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  config.hidden = absl::GetFlag(FLAGS_hidden);
  config.vocab = absl::GetFlag(FLAGS_vocab);
  config.clip = absl::GetFlag(FLAGS_clip);
  config.reshard_after_forward = absl::GetFlag(FLAGS_reshard_after_forward);
  config.prefetch = absl::GetFlag(FLAGS_prefetch);
  config.mesh = absl::GetFlag(FLAGS_mesh);
  config.param_dtype = absl::GetFlag(FLAGS_param_dtype);
  config.reduce_dtype = absl::GetFlag(FLAGS_reduce_dtype);
  config.ac = absl::GetFlag(FLAGS_ac);
  config.ac_every = absl::GetFlag(FLAGS_ac_every);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.cpu_offload = absl::GetFlag(FLAGS_cpu_offload);
}

}  // namespace fsdp_train
