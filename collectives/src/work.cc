#include "collectives/work.h"

#include <algorithm>
#include <utility>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "collectives/errors.h"
#include "divergence_monitor.h"
#include "multi_work.h"

namespace fsdp::collectives {
namespace {

template <typename Error, typename... Args>
[[noreturn]] void throw_error(const char* function, uint32_t line, const Args&... message) {
  throw Error(c10::SourceLocation{function, __FILE__, line}, c10::str(message...));
}

// The engines' own errors ("Connection reset by peer", "Operation timed out!")
// do not say which collective of which group failed; ours do.
[[noreturn]] void throw_failure(const std::string& description, const std::exception_ptr& error) {
  throw_error<CollectiveFailed>(__func__, __LINE__, "fsdp2cpp: ", description, " failed: ", exception_text(error),
                                ". A peer that exited, crashed or stopped issuing the same collectives makes the "
                                "others fail; check the logs of the other ranks of the group.");
}

std::exception_ptr as_described(const std::string& description, const std::exception_ptr& error) {
  try {
    throw_failure(description, error);
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

Work::Work() = default;

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::string description, std::function<void()> finish)
    : work_(std::move(work)), description_(std::move(description)), finish_(std::move(finish)) {}

Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&&) noexcept = default;
Work::~Work() = default;

void Work::wait(std::chrono::milliseconds timeout) {
  if (end_event_) {
    const c10::impl::VirtualGuardImpl impl(end_event_->device_type());
    end_event_->block(impl.getStream(impl.getDevice()));
  }
  if (!waited_ && work_) {
    if (monitor_) monitor_->recorder().mark(record_id_, CollectiveState::kWaiting);
    const auto started = std::chrono::steady_clock::now();
    bool done = false;
    try {
      done = wait_watched(timeout);
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      // A caller's own timeout leaves the collective in flight, to be waited
      // for again.
      const bool failed = work_->isCompleted();
      if (monitor_) monitor_->recorder().mark(record_id_, failed ? CollectiveState::kFailed : CollectiveState::kIssued);
      // The engine's words ("op.preamble.length <= op.nbytes") do not say
      // that the ranks issued different collectives; the logs do.
      if (monitor_ && failed && timeout.count() == 0) {
        const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        if (auto diagnosis = monitor_->diagnose_failure(waited_s)) {
          throw_error<CollectiveDiverged>(__func__, __LINE__, "fsdp2cpp: ", description_,
                                          " failed: ", exception_text(error), ". ", *diagnosis);
        }
      }
      if (!failed && timeout.count() != 0) {
        throw_error<CollectiveTimeout>(__func__, __LINE__, "fsdp2cpp: ", description_, " did not complete within ",
                                       timeout.count(), " ms (", exception_text(error),
                                       "); it is still in flight, and wait() may be called again");
      }
      throw_failure(description_, error);
    }
    if (!done) {
      const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      const std::string diagnosis = monitor_->diagnose(waited_s);
      monitor_->recorder().mark(record_id_, CollectiveState::kFailed);
      throw_error<CollectiveDiverged>(__func__, __LINE__, "fsdp2cpp: ", description_, " did not complete: ", diagnosis);
    }
    if (monitor_) {
      // A stream waits for it, the host does not: the monitor's watchdog
      // marks it completed, or diagnoses it ([Note: watching stream-ordered
      // collectives]).
      if (stream_ordered_ && timeout.count() == 0 && !work_->isCompleted() && monitor_->watching()) {
        monitor_->watch_in_flight(work_, record_id_, started);
      } else {
        monitor_->recorder().mark(record_id_, CollectiveState::kCompleted);
      }
    }
  }
  waited_ = true;
  // Moved out before it runs, so that a failing finish step (it should not
  // fail) is never applied twice; steps added later by then() run at the
  // next wait().
  if (finish_) {
    const std::function<void()> finish = std::move(finish_);
    finish_ = nullptr;
    finish();
  }
}

void Work::complete_at_issue() {
  const bool stream_ordered = stream_ordered_;
  stream_ordered_ = false;
  wait();
  stream_ordered_ = stream_ordered;
  waited_ = false;
}

void Work::then(std::function<void()> step) {
  if (!step) return;
  if (!finish_) {
    finish_ = std::move(step);
    return;
  }
  finish_ = [first = std::move(finish_), second = std::move(step)] {
    first();
    second();
  };
}

bool Work::wait_watched(std::chrono::milliseconds timeout) {
  // A caller that gives a timeout bounds the wait itself (a checkpoint's
  // barrier behind a slow disk may rightly take minutes): not watched. On
  // NCCL this blocks the host until the collective completes, as
  // ProcessGroupNCCL's wait does with any timeout.
  if (timeout.count() != 0) {
    work_->wait(timeout);
    return true;
  }
  // [Note: NCCL's wait never gets a timeout] ProcessGroupNCCL's wait with a
  // timeout busy-waits the host until the collective completes (and aborts
  // the communicator when it expires); without one it only makes the
  // caller's current stream wait. Every FSDP wait must be the latter, or the
  // host could never run ahead of the GPU: the monitor's watchdog watches
  // the collective instead.
  if (stream_ordered_) {
    work_->wait(::kNoTimeout);
    return true;
  }
  const std::chrono::milliseconds threshold = monitor_ ? monitor_->options().timeout : std::chrono::milliseconds(0);
  if (threshold.count() == 0) {
    work_->wait(::kNoTimeout);
    return true;
  }
  try {
    work_->wait(threshold);
    return true;
  } catch (...) {
    // A finished collective reports its own outcome (its error, or none if
    // it completed just after the timed wait gave up).
    if (!work_->isCompleted()) return false;
  }
  work_->wait();
  return true;
}

void Work::set_record(std::shared_ptr<detail::DivergenceMonitor> monitor, int64_t record_id) {
  monitor_ = std::move(monitor);
  record_id_ = record_id;
}

// A c10d work can report itself incomplete after its wait() returned (Gloo's
// reduce-scatter at one rank does), so a successful wait() counts as done.
bool Work::is_completed() const { return !work_ || waited_ || work_->isCompleted(); }

std::exception_ptr Work::exception() const {
  if (!work_ || !work_->isCompleted()) return nullptr;
  std::exception_ptr error = work_->exception();
  return error ? as_described(description_, error) : nullptr;
}

const c10::intrusive_ptr<c10d::Work>& Work::c10d_work() const { return work_; }

namespace detail {

MultiWork::MultiWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
    : c10d::Work(/*rank=*/-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

bool MultiWork::isCompleted() {
  return std::all_of(works_.begin(), works_.end(), [](const auto& w) { return w->isCompleted(); });
}

bool MultiWork::isSuccess() const { return exception() == nullptr; }

std::exception_ptr MultiWork::exception() const {
  for (const auto& w : works_) {
    if (auto error = w->exception()) return error;
  }
  return nullptr;
}

bool MultiWork::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& w : works_) {
    auto remaining = kNoTimeout;
    if (timeout != kNoTimeout) {
      // At least 1 ms: 0 would mean "no timeout" to the part.
      remaining =
          std::max(std::chrono::milliseconds(1),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
    }
    w->wait(remaining);
  }
  return true;
}

void MultiWork::synchronize() {
  for (const auto& w : works_) w->synchronize();
}

}  // namespace detail
}  // namespace fsdp::collectives
