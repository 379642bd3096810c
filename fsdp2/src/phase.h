// Internal: labels one phase of the runtime (all-gather, copy-in, reduce-
// scatter, ...) with FSDP2's names and the module FQN, e.g.
// "FSDP::all_gather (layers.3)": for LibTorch's profiler (a user-scope
// RecordFunction, visible in Kineto/Chrome traces), as an NVTX range on CUDA
// builds (Nsight), as a debug-level log line, as the label of the
// collectives issued inside it (the flight recorder's, and the divergence
// diagnosis's: collectives/flight_recorder.h), and as the phase the
// stream-order checker names.
#pragma once

#include <optional>
#include <string>

#include <ATen/record_function.h>

#include "collectives/flight_recorder.h"
#include "fsdp_common/logging.h"
#include "phase_labels.h"
#include "stream_check/stream_check.h"

namespace fsdp::detail {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  bool pushed_ = false;
};

// Labels the scope it lives in. `name` must outlive the scope (a literal or
// a PhaseLabels entry, phase_labels.h): a temporary string does not compile.
class PhaseScope {
 public:
  explicit PhaseScope(const char* name) : name_(name), nvtx_(name), stream_check_(name), collective_label_(name) {
    FSDP2CPP_LOG_DEBUG(name_);
    if (at::hasCallbacks()) {
      record_.emplace(at::RecordScope::USER_SCOPE);
      if (record_->isActive()) record_->before(name_);
    }
  }
  explicit PhaseScope(const std::string& name) : PhaseScope(name.c_str()) {}
  explicit PhaseScope(std::string&&) = delete;
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  const char* name_;
  NvtxRange nvtx_;
  stream_check::PhaseLabel stream_check_;
  collectives::CollectiveLabel collective_label_;
  std::optional<at::RecordFunction> record_;
};

}  // namespace fsdp::detail
