#include "divergence_monitor.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::collectives::detail {
namespace {

constexpr char kRequestKey[] = "fsdp2cpp/divergence/request";
constexpr char kDiagnosisKey[] = "fsdp2cpp/divergence/diagnosis";
constexpr char kStoppedKey[] = "fsdp2cpp/divergence/stopped";
// How long the store's host waits at exit for the other ranks' watchdogs.
constexpr std::chrono::seconds kStopWindow{5};
// How often the watchdog looks for a request: a store round trip each time.
constexpr std::chrono::milliseconds kPollInterval{200};

std::string log_key(int rank) { return c10::str("fsdp2cpp/divergence/log/", rank); }

// [Note: an engine that aborts the process] Gloo checks a received message
// against the buffer posted for it on its own I/O thread, and a mismatch
// (ranks that reduce-scatter different sizes: "op.preamble.length <=
// op.nbytes") escapes that thread, so std::terminate ends the process before
// any wait can see an error. The terminate handler is the one place left
// where the ranks' flight logs can still be compared: it asks the live
// monitor to gather them and print the diagnosis (the other ranks then stop
// with it too), and then hands over to the handler it replaced. The monitor
// is process-wide state only because std::terminate's handler is.
std::atomic<DivergenceMonitor*> g_terminate_monitor{nullptr};
std::terminate_handler g_previous_terminate = nullptr;

[[noreturn]] void diagnose_then_terminate() {
  if (DivergenceMonitor* monitor = g_terminate_monitor.exchange(nullptr)) {
    std::string what = "an exception nothing caught";
    if (const std::exception_ptr error = std::current_exception()) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
    }
    monitor->diagnose_abort(what);
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

// The monitors whose watchdog runs, for the handler that stops them when the
// process exits ([Note: the divergence watchdog at exit]). Never destroyed:
// the handler runs while statics are being destroyed.
std::mutex& live_monitors_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<DivergenceMonitor*>& live_monitors() {
  static auto* monitors = new std::vector<DivergenceMonitor*>;
  return *monitors;
}

// The process that installed the exit handler: a child forked from it (a
// data loader's worker, say) inherits the handler but neither the watchdog
// threads nor, maybe, an unlocked mutex, and must not touch them at its exit.
std::atomic<pid_t> g_exit_handler_pid{0};

void stop_live_monitors_at_exit() {
  if (::getpid() != g_exit_handler_pid.load()) return;
  // Held throughout, so that a monitor destroyed meanwhile by another thread
  // waits until this handler has stopped it.
  std::lock_guard<std::mutex> lock(live_monitors_mutex());
  for (DivergenceMonitor* monitor : live_monitors()) monitor->stop_watchdog();
  live_monitors().clear();
}

void install_terminate_handler_once() {
  static std::once_flag once;
  std::call_once(once, [] { g_previous_terminate = std::set_terminate(&diagnose_then_terminate); });
}

std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string as_text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

}  // namespace

DivergenceMonitor::DivergenceMonitor(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                     DivergenceOptions options)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      recorder_(rank, options_.recorder_capacity),
      store_(store) {
  if (options_.timeout.count() > 0 && world_size_ > 1) {
    watchdog_ = std::thread([this] { watch(); });
    watching_ = true;
    install_terminate_handler_once();
    g_terminate_monitor.store(this);
    std::lock_guard<std::mutex> lock(live_monitors_mutex());
    static const bool exit_handler_installed = [] {
      g_exit_handler_pid = ::getpid();
      return std::atexit(&stop_live_monitors_at_exit) == 0;
    }();
    (void)exit_handler_installed;
    live_monitors().push_back(this);
  }
}

DivergenceMonitor::~DivergenceMonitor() {
  DivergenceMonitor* self = this;
  g_terminate_monitor.compare_exchange_strong(self, nullptr);
  {
    // Waits for the exit handler, when it is stopping this monitor.
    std::lock_guard<std::mutex> lock(live_monitors_mutex());
    auto& live = live_monitors();
    live.erase(std::remove(live.begin(), live.end(), this), live.end());
  }
  stop_watchdog();
}

void DivergenceMonitor::stop_watchdog() {
  std::call_once(stopped_, [this] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (!watchdog_.joinable()) return;
    watching_ = false;
    watchdog_.join();
    say_stopped();
  });
}

// [Note: the divergence watchdog at exit]
// Every watchdog polls the store, which lives in rank 0's process. When rank
// 0 finished first and its process exited, a watchdog still polling on
// another rank met a closed socket, and c10d printed the failed receive with
// a stack trace on a job that ended well (about 1 clean 4-rank run in 8).
// So each rank counts itself out once its watchdog has stopped, and rank 0
// keeps the store up until every rank has (at most kStopWindow: a rank that
// crashed or was stopped never counts itself out).
// A World is often never destroyed: the FSDP states of a program's modules
// keep their mesh's World until the process ends (LibTorch modules have no
// slot of their own for them, [Note: the module side table]), and so did
// fsdp_train's, which printed the failed receives in 6 runs of 10 at 4 ranks
// on a loaded machine. So the watchdogs still running when the process
// exits normally (std::exit, or main's return) are stopped, and counted
// out, by a handler std::atexit runs; it was installed after the store
// existed, so it runs before the store's statics are destroyed.
void DivergenceMonitor::say_stopped() {
  try {
    store_->add(kStoppedKey, 1);
    if (rank_ != 0) return;
    const auto deadline = std::chrono::steady_clock::now() + kStopWindow;
    while (store_->add(kStoppedKey, 0) < world_size_ && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } catch (const std::exception&) {
    // The store is gone already: nothing is left to protect.
  }
}

void DivergenceMonitor::watch_in_flight(c10::intrusive_ptr<c10d::Work> work, int64_t record_id,
                                        std::chrono::steady_clock::time_point since) {
  if (!watching()) return;
  std::lock_guard<std::mutex> lock(in_flight_mutex_);
  in_flight_.push_back(InFlight{std::move(work), record_id, since});
}

// [Note: watching stream-ordered collectives]
// On NCCL, Work::wait() makes a stream wait and returns: the host must run
// ahead of the GPU, so it cannot be the one that notices a collective that
// never completes. The watchdog does, as ProcessGroupNCCL's own watchdog
// does: it polls the engine's completion of every collective a stream waits
// for, marks the flight record when it completes, and when one is still
// incomplete after the divergence timeout it makes the same diagnosis a
// blocked Gloo wait makes, prints it, and ends the process a few seconds
// later (the collectives in flight can no longer complete).
void DivergenceMonitor::check_in_flight(std::chrono::steady_clock::time_point now) {
  std::optional<InFlight> stalled;
  {
    std::lock_guard<std::mutex> lock(in_flight_mutex_);
    auto it = in_flight_.begin();
    while (it != in_flight_.end()) {
      if (it->work->isCompleted()) {
        recorder_.mark(it->record_id, it->work->exception() ? CollectiveState::kFailed : CollectiveState::kCompleted);
        it = in_flight_.erase(it);
        continue;
      }
      if (!stalled && now - it->since >= options_.timeout) stalled = *it;
      ++it;
    }
  }
  if (!stalled || failed()) return;
  const double waited_s = std::chrono::duration<double>(now - stalled->since).count();
  const std::string diagnosis = diagnose(waited_s);
  std::fprintf(stderr,
               "fsdp2cpp: rank %d: a collective that a stream waits for has not completed after %.1f s "
               "(FSDP2CPP_DIVERGENCE_TIMEOUT_S): %s\n",
               rank_, waited_s, diagnosis.c_str());
  std::fflush(stderr);
}

std::chrono::milliseconds DivergenceMonitor::gather_window() const {
  return std::clamp<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(1), std::chrono::seconds(5));
}

std::optional<std::string> DivergenceMonitor::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void DivergenceMonitor::write_dump(const std::string& name, const std::string& text) const {
  if (options_.dump_dir.empty()) return;
  // One level of directory: the parent must exist (docs/debugging.md).
  if (::mkdir(options_.dump_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    std::fprintf(stderr, "fsdp2cpp: rank %d: cannot create FSDP2CPP_FLIGHT_RECORDER_DIR %s\n", rank_,
                 options_.dump_dir.c_str());
    return;
  }
  std::ofstream out(options_.dump_dir + "/" + name, std::ios::trunc);
  out << text << "\n";
}

void DivergenceMonitor::publish(c10d::Store& store, bool diagnosing) {
  std::lock_guard<std::mutex> lock(publish_mutex_);
  FlightLog log = recorder_.snapshot();
  log.diagnosing = diagnosing;
  const std::string json = to_json(log);
  store.set(log_key(rank_), as_bytes(json));
  write_dump(c10::str("flight_recorder_rank", rank_, ".json"), json);
}

// [Note: the divergence watchdog]
// A rank whose collectives went another way may not be waiting at all (it
// sleeps in user code, or loops on), so its log must be published by a
// thread of its own. The watchdog checks the store for a request every
// kPollInterval and answers it once. Two kinds of process are then ended by
// the watchdog, with status 1, a few seconds later (time for the diagnosing
// ranks to gather the logs and throw):
//  - a rank that answered without waiting itself: its collectives no longer
//    match its peers', so all it could do is hang or compute with wrong data;
//  - a rank whose own wait was diagnosed: its exception has reached the
//    program, but the collectives in flight never complete, so the engine's
//    threads (and with them the program's exit) would wait for the
//    communicator's timeout.
// Each prints the diagnosis first; what a training job could still do after
// a divergence (save a checkpoint, say) would need the same collectives.
void DivergenceMonitor::watch() {
  // Requests are counted: a rank whose failed collective only probed the
  // logs (diagnose_failure found the ranks agreeing) may be followed by a
  // real diagnosis later.
  int64_t answered_requests = 0;
  bool answered = false;
  auto answered_at = std::chrono::steady_clock::now();
  const auto grace = gather_window() + std::chrono::seconds(3);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, kPollInterval, [this] { return stop_; })) {
    const auto now = std::chrono::steady_clock::now();
    if (exit_deadline_ && now >= *exit_deadline_) {
      std::fprintf(stderr,
                   "fsdp2cpp: rank %d exits: the collectives in flight cannot complete after the divergence "
                   "diagnosed above; the process would otherwise wait for the communicators' timeout\n",
                   rank_);
      std::fflush(stderr);
      std::fflush(stdout);
      std::_Exit(1);
    }
    lock.unlock();
    try {
      check_in_flight(now);
      const int64_t requests = store_->add(kRequestKey, 0);
      if (requests > answered_requests) {
        if (!diagnosing_) publish(*store_, /*diagnosing=*/false);
        answered_requests = requests;
        answered = true;
        answered_at = now;
      }
      if (answered && !diagnosing_ && now - answered_at > grace) {
        answered = false;
        // No diagnosis: the ranks agreed (a probe after an engine error).
        if (store_->check({kDiagnosisKey})) {
          const std::string diagnosis = as_text(store_->get(kDiagnosisKey));
          std::fprintf(stderr,
                       "fsdp2cpp: rank %d stops: another rank found that the ranks' collectives diverged, and this "
                       "rank's no longer match its peers'. Diagnosis:\n%s\n",
                       rank_, diagnosis.c_str());
          std::fflush(stderr);
          std::fflush(stdout);
          std::_Exit(1);
        }
      }
    } catch (const std::exception&) {
      // The store is gone (its host, rank 0, finished first): nobody can ask
      // any more, and a job that ends normally must not print an error.
      lock.lock();
      if (!exit_deadline_) return;
      continue;
    }
    lock.lock();
  }
}

void DivergenceMonitor::fail(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_) failure_ = reason;
  failed_ = true;
}

std::string DivergenceMonitor::diagnose(double waited_s) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) return *failure_;
  }
  diagnosing_ = true;
  const std::vector<std::optional<FlightLog>> logs = gather_logs_or_own();
  return settle(diagnose_divergence(logs, rank_, waited_s));
}

std::optional<std::string> DivergenceMonitor::diagnose_failure(double waited_s) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) return *failure_;
  }
  // Without watchdogs (detection off) no rank would answer.
  if (!watching()) return std::nullopt;
  diagnosing_ = true;
  const std::vector<std::optional<FlightLog>> logs = gather_logs_or_own();
  if (find_divergence(logs, /*count_ranks_behind=*/false).empty()) {
    diagnosing_ = false;
    return std::nullopt;
  }
  return settle(diagnose_divergence(logs, rank_, waited_s));
}

void DivergenceMonitor::diagnose_abort(const std::string& what) {
  try {
    const double waited_s = 0;
    if (auto diagnosis = diagnose_failure(waited_s)) {
      std::fprintf(stderr,
                   "fsdp2cpp: rank %d: the collective engine ends this process (%s); the ranks' flight recorders "
                   "say: %s\n",
                   rank_, what.c_str(), diagnosis->c_str());
      std::fflush(stderr);
    }
  } catch (...) {
    // Terminating already: the engine's own message follows.
  }
}

std::vector<std::optional<FlightLog>> DivergenceMonitor::gather_logs_or_own() {
  std::vector<std::optional<FlightLog>> logs(static_cast<size_t>(world_size_));
  try {
    logs = gather_logs();
  } catch (const std::exception& e) {
    // The store is gone (its host exited): this rank's own log is all there is.
    FlightLog own = recorder_.snapshot();
    own.diagnosing = true;
    logs[rank_] = std::move(own);
    std::fprintf(stderr, "fsdp2cpp: rank %d: could not gather the other ranks' flight logs: %s\n", rank_, e.what());
  }
  return logs;
}

std::string DivergenceMonitor::settle(std::string diagnosis) {
  try {
    if (!store_->check({kDiagnosisKey})) store_->set(kDiagnosisKey, as_bytes(diagnosis));
  } catch (const std::exception&) {
  }
  write_dump(c10::str("divergence_rank", rank_, ".txt"), diagnosis);
  std::lock_guard<std::mutex> lock(mutex_);
  failure_ = diagnosis;
  failed_ = true;
  exit_deadline_ = std::chrono::steady_clock::now() + gather_window() + std::chrono::seconds(3);
  return diagnosis;
}

std::vector<std::optional<FlightLog>> DivergenceMonitor::gather_logs() {
  c10d::Store& store = *store_;
  store.add(kRequestKey, 1);
  publish(store, /*diagnosing=*/true);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size_; ++r) keys.push_back(log_key(r));
  const auto deadline = std::chrono::steady_clock::now() + gather_window();
  std::vector<std::optional<FlightLog>> logs(static_cast<size_t>(world_size_));
  std::vector<bool> have(static_cast<size_t>(world_size_), false);
  while (true) {
    bool all = true;
    for (int r = 0; r < world_size_; ++r) {
      if (!have[r]) have[r] = store.check({keys[r]});
      all = all && have[r];
    }
    if (all || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (int r = 0; r < world_size_; ++r) {
    if (!have[r]) continue;
    try {
      logs[r] = flight_log_from_json(as_text(store.get(keys[r])));
    } catch (const std::exception&) {
      // An unreadable log counts as no answer.
    }
  }
  return logs;
}

}  // namespace fsdp::collectives::detail
