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

class Work {
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
  // c10::Error naming the collective when it failed, a peer died, or
  // `timeout` (when non-zero) passed; after a timeout the collective is still
  // in flight and wait() may be called again. A wait without a timeout that
  // blocks the host (Gloo) for the World's divergence timeout (divergence.h)
  // throws the diagnosis of the ranks' flight recorders instead; the
  // communicator is unusable after that. A wait with a timeout is bounded by
  // its caller and not watched; on NCCL it blocks the host (see above), so
  // the runtime never passes one.
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

  // The error of a failed collective (a c10::Error naming it), or nullptr
  // while it runs or when it succeeded.
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
