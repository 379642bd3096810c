#include "fsdp2/clip_grad.h"

#include <cmath>
#include <limits>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace fsdp {

double clip_grad_norm_(const FSDPModule& root, double max_norm, double norm_type) {
  TORCH_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf_norm = std::isinf(norm_type);
  std::vector<at::Tensor> grads;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : root.module().parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second || !p.grad().defined()) continue;
    TORCH_CHECK(p.grad().sizes() == p.sizes(), "clip_grad_norm_: a gradient of shape ", p.grad().sizes(),
                " does not match its parameter's shape ", p.sizes(), "; call it after backward has finished");
    grads.push_back(p.grad());
  }
  const auto& comm = root.mesh().group(root.mesh().ndim() - 1);
  c10::NoGradGuard no_grad;
  // Accumulate in fp32 (at least), on the gradients' device; with CPU offload
  // (OffloadPolicy) the gradients are on the host but the collective needs
  // the mesh's device, so each term is moved there.
  at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
  if (!grads.empty()) {
    options = options.device(grads.front().device());
    if (grads.front().scalar_type() == at::kDouble) options = options.dtype(at::kDouble);
  }
  if (root.mesh().device_type() != c10::kCPU && options.device().is_cpu()) {
    options = options.device(c10::Device(root.mesh().device_type()));
  }
  at::Tensor local = at::zeros({1}, options);
  for (const auto& g : grads) {
    if (g.numel() == 0) continue;
    at::Tensor gf = g.to(options.dtype());
    if (inf_norm) {
      local = at::maximum(local, gf.abs().max().reshape({1}).to(local.device()));
    } else {
      local += gf.abs().pow(norm_type).sum().reshape({1}).to(local.device());
    }
  }
  comm->all_reduce(local, inf_norm ? collectives::ReduceOp::max() : collectives::ReduceOp::sum()).wait();
  const double total = inf_norm ? local.item<double>() : std::pow(local.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

}  // namespace fsdp
