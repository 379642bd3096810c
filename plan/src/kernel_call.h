// Internal: a kernel the dry run saw, in a form that runs again on real CPU
// tensors of the same shapes, strides and dtypes (the CPU profile times each
// distinct kernel of a plan so: timeline.h, measure_cpu_profile).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/core/operator_name.h>
#include <ATen/record_function.h>

namespace fsdp_plan::detail {

struct TensorSpec {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
};

struct KernelCall {
  c10::OperatorName op{"", ""};
  // Each argument: a value as it was, a tensor's description, or a list of them.
  using Argument = std::variant<c10::IValue, TensorSpec, std::vector<TensorSpec>>;
  std::vector<Argument> arguments;
  std::string signature;  // the op, its tensors' shapes, strides and dtypes, its other values
};

// The call `fn` makes, or nullopt when an argument is of a kind it cannot
// describe (then the kernel is timed by the roofline instead).
std::optional<KernelCall> describe_call(const at::RecordFunction& fn);

// Runs `call` on fresh CPU tensors: the median seconds of `reps` runs after
// one warm-up, or nullopt when the op throws on them. Before each run,
// `before_run` (default: evict_caches), once the inputs are made.
std::optional<double> time_call(const KernelCall& call, int reps, const std::function<void()>& before_run = {});

// Writes more than the last-level cache elsewhere, so that what this thread
// made before is in memory only ([Note: a kernel's inputs come from memory]
// in kernel_call.cc).
void evict_caches();

}  // namespace fsdp_plan::detail
