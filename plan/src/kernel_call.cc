#include "kernel_call.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

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

// A tensor as large as `s` with values an op accepts and takes its usual
// time on: floats in [0.5, 1.5) (the square root of a negative number takes
// a slow path, ten times a positive one's on this project's CPU, and an
// optimizer only takes roots of positive moments), zero integers (a valid
// index and class), false booleans.
at::Tensor make(const TensorSpec& s) {
  at::Tensor t = at::empty_strided(s.sizes, s.strides, at::TensorOptions().dtype(s.dtype));
  if (at::isFloatingType(s.dtype) || at::isComplexType(s.dtype)) {
    t.uniform_(0.5, 1.5);
  } else {
    t.zero_();
  }
  return t;
}

// The size of this machine's last-level cache: the highest level sysfs
// lists for CPU 0 (sysconf's figure can be the whole package's, which a
// virtual machine's cores do not have), else sysconf's, else 32 MiB.
size_t last_level_cache_bytes() {
  int best_level = 0;
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size) || size.empty()) continue;
    size_t bytes = std::strtoull(size.c_str(), nullptr, 10);
    if (size.back() == 'K') bytes <<= 10;
    if (size.back() == 'M') bytes <<= 20;
    if (level > best_level && bytes > 0) {
      best_level = level;
      best = bytes;
    }
  }
  if (best > 0) return best;
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : size_t{32} << 20;
}

}  // namespace

// [Note: a kernel's inputs come from memory] A training step's tensors
// outgrow the caches (and a virtual machine shares its last-level cache
// with its neighbours): backward reads what forward saved long before, the
// optimizer state was last touched a step ago, and even a forward matmul's
// weight comes from memory. Timed right after its inputs were made, a kernel
// finds them in cache and runs faster than in the step (on this project's
// CPU: flash attention's backward twice as fast, SiLU's backward nearly
// three times, the trainer's forward matmuls a third). So before each timed
// run the thread writes one and a half times the last-level cache's size
// elsewhere, which leaves the inputs in memory only.
void evict_caches() {
  static const size_t bytes = std::min(last_level_cache_bytes() * 3 / 2, size_t{256} << 20);
  thread_local std::vector<char> elsewhere(bytes);
  thread_local char value = 0;
  std::memset(elsewhere.data(), ++value, elsewhere.size());
}

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

std::optional<double> time_call(const KernelCall& call, int reps, const std::function<void()>& before_run) {
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
    if (before_run) {
      before_run();
    } else {
      evict_caches();
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
