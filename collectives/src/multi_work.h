// Internal: one c10d::Work over several, for collectives that a backend cannot
// coalesce and that the Communicator therefore issues back to back (Gloo's
// coalesced all-gather / reduce-scatter). Keeps the public Work holding a
// single c10d work.
#pragma once

#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp::collectives::detail {

class MultiWork : public c10d::Work {
 public:
  explicit MultiWork(std::vector<c10::intrusive_ptr<c10d::Work>> works);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // Waits for every part; `timeout` (when non-zero) bounds the whole wait.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace fsdp::collectives::detail
