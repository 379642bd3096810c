// Work: the handle of an asynchronous collective.
//
// Every Communicator operation returns a Work as soon as the collective is
// enqueued; library code never blocks the host right after issuing one.
//
// Stream contract on CUDA (NCCL): the collective is ordered after the work
// already enqueued on the caller's current stream when the operation was
// called. wait() without a timeout makes the caller's *current* stream wait
// for the collective; the host does not block (a collective that never
// completes is found by the divergence monitor's watchdog, divergence.h).
// wait(timeout) with a timeout of the caller's blocks the host until the
// collective completed, as ProcessGroupNCCL's wait does with any timeout.
// On CPU (Gloo) wait() blocks the host until the result is in the output
// tensor.
//
// Outputs are only valid after wait(): some reductions finish with a scale
// applied at wait time (see reduce_op.h).
//
// Errors: wait() throws one of the types of errors.h, each a CollectiveError
// (a c10::Error) whose message names the collective and its group, so that a
// caller decides by type:
//   CollectiveTimeout   wait(timeout)'s own timeout passed first; the
//                       collective is still in flight and wait() may be
//                       called again (retryable).
//   CollectiveDiverged  the divergence monitor's diagnosis (divergence.h): a
//                       wait that blocked past the divergence timeout, or a
//                       failure traced to ranks that issued different
//                       collectives. The communicator is unusable.
//   CollectiveFailed    the engine failed otherwise: a peer exited, crashed
//                       or aborted, a connection broke, the engine's own
//                       timeout. The communicator is unusable.
// Errors at issue (a tensor on the wrong device, sizes that do not fit) are
// thrown by the Communicator operation itself as plain c10::Errors.
//
// A Work is [[nodiscard]]: dropping one skips its finishing step (Gloo's AVG
// divide, a custom all-gather's dequantization) and any error it would throw.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include <c10/core/Event.h>
#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Work;
}

namespace fsdp::collectives {

namespace detail {
class DivergenceMonitor;
}

class [[nodiscard]] Work {
 public:
  // No timeout: wait as long as the communicator's own timeout allows.
  static constexpr std::chrono::milliseconds kDefaultTimeout{0};

  // An already-completed work (world size 1 fast paths, empty coalesced calls).
  Work();
  // Wraps a c10d work. `finish` runs once, after the collective completed and
  // in the waiting thread (on its current stream on CUDA); used to apply the
  // scale of AVG/PREMUL_SUM on backends that reduce with SUM only.
  Work(c10::intrusive_ptr<c10d::Work> work, std::string description, std::function<void()> finish = {});
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work();

  // Waits for the collective (see the stream contract above) and then runs
  // the finishing step. Idempotent: the finishing step runs once. Throws
  // (errors.h, all CollectiveError, a c10::Error naming the collective):
  // CollectiveTimeout when `timeout` (when non-zero) passed; the collective
  // is still in flight and wait() may be called again. CollectiveDiverged
  // when a wait without a timeout that blocks the host (Gloo) lasted the
  // World's divergence timeout (divergence.h), or the collective failed and
  // the monitor traced it to diverged ranks; the message is the diagnosis of
  // the ranks' flight recorders. CollectiveFailed when the collective failed
  // otherwise (a peer died, a connection broke). After either of the last two
  // the communicator is unusable. A wait with a timeout is bounded by its
  // caller and not watched; on NCCL it blocks the host (see above), so the
  // runtime never passes one.
  void wait(std::chrono::milliseconds timeout = kDefaultTimeout);

  // Appends a finishing step, run once inside wait() after the collective
  // and any finishing step already there, in the waiting thread and on its
  // current stream on CUDA (custom_collectives.h's Int8AllGather dequantizes
  // there: whoever waits for the Work gets the finished result). On a Work
  // already waited for (the stream-order checker completes collectives at
  // issue) the step runs at the next wait(), after that wait's stream wait.
  void then(std::function<void()> step);

  // True when the collective has completed (successfully or not). Never blocks.
  bool is_completed() const;

  // The error of a failed collective (a CollectiveFailed naming it), or
  // nullptr while it runs or when it succeeded.
  std::exception_ptr exception() const;

  // What this work does, e.g. "reduce_scatter_tensor(AVG) on gloo[0,1,2]".
  const std::string& description() const { return description_; }

  // The underlying c10d work (null for already-completed works).
  const c10::intrusive_ptr<c10d::Work>& c10d_work() const;

  // Internal: an event recorded on the collective's stream after it, which
  // every wait() makes the caller's current stream wait for (the
  // stream-order checker's collectives, [Note: collectives under the
  // stream-order checker] in communicator.cc).
  void set_end_event(std::shared_ptr<c10::Event> event) { end_event_ = std::move(event); }
  // Internal: the flight-recorder entry of this collective, which wait()
  // updates, and the monitor that diagnoses a wait that blocks too long.
  void set_record(std::shared_ptr<detail::DivergenceMonitor> monitor, int64_t record_id);
  // Internal: the engine's wait orders a stream and returns (NCCL, and the
  // stream-order checker's NCCL model): wait() never passes the engine a
  // timeout of its own, and the monitor watches the collective instead
  // ([Note: NCCL's wait never gets a timeout], work.cc).
  void set_stream_ordered(bool stream_ordered) { stream_ordered_ = stream_ordered; }
  // Internal: the stream-order checker runs every collective to completion
  // at issue: waits for the engine (watched as a blocking Gloo wait is) and
  // runs the finishing steps, but leaves the Work to be waited for, so that
  // the caller's wait() still goes through the engine's wait contract.
  void complete_at_issue();

 private:
  // Waits for work_ up to `timeout` (0: no limit); false when the divergence
  // timeout passed first.
  bool wait_watched(std::chrono::milliseconds timeout);

  c10::intrusive_ptr<c10d::Work> work_;
  std::string description_;
  std::function<void()> finish_;
  bool waited_ = false;
  bool stream_ordered_ = false;
  std::shared_ptr<c10::Event> end_event_;
  std::shared_ptr<detail::DivergenceMonitor> monitor_;
  int64_t record_id_ = 0;
};

}  // namespace fsdp::collectives
