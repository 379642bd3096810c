#include "divergence_monitor.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::collectives::detail {
namespace {

constexpr char kRequestKey[] = "fsdp2cpp/divergence/request";
constexpr char kDiagnosisKey[] = "fsdp2cpp/divergence/diagnosis";
// How often the watchdog looks for a request: a store round trip each time.
constexpr std::chrono::milliseconds kPollInterval{200};

std::string log_key(int rank) { return c10::str("fsdp2cpp/divergence/log/", rank); }

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
  if (options_.timeout.count() > 0 && world_size_ > 1) watchdog_ = std::thread([this] { watch(); });
}

DivergenceMonitor::~DivergenceMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
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
  bool answered = false;
  std::chrono::steady_clock::time_point answered_at;
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
      if (!answered && store_->check({kRequestKey})) {
        if (!diagnosing_) publish(*store_, /*diagnosing=*/false);
        answered = true;
        answered_at = now;
      }
      if (answered && !diagnosing_ && now - answered_at > grace) {
        std::string diagnosis = "(no rank published a diagnosis)";
        if (store_->check({kDiagnosisKey})) diagnosis = as_text(store_->get(kDiagnosisKey));
        std::fprintf(stderr,
                     "fsdp2cpp: rank %d stops: another rank found that the ranks' collectives diverged, and this "
                     "rank's no longer match its peers'. Diagnosis:\n%s\n",
                     rank_, diagnosis.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        std::_Exit(1);
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
  std::string diagnosis = diagnose_divergence(logs, rank_, waited_s);
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
