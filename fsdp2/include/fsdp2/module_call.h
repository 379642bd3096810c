// Calling LibTorch modules through forward hooks.
//
// torch::nn::Module has no forward hooks (pytorch/pytorch#25888), and
// ModuleHolder::operator() calls forward() directly. For fully_shard to act
// on a module call (unshard before it, reshard and hook backward after it),
// the call must pass through this facility, the C++ counterpart of Python's
// `module(*args)` (examples/downstream/main.cc):
//
//   const at::Tensor logits = fsdp::call_module(model, inputs);  // the root, through its hooks
//
// or, with no change at call sites, declare the holder with FSDP2CPP_MODULE
// instead of TORCH_MODULE, so that `block(x)` goes through the hooks
// (examples/downstream/tiny_lm.h):
//
//   struct ResidualImpl : torch::nn::Module {
//     ...
//     at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(norm(x)))); }
//     ...
//   };
//   FSDP2CPP_MODULE(Residual);  // block(x) runs fully_shard's hooks
//
// fsdp::Sequential is torch::nn::Sequential whose children are called through
// their hooks. A Sequential cannot hold another Sequential (LibTorch's
// AnyModule needs a non-template forward); wrap the inner one in a module of
// its own (examples/downstream/tiny_lm.h):
//
//   struct NestedImpl : torch::nn::Module {
//     explicit NestedImpl(fsdp::Sequential inner) : inner(register_module("inner", std::move(inner))) {}
//     at::Tensor forward(const at::Tensor& x) { return inner(x); }
//     fsdp::Sequential inner;
//   };
//   FSDP2CPP_MODULE(Nested);
//
// A module used through a method other than forward (an encoder's `encode`)
// is called with fsdp::call_module_method(encoder, &EncoderImpl::encode, x),
// which runs the same hooks around that method.
//
// Forward arguments and results may be tensors, std::vector /
// std::tuple / std::pair / std::optional of them (nested), or plain values;
// hooks see (and may replace) every tensor among them.
//
// Modules without hooks are called directly, at the cost of one table lookup.
// Hooks are process-wide per module object, registered with
// register_forward_pre_hook / register_forward_hook, and live until removed
// or until the module is destroyed (released at the next registration after
// that, or by fsdp::release_fsdp_state_of_destroyed_modules(): a C++ module
// cannot say it was destroyed).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

namespace fsdp {

// Pointers to the tensors among a call's arguments or results, in order.
// A hook may assign through them (to cast or wrap a tensor).
using TensorRefs = std::vector<at::Tensor*>;
using ForwardPreHook = std::function<void(torch::nn::Module& module, TensorRefs& inputs)>;
using ForwardHook = std::function<void(torch::nn::Module& module, TensorRefs& inputs, TensorRefs& outputs)>;
// Runs inside the handler of an exception thrown by `module`'s forward (so
// std::current_exception() is that exception). It may throw a better one in
// its place; when it returns, the original exception propagates.
using ForwardErrorHook = std::function<void(torch::nn::Module& module)>;

// Identifies a registered hook, for remove_hook().
using HookId = uint64_t;

// Registers a hook run before `module`'s forward on every call_module.
// REQUIRES: `module` is owned by a std::shared_ptr (as all LibTorch modules
// made with std::make_shared or a holder are). Hooks run in registration order.
HookId register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook);
// Registers a hook run after `module`'s forward on every call_module.
HookId register_forward_hook(torch::nn::Module& module, ForwardHook hook);
// Registers a hook run when `module`'s forward, called through call_module,
// throws (not when a pre- or post-hook throws). No counterpart in PyTorch:
// it lets a runtime explain an error its own state caused (fully_shard uses
// it for modules called around their hooks).
HookId register_forward_error_hook(torch::nn::Module& module, ForwardErrorHook hook);
// Removes a hook; throws when `id` is not registered on `module`.
void remove_hook(torch::nn::Module& module, HookId id);
// True when `module` has any hook.
bool has_forward_hooks(const torch::nn::Module& module);

namespace detail {

// A module call (or any callable) reduced to its tensors: runs it on
// `inputs`, the tensors among its arguments in order (its other arguments
// are bound in), and returns the tensors among its results, in order. It may
// be run again later (activation checkpointing recomputes it in backward).
using TensorRegion = std::function<std::vector<at::Tensor>(std::vector<at::Tensor> inputs)>;
// Runs a region in place of a plain call: calls `region(inputs)` once before
// returning and returns tensors standing for its results, one per result
// tensor (fsdp/activation_checkpoint.h). `module` is the module called, or
// null for a callable. The forward pre-hooks run before it and the forward
// hooks after it.
using ForwardWrapper = std::function<std::vector<at::Tensor>(torch::nn::Module* module, const TensorRegion& region,
                                                             std::vector<at::Tensor> inputs)>;

struct ModuleHooks {
  std::vector<std::pair<HookId, ForwardPreHook>> pre;
  std::vector<std::pair<HookId, ForwardHook>> post;
  std::vector<std::pair<HookId, ForwardErrorHook>> error;
  // At most one; see set_forward_wrapper.
  ForwardWrapper wrapper;
  bool empty() const { return pre.empty() && post.empty() && error.empty() && !wrapper; }
};

// Makes every call of `module` through call_module / call_module_method /
// fsdp::Sequential run through `wrapper` (an empty one removes it). Throws
// when `module` has a wrapper and `wrapper` is not empty.
void set_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper);

// The hooks of `module`, or null. Snapshot: safe against concurrent changes.
std::shared_ptr<const ModuleHooks> hooks_of(const torch::nn::Module& module);

inline void collect_tensors(at::Tensor& t, TensorRefs& out) { out.push_back(&t); }
template <typename T>
void collect_tensors(std::vector<T>& v, TensorRefs& out);
template <typename T>
void collect_tensors(std::optional<T>& v, TensorRefs& out);
template <typename A, typename B>
void collect_tensors(std::pair<A, B>& v, TensorRefs& out);
template <typename... T>
void collect_tensors(std::tuple<T...>& v, TensorRefs& out);
// Plain values carry no tensor.
template <typename T>
void collect_tensors(T&, TensorRefs&) {}

template <typename T>
void collect_tensors(std::vector<T>& v, TensorRefs& out) {
  for (auto& x : v) collect_tensors(x, out);
}
template <typename T>
void collect_tensors(std::optional<T>& v, TensorRefs& out) {
  if (v) collect_tensors(*v, out);
}
template <typename A, typename B>
void collect_tensors(std::pair<A, B>& v, TensorRefs& out) {
  collect_tensors(v.first, out);
  collect_tensors(v.second, out);
}
template <typename... T>
void collect_tensors(std::tuple<T...>& v, TensorRefs& out) {
  std::apply([&out](auto&... x) { (collect_tensors(x, out), ...); }, v);
}

void run_pre_hooks(const ModuleHooks& hooks, torch::nn::Module& module, TensorRefs& inputs);
void run_post_hooks(const ModuleHooks& hooks, torch::nn::Module& module, TensorRefs& inputs, TensorRefs& outputs);
// Call only from a catch block; rethrows the exception being handled unless
// a hook throws another.
[[noreturn]] void run_error_hooks_and_rethrow(const ModuleHooks& hooks, torch::nn::Module& module);

// Calls `forward`, running the error hooks when it throws.
template <typename Forward>
auto forward_with_error_hooks(const ModuleHooks& hooks, torch::nn::Module& module, Forward&& forward) {
  if (hooks.error.empty()) return forward();
  try {
    return forward();
  } catch (...) {
    run_error_hooks_and_rethrow(hooks, module);
  }
}

// Runs the Sequential's own hooks around calling each child, in order,
// through the child's hooks. Children must take and return one tensor.
at::Tensor call_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input);

}  // namespace detail

namespace detail {

// Calls `fn` on `values` (a std::tuple of its arguments) through `wrapper`,
// and returns its result with each tensor replaced by the one the wrapper
// returned for it. `fn` and the non-tensor values are copied into the
// region, the tensors are passed as its inputs; `owner` (may be null) is
// kept alive by the region, for `fn` to reference.
template <typename Fn, typename Tuple>
auto call_through_wrapper(const ForwardWrapper& wrapper, torch::nn::Module* module, std::shared_ptr<const void> owner,
                          Fn fn, Tuple values) {
  using Result = std::decay_t<decltype(std::apply(fn, values))>;
  TensorRefs refs;
  collect_tensors(values, refs);
  std::vector<at::Tensor> inputs;
  inputs.reserve(refs.size());
  // The region keeps the arguments without their tensors: whoever runs it
  // again passes the tensors back in (and decides how long they live).
  for (at::Tensor* t : refs) inputs.push_back(std::exchange(*t, at::Tensor()));
  // The first run's result, whose structure the call returns.
  struct First {
    std::optional<Result> result;
    bool taken = false;
  };
  auto first = std::make_shared<First>();
  TensorRegion region = [fn = std::move(fn), values = std::move(values), owner = std::move(owner),
                         first](std::vector<at::Tensor> in) mutable {
    Tuple args = values;
    TensorRefs arg_refs;
    collect_tensors(args, arg_refs);
    TORCH_INTERNAL_ASSERT(arg_refs.size() == in.size(), "fsdp2: a region got ", in.size(), " tensors for ",
                          arg_refs.size(), " tensor arguments");
    for (size_t i = 0; i < in.size(); ++i) *arg_refs[i] = std::move(in[i]);
    Result out = std::apply(fn, args);
    TensorRefs out_refs;
    collect_tensors(out, out_refs);
    std::vector<at::Tensor> result;
    result.reserve(out_refs.size());
    for (at::Tensor* t : out_refs) result.push_back(*t);
    if (!first->taken && !first->result) first->result.emplace(std::move(out));
    return result;
  };
  std::vector<at::Tensor> outputs = wrapper(module, region, std::move(inputs));
  TORCH_CHECK(first->result.has_value(), "fsdp2: a forward wrapper returned without running the forward");
  first->taken = true;
  Result result = std::move(*first->result);
  first->result.reset();
  TensorRefs out_refs;
  collect_tensors(result, out_refs);
  TORCH_CHECK(out_refs.size() == outputs.size(), "fsdp2: a forward wrapper returned ", outputs.size(),
              " tensors for a result of ", out_refs.size());
  for (size_t i = 0; i < outputs.size(); ++i) *out_refs[i] = std::move(outputs[i]);
  return result;
}

// `fn(values...)`, through the module's forward wrapper when it has one.
template <typename Fn, typename Tuple>
auto call_forward(const ModuleHooks& hooks, torch::nn::Module& module, Fn& fn, Tuple& values)
    -> std::decay_t<decltype(std::apply(fn, values))> {
  if (!hooks.wrapper) return std::apply(fn, values);
  return call_through_wrapper(hooks.wrapper, &module, module.shared_from_this(), fn, values);
}

// Runs `fn(args...)` with `module`'s forward hooks around it: what
// call_module and call_module_method share. `fn` takes the arguments as
// forwarded here when `module` has no hooks, else as lvalues of the copies
// the hooks saw (and may have replaced).
template <typename Fn, typename... Args>
auto call_with_hooks(torch::nn::Module& module, Fn&& fn, Args&&... args) {
  auto hooks = hooks_of(module);
  if (!hooks) return fn(std::forward<Args>(args)...);
  std::tuple<std::decay_t<Args>...> values(std::forward<Args>(args)...);
  TensorRefs inputs;
  collect_tensors(values, inputs);
  run_pre_hooks(*hooks, module, inputs);
  auto output = forward_with_error_hooks(*hooks, module, [&] { return call_forward(*hooks, module, fn, values); });
  TensorRefs outputs;
  collect_tensors(output, outputs);
  run_post_hooks(*hooks, module, inputs, outputs);
  return output;
}

}  // namespace detail

// Runs `module.forward(args...)` with `module`'s forward hooks around it.
// Works for any module type (an Impl or a holder). Arguments are taken by
// value when the module has hooks, so that hooks can replace tensors.
template <typename ModuleT, typename... Args>
auto call_module(ModuleT& module, Args&&... args) {
  if constexpr (torch::detail::is_module_holder<ModuleT>::value) {
    return call_module(*module.ptr(), std::forward<Args>(args)...);
  } else if constexpr (std::is_same_v<ModuleT, torch::nn::SequentialImpl>) {
    static_assert(sizeof...(Args) == 1, "fsdp::call_module on a Sequential takes one tensor");
    return detail::call_sequential(module, at::Tensor(std::forward<Args>(args)...));
  } else {
    static_assert(std::is_base_of_v<torch::nn::Module, ModuleT>, "call_module needs a torch::nn::Module");
    return detail::call_with_hooks(
        module, [&module](auto&&... a) -> decltype(auto) { return module.forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
}

// Runs `(module.*method)(args...)` with `module`'s forward hooks around it,
// exactly as call_module runs forward: the pre-hooks see (and may replace)
// the tensors among the arguments, the error hooks run when the method
// throws, the post-hooks see its results. The C++ counterpart of FSDP2's
// register_fsdp_forward_method(module, "encode") (C++ cannot patch a method
// in place, so the call site names it): for a sharded module used through a
// method other than forward, e.g. an encoder-decoder's `encode` or a
// generate-style method, fully_shard then unshards before the method and
// reshards and hooks backward after it, as for forward
// (tests/fsdp2/fsdp2_multi_module_test.cc):
//
//   struct EncoderImpl : torch::nn::Module {
//     ...
//     at::Tensor encode(const at::Tensor& x, double temperature) {  // what the model calls, not forward
//       ...
//     }
//     ...
//   };
//   FSDP2CPP_MODULE(Encoder);
//   ...
//   at::Tensor h = fsdp::call_module_method(enc, &EncoderImpl::encode, x, 0.5);  // through the hooks
//
// with `enc` sharded by fsdp::fully_shard(model->enc, opts) and the model
// sharded after it. `enc->encode(x, 0.5)` would run on the shards:
// fully_shard's end-of-forward check throws when that happens inside a
// sharded forward.
//
// Works on an Impl or a holder (holders are called through their Impl);
// `method` is a pointer to a member function of the Impl or of one of its
// bases, taking `args`. Arguments are taken by value when the module has
// hooks, as for call_module. Unlike FSDP2 the call site chooses: the same
// method called directly runs without hooks.
template <typename ModuleT, typename Method, typename... Args>
auto call_module_method(ModuleT& module, Method method, Args&&... args) {
  static_assert(std::is_member_function_pointer_v<Method>,
                "fsdp::call_module_method needs a pointer to a member function, e.g. &EncoderImpl::encode");
  if constexpr (torch::detail::is_module_holder<ModuleT>::value) {
    return call_module_method(*module.ptr(), method, std::forward<Args>(args)...);
  } else {
    static_assert(std::is_base_of_v<torch::nn::Module, ModuleT>, "call_module_method needs a torch::nn::Module");
    return detail::call_with_hooks(
        module,
        [&module, method](auto&&... a) -> decltype(auto) { return (module.*method)(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
}

// A ModuleHolder whose operator() goes through call_module.
template <typename Impl>
class HookedModuleHolder : public torch::nn::ModuleHolder<Impl> {
 public:
  using torch::nn::ModuleHolder<Impl>::ModuleHolder;
  using ContainedType = Impl;

  template <typename... Args>
  auto operator()(Args&&... args) {
    return call_module(*this->ptr(), std::forward<Args>(args)...);
  }
};

// torch::nn::Sequential whose call runs each child through its hooks.
// Children take and return one tensor.
class Sequential : public HookedModuleHolder<torch::nn::SequentialImpl> {
 public:
  using HookedModuleHolder<torch::nn::SequentialImpl>::HookedModuleHolder;
  Sequential() : HookedModuleHolder(std::make_shared<torch::nn::SequentialImpl>()) {}
  // Same constructors as torch::nn::Sequential.
  template <typename... Modules, typename = std::enable_if_t<(sizeof...(Modules) > 0)>>
  explicit Sequential(Modules&&... modules)
      : HookedModuleHolder(std::make_shared<torch::nn::SequentialImpl>(std::forward<Modules>(modules)...)) {}
};

}  // namespace fsdp

// Drop-in for TORCH_MODULE(Name): declares `Name` as the holder of `NameImpl`
// whose call operator runs the module's forward hooks (fsdp::call_module).
#define FSDP2CPP_MODULE(Name)                                         \
  class Name : public ::fsdp::HookedModuleHolder<Name##Impl> {        \
   public:                                                            \
    using ::fsdp::HookedModuleHolder<Name##Impl>::HookedModuleHolder; \
    using Impl = Name##Impl;                                          \
  }
