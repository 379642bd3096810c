// FlightRecorder: the last collectives this process issued, always on, and
// the labels the runtime gives them.
//
// Every collective a Communicator issues is recorded with its fingerprint
// (communicator, per-communicator sequence number, op, reduction, dtype,
// element count, and the label of the code that issued it) and its state
// (issued, waiting, completed, failed) with times. The recorder is a ring of
// fixed capacity: recording takes a mutex, copies a few words and at most
// two short labels, and never touches a device (docs/debugging.md gives the
// measured cost). A World owns one recorder shared by the communicators it
// makes; when ranks stop agreeing on which collective comes next, the
// recorders of all ranks are compared (divergence.h).
//
// Labels: the fsdp2 runtime wraps each phase in a CollectiveLabel ("FSDP::
// all_gather (layers.3)" inside "FSDP::pre_forward (layers.3)"); a collective
// issued inside it is recorded with the innermost label and the one around
// it. A user labels their own collectives the same way
// (tests/fsdp2/fsdp2_divergence_test.cc):
//
//   fsdp::collectives::CollectiveLabel label("metrics: mean loss");
//   group->all_reduce(loss, fsdp::collectives::ReduceOp::avg()).wait();
//
// Thread safety: record_* and mark may be called from any thread; snapshot()
// copies under the same mutex. Labels are per thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace fsdp::collectives {

// Labels the collectives the calling thread issues while it lives. `label`
// is not copied: it must outlive the scope (a literal, or a string the
// caller keeps); a temporary string does not compile.
class CollectiveLabel {
 public:
  explicit CollectiveLabel(const char* label);
  explicit CollectiveLabel(const std::string& label) : CollectiveLabel(label.c_str()) {}
  explicit CollectiveLabel(std::string&&) = delete;
  ~CollectiveLabel();
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;

  // The innermost label of this thread, or nullptr outside any scope.
  static const char* current();
  // The label around the innermost one, or nullptr.
  static const char* enclosing();

 private:
  const char* saved_current_;
  const char* saved_enclosing_;
};

enum class CollectiveState : uint8_t {
  kIssued,     // enqueued; nobody waits for it yet
  kWaiting,    // a thread is in Work::wait() for it
  kCompleted,  // Work::wait() returned (on NCCL: the caller's stream waits for it)
  kFailed,     // Work::wait() threw
};

const char* to_string(CollectiveState state);

// What identifies a collective across ranks: the members of a communicator
// must issue equal fingerprints in the same order.
struct CollectiveFingerprint {
  std::string op;         // "all_gather_into_tensor", "reduce_scatter_tensor_coalesced", ...
  std::string reduction;  // "SUM", "AVG", ...; empty for non-reductions
  std::string dtype;      // of the inputs, e.g. "Float"; empty when there are none
  int64_t numel = 0;      // elements of all inputs together
  int64_t tensors = 0;    // number of input tensors
  std::string label;      // innermost CollectiveLabel at issue, or empty
  bool operator==(const CollectiveFingerprint& other) const;
  bool operator!=(const CollectiveFingerprint& other) const { return !(*this == other); }
  // "all_gather_into_tensor(Float, 2048 elements) for FSDP::all_gather (layers.3)"
  std::string describe() const;
};

// One recorded collective, as snapshot() reports it.
struct CollectiveRecord {
  int64_t id = 0;            // process-wide issue index, from 1
  std::string communicator;  // Communicator::id(), e.g. "gloo[0,1]#0"
  int64_t seq = 0;           // per-communicator sequence number, from 1
  CollectiveFingerprint fingerprint;
  std::string context;  // the CollectiveLabel around `fingerprint.label`, or empty
  CollectiveState state = CollectiveState::kIssued;
  // Seconds before the snapshot; negative when it has not happened.
  double issued_ago_s = -1;
  double wait_started_ago_s = -1;
  double ended_ago_s = -1;
};

// A communicator the recorder knows: its id and its members' global ranks.
struct RecordedCommunicator {
  std::string id;
  std::vector<int> global_ranks;
};

// One process's recorder at one moment.
struct FlightLog {
  int rank = -1;  // global rank
  std::vector<RecordedCommunicator> communicators;
  std::vector<CollectiveRecord> records;  // oldest first
  int64_t dropped = 0;                    // records overwritten by the ring
  double last_issue_ago_s = -1;           // -1: nothing issued yet
  bool diagnosing = false;                // this rank's own wait passed the threshold
};

// JSON of a FlightLog (the dump format, docs/debugging.md), and back.
// from_json throws c10::Error naming what is malformed.
std::string to_json(const FlightLog& log);
FlightLog flight_log_from_json(const std::string& json);

class FlightRecorder {
 public:
  // REQUIRES: capacity > 0.
  FlightRecorder(int rank, size_t capacity);

  // Makes a communicator known; returns the index record_issue takes.
  int register_communicator(std::string id, std::vector<int> global_ranks);

  // Records a collective issued now, labelled from the calling thread's
  // CollectiveLabel scopes. `op` must be a literal (it is kept by pointer).
  // Returns the record's id.
  int64_t record_issue(int communicator, int64_t seq, const char* op, const char* reduction, c10::ScalarType dtype,
                       bool has_dtype, int64_t numel, int64_t tensors);
  // Moves record `id` to `state` (no-op when the ring has overwritten it).
  void mark(int64_t id, CollectiveState state);

  FlightLog snapshot() const;
  size_t capacity() const { return slots_.size(); }

 private:
  static constexpr size_t kLabelBytes = 96;
  struct Slot {
    int64_t id = 0;
    int communicator = 0;
    int64_t seq = 0;
    const char* op = "";
    const char* reduction = "";
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    bool has_dtype = false;
    int64_t numel = 0;
    int64_t tensors = 0;
    char label[kLabelBytes] = {};
    char context[kLabelBytes] = {};
    CollectiveState state = CollectiveState::kIssued;
    std::chrono::steady_clock::time_point issued, wait_started, ended;
  };

  const int rank_;
  mutable std::mutex mutex_;
  std::vector<Slot> slots_;
  int64_t next_id_ = 1;
  std::vector<RecordedCommunicator> communicators_;
  std::chrono::steady_clock::time_point last_issue_;
};

}  // namespace fsdp::collectives
