// StateDict: an FQN-keyed, insertion-ordered map of tensors and DTensors.
//
// The currency between the layer that knows which rows a rank owns (fsdp2's
// get_model_state_dict / get_optimizer_state_dict) and the layer that knows
// files (checkpoint/), as PyTorch's `Dict[str, Tensor | DTensor]` is between
// torch.distributed.checkpoint.state_dict and torch.distributed.checkpoint
// (examples/distributed_test_example.cc):
//
//   fsdp::StateDict sd;
//   sd.insert("embed.weight",
//             fsdp::DTensor::from_local(rows, mesh, {fsdp::Placement::shard(0)}, std::vector<int64_t>{100, 16}));
//   sd.insert("norm.weight", at::ones({16}));          // a plain tensor: the same on every rank
//   int64_t local_elements = 0;
//   for (const auto& [fqn, value] : sd) local_elements += value.local().numel();
//
// A plain tensor value is the whole tensor: replicated on every rank, or (a
// full state dict with cpu_offload) meaningful on rank 0 only. A DTensor value
// is this rank's piece of a global tensor (local tensor, mesh, placements,
// global shape); its local tensor may share storage with a live parameter.
//
// Not thread-safe; a StateDict is a value (copies share the tensors, as
// copies of a Python dict do).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>

#include "device_mesh/dtensor.h"

namespace fsdp {

class StateValue {
 public:
  StateValue(at::Tensor tensor);  // NOLINT: implicit, as a dict accepts a Tensor
  StateValue(DTensor dtensor);    // NOLINT: implicit, as a dict accepts a DTensor

  bool is_dtensor() const { return std::holds_alternative<DTensor>(value_); }
  // The DTensor. Throws when the value is a plain tensor.
  const DTensor& dtensor() const;
  DTensor& dtensor();
  // This rank's tensor: the plain tensor, or the DTensor's local piece.
  const at::Tensor& local() const;
  // The global shape (a plain tensor's own shape).
  std::vector<int64_t> global_shape() const;
  // Where local() starts in the global tensor, per dim (zeros for a plain
  // tensor).
  std::vector<int64_t> local_offset() const;
  c10::ScalarType dtype() const { return local().scalar_type(); }

 private:
  std::variant<at::Tensor, DTensor> value_;
};

class StateDict {
 public:
  using Entry = std::pair<std::string, StateValue>;

  // Appends `value` under `key`. Throws when `key` is already present.
  void insert(std::string key, StateValue value);
  // Replaces the value under `key`, or appends it when absent.
  void insert_or_assign(std::string key, StateValue value);
  // The value under `key`, or nullptr.
  const StateValue* find(const std::string& key) const;
  StateValue* find(const std::string& key);
  // The value under `key`. Throws c10::Error naming the key when absent.
  const StateValue& at(const std::string& key) const;
  bool contains(const std::string& key) const { return index_.count(key) != 0; }

  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  // Keys in insertion order.
  std::vector<std::string> keys() const;

  std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
  std::vector<Entry>::const_iterator end() const { return entries_.end(); }
  std::vector<Entry>::iterator begin() { return entries_.begin(); }
  std::vector<Entry>::iterator end() { return entries_.end(); }

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace fsdp
