// Internal: the engine of the dry run's communicators. Every collective
// completes at issue and moves no bytes; each is reported to `on_collective`
// with its name and size. With `gloo_buffers`, a reduce-scatter allocates
// what this project's Gloo reduce-scatter allocates (a buffer as large as its
// input, from issue until the Work is waited for).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fsdp_plan::detail {

// `reads` and `writes` are the tensors the collective reads and writes.
using CollectiveCallback = std::function<void(const char* op, int64_t bytes, const std::vector<at::Tensor>& reads,
                                              const std::vector<at::Tensor>& writes)>;

c10::intrusive_ptr<c10d::Backend> make_dry_backend(int rank, int size, bool gloo_buffers,
                                                   CollectiveCallback on_collective);

}  // namespace fsdp_plan::detail
