// Meta kernels for the ATen ops that training a LibTorch model reaches and
// that LibTorch registers none for (PyTorch's own are Python functions,
// torch/_meta_registrations.py, which a C++ process does not load). Each
// allocates the outputs the CPU and CUDA kernels return, with their shapes
// and dtypes, and computes nothing.
#include <array>
#include <tuple>
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

// Layer norm (CPU's layer_norm_cpu): the output like the input, mean and
// rstd with one value per normalized row, in the input's dtype, shaped to
// broadcast against it. Backward: each gradient the mask asks for, like its
// input.
std::tuple<at::Tensor, at::Tensor, at::Tensor> native_layer_norm_meta(const at::Tensor& input,
                                                                      c10::SymIntArrayRef normalized_shape,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      const std::optional<at::Tensor>& bias,
                                                                      double eps) {
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  std::vector<int64_t> stat_shape = input.sizes().vec();
  for (int64_t d = axis; d < input.dim(); ++d) stat_shape[static_cast<size_t>(d)] = 1;
  return {at::empty_like(input), at::empty(stat_shape, input.options()), at::empty(stat_shape, input.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_layer_norm_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& input, c10::SymIntArrayRef normalized_shape, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> mask) {
  at::Tensor dx = mask[0] ? at::empty_like(input) : at::Tensor();
  at::Tensor dweight = mask[1] && weight && weight->defined() ? at::empty_like(*weight) : at::Tensor();
  at::Tensor dbias = mask[2] && bias && bias->defined() ? at::empty_like(*bias) : at::Tensor();
  return {dx, dweight, dbias};
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("native_layer_norm", TORCH_FN(native_layer_norm_meta));
  m.impl("native_layer_norm_backward", TORCH_FN(native_layer_norm_backward_meta));
  m.impl("index_select", TORCH_FN(index_select_meta));
  m.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
}

}  // namespace
}  // namespace fsdp_plan
