#include "phase_labels.h"

#include <utility>

namespace fsdp::detail {
namespace {

// FSDP2's names for the phases, in Phase's order.
constexpr std::array<const char*, static_cast<std::size_t>(Phase::kCount)> kPhaseNames = {
    "FSDP::pre_forward",          "FSDP::post_forward",
    "FSDP::pre_backward",         "FSDP::post_backward",
    "FSDP::post_backward_reduce", "FSDP::all_gather",
    "FSDP::all_gather_copy_in",   "FSDP::all_gather_wait",
    "FSDP::all_gather_copy_out",  "FSDP::reduce_scatter_copy_in",
    "FSDP::reduce_scatter",       "FSDP::all_reduce",
    "FSDP::all_reduce_hook",      "FSDP::forward_prefetch",
    "FSDP::backward_prefetch",
};

}  // namespace

PhaseLabels::PhaseLabels(const std::string& module_fqn, const std::string& group) {
  // FSDP2 leaves the root's labels bare ("FSDP::all_gather"); in a trace or
  // a divergence report that reads as no module at all, so it is named.
  const std::string module = (module_fqn.empty() ? "root" : module_fqn) + (group.empty() ? "" : ", " + group);
  for (std::size_t i = 0; i < labels_.size(); ++i) {
    const auto phase = static_cast<Phase>(i);
    std::string label = kPhaseNames[i];
    // A prefetch is labelled by the group it prefetches.
    if (phase == Phase::kForwardPrefetch || phase == Phase::kBackwardPrefetch) {
      label += " for " + module;
    } else {
      label += " (" + module + ")";
    }
    labels_[i] = std::move(label);
  }
}

}  // namespace fsdp::detail
