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
// selects the device: an interface name when `is_interface`, else a host
// name or address to bind to.
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout,
                                                    const std::string& host, bool is_interface);

// A ProcessGroupNCCL on the current CUDA device. Throws in builds without CUDA.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout);

// True when this build can make NCCL backends.
bool nccl_compiled();

}  // namespace fsdp::collectives::detail
