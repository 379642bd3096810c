// The trainer's configuration: every setting the flags carry, and the checks
// that run before any work starts.
//
//   fsdp_train::TrainConfig config = ...;            // from the flags
//   absl::Status ok = fsdp_train::validate(config, /*world_size=*/2);
//   if (!ok.ok()) { print ok.message(); exit 2; }    // names the flag
//
// Flag names: Abseil names flags with underscores (--global_batch). The
// trainer also accepts dashes (--global-batch, --no-reshard-after-forward):
// normalize_flag_names() rewrites the name part of every flag argument
// before absl::ParseCommandLine sees it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp_train {

// The defaults are the demo (`make demo`): about a minute on 2 CPU cores with
// 2 ranks, loss from ~5.6 to below 2.
struct TrainConfig {
  // Optimizer steps (one global batch each).
  int64_t steps = 250;
  // Sequences per step over all data-parallel ranks; must be divisible by
  // the world size so every rank gets the same number of rows.
  int64_t global_batch = 16;
  int64_t seq_len = 128;
  // Model shape. hidden == 0 picks SwiGLU's usual 8/3 * dim (rounded up to 16).
  int64_t layers = 4;
  int64_t dim = 128;
  int64_t heads = 4;
  // Key/value heads: grouped-query attention when fewer than heads (Llama 3.1
  // 8B: 32 heads, 8 KV heads); 0: as many as heads. Must divide heads.
  int64_t kv_heads = 0;
  int64_t hidden = 0;
  // Token embedding and output rows: 256 covers every byte of the corpus; a
  // larger vocabulary (a real tokenizer's, e.g. Llama 3's 128256) adds rows
  // the byte data never uses, for sizing runs.
  int64_t vocab = 256;
  // AdamW with linear warm-up and cosine decay to lr / 10.
  double lr = 1e-2;
  double weight_decay = 0.1;
  int64_t warmup = 20;
  // Max global gradient norm (fsdp::clip_grad_norm_); 0 disables clipping.
  double clip = 1.0;
  int64_t seed = 0;
  // "cpu" (Gloo) or "cuda" (NCCL, one rank per GPU).
  std::string device = "cpu";
  // Passed to fully_shard of every block (the root keeps FSDP2's default).
  bool reshard_after_forward = true;
  // Explicit prefetch: each block all-gathers the next `prefetch` blocks as
  // its forward starts, and the previous `prefetch` as its backward starts
  // (FSDPModule::set_modules_to_forward_prefetch and
  // set_modules_to_backward_prefetch); 0 keeps FSDP2's implicit prefetching
  // (backward all-gathers one block ahead, forward none).
  int64_t prefetch = 0;
  // Where to write the per-step record (rank 0); empty: nowhere.
  std::string json_path;
  // A text file to train on; empty: the corpus shipped in data/.
  std::string data_path;
  int64_t log_every = 25;
  // "RxS" (replicate x shard); empty: 1 x world size.
  std::string mesh;
  // fp32 | bf16 | fp16 (MixedPrecisionPolicy).
  std::string param_dtype = "fp32";
  std::string reduce_dtype = "fp32";
  // param | int8: what the blocks' all-gathers move. int8 sets
  // fsdp::Int8AllGather (fsdp2/custom_collectives.h) on every block: int8
  // values with an fp32 scale per 256 elements, dequantized before the
  // copy-out. The root (embeddings, final norm, output projection) keeps
  // the unquantized all-gather (docs/trainer.md says why).
  std::string all_gather_dtype = "param";
  // Train twice in one run, without and with --all-gather-dtype int8 (same
  // seed, data and ranks), and print the two side by side: all-gather bytes
  // per step, median step time, final loss, the largest loss difference.
  bool compare_all_gather = false;
  // OffloadPolicy::offload_to_cpu for every fully_shard call (CUDA only):
  // shards, gradients and AdamW state in pinned host memory.
  bool cpu_offload = false;
  // Intra-op threads per rank; 0: the machine's cores divided among the local ranks.
  int64_t threads = 0;
  // Activation checkpointing of the blocks (fsdp2/activation_checkpoint.h):
  // none; full (each checkpointed block keeps only its input through
  // forward and runs again in backward); selective (it also keeps the
  // outputs of its matmuls and attention, fsdp::selective_checkpoint_ops(),
  // and recomputes the rest). ac_every N checkpoints blocks 0, N, 2N, ...
  // (torchtitan's "every Nth block"). torchtitan: selective with
  // torchtitan's refinement, every other matmul output recomputed
  // (fsdp::CheckpointOptions::save_every_other_mm).
  std::string ac = "none";
  int64_t ac_every = 1;
  // The same model and loop without fully_shard, on one rank: the unsharded
  // LibTorch baseline of the benchmarks (tools/bench).
  bool no_shard = false;
  // Checkpoints (docs/checkpoints.md). With save_dir, a checkpoint
  // save_dir/step-N is written every save_every steps (0: only after the
  // last step) and after the last step of the run; keep > 0 keeps the newest
  // that many.
  std::string save_dir;
  int64_t save_every = 0;
  int64_t keep = 0;
  // Stage each checkpoint to host memory and write it on a background
  // thread while training goes on (at most one in flight).
  bool async_save = false;
  // Continue from the newest complete checkpoint in save_dir (a first run
  // when there is none), at any world size or mesh.
  bool resume = false;
  // Write the full model in the Hugging Face layout here after the last step.
  std::string export_hf;
  // Start from these weights (a Hugging Face layout, one of our checkpoints,
  // or a save directory); ignored when --resume finds a checkpoint.
  std::string init_from;
  // Stop after this step (0: run to `steps`); the learning-rate schedule
  // still spans `steps`, so a stopped run can be resumed as if uninterrupted.
  int64_t stop_after = 0;
  // --profile: write a Kineto trace (Chrome trace JSON) per rank into this
  // directory; empty: no profiling. --profile-steps "A:B" (profile.h).
  std::string profile_dir;
  std::string profile_steps;
};

// The mesh of --mesh: `replicate` x `shard` ranks.
struct MeshShape {
  int64_t replicate = 1;
  int64_t shard = 1;
};

// Parses --mesh ("RxS"; empty means 1 x world_size). Fails, naming --mesh,
// on malformed text or when R * S != world_size.
absl::StatusOr<MeshShape> parse_mesh(const std::string& text, int64_t world_size);

// Parses a dtype flag value (fp32 | bf16 | fp16). fp32 is the parameters' own
// dtype and maps to "unset" (std::nullopt), FSDP2's default policy.
absl::StatusOr<std::optional<c10::ScalarType>> parse_dtype(const std::string& flag, const std::string& text);

// The SwiGLU hidden size of `config` (config.hidden, or 8/3 * dim rounded up
// to a multiple of 16).
int64_t hidden_size(const TrainConfig& config);

// Checks every value that can be checked without starting anything, for a
// run over `world_size` ranks. The message names the flag and the value, e.g.
// "--heads must divide --dim (got 64 and 5)".
absl::Status validate(const TrainConfig& config, int64_t world_size);

// The checks of validate() on the model's shape alone (--layers, --dim,
// --heads, --kv-heads, --hidden, --vocab), which need no world size.
absl::Status validate_model(const TrainConfig& config);

// Checks that the device of --device can host `local_ranks` ranks on this
// machine (CUDA: present, and one GPU per local rank).
absl::Status check_device(const TrainConfig& config, int64_t local_ranks);

// argv with "--foo-bar[=v]" rewritten to "--foo_bar[=v]" (the name only, never
// the value; one or two leading dashes), and "--no-foo-bar" to
// "--nofoo_bar" when foo_bar is a flag. Arguments after "--" are kept as they
// are. Includes argv[0].
std::vector<std::string> normalize_flag_names(int argc, const char* const* argv);

// `args` without the flag `name` (underscore form) in any of its spellings:
// "--name=v", "-name=v", or "--name v" (two arguments).
std::vector<std::string> remove_flag(const std::vector<std::string>& args, const std::string& name);

}  // namespace fsdp_train
