// Meta kernels for the ATen ops that training a LibTorch model reaches and
// that LibTorch registers none for (PyTorch's own are Python functions,
// torch/_meta_registrations.py, which a C++ process does not load). Each
// allocates the outputs the CPU and CUDA kernels return, with their shapes
// and dtypes, and computes nothing.
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace fsdp_plan {
namespace {

at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  std::vector<int64_t> shape = self.sizes().vec();
  if (shape.empty()) return at::empty({}, self.options());
  const int64_t d = c10::maybe_wrap_dim(dim, self.dim());
  shape[static_cast<size_t>(d)] = index.numel();
  return at::empty(shape, self.options());
}

// The CPU and CUDA kernels return a fresh [num_weights, embedding dim]
// gradient (zero-filled, then accumulated into).
at::Tensor embedding_dense_backward_meta(const at::Tensor& grad_output, const at::Tensor& indices, int64_t num_weights,
                                         int64_t padding_idx, bool scale_grad_by_freq) {
  return at::empty({num_weights, grad_output.size(-1)}, grad_output.options());
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("index_select", TORCH_FN(index_select_meta));
  m.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
}

}  // namespace
}  // namespace fsdp_plan
