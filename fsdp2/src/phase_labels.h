// Internal: the phases of the runtime that are labelled for profilers and
// logs (phase.h), and one parameter group's label for each.
#pragma once

#include <array>
#include <cstddef>
#include <string>

namespace fsdp::detail {

// The phases a parameter group labels, each under FSDP2's name.
enum class Phase : std::size_t {
  kPreForward,
  kPostForward,
  kPreBackward,
  kPostBackward,
  kPostBackwardReduce,
  kAllGather,
  kAllGatherCopyIn,
  kAllGatherWait,
  kAllGatherCopyOut,
  kReduceScatterCopyIn,
  kReduceScatter,
  kAllReduce,
  kAllReduceHook,
  kForwardPrefetch,   // labelled "FSDP::forward_prefetch for <fqn>"
  kBackwardPrefetch,  // labelled "FSDP::backward_prefetch for <fqn>"
  kCount,
};

// One group's label for every Phase ("FSDP::all_gather (layers.3)", or
// "FSDP::all_gather (root)" for the module with the empty FQN), built once when the
// group learns its module's FQN, so that labelling a phase on the per-step
// path builds no string. A module with several groups (per-parameter meshes)
// gives each a `group` note, which tells them apart in a trace:
// "FSDP::all_gather (blocks.0, group 1, mesh gloo[0,1,2,3])"; a module with
// one group passes none and keeps the plain label.
class PhaseLabels {
 public:
  explicit PhaseLabels(const std::string& module_fqn = "", const std::string& group = "");
  const std::string& operator[](Phase phase) const { return labels_[static_cast<std::size_t>(phase)]; }

 private:
  std::array<std::string, static_cast<std::size_t>(Phase::kCount)> labels_;
};

}  // namespace fsdp::detail
