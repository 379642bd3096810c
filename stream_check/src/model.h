// Internal: the happens-before model of the stream-order checker, free of
// LibTorch's dispatcher, allocator and guard machinery (stream_check.cc wires
// those to it). Streams are small integers (0 is the default stream, the one
// current when no guard is active); buffers are keyed by the address of their
// storage's memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "stream_check/stream_check.h"

namespace fsdp::stream_check::detail {

// clock[s] is the last epoch of stream s known to be ordered before (for a
// stream's own clock: its current epoch). Missing entries are 0.
using Clock = std::vector<uint64_t>;

// What a c10::Event recorded on a checked stream holds.
struct EventState {
  Clock clock;
};

class Model {
 public:
  // Stream 0 is the default stream; this one is the host's (never a c10
  // stream): its accesses are ordered before all later stream work, and it is
  // ordered after stream work only by host synchronizations.
  static constexpr int kHostStream = 1;

  explicit Model(Options options);

  // Streams.
  int new_stream(std::string name);
  void name_stream(int stream, std::string name);
  int collective_stream(const void* key, const std::string& name);

  // Events: record snapshots `stream`'s clock (later work on it is after
  // the snapshot); block joins a snapshot into `stream`; host_sync joins it
  // into every stream (the host knows that work finished, so all it enqueues
  // later comes after).
  Clock record(int stream);
  void block(const Clock& clock, int stream);
  // `what` and `phase` name the synchronization in host_syncs().
  void host_sync(const Clock& clock, const char* what, const char* phase);
  void host_sync_all(const char* what, const char* phase);

  // Memory. `phase` and `op` may be null. An allocation by kHostStream is
  // host memory, pinned when `pinned`.
  void on_alloc(const void* ptr, size_t nbytes, int stream, const char* phase, const char* op, bool pinned = false);
  // kDevice for memory the model has not seen.
  Memory memory_of(const void* ptr) const;
  // Whether any host memory was made while the model lived (the op
  // classification's fast path).
  bool has_host_memory() const { return has_host_memory_.load(std::memory_order_relaxed); }
  void on_free(const void* ptr, const char* phase);
  void record_stream(const void* ptr, int stream);
  void name_buffer(const void* ptr, std::string name);
  // An access of bytes [begin, end) of the buffer at `ptr` by `stream`.
  void access(const void* ptr, int64_t begin, int64_t end, bool write, int stream, const char* phase, const char* op);

  const Options& options() const { return options_; }
  std::vector<Report> reports() const;
  void clear_reports();
  std::vector<HostSync> host_syncs() const;
  void clear_host_syncs();
  // OnRace::kThrow: the message of the oldest report not yet thrown.
  std::optional<std::string> take_unthrown();
  // Reports never thrown (for the exit check of a process-lifetime checker).
  std::vector<std::string> unthrown() const;

 private:
  struct Access {
    int stream;
    uint64_t epoch;
    int64_t begin;
    int64_t end;
    bool write;
    std::string phase;
    std::string op;
  };
  struct Buffer {
    std::string name;
    int alloc_stream = -1;  // -1: allocated where the checker did not see it
    Memory memory = Memory::kDevice;
    size_t nbytes = 0;
    std::string alloc_phase;
    std::string alloc_op;
    // The allocating stream's epoch at the allocation: the position every
    // other stream must be ordered after before touching the block.
    uint64_t alloc_epoch = 0;
    // Streams already checked against the allocation (ordered, or reported once).
    std::unordered_set<int> alloc_ordered_on;
    std::vector<Access> accesses;
    std::unordered_set<int> recorded_streams;
  };
  struct Stream {
    std::string name;
    Clock clock;
  };

  Clock& clock_of(int stream);
  // Whether `a` happens before `stream`'s current position.
  bool ordered(const Access& a, int stream);
  std::string stream_name(int stream) const;
  std::string describe(const Buffer& b) const;
  void report(Report::Kind kind, const Buffer& b, const Access& first, int second_stream, const char* second_phase,
              const char* second_op);
  void count_host_sync(const char* what, const char* phase);

  Options options_;
  mutable std::mutex mu_;
  std::vector<Stream> streams_;
  std::unordered_map<const void*, int> collective_streams_;
  std::unordered_map<const void*, Buffer> buffers_;
  std::vector<Report> reports_;
  std::vector<HostSync> host_syncs_;
  std::unordered_set<std::string> seen_;
  size_t thrown_ = 0;
  std::atomic<bool> has_host_memory_{false};
};

}  // namespace fsdp::stream_check::detail
