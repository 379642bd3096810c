#include "host_memory.h"

#include <optional>

#include <ATen/ops/empty.h>

#include "stream_check/stream_check.h"

namespace fsdp::detail {

at::Tensor HostMemory::empty(at::IntArrayRef shape, const at::TensorOptions& options) const {
  const at::TensorOptions host = options.device(c10::kCPU).requires_grad(false);
  if (!modelled_) return at::empty(shape, host.pinned_memory(pinned_));
  std::optional<stream_check::HostScope> on_host;
  if (stream_check::active()) on_host.emplace(pinned_);
  return at::empty(shape, host.pinned_memory(false));
}

bool HostMemory::holds(const at::Tensor& t) const {
  if (!modelled_) return t.is_cpu();
  return !stream_check::active() || stream_check::memory_of(t) != stream_check::Memory::kDevice;
}

at::Tensor HostMemory::copy_of(const at::Tensor& on_device, bool non_blocking) const {
  at::Tensor host = empty(on_device.sizes(), on_device.options());
  host.copy_(on_device, non_blocking && pinned_);
  return host;
}

}  // namespace fsdp::detail
