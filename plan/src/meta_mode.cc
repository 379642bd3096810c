#include "fsdp_plan/meta_mode.h"

#include <atomic>
#include <cstring>
#include <optional>
#include <tuple>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "host_placement.h"

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
  // [Note: host memory in a dry run] (host_placement.h): an explicit device
  // places the outputs, else the first tensor argument, else the caller.
  std::optional<bool> on_host_by_device;
  bool pinned = false;
  const bool placing = detail::host_placement_enabled();
  std::optional<at::Tensor> first_tensor;
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& arg = (*stack)[base + i];
    const std::string& name = args[i].name();
    if (name == "device") {
      if (!arg.isNone() && arg.toDevice().type() != c10::kMeta) on_host_by_device = arg.toDevice().is_cpu();
      arg = c10::IValue(c10::Device(c10::kMeta));
    }
    if (name == "pin_memory" && !arg.isNone()) {
      pinned = arg.toBool();
      arg = c10::IValue(false);
    }
    if (!placing || first_tensor) continue;
    if (arg.isTensor() && arg.toTensor().defined()) first_tensor = arg.toTensor();
    if (arg.isTensorList() && !arg.toTensorList().empty()) first_tensor = arg.toTensorList().get(0);
  }
  const auto redispatch = [&] {
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kModeKey), stack);
  };
  if (!placing) {
    redispatch();
    return;
  }
  detail::Placement placement = detail::current_placement();
  if (on_host_by_device) {
    placement = {*on_host_by_device, *on_host_by_device && pinned};
  } else if (first_tensor && first_tensor->defined()) {
    const bool host = detail::on_host(*first_tensor);
    placement = {host, host && pinned};
  }
  const detail::PlacementScope scope(placement);
  redispatch();
}

TORCH_LIBRARY_IMPL(_, DeferredInit, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&meta_fallback>()); }

// Meta kernels of flash attention. The output's layout is the kernel's: the
// CPU kernel (aten/src/ATen/native/transformers/attention.cpp,
// _scaled_dot_product_flash_attention_cpu) returns empty_like(query),
// [batch, heads, seq, head_dim], so the usual out.transpose(1, 2).reshape()
// back to [batch, seq, dim] copies it; CUDA's flash kernel writes
// [batch, seq, heads, head_dim] and returns it transposed, so that reshape is
// a view. The log-sum-exp is [batch, heads, seq] in float32 (float for bf16
// and fp16 inputs). Backward makes one gradient like each input, and on
// CUDA the scratch of FlashAttention-2's backward (flash_api.cpp, mha_bwd),
// freed when it returns: softmax_d [batch, heads, q_len rounded up to 128]
// and the dq accumulator [batch, that q_len, heads, head_dim rounded up to
// 32 (64 past 128)], both float32, and with fewer key/value heads than query
// heads dk and dv expanded to every query head. Not modelled: the CPU
// kernel's per-thread scratch (tens of KiB, freed within the op), and the
// CUDA forward's two 8-byte random-number-state tensors it saves per call.
std::atomic<bool> g_cuda_attention_layout{true};

std::tuple<at::Tensor, at::Tensor> flash_forward_meta(const at::Tensor& query, const at::Tensor& key,
                                                      const at::Tensor& value, double dropout_p, bool is_causal,
                                                      const std::optional<at::Tensor>& attn_mask,
                                                      std::optional<double> scale) {
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), v_dim = value.size(3);
  const c10::ScalarType acc = at::isReducedFloatingType(query.scalar_type()) ? at::kFloat : query.scalar_type();
  at::Tensor logsumexp = at::empty({batch, heads, q_len}, query.options().dtype(acc));
  if (g_cuda_attention_layout.load()) {
    return {at::empty({batch, q_len, heads, v_dim}, query.options()).transpose(1, 2), logsumexp};
  }
  if (v_dim == query.size(3)) return {at::empty_like(query), logsumexp};
  return {at::empty({batch, heads, q_len, v_dim}, query.options()), logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward_meta(const at::Tensor& grad_out, const at::Tensor& query,
                                                                   const at::Tensor& key, const at::Tensor& value,
                                                                   const at::Tensor& out, const at::Tensor& logsumexp,
                                                                   double dropout_p, bool is_causal,
                                                                   const std::optional<at::Tensor>& attn_mask,
                                                                   std::optional<double> scale) {
  at::Tensor grads[3] = {at::empty_like(query), at::empty_like(key), at::empty_like(value)};
  if (g_cuda_attention_layout.load()) {
    const auto round_up = [](int64_t x, int64_t m) { return (x + m - 1) / m * m; };
    const int64_t batch = query.size(0), heads = query.size(1), q_len = round_up(query.size(2), 128),
                  head_dim = query.size(3);
    const at::TensorOptions fp32 = query.options().dtype(at::kFloat);
    // The scratch lives for this scope only: the dry run records its allocation and free.
    const at::Tensor softmax_d = at::empty({batch, heads, q_len}, fp32);
    const at::Tensor dq_accum = at::empty({batch, q_len, heads, round_up(head_dim, head_dim <= 128 ? 32 : 64)}, fp32);
    if (key.size(1) != heads) {
      const at::Tensor dk_expanded = at::empty({batch, key.size(2), heads, head_dim}, query.options());
      const at::Tensor dv_expanded = at::empty({batch, value.size(2), heads, value.size(3)}, query.options());
    }
  }
  return {grads[0], grads[1], grads[2]};
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_forward_meta));
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward", TORCH_FN(flash_backward_meta));
}

}  // namespace

namespace {
thread_local int depth = 0;
thread_local detail::Placement t_placement;
std::atomic<bool> g_host_placement{false};
}  // namespace

namespace detail {

void set_host_placement(bool enabled) { g_host_placement.store(enabled); }
bool host_placement_enabled() { return g_host_placement.load(std::memory_order_relaxed); }
Placement current_placement() { return t_placement; }
PlacementScope::PlacementScope(Placement placement) : previous_(t_placement) { t_placement = placement; }
PlacementScope::~PlacementScope() { t_placement = previous_; }

}  // namespace detail

MetaMode::MetaMode() {
  if (depth++ == 0) include_.emplace(kModeKey);
}

MetaMode::~MetaMode() { --depth; }

bool MetaMode::active() { return depth > 0; }

void set_attention_layout(AttentionLayout layout) { g_cuda_attention_layout.store(layout == AttentionLayout::kCuda); }

}  // namespace fsdp_plan
