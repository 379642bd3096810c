// TEST-ONLY. Points inside AsyncTrainingStateSaver where a test may act, so
// that a death during the background write, or a buffer reused too early,
// can be provoked deterministically instead of by timing
// (tests/checkpoint/training_state_test.cc, TrainingStateAsync.*). Not part
// of the library's interface: no program other than a test installs a hook.
#pragma once

#include <cstdint>
#include <functional>

namespace fsdp::checkpoint::internal {

enum class AsyncSavePoint {
  // save(), on the calling thread, right before it waits for the save in flight.
  kBeforeWaitForPrevious,
  // The background thread, before it writes anything of step N.
  kBeforeWrite,
  // The background thread, after this rank's tensor files are in
  // ROOT/.tmp-step-N and before the commit (the barrier, the manifest).
  kBeforeCommit,
};

using AsyncSaveHook = std::function<void(AsyncSavePoint point, int64_t step)>;

// Installs `hook` for every saver of the process (an empty function removes
// it). The hook runs on the thread the point names; it may block or
// std::_Exit. Thread-safe.
void set_async_save_hook_for_testing(AsyncSaveHook hook);

}  // namespace fsdp::checkpoint::internal
