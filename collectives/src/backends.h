// Internal: construction of the c10d engines. Each lives in its own
// translation unit so that only it sees the engine's headers (gloo's come from
// Debian, NCCL's only exist in CUDA builds).
#pragma once

#include <chrono>
#include <string>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp::collectives::detail {

// A ProcessGroupGloo over `store` (already prefixed for the group). `host`
// selects the device: interface names (comma-separated, as GLOO_SOCKET_IFNAME
// allows) when `is_interface`, else a host name or address to bind to, or
// gloo's default device (the address the host name resolves to) when empty.
// Collective over the group: connects the full mesh, failing after `timeout`.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& host,
                                                    bool is_interface);

// A ProcessGroupNCCL bound to the current CUDA device (communicators are
// created lazily, at the first collective). Throws in builds without CUDA and
// where no GPU is visible.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout);

// True when this build can make NCCL backends.
bool nccl_compiled();

}  // namespace fsdp::collectives::detail
