// The trainer's model (tools/train) sharded and stepped as fsdp_train's
// run_training does it, on any device and mesh: on the meta device of a dry
// run (fsdp_plan::DryRun) to predict a rank's memory, and on the CPU with
// real ranks to measure it, with the same code.
//
//   fsdp_plan::DryRun dry(options);
//   fsdp_plan_tool::ShardedTrainer trainer = fsdp_plan_tool::shard_trainer(config, dry.mesh(), c10::kMeta);
//   dry.track(trainer.model);
//   fsdp_plan_tool::train_step(trainer, config, /*local_batch=*/4, [&](auto phase) { dry.begin(phase); });
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include "config.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/fully_shard.h"
#include "fsdp_plan/dry_run.h"
#include "fsdp_plan/timeline.h"
#include "model.h"

namespace fsdp_plan_tool {

struct ShardedTrainer {
  std::shared_ptr<fsdp_train::Transformer> model;
  std::optional<fsdp::FSDPModule> root;
  std::unique_ptr<torch::optim::AdamW> optim;
  // Where the batches go: the mesh's device (the shards may be on the host,
  // with --cpu-offload).
  c10::Device device = c10::Device(c10::kCPU);
  int64_t parameters = 0;        // the whole model's
  int64_t local_parameters = 0;  // this rank's rows
};

// The model of `config` (fsdp_train::model_config: --layers, --dim, --heads,
// --kv-heads, --hidden, --vocab, --seq-len),
// each block checkpointed as --ac / --ac-every say and sharded with
// --reshard-after-forward, --param-dtype, --reduce-dtype, --cpu-offload, then the root, and
// AdamW over the shards: what run_training builds. REQUIRES:
// fsdp_train::validate(config, mesh.size()) is OK. Collective over the mesh.
ShardedTrainer shard_trainer(const fsdp_train::TrainConfig& config, const fsdp::DeviceMesh& mesh,
                             const c10::Device& device);

// One training step as run_training's loop runs it: zero_grad, forward of
// `local_batch` sequences of random tokens, cross-entropy in float32,
// backward, gradient clipping (--clip), the optimizer step. `on_phase` is
// called as the forward, backward and optimizer phases start.
void train_step(ShardedTrainer& trainer, const fsdp_train::TrainConfig& config, int64_t local_batch,
                const std::function<void(fsdp_plan::StepPhase)>& on_phase = {});

// A dry run of `steps` steps of the trainer at `options` (world size, rank,
// mesh from config.mesh, engine) with `local_batch` sequences per rank.
// Throws c10::Error naming the flag when config fails
// fsdp_train::validate_model (e.g. --kv-heads that does not divide --heads).
struct TrainerPlan {
  fsdp_plan::MemoryReport memory;
  std::vector<fsdp_plan::CollectiveRecord> collectives;
  std::vector<fsdp_plan::OpRecord> ops;  // every kernel and collective, for the time model
  int64_t parameters = 0;
  int64_t local_parameters = 0;
  int64_t embedding_parameters = 0;  // the token embedding's (not counted in MFU's 6N)
};
TrainerPlan plan_trainer(const fsdp_train::TrainConfig& config, fsdp_plan::DryRunOptions options, int64_t local_batch,
                         int steps);

// The time of step `steps` of `plan` under `profile`, with `local_batch`
// sequences of config.seq_len tokens per rank. MFU counts model FLOPs as
// torchtitan does: 6 per parameter and token (the token embedding's
// excluded) and 12 * layers * dim * seq_len per token for attention.
fsdp_plan::StepTime simulate_trainer(const TrainerPlan& plan, const fsdp_train::TrainConfig& config,
                                     int64_t local_batch, int steps, const fsdp_plan::DeviceProfile& profile);

// The largest local batch (sequences per rank) whose predicted peak reserved
// memory fits in `memory_bytes`, searched by doubling and bisection over dry
// runs of one step... two steps (the second holds the optimizer state); 0 when
// not even one sequence fits. At most `max_batch`.
int64_t largest_local_batch(const fsdp_train::TrainConfig& config, const fsdp_plan::DryRunOptions& options,
                            int64_t memory_bytes, int64_t max_batch = 1 << 16);

}  // namespace fsdp_plan_tool
