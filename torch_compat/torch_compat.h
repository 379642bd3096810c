// Internal: where the LibTorch C++ API differs between the torch versions the
// build accepts (2.11 to 2.15, [Note: supported torch versions] in
// cmake/Fsdp2cppTorch.cmake), one entry per difference, so that no other file
// tests a torch version. Each entry says what changed and how we know.
// (The C++ standard, which also differs, is the build's business: [Note: the
// C++ standard torch needs] in the same file.)
//
// Checked by building the whole project and running its tests against torch
// 2.11.0 and 2.15.0 (docs/build.md, "Torch versions"); 2.12 to 2.14 were not
// built.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/headeronly/version.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fsdp::torch_compat {

// PREMUL_SUM as a c10d::ReduceOp: each input multiplied by `factor`, then
// summed (NCCL's ncclRedOpCreatePreMulSum).
// torch 2.11.0's c10d/Types.hpp names the maker makeNCCLPreMulSum; 2.15.0's
// names it makePreMulSum and no longer has the old name (pytorch/pytorch#172216,
// merged after 2.11's branch was cut: projects that follow PyTorch's main
// branch adapted to it on 2026-03-25, so 2.12 and later have the new name).
inline c10d::ReduceOp make_premul_sum(double factor) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
  return c10d::makeNCCLPreMulSum(factor);
#else
  return c10d::makePreMulSum(factor);
#endif
}

namespace detail {
template <class Ptr>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T>
struct WeakOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
};
}  // namespace detail

// An owning handle to an autograd graph node, as LibTorch hands them out
// (torch::autograd::impl::try_get_grad_accumulator, grad_fn): a
// std::shared_ptr<Node> in torch 2.11.0, a c10::intrusive_ptr<Node> in 2.15.0
// (their autograd/variable.h). Taken from the function's own return type, so
// it is right whichever version made the change.
using NodePtr =
    decltype(torch::autograd::impl::try_get_grad_accumulator(std::declval<const torch::autograd::Variable&>()));

// The non-owning handle that goes with NodePtr (std::weak_ptr or
// c10::weak_intrusive_ptr): lock() gives a NodePtr, null once the node is gone.
// c10::weak_intrusive_ptr has no default constructor: a container of them
// grows by push_back, not resize.
using WeakNodePtr = typename detail::WeakOf<NodePtr>::type;

// A WeakNodePtr to `node` (c10::weak_intrusive_ptr's constructor is explicit).
inline WeakNodePtr weak_node(const NodePtr& node) { return WeakNodePtr(node); }

}  // namespace fsdp::torch_compat
