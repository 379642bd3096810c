// Internal: labels one phase of the runtime (all-gather, copy-in, reduce-
// scatter, ...) with FSDP2's names and the module FQN, e.g.
// "FSDP::all_gather (layers.3)": for LibTorch's profiler (a user-scope
// RecordFunction, visible in Kineto/Chrome traces), as an NVTX range on CUDA
// builds (Nsight), and as a debug-level log line.
#pragma once

#include <optional>
#include <string>

#include <ATen/record_function.h>

#include "fsdp_common/logging.h"

namespace fsdp::detail {

class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  bool pushed_ = false;
};

class PhaseScope {
 public:
  explicit PhaseScope(std::string name) : name_(std::move(name)), nvtx_(name_) {
    FSDP2CPP_LOG_DEBUG(name_);
    if (at::hasCallbacks()) {
      record_.emplace(at::RecordScope::USER_SCOPE);
      if (record_->isActive()) record_->before(name_);
    }
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  std::string name_;
  NvtxRange nvtx_;
  std::optional<at::RecordFunction> record_;
};

}  // namespace fsdp::detail
