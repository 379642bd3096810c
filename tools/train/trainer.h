// One rank of the sharded training run: build the mesh and the model, shard
// it, train, report. Every rank of the job calls run_training with the same
// config; rank 0 prints and writes --json.
//
//   auto world = fsdp::collectives::World::from_env();
//   fsdp_train::run_training(config, world);
#pragma once

#include <memory>

#include "collectives/world.h"
#include "config.h"

namespace fsdp_train {

// Trains as this process's rank of `world`. REQUIRES: validate(config,
// world->size()) is OK. Throws c10::Error (or std::runtime_error for data
// and file errors) on failure; collective over every rank of `world`.
void run_training(const TrainConfig& config, const std::shared_ptr<fsdp::collectives::World>& world);

}  // namespace fsdp_train
