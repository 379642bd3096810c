#include "kernel_call.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_strided.h>

namespace fsdp_plan::detail {
namespace {

TensorSpec spec_of(const at::Tensor& t) { return TensorSpec{t.sizes().vec(), t.strides().vec(), t.scalar_type()}; }

void describe(std::ostringstream& out, const TensorSpec& s) {
  out << c10::toString(s.dtype) << "[" << c10::Join(",", s.sizes) << "]/[" << c10::Join(",", s.strides) << "]";
}

// Values of the kinds a kernel's schema takes besides tensors.
bool plain(const c10::IValue& v) {
  if (v.isNone() || v.isInt() || v.isDouble() || v.isBool() || v.isString() || v.isDevice() || v.isIntList() ||
      v.isDoubleList() || v.isBoolList()) {
    return true;
  }
  return v.isScalar();
}

// A tensor as large as `s` with values an op accepts: normal floats, zero
// integers (a valid index and class), false booleans.
at::Tensor make(const TensorSpec& s) {
  at::Tensor t = at::empty_strided(s.sizes, s.strides, at::TensorOptions().dtype(s.dtype));
  if (at::isFloatingType(s.dtype) || at::isComplexType(s.dtype)) {
    t.normal_();
  } else {
    t.zero_();
  }
  return t;
}

}  // namespace

std::optional<KernelCall> describe_call(const at::RecordFunction& fn) {
  const auto name = fn.operator_name();
  if (!name) return std::nullopt;
  KernelCall call;
  call.op = *name;
  std::ostringstream sig;
  sig << fn.name();
  for (const c10::IValue& v : fn.inputs()) {
    sig << " ";
    if (v.isTensor()) {
      if (!v.toTensor().defined()) return std::nullopt;
      call.arguments.emplace_back(spec_of(v.toTensor()));
      describe(sig, std::get<TensorSpec>(call.arguments.back()));
    } else if (v.isTensorList()) {
      std::vector<TensorSpec> list;
      for (const at::Tensor& t : v.toTensorList().vec()) {
        if (!t.defined()) return std::nullopt;
        list.push_back(spec_of(t));
        describe(sig, list.back());
        sig << ";";
      }
      call.arguments.emplace_back(std::move(list));
    } else if (plain(v)) {
      call.arguments.emplace_back(v);
      sig << v;
    } else {
      return std::nullopt;
    }
  }
  call.signature = sig.str();
  return call;
}

std::optional<double> time_call(const KernelCall& call, int reps) {
  const auto handle = c10::Dispatcher::singleton().findSchema(call.op);
  if (!handle) return std::nullopt;
  const auto run = [&]() {
    torch::jit::Stack stack;
    for (const KernelCall::Argument& a : call.arguments) {
      if (const auto* v = std::get_if<c10::IValue>(&a)) {
        stack.push_back(*v);
      } else if (const auto* s = std::get_if<TensorSpec>(&a)) {
        stack.emplace_back(make(*s));
      } else {
        std::vector<at::Tensor> list;
        for (const TensorSpec& s : std::get<std::vector<TensorSpec>>(a)) list.push_back(make(s));
        stack.emplace_back(std::move(list));
      }
    }
    const auto start = std::chrono::steady_clock::now();
    handle->callBoxed(stack);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  try {
    run();
    std::vector<double> times;
    for (int i = 0; i < reps; ++i) times.push_back(run());
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace fsdp_plan::detail
