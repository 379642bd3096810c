// Deferred initialisation of the trainer's model: build it one block at a
// time, each block initialised from (seed, parameter FQN) and handed to a
// callback (fully_shard) before the next one is made, so that no rank ever
// holds all of the model's full parameters, and the initial values do not
// depend on the world size.
//
//   auto model = fsdp_train::build_transformer(config, seed, device,
//       [&](fsdp_train::Block& block) { fsdp::fully_shard(block, options); });
//   fsdp::FSDPModule root = fsdp::fully_shard(model, options);
//
// LibTorch has no meta-device construction (an IncludeDispatchKeyGuard(Meta)
// does not make factory functions meta), so the model cannot be built
// without storage and materialised later, as FSDP2 users do in Python.
// Building block by block gives the same bound: while the model is built a
// rank holds the root's own parameters (embeddings, final norm, output) and
// one block's full parameters; a block's full tensors are freed once
// fully_shard has copied this rank's rows out of them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include "model.h"

namespace fsdp_train {

// The seed of the generator that fills the parameter named `fqn`: a hash of
// `seed` and the name, the same on every rank and at every world size.
uint64_t parameter_seed(int64_t seed, const std::string& fqn);

// Fills every parameter of `module` (recursively) in place, each from its own
// generator seeded by parameter_seed(seed, prefix + its name), one full
// parameter at a time on the CPU:
//   Linear weights   uniform(-1/sqrt(in), 1/sqrt(in))  (LibTorch's default bound)
//   Embedding        normal(0, 1)                       (LibTorch's default)
//   RMSNorm weights  ones
// `prefix` is the module's FQN in the model followed by '.' ("layers.3."), or
// empty for the root. REQUIRES: the parameters are not sharded yet. Throws
// c10::Error naming the parameter when a module type has no rule.
void init_parameters(torch::nn::Module& module, const std::string& prefix, int64_t seed);

// Builds the Transformer of `config` on `device`: the root's own parameters
// first, then for each block i: construct it, init_parameters(block,
// "layers.<i>.", seed), move it to `device`, register it as layers.<i>, and
// call `on_block(block)` (typically fully_shard) before building block i + 1.
// The result's parameters equal those of the same call with any `on_block`
// and on any number of ranks. Threading: the caller's thread only.
std::shared_ptr<Transformer> build_transformer(const ModelConfig& config, int64_t seed, const c10::Device& device,
                                               const std::function<void(Block&)>& on_block = {});

}  // namespace fsdp_train
