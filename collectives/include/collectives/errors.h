// The ways a collective ends badly, as types a caller can catch (thrown by
// Work::wait(), work.h, and held by Work::exception()).
//
// Each is a c10::Error, so code that catches c10::Error sees them as before;
// the type says what the caller can do, the message says what happened, to
// which collective of which group:
//
//   try {
//     work.wait(std::chrono::minutes(5));
//   } catch (const fsdp::collectives::CollectiveTimeout&) {
//     // still in flight: wait again, or give up on the job
//   } catch (const fsdp::collectives::CollectiveError& e) {
//     // diverged or failed: the communicator is unusable; save what can be
//     // saved and exit (the other ranks' logs say why)
//   }
#pragma once

#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::collectives {

// Any of the below.
class CollectiveError : public c10::Error {
 public:
  using c10::Error::Error;
};

// Work::wait(timeout) passed its caller's timeout before the collective
// completed. The collective is still in flight and the communicator usable:
// wait() may be called again (retryable).
class CollectiveTimeout : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// The ranks diverged or stalled, as the divergence monitor diagnosed from the
// ranks' flight recorders (divergence.h): a wait that blocked past the
// divergence timeout, or a failure the monitor traced to ranks that issued
// different collectives or were left behind. The message carries the
// diagnosis. The communicator is unusable.
class CollectiveDiverged : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// The collective failed in its engine, and the monitor could not trace it to
// a divergence: a peer exited, crashed or aborted its communicator, a
// connection broke, or the engine itself failed. The message carries the
// engine's words. The communicator is unusable.
class CollectiveFailed : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// The message of an error, for a message of one's own that names its cause:
// what_without_backtrace() for a c10::Error (without LibTorch's C++
// backtrace), what() for another std::exception, and "an exception of
// unknown type" for anything else thrown.
std::string exception_text(const std::exception& error);
std::string exception_text(const std::exception_ptr& error);

}  // namespace fsdp::collectives
