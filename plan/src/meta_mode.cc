#include "fsdp_plan/meta_mode.h"

#include <cstring>
#include <tuple>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

namespace fsdp_plan {
namespace {

constexpr c10::DispatchKey kModeKey = c10::DispatchKey::DeferredInit;

void meta_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const std::vector<c10::Argument>& args = schema.arguments();
  const size_t base = stack->size() - args.size();
  if (schema.name() == "aten::scaled_dot_product_attention" && schema.overload_name().empty() &&
      (*stack)[base + 3].isNone() && (*stack)[base + 4].toDouble() == 0.0) {
    // ATen chooses the kernel for CPU and CUDA tensors only, and takes the
    // math path for meta ones; without a mask or dropout both choose flash.
    const at::Tensor query = (*stack)[base].toTensor(), key = (*stack)[base + 1].toTensor(),
                     value = (*stack)[base + 2].toTensor();
    const bool is_causal = (*stack)[base + 5].toBool();
    const std::optional<double> scale = (*stack)[base + 6].toOptional<double>();
    torch::jit::drop(*stack, args.size());
    stack->emplace_back(std::get<0>(
        at::_scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal, std::nullopt, scale)));
    return;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& name = args[i].name();
    if (name == "device") (*stack)[base + i] = c10::IValue(c10::Device(c10::kMeta));
    if (name == "pin_memory" && !(*stack)[base + i].isNone()) (*stack)[base + i] = c10::IValue(false);
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kModeKey), stack);
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&meta_fallback>()); }

// Meta kernels of CPU flash attention, allocating what the CPU kernels
// allocate (aten/src/ATen/native/transformers/attention.cpp,
// _scaled_dot_product_flash_attention_cpu and its backward): the output as
// [batch, q_len, heads, head_dim] and the log-sum-exp as [batch, q_len,
// heads] in the accumulation dtype (float32 for float32, bfloat16 and
// float16), both returned transposed to [batch, heads, ...]; backward one
// gradient like each input. The kernels' per-thread scratch buffers are not
// modelled (tens of KiB per thread).
std::tuple<at::Tensor, at::Tensor> flash_forward_meta(const at::Tensor& query, const at::Tensor& key,
                                                      const at::Tensor& value, double dropout_p, bool is_causal,
                                                      const std::optional<at::Tensor>& attn_mask,
                                                      std::optional<double> scale) {
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), v_dim = value.size(3);
  at::Tensor output = at::empty({batch, q_len, heads, v_dim}, query.options());
  const c10::ScalarType acc = at::isReducedFloatingType(query.scalar_type()) ? at::kFloat : query.scalar_type();
  at::Tensor logsumexp = at::empty({batch, q_len, heads}, query.options().dtype(acc));
  return {output.transpose(1, 2), logsumexp.transpose(1, 2)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward_meta(const at::Tensor& grad_out, const at::Tensor& query,
                                                                   const at::Tensor& key, const at::Tensor& value,
                                                                   const at::Tensor& out, const at::Tensor& logsumexp,
                                                                   double dropout_p, bool is_causal,
                                                                   const std::optional<at::Tensor>& attn_mask,
                                                                   std::optional<double> scale) {
  return {at::empty_like(query), at::empty_like(key), at::empty_like(value)};
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_forward_meta));
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward", TORCH_FN(flash_backward_meta));
}

thread_local int depth = 0;

}  // namespace

MetaMode::MetaMode() {
  if (depth++ == 0) include_.emplace(kModeKey);
}

MetaMode::~MetaMode() { --depth; }

bool MetaMode::active() { return depth > 0; }

}  // namespace fsdp_plan
