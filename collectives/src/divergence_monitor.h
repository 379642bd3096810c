// Internal: the per-World object behind divergence.h: the flight recorder,
// the watchdog thread that answers other ranks' requests for it, and the
// diagnosis a wait that blocked too long makes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "collectives/divergence.h"
#include "collectives/flight_recorder.h"

namespace c10d {
class Store;
}

namespace fsdp::collectives::detail {

class DivergenceMonitor {
 public:
  // Starts the watchdog thread (when options.timeout is non-zero and there
  // are other ranks). `store` is the World's, used from the watchdog thread
  // too (c10d's stores serialize their operations; a clone would not do:
  // a cloned FileStore counts as one more worker when it deletes the file).
  DivergenceMonitor(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size, DivergenceOptions options);
  // Stops and joins the watchdog, then tells the other ranks so; the rank
  // that hosts the store (rank 0) waits a few seconds for every other rank's
  // watchdog to stop, so that none of them polls a store that is gone
  // ([Note: the divergence watchdog at exit]). A monitor still alive when
  // the process exits normally is stopped the same way then.
  ~DivergenceMonitor();
  DivergenceMonitor(const DivergenceMonitor&) = delete;
  DivergenceMonitor& operator=(const DivergenceMonitor&) = delete;

  FlightRecorder& recorder() { return recorder_; }
  const DivergenceOptions& options() const { return options_; }
  int rank() const { return rank_; }

  // Called by a wait that blocked options().timeout (`waited_s`): asks every
  // rank for its log, waits a few seconds for the answers, and returns the
  // diagnosis (also written to options().dump_dir). Once made, the same
  // diagnosis is returned to every later call, and failure() reports it.
  std::string diagnose(double waited_s);

  // Called by a wait whose collective the engine failed (a peer's error, or
  // Gloo's abort on buffers of different sizes): gathers the logs as
  // diagnose() does and, only when they show ranks that issued different
  // collectives (not ranks that issued fewer: an engine timeout), settles and returns that diagnosis as diagnose()
  // would; otherwise nullopt, and nothing changes (the engine's error stands).
  std::optional<std::string> diagnose_failure(double waited_s);
  // Called from std::terminate when an exception escaped a thread (Gloo's
  // I/O thread on mismatched sizes, [Note: an engine that aborts the
  // process]): diagnose_failure(), printed on stderr when it found ranks
  // that issued different collectives. Never throws.
  void diagnose_abort(const std::string& what);

  // The diagnosis this process made or received, or nullopt: collectives
  // issued after one refuse to run, since the ranks no longer agree.
  std::optional<std::string> failure() const;
  // failure().has_value(), without a lock: checked at every issue.
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  // Records a failure found without a hang (strict mode's check), so that
  // later collectives refuse to run.
  void fail(const std::string& reason);

  // Watches a collective whose wait ordered a stream without blocking the
  // host (NCCL): the watchdog marks its record completed once the engine
  // reports it so, and diagnoses it like a blocked wait (the same diagnosis,
  // printed, and the same exit) when it has not completed options().timeout
  // after `since`. No-op without a watchdog ([Note: watching stream-ordered
  // collectives]).
  void watch_in_flight(c10::intrusive_ptr<c10d::Work> work, int64_t record_id,
                       std::chrono::steady_clock::time_point since);
  // Whether a watchdog thread runs (a timeout and other ranks, and not
  // stopped yet).
  bool watching() const { return watching_.load(std::memory_order_acquire); }
  // Stops and joins the watchdog, then tells the other ranks so (rank 0
  // waits for theirs, as the destructor says). Idempotent and thread-safe:
  // called by the destructor, and by the handler that stops the watchdogs
  // of the Worlds still alive when the process exits ([Note: the divergence
  // watchdog at exit]).
  void stop_watchdog();

 private:
  void watch();
  // One pass over the collectives watch_in_flight() holds: completed ones
  // are marked and dropped; a stalled one is diagnosed (once).
  void check_in_flight(std::chrono::steady_clock::time_point now);
  // Tells the other ranks this one's watchdog stopped; rank 0 waits for all.
  void say_stopped();
  // Publishes this rank's log to the store (and the dump directory).
  void publish(c10d::Store& store, bool diagnosing);
  void write_dump(const std::string& name, const std::string& text) const;
  // Requests every rank's log and collects those that arrive within
  // gather_window(); throws when the store fails.
  std::vector<std::optional<FlightLog>> gather_logs();
  // gather_logs(), or only this rank's own log when the store is gone.
  std::vector<std::optional<FlightLog>> gather_logs_or_own();
  // Records `diagnosis` as this process's failure (store, dump directory,
  // failure(), the exit deadline) and returns it.
  std::string settle(std::string diagnosis);
  // How long a diagnosing rank waits for the others' logs.
  std::chrono::milliseconds gather_window() const;

  const int rank_;
  const int world_size_;
  const DivergenceOptions options_;
  FlightRecorder recorder_;
  c10::intrusive_ptr<c10d::Store> store_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::optional<std::string> failure_;
  // Set by diagnose(): when the watchdog ends a process whose collectives
  // can no longer complete ([Note: the divergence watchdog]).
  std::optional<std::chrono::steady_clock::time_point> exit_deadline_;
  std::atomic<bool> diagnosing_{false};
  std::atomic<bool> failed_{false};
  std::mutex publish_mutex_;

  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t record_id;
    std::chrono::steady_clock::time_point since;
  };
  std::mutex in_flight_mutex_;
  std::vector<InFlight> in_flight_;

  std::thread watchdog_;
  std::atomic<bool> watching_{false};
  std::once_flag stopped_;
};

}  // namespace fsdp::collectives::detail
