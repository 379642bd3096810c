// Internal: host memory in a dry run of a CUDA job (CPU offload).
//
// [Note: host memory in a dry run] MetaMode makes every tensor a meta
// tensor, the host's included, so a dry run must be told which storages a
// CUDA run would hold in host memory: CPU offload's sharded parameters,
// gradients and optimizer state, and the batch the program builds on the CPU.
// The meta fallback decides where each op's outputs live, as ATen would have
// placed them: an explicit device argument (the CPU: the host; a CUDA device:
// the device; the meta device, as a composite op passes on what it was given:
// the op that called it decides), else the first tensor argument's memory
// (zeros_like of a host shard is on the host), else the caller's. It holds
// that decision while the op runs, and the dry run's allocator records the
// storages made meanwhile as host memory: outside the caching allocator, and
// reported apart (MemoryReport::host_peak_bytes). A dry run of a CPU job has
// no such distinction (the device is the host) and leaves it off.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp_plan::detail {

struct Placement {
  bool host = false;
  bool pinned = false;  // page-locked (pin_memory=true), as CPU offload asks
};

// Whether the live dry run tells host memory apart (process-wide; set by the
// DryRun of a CUDA job, cleared when it ends).
void set_host_placement(bool enabled);
bool host_placement_enabled();

// Where storages allocated now on this thread live.
Placement current_placement();

// Places what this thread allocates while it lives; nests.
class PlacementScope {
 public:
  explicit PlacementScope(Placement placement);
  ~PlacementScope();
  PlacementScope(const PlacementScope&) = delete;
  PlacementScope& operator=(const PlacementScope&) = delete;

 private:
  Placement previous_;
};

// Whether `t`'s storage is one the live dry run recorded as host memory
// (dry_run.cc).
bool on_host(const at::Tensor& t);

}  // namespace fsdp_plan::detail
