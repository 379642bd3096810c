#include "collectives/flight_recorder.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

namespace fsdp::collectives {
namespace {

// The labels of the calling thread: two slots, not a stack, because a record
// keeps the innermost label and the one around it only.
thread_local const char* current_label = nullptr;
thread_local const char* enclosing_label = nullptr;

double seconds_before(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::time_point then) {
  if (then == std::chrono::steady_clock::time_point{}) return -1;
  return std::chrono::duration<double>(now - then).count();
}

// Copies at most kBytes - 1 characters: a label cut short still names its
// module for all but very deep FQNs, and recording stays a bounded copy.
template <size_t kBytes>
void copy_label(char (&to)[kBytes], const char* from) {
  if (from == nullptr) {
    to[0] = '\0';
    return;
  }
  size_t n = 0;
  while (n + 1 < kBytes && from[n] != '\0') ++n;
  std::memcpy(to, from, n);
  to[n] = '\0';
}

CollectiveState state_from_string(const std::string& text) {
  for (auto state :
       {CollectiveState::kIssued, CollectiveState::kWaiting, CollectiveState::kCompleted, CollectiveState::kFailed}) {
    if (text == to_string(state)) return state;
  }
  TORCH_CHECK(false, "fsdp2cpp: flight log: unknown collective state '", text, "'");
}

}  // namespace

CollectiveLabel::CollectiveLabel(const char* label) : saved_current_(current_label), saved_enclosing_(enclosing_label) {
  enclosing_label = current_label;
  current_label = label;
}

CollectiveLabel::~CollectiveLabel() {
  current_label = saved_current_;
  enclosing_label = saved_enclosing_;
}

const char* CollectiveLabel::current() { return current_label; }
const char* CollectiveLabel::enclosing() { return enclosing_label; }

const char* to_string(CollectiveState state) {
  switch (state) {
    case CollectiveState::kIssued: return "issued";
    case CollectiveState::kWaiting: return "waiting";
    case CollectiveState::kCompleted: return "completed";
    case CollectiveState::kFailed: return "failed";
  }
  return "unknown";
}

bool CollectiveFingerprint::operator==(const CollectiveFingerprint& other) const {
  return op == other.op && reduction == other.reduction && dtype == other.dtype && numel == other.numel &&
         tensors == other.tensors && label == other.label;
}

std::string CollectiveFingerprint::describe() const {
  std::string text = op + "(";
  if (tensors > 0) {
    if (!reduction.empty()) text += reduction + ", ";
    if (!dtype.empty()) text += dtype + ", ";
    text += c10::str(numel, numel == 1 ? " element" : " elements");
    if (tensors > 1) text += c10::str(" in ", tensors, " tensors");
  }
  text += ")";
  if (!label.empty()) text += " for " + label;
  return text;
}

FlightRecorder::FlightRecorder(int rank, size_t capacity) : rank_(rank), slots_(capacity) {
  TORCH_CHECK(capacity > 0, "fsdp2cpp: a flight recorder needs room for at least one record, got capacity 0");
}

int FlightRecorder::register_communicator(std::string id, std::vector<int> global_ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  communicators_.push_back(RecordedCommunicator{std::move(id), std::move(global_ranks)});
  return static_cast<int>(communicators_.size()) - 1;
}

int64_t FlightRecorder::record_issue(int communicator, int64_t seq, const char* op, const char* reduction,
                                     c10::ScalarType dtype, bool has_dtype, int64_t numel, int64_t tensors) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = next_id_++;
  Slot& slot = slots_[static_cast<size_t>(id) % slots_.size()];
  slot.id = id;
  slot.communicator = communicator;
  slot.seq = seq;
  slot.op = op;
  slot.reduction = reduction;
  slot.dtype = dtype;
  slot.has_dtype = has_dtype;
  slot.numel = numel;
  slot.tensors = tensors;
  copy_label(slot.label, current_label);
  copy_label(slot.context, enclosing_label);
  slot.state = CollectiveState::kIssued;
  slot.issued = now;
  slot.wait_started = {};
  slot.ended = {};
  last_issue_ = now;
  return id;
}

void FlightRecorder::mark(int64_t id, CollectiveState state) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = slots_[static_cast<size_t>(id) % slots_.size()];
  if (slot.id != id) return;
  slot.state = state;
  if (state == CollectiveState::kWaiting) {
    slot.wait_started = now;
  } else if (state == CollectiveState::kCompleted || state == CollectiveState::kFailed) {
    slot.ended = now;
  }
}

FlightLog FlightRecorder::snapshot() const {
  const auto now = std::chrono::steady_clock::now();
  FlightLog log;
  log.rank = rank_;
  std::lock_guard<std::mutex> lock(mutex_);
  log.communicators = communicators_;
  const int64_t last = next_id_ - 1;
  const int64_t first = std::max<int64_t>(1, last - static_cast<int64_t>(slots_.size()) + 1);
  log.dropped = first - 1;
  log.last_issue_ago_s = seconds_before(now, last_issue_);
  log.records.reserve(static_cast<size_t>(last - first + 1));
  for (int64_t id = first; id <= last; ++id) {
    const Slot& slot = slots_[static_cast<size_t>(id) % slots_.size()];
    CollectiveRecord record;
    record.id = slot.id;
    record.communicator = communicators_.at(static_cast<size_t>(slot.communicator)).id;
    record.seq = slot.seq;
    record.fingerprint.op = slot.op;
    record.fingerprint.reduction = slot.reduction;
    record.fingerprint.dtype = slot.has_dtype ? c10::toString(slot.dtype) : "";
    record.fingerprint.numel = slot.numel;
    record.fingerprint.tensors = slot.tensors;
    record.fingerprint.label = slot.label;
    record.context = slot.context;
    record.state = slot.state;
    record.issued_ago_s = seconds_before(now, slot.issued);
    record.wait_started_ago_s = seconds_before(now, slot.wait_started);
    record.ended_ago_s = seconds_before(now, slot.ended);
    log.records.push_back(std::move(record));
  }
  return log;
}

std::string to_json(const FlightLog& log) {
  nlohmann::json j;
  j["rank"] = log.rank;
  j["dropped"] = log.dropped;
  j["last_issue_ago_s"] = log.last_issue_ago_s;
  j["diagnosing"] = log.diagnosing;
  j["communicators"] = nlohmann::json::array();
  for (const auto& c : log.communicators)
    j["communicators"].push_back({{"id", c.id}, {"global_ranks", c.global_ranks}});
  j["records"] = nlohmann::json::array();
  for (const auto& r : log.records) {
    j["records"].push_back({{"id", r.id},
                            {"communicator", r.communicator},
                            {"seq", r.seq},
                            {"op", r.fingerprint.op},
                            {"reduction", r.fingerprint.reduction},
                            {"dtype", r.fingerprint.dtype},
                            {"numel", r.fingerprint.numel},
                            {"tensors", r.fingerprint.tensors},
                            {"label", r.fingerprint.label},
                            {"context", r.context},
                            {"state", to_string(r.state)},
                            {"issued_ago_s", r.issued_ago_s},
                            {"wait_started_ago_s", r.wait_started_ago_s},
                            {"ended_ago_s", r.ended_ago_s}});
  }
  // Labels are cut at a byte count, which may split a UTF-8 sequence.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

FlightLog flight_log_from_json(const std::string& json) {
  try {
    const nlohmann::json j = nlohmann::json::parse(json);
    FlightLog log;
    log.rank = j.at("rank").get<int>();
    log.dropped = j.at("dropped").get<int64_t>();
    log.last_issue_ago_s = j.at("last_issue_ago_s").get<double>();
    log.diagnosing = j.at("diagnosing").get<bool>();
    for (const auto& c : j.at("communicators")) {
      log.communicators.push_back(
          RecordedCommunicator{c.at("id").get<std::string>(), c.at("global_ranks").get<std::vector<int>>()});
    }
    for (const auto& r : j.at("records")) {
      CollectiveRecord record;
      record.id = r.at("id").get<int64_t>();
      record.communicator = r.at("communicator").get<std::string>();
      record.seq = r.at("seq").get<int64_t>();
      record.fingerprint.op = r.at("op").get<std::string>();
      record.fingerprint.reduction = r.at("reduction").get<std::string>();
      record.fingerprint.dtype = r.at("dtype").get<std::string>();
      record.fingerprint.numel = r.at("numel").get<int64_t>();
      record.fingerprint.tensors = r.at("tensors").get<int64_t>();
      record.fingerprint.label = r.at("label").get<std::string>();
      record.context = r.at("context").get<std::string>();
      record.state = state_from_string(r.at("state").get<std::string>());
      record.issued_ago_s = r.at("issued_ago_s").get<double>();
      record.wait_started_ago_s = r.at("wait_started_ago_s").get<double>();
      record.ended_ago_s = r.at("ended_ago_s").get<double>();
      log.records.push_back(std::move(record));
    }
    return log;
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "fsdp2cpp: a flight log is not valid JSON of the dump format: ", e.what());
  }
}

}  // namespace fsdp::collectives
