// Internal: the host memory of CPU offload (OffloadPolicy; [Note: CPU
// offload] in fsdp_param.h).
//
// [Note: offload on the modelled device] On a CUDA mesh the host is the CPU:
// offload's shards, host gradients and optimizer state are CPU tensors,
// page-locked when OffloadPolicy::pin_memory asks, and copies between them
// and the device are CUDA copies. On a CPU mesh there is no device to offload
// from, so fully_shard allows offload there only under the stream-order
// checker, which models one (stream_check.h, "the host is an agent"): the
// host memory is ordinary CPU memory that the checker treats as the host's
// (pinned or pageable, as asked; a real pinned allocation needs a GPU), and
// every copy between it and the modelled device is a real copy_ that the
// checker sees as a transfer. The values are those of the CUDA run; what the
// checker adds is the order of the copies, the host's reads and writes, and
// the host synchronizations between them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/TensorOptions.h>

namespace fsdp::detail {

class HostMemory {
 public:
  HostMemory() = default;
  // `device`: the mesh's device (the CPU for the modelled device).
  HostMemory(bool pinned, c10::Device device) : pinned_(pinned), modelled_(device.is_cpu()) {}

  bool pinned() const { return pinned_; }
  // Uninitialized host memory of `shape` with `options`' dtype.
  at::Tensor empty(at::IntArrayRef shape, const at::TensorOptions& options) const;
  // Whether `t` is in host memory (rather than on the device).
  bool holds(const at::Tensor& t) const;
  // A host copy of the device tensor `on_device`, made on the current
  // stream: without blocking the host when `non_blocking` and the memory is
  // pinned (the caller then records an event to synchronize on before the
  // host reads it); otherwise the host waits for the copy.
  at::Tensor copy_of(const at::Tensor& on_device, bool non_blocking) const;

 private:
  bool pinned_ = false;
  bool modelled_ = false;
};

}  // namespace fsdp::detail
