// The flags that describe the trainer's model and its sharding, shared by
// fsdp_train and fsdp_plan so that a plan is made for exactly the job the
// same command line would train (same names, defaults and help).
//
//   fsdp_train::TrainConfig config;   // the defaults
//   fsdp_train::apply_model_flags(config);
//
// The flags are defined in this library (fsdp_train_model_flags), so a
// program links it only when it has no flags of these names of its own.
#pragma once

#include "config.h"

namespace fsdp_train {

// Sets the model, batch, sharding, precision, offload, activation
// checkpointing and intra-op threads fields of `config` from their flags (--global-batch,
// --seq-len, --layers, --dim, --heads, --kv-heads, --hidden, --vocab,
// --clip, --reshard-after-forward, --mesh, --param-dtype, --reduce-dtype,
// --ac, --ac-every, --threads, --cpu-offload). Call after the command line is parsed; the
// values are checked by validate() (config.h), not here.
void apply_model_flags(TrainConfig& config);

}  // namespace fsdp_train
