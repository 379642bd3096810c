// MetaMode: while it lives, this thread builds and runs models on the meta
// device: tensors with shapes, dtypes and strides but no data, so that a
// model of any size is built and trained in no memory and little time.
//
//   {
//     fsdp_plan::MetaMode meta;
//     auto model = std::make_shared<Net>();        // parameters on the meta device
//     at::Tensor x = at::randn({8, 1024});         // meta too
//     at::Tensor loss = model->forward(x).sum();   // shapes propagate; nothing is computed
//     loss.backward();                             // gradients are meta tensors
//   }
//
// What it changes, for the thread that made it (and the autograd engine's
// threads working for it, which inherit the thread's dispatch state):
// - every factory function (an op with a `device` argument: at::empty,
//   at::zeros, at::randn, at::arange, Tensor::to(device), ...) makes meta
//   tensors, whatever device it was asked for, and never pinned memory
//   (where a CUDA run would have put them, host or device, is kept for a
//   DryRun: plan/src/host_placement.h).
//   LibTorch's modules (torch::nn::Linear, ...) construct their parameters
//   with such calls, so they are built on the meta device as they are;
//   in-place initialisers (uniform_, normal_) do nothing on meta tensors.
// - scaled dot-product attention takes the flash-attention path (output and
//   a float32 log-sum-exp saved for backward; backward makes one gradient per
//   input), as CPU and CUDA choose for causal attention without a mask,
//   where on the meta device ATen would take the math path that
//   materialises the attention matrix (and has no meta kernels).
//   Its tensors are laid out as the CUDA kernel lays them out, or as the
//   CPU kernel does (set_attention_layout), which decides whether a later
//   reshape of the output copies; with the CUDA layout, backward also makes
//   (and frees) FlashAttention-2's float32 scratch.
// Anything that needs values fails as on any meta tensor (Tensor::item(),
// printing, data_ptr()). The mode is a dispatch-key fallback on
// c10::DispatchKey::DeferredInit (PyTorch reserves that key for deferred
// initialisation; this library is its only user in the process: the
// stream-order checker holds TESTING_ONLY_GenericMode and selective
// activation checkpointing holds Fake).
//
// Threading: per thread; nests (an inner MetaMode is a no-op).
#pragma once

#include <optional>

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace fsdp_plan {

class MetaMode {
 public:
  MetaMode();
  ~MetaMode();
  MetaMode(const MetaMode&) = delete;
  MetaMode& operator=(const MetaMode&) = delete;

  // Whether a MetaMode is active on this thread.
  static bool active();

 private:
  std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
};

// Whose flash-attention kernel MetaMode's attention models (process-wide;
// default kCuda). A DryRun sets it from its engine: kCpu for Gloo.
enum class AttentionLayout { kCuda, kCpu };
void set_attention_layout(AttentionLayout layout);

}  // namespace fsdp_plan
