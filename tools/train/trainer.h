// One rank of the sharded training run: build the mesh and the model, shard
// it, train, report. Every rank of the job calls run_training with the same
// config; rank 0 prints and writes --json.
//
//   auto world = fsdp::collectives::World::from_env();
//   fsdp_train::run_training(config, world);
#pragma once

#include <memory>
#include <vector>

#include "collectives/world.h"
#include "config.h"
#include "fsdp2/activation_checkpoint.h"
#include "model.h"
#include "report.h"

namespace fsdp_train {

// The model of `config` (--layers, --dim, --heads, --kv-heads, --hidden,
// --vocab, --seq-len as the longest sequence): what run_training builds, and
// what fsdp_plan plans.
ModelConfig model_config(const TrainConfig& config);

// What --ac checkpoints each chosen block with: full (nothing kept),
// selective (fsdp::selective_checkpoint_ops()) or torchtitan (the same, every
// other matmul output recomputed). The same for run_training and fsdp_plan.
fsdp::CheckpointOptions checkpoint_options(const TrainConfig& config);

// --prefetch N on the blocks of `model`, each already fully_shard-ed: block
// i's forward all-gathers blocks i+1..i+N, its backward blocks i-1..i-N (the
// order backward runs them). N = 0 changes nothing. The same for
// run_training and fsdp_plan.
void set_block_prefetch(const Transformer& model, int64_t prefetch);

// Trains as this process's rank of `world`. REQUIRES: validate(config,
// world->size()) is OK. Throws c10::Error (or std::runtime_error for data
// and file errors) on failure; collective over every rank of `world`.
// Returns what --compare-all-gather compares (the same on every rank).
struct TrainingResult {
  std::vector<StepRecord> records;
  // Bytes this rank received in all-gathers, per step (RuntimeStats), and
  // the number of all-gathers per step.
  double all_gather_bytes_per_step = 0;
  double all_gathers_per_step = 0;
};
TrainingResult run_training(const TrainConfig& config, const std::shared_ptr<fsdp::collectives::World>& world);

// --compare-all-gather: run_training twice, with --all-gather-dtype param
// and int8, then (rank 0) the table: all-gather bytes per step and per rank,
// median step time (slowest rank, the first step left out), final loss, and
// the largest |loss difference| over the steps. REQUIRES: validate() is OK
// and config.all_gather_dtype is int8.
void compare_all_gather_dtypes(const TrainConfig& config, const std::shared_ptr<fsdp::collectives::World>& world);

}  // namespace fsdp_train
