// Per-module state for runtimes built on module_call.h hooks.
//
// LibTorch modules have no slot for a runtime's per-module state (Python keeps
// it in the module's __dict__); fully_shard keeps its FSDPState here. The
// state lives as long as the module, and at most until the next registration
// or release_states_of_destroyed_modules() after it (see module_call.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace fsdp::detail {

// Attaches `state` to `module` under `key` (null removes it).
// REQUIRES: `module` is owned by a std::shared_ptr.
void set_module_state(torch::nn::Module& module, const std::string& key, std::shared_ptr<void> state);
// The state attached under `key`, or null.
std::shared_ptr<void> module_state(const torch::nn::Module& module, const std::string& key);
// Every state attached under `key` to a live module.
std::vector<std::shared_ptr<void>> module_states(const std::string& key);
// Drops the hooks and states of modules destroyed since the last
// registration (fsdp::release_fsdp_state_of_destroyed_modules says why).
void release_states_of_destroyed_modules();

}  // namespace fsdp::detail
