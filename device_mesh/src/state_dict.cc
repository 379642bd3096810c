#include "device_mesh/state_dict.h"

#include <c10/util/Exception.h>

namespace fsdp {

StateValue::StateValue(at::Tensor tensor) : value_(std::move(tensor)) {
  TORCH_CHECK(std::get<at::Tensor>(value_).defined(), "StateDict: a value must be a defined tensor");
}

StateValue::StateValue(DTensor dtensor) : value_(std::move(dtensor)) {}

const DTensor& StateValue::dtensor() const {
  TORCH_CHECK(is_dtensor(), "StateDict: the value is a plain tensor, not a DTensor");
  return std::get<DTensor>(value_);
}

DTensor& StateValue::dtensor() {
  TORCH_CHECK(is_dtensor(), "StateDict: the value is a plain tensor, not a DTensor");
  return std::get<DTensor>(value_);
}

const at::Tensor& StateValue::local() const {
  if (is_dtensor()) return std::get<DTensor>(value_).to_local();
  return std::get<at::Tensor>(value_);
}

std::vector<int64_t> StateValue::global_shape() const {
  if (is_dtensor()) return std::get<DTensor>(value_).shape();
  return std::get<at::Tensor>(value_).sizes().vec();
}

std::vector<int64_t> StateValue::local_offset() const {
  if (is_dtensor()) return std::get<DTensor>(value_).spec().local_offset();
  return std::vector<int64_t>(static_cast<size_t>(std::get<at::Tensor>(value_).dim()), 0);
}

void StateDict::insert(std::string key, StateValue value) {
  TORCH_CHECK(!contains(key), "StateDict: duplicate key '", key, "'");
  index_.emplace(key, entries_.size());
  entries_.emplace_back(std::move(key), std::move(value));
}

void StateDict::insert_or_assign(std::string key, StateValue value) {
  if (auto it = index_.find(key); it != index_.end()) {
    entries_[it->second].second = std::move(value);
    return;
  }
  insert(std::move(key), std::move(value));
}

const StateValue* StateDict::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

StateValue* StateDict::find(const std::string& key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &entries_[it->second].second;
}

const StateValue& StateDict::at(const std::string& key) const {
  const StateValue* v = find(key);
  TORCH_CHECK(v != nullptr, "StateDict: no key '", key, "'");
  return *v;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> result;
  result.reserve(entries_.size());
  for (const auto& e : entries_) result.push_back(e.first);
  return result;
}

}  // namespace fsdp
