#include "fsdp2/activation_checkpoint.h"

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <torch/library.h>

#include "fsdp2/module_state.h"

namespace fsdp {
namespace detail {
namespace {

thread_local int recompute_depth = 0;

constexpr const char* kModuleStateKey = "fsdp.activation_checkpoint";

std::string region_name(torch::nn::Module* module) {
  return module ? c10::str("the checkpointed module '", module->name(), "'") : std::string("a checkpointed callable");
}

// The random state a region's forward drew from (PyTorch's
// preserve_rng_state: the CPU generator, and the CUDA generator of every
// device that holds a tensor input).
struct RngState {
  at::Tensor cpu;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda;

  static RngState capture(const std::vector<at::Tensor>& inputs) {
    RngState s;
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu = gen.get_state();
    }
    std::unordered_set<c10::DeviceIndex> seen;
    for (const at::Tensor& t : inputs) {
      if (!t.defined() || !t.is_cuda() || !seen.insert(t.device().index()).second) continue;
      at::Generator gen = at::detail::getCUDAHooks().getDefaultGenerator(t.device().index());
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cuda.emplace_back(t.device().index(), gen.get_state());
    }
    return s;
  }

  void restore() const {
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cpu);
    }
    for (const auto& [index, state] : cuda) {
      at::Generator gen = at::detail::getCUDAHooks().getDefaultGenerator(index);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

// CPU and CUDA autocast as forward saw them (the backward thread has its
// own, usually off).
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState capture() {
    AutocastState s;
    s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// [Note: selective checkpointing on the dispatcher] The policy's ops are
// caught below autograd, by a boxed fallback on a dispatch key that the
// region's runs include in the thread's key set (as PyTorch's SAC uses a
// TorchDispatchMode, the Python key below autograd). Autograd above it
// records every op as usual, so the recomputed graph is the plain one; only
// the kernels of the policy's ops are skipped in the recomputation, which
// gets the outputs forward kept. Ops are matched by their order among the
// policy's ops (only top-level calls: ops that kernels call inside other
// ops are neither counted nor kept), and by name. The key is Fake: it sits
// between autograd and the backends, and LibTorch registers nothing on it
// (PyTorch's FakeTensor is Python code on the Python key; keys such as
// CustomRNGKeyId, by contrast, receive every composite kernel, which would
// run in place of the fallback); tests/fsdp2/fsdp2_activation_checkpoint_test.cc
// checks that no operator has a kernel there.
constexpr c10::DispatchKey kSelectiveKey = c10::DispatchKey::Fake;

// One kept call of a policy op.
struct SavedOp {
  std::string name;
  // Its results; tensors as private aliases (own version counters).
  std::vector<c10::IValue> returns;
  // The version counters of the tensors forward returned, and their
  // versions then: a change means forward modified a kept output in place,
  // and the op is recomputed.
  std::vector<c10::VariableVersion> versions;
  std::vector<uint32_t> saved_versions;
};

struct SelectiveFrame {
  const std::unordered_set<std::string>* ops = nullptr;
  std::vector<SavedOp>* saved = nullptr;
  bool replay = false;
  size_t cursor = 0;
  int depth = 0;
  const std::string* region = nullptr;
  bool every_other_mm = false;  // CheckpointOptions::save_every_other_mm
  int64_t mms = 0;              // aten::mm calls seen in forward
};

thread_local SelectiveFrame* selective_frame = nullptr;

at::Tensor alias_with_version(const at::Tensor& t, c10::VariableVersion version) {
  if (!t.defined()) return t;
  return at::Tensor(t.unsafeGetTensorImpl()->shallow_copy_and_detach(std::move(version),
                                                                     /*allow_tensor_metadata_change=*/true));
}

void forget_written(SelectiveFrame& f, const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const auto& args = schema.arguments();
  const size_t first = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite()) continue;
    const c10::IValue& v = stack[first + i];
    std::vector<at::Tensor> written;
    if (v.isTensor()) written.push_back(v.toTensor());
    if (v.isTensorList()) written = v.toTensorVector();
    for (const at::Tensor& w : written) {
      if (!w.defined() || !w.has_storage()) continue;
      for (SavedOp& saved : *f.saved) {
        for (const c10::IValue& r : saved.returns) {
          if (r.isTensor() && r.toTensor().defined() && r.toTensor().has_storage() &&
              r.toTensor().storage().is_alias_of(w.storage())) {
            saved.returns.clear();  // recomputed in backward
            break;
          }
        }
      }
    }
  }
}

void selective_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::DispatchKeySet below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kSelectiveKey);
  SelectiveFrame* f = selective_frame;
  auto run = [&] {
    if (f) ++f->depth;
    try {
      op.redispatchBoxed(below, stack);
    } catch (...) {
      if (f) --f->depth;
      throw;
    }
    if (f) --f->depth;
  };
  const c10::FunctionSchema& schema = op.schema();
  if (f == nullptr || f->depth > 0) return run();
  // A kept output written in place later in forward (through any alias:
  // matmul returns mm's output through _unsafe_view, which has its own
  // version counter, and linear adds the bias into it) no longer holds what
  // the op returned: it is recomputed instead.
  if (!f->replay && schema.is_mutable()) forget_written(*f, schema, *stack);
  if (f->ops->count(schema.name()) == 0) return run();
  if (f->replay) {
    TORCH_CHECK(f->cursor < f->saved->size() && (*f->saved)[f->cursor].name == schema.name(),
                "fsdp::activation_checkpoint: the recomputation of ", *f->region, " in backward ran ", schema.name(),
                " where forward ran ",
                f->cursor < f->saved->size() ? (*f->saved)[f->cursor].name : std::string("no more kept op"),
                ". A checkpointed region must compute the same in backward as in forward; keep data-dependent "
                "control flow out of it, or do not checkpoint it.");
    const SavedOp& saved = (*f->saved)[f->cursor++];
    bool intact = !saved.returns.empty();
    for (size_t i = 0; i < saved.versions.size(); ++i) {
      intact = intact && saved.versions[i].current_version() == saved.saved_versions[i];
    }
    if (intact) {
      torch::jit::drop(*stack, schema.arguments().size());
      for (const c10::IValue& v : saved.returns) {
        stack->push_back(v.isTensor() ? c10::IValue(alias_with_version(v.toTensor(), c10::VariableVersion(0))) : v);
      }
      return;
    }
    return run();
  }
  run();
  SavedOp saved;
  saved.name = schema.name();
  const size_t num_returns = schema.returns().size();
  // Only functional ops: the replay returns values, it writes nothing.
  bool keepable = !schema.is_mutable();
  // torchtitan's refinement: the 2nd, 4th, ... matmul of the region is
  // recomputed (its replay finds no kept output).
  if (f->every_other_mm && schema.name() == "aten::mm" && ++f->mms % 2 == 0) keepable = false;
  for (const auto& r : schema.returns()) keepable = keepable && r.alias_info() == nullptr;
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();
      saved.versions.push_back(t.unsafeGetTensorImpl()->version_counter());
      saved.saved_versions.push_back(t._version());
      saved.returns.emplace_back(alias_with_version(t, c10::VariableVersion(0)));
    } else if (v.isTensor() || v.isNone() || v.isInt() || v.isSymInt() || v.isDouble() || v.isBool()) {
      saved.returns.push_back(v);
    } else {
      keepable = false;  // lists and other results: recomputed
    }
  }
  // An empty `returns` makes the replay run the op.
  if (!keepable) saved.returns.clear();
  f->saved->push_back(std::move(saved));
}

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&selective_fallback>()); }

// Installs `frame` (null: none) for a run of a region, RAII.
class SelectiveScope {
 public:
  explicit SelectiveScope(SelectiveFrame* frame) : previous_(selective_frame) {
    selective_frame = frame;
    if (frame) include_.emplace(kSelectiveKey);
  }
  ~SelectiveScope() { selective_frame = previous_; }
  SelectiveScope(const SelectiveScope&) = delete;
  SelectiveScope& operator=(const SelectiveScope&) = delete;

 private:
  SelectiveFrame* previous_;
  std::optional<c10::impl::IncludeDispatchKeyGuard> include_;
};

struct OutputMeta {
  bool defined = false;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::kCPU;
};

// Everything a checkpoint keeps from forward to backward, besides the
// inputs (saved in the node, so that autograd frees them after backward and
// reports a second backward without retain_graph).
struct CheckpointState : torch::CustomClassHolder {
  TensorRegion region;
  std::string name;
  CheckpointOptions options;
  // Per input: whether it required grad, and its version counter and
  // version at forward (none for undefined and inference tensors).
  std::vector<bool> input_requires_grad;
  std::vector<std::optional<c10::VariableVersion>> input_versions;
  std::vector<uint32_t> saved_versions;
  // The node's tensor inputs: these inputs (by index), then `leaves`.
  std::vector<size_t> grad_inputs;
  std::vector<at::Tensor> leaves;
  // Per region output.
  std::vector<OutputMeta> output_meta;
  // The region output each node output stands for.
  std::vector<size_t> node_outputs;
  std::optional<RngState> rng;
  AutocastState autocast;
  // Selective checkpointing: the policy (empty: full) and what forward kept.
  std::unordered_set<std::string> save_ops;
  bool save_every_other_mm = false;
  std::vector<SavedOp> saved_ops;
  // Handed from checkpoint_region to the node's forward.
  std::vector<at::Tensor> pending_inputs, pending_outputs;
  std::vector<at::Tensor> pending_non_differentiable;
};

// What the recomputation restores while it runs, RAII.
class RecomputeScope {
 public:
  explicit RecomputeScope(const CheckpointState& state) : grad_mode_(true), autocast_(AutocastState::capture()) {
    if (state.rng) {
      rng_ = RngState::capture({});
      // The CUDA generators forward saved, put back after.
      for (const auto& [index, unused] : state.rng->cuda) {
        at::Generator gen = at::detail::getCUDAHooks().getDefaultGenerator(index);
        std::lock_guard<std::mutex> lock(gen.mutex());
        rng_->cuda.emplace_back(index, gen.get_state());
      }
      state.rng->restore();
    }
    state.autocast.apply();
    ++recompute_depth;
  }
  ~RecomputeScope() {
    --recompute_depth;
    autocast_.apply();
    if (rng_) rng_->restore();
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  torch::autograd::AutoGradMode grad_mode_;
  AutocastState autocast_;
  std::optional<RngState> rng_;
};

OutputMeta meta_of(const at::Tensor& t) {
  OutputMeta m;
  if (!t.defined()) return m;
  m.defined = true;
  m.sizes = t.sizes().vec();
  m.dtype = t.scalar_type();
  m.device = t.device();
  return m;
}

std::string describe(const OutputMeta& m) {
  if (!m.defined) return "an undefined tensor";
  return c10::str("shape ", c10::IntArrayRef(m.sizes), ", ", m.dtype, " on ", m.device);
}

// [Note: the checkpoint boundary] What the region's forward graph reaches
// outside itself: the AccumulateGrad nodes of the (detached) inputs and of
// leaves (parameters, buffers), and nothing else. A node made before the
// region ran (its sequence number is outside [begin, end)) is a tensor
// computed outside the region and captured by it: its gradient could not be
// routed, so that is refused.
void find_boundary(const std::vector<at::Tensor>& outputs,
                   const std::unordered_map<const c10::TensorImpl*, size_t>& input_index, uint64_t begin, uint64_t end,
                   const std::string& name, std::vector<bool>& input_reached, std::vector<at::Tensor>& leaves) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  std::unordered_set<const c10::TensorImpl*> leaf_seen;
  for (const at::Tensor& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const c10::TensorImpl* impl = acc->variable.unsafeGetTensorImpl();
      auto it = input_index.find(impl);
      if (it != input_index.end()) {
        input_reached[it->second] = true;
      } else if (leaf_seen.insert(impl).second) {
        leaves.push_back(acc->variable);
      }
      continue;
    }
    const uint64_t seq = node->sequence_nr();
    TORCH_CHECK(seq >= begin && seq < end, "fsdp::activation_checkpoint: ", name,
                " used a tensor that requires grad and was computed outside it (by ", node->name(),
                "), captured rather than passed as an argument: its gradient cannot be routed through the "
                "recomputation. Pass that tensor as an argument of the checkpointed call.");
    for (const auto& next : node->next_edges()) {
      if (next.function && seen.insert(next.function.get()).second) stack.push_back(next.function.get());
    }
  }
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList /*boundary*/,
                                                c10::IValue state_capsule) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(state_capsule.toCapsule());
    ctx->saved_data["state"] = std::move(state_capsule);
    ctx->save_for_backward(std::exchange(state->pending_inputs, {}));
    ctx->mark_non_differentiable(std::exchange(state->pending_non_differentiable, {}));
    // Outputs autograd did not reach stay undefined, rather than zeros
    // entering the recomputed backward (exactness).
    ctx->set_materialize_grads(false);
    return std::exchange(state->pending_outputs, {});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    for (size_t i = 0; i < state->input_versions.size(); ++i) {
      if (!state->input_versions[i]) continue;
      const uint32_t now = state->input_versions[i]->current_version();
      TORCH_CHECK(now == state->saved_versions[i], "fsdp::activation_checkpoint: input ", i, " of ", state->name,
                  " was modified in place between forward and backward (version ", state->saved_versions[i],
                  " at forward, ", now,
                  " now; a view of it, an output of the region included, counts), so its recomputation would run on "
                  "other values. Modify a copy (x.clone()), or move the in-place op before the checkpointed call.");
    }
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const size_t num_boundary = state->grad_inputs.size() + state->leaves.size();
    torch::autograd::variable_list result(num_boundary + 1);  // + the capsule
    bool any = false;
    for (const auto& g : grads) any = any || g.defined();
    if (!any) return result;

    std::vector<at::Tensor> inputs;
    inputs.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].defined() ? saved[i].detach() : at::Tensor();
      if (d.defined() && state->input_requires_grad[i]) d.requires_grad_(true);
      inputs.push_back(std::move(d));
    }
    std::vector<at::Tensor> outputs;
    {
      RecomputeScope scope(*state);
      SelectiveFrame frame{&state->save_ops, &state->saved_ops, /*replay=*/true, 0, 0, &state->name};
      SelectiveScope selective(state->save_ops.empty() ? nullptr : &frame);
      outputs = state->region(inputs);
    }
    // Without retain_graph this node runs once: the kept outputs go now, not
    // when the graph is destroyed (the loss may outlive backward).
    if (!torch::autograd::get_current_graph_task_keep_graph()) state->saved_ops.clear();
    TORCH_CHECK(outputs.size() == state->output_meta.size(), "fsdp::activation_checkpoint: the recomputation of ",
                state->name, " in backward returned ", outputs.size(), " tensors where forward returned ",
                state->output_meta.size(),
                ". A checkpointed region must compute the same in backward as in forward; keep data-dependent "
                "control flow out of it, or do not checkpoint it.");
    for (size_t i = 0; i < outputs.size(); ++i) {
      const OutputMeta now = meta_of(outputs[i]);
      const OutputMeta& then = state->output_meta[i];
      TORCH_CHECK(now.defined == then.defined && now.sizes == then.sizes && now.dtype == then.dtype &&
                      now.device == then.device,
                  "fsdp::activation_checkpoint: the recomputation of ", state->name, " in backward returned output ", i,
                  " as ", describe(now), " where forward returned ", describe(then),
                  ". A checkpointed region must compute the same in backward as in forward; keep data-dependent "
                  "control flow out of it, or do not checkpoint it.");
    }
    torch::autograd::variable_list roots, root_grads;
    for (size_t k = 0; k < grads.size() && k < state->node_outputs.size(); ++k) {
      const at::Tensor& out = outputs[state->node_outputs[k]];
      if (!grads[k].defined() || !out.requires_grad()) continue;
      roots.push_back(out);
      root_grads.push_back(grads[k]);
    }
    if (roots.empty()) return result;
    // Only what the enclosing backward needs (torch::autograd::grad with
    // `inputs`, frozen parameters).
    torch::autograd::variable_list targets;
    std::vector<size_t> target_slots;
    for (size_t b = 0; b < num_boundary; ++b) {
      if (!ctx->needs_input_grad(b)) continue;
      const size_t n = state->grad_inputs.size();
      targets.push_back(b < n ? inputs[state->grad_inputs[b]] : state->leaves[b - n]);
      target_slots.push_back(b);
    }
    if (targets.empty()) return result;
    torch::autograd::variable_list g =
        torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                              /*create_graph=*/c10::GradMode::is_enabled(), /*allow_unused=*/true);
    for (size_t i = 0; i < g.size(); ++i) result[target_slots[i]] = std::move(g[i]);
    return result;
  }
};

}  // namespace

bool checkpoint_records() { return c10::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(); }

bool in_checkpoint_recompute() { return recompute_depth > 0; }

std::vector<at::Tensor> checkpoint_region(const CheckpointOptions& options, torch::nn::Module* module,
                                          const TensorRegion& region, std::vector<at::Tensor> inputs) {
  if (!checkpoint_records()) return region(std::move(inputs));
  auto state = c10::make_intrusive<CheckpointState>();
  state->region = region;
  state->name = region_name(module);
  state->options = options;
  if (options.preserve_rng_state) state->rng = RngState::capture(inputs);
  state->autocast = AutocastState::capture();

  // The region runs on detached inputs, so that its graph ends at their
  // AccumulateGrad nodes (see [Note: the checkpoint boundary]).
  std::vector<at::Tensor> detached;
  std::unordered_map<const c10::TensorImpl*, size_t> input_index;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const bool requires_grad = t.defined() && t.requires_grad();
    state->input_requires_grad.push_back(requires_grad);
    if (t.defined() && !t.is_inference()) {
      state->input_versions.emplace_back(t.unsafeGetTensorImpl()->version_counter());
      state->saved_versions.push_back(t._version());
    } else {
      state->input_versions.emplace_back(std::nullopt);
      state->saved_versions.push_back(0);
    }
    at::Tensor d = t.defined() ? t.detach() : at::Tensor();
    if (requires_grad) d.requires_grad_(true);
    if (d.defined()) input_index.emplace(d.unsafeGetTensorImpl(), i);
    detached.push_back(std::move(d));
  }
  state->save_ops.insert(options.save_ops.begin(), options.save_ops.end());
  state->save_every_other_mm = options.save_every_other_mm;
  const uint64_t begin = at::sequence_number::peek();
  std::vector<at::Tensor> outputs;
  {
    SelectiveFrame frame{&state->save_ops, &state->saved_ops,         /*replay=*/false, 0, 0,
                         &state->name,     state->save_every_other_mm};
    SelectiveScope selective(state->save_ops.empty() ? nullptr : &frame);
    outputs = region(detached);
  }
  const uint64_t end = at::sequence_number::peek();

  std::vector<bool> input_reached(inputs.size(), false);
  find_boundary(outputs, input_index, begin, end, state->name, input_reached, state->leaves);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (input_reached[i]) state->grad_inputs.push_back(i);
  }
  bool any_grad = false;
  for (const auto& out : outputs) any_grad = any_grad || (out.defined() && out.requires_grad());
  // Nothing to differentiate: the outputs carry no graph, nothing to keep.
  if (!any_grad) return outputs;

  for (size_t i = 0; i < outputs.size(); ++i) {
    state->output_meta.push_back(meta_of(outputs[i]));
    if (!outputs[i].defined()) continue;
    state->node_outputs.push_back(i);
    at::Tensor d = outputs[i].detach();
    if (!outputs[i].requires_grad()) state->pending_non_differentiable.push_back(d);
    state->pending_outputs.push_back(std::move(d));
  }
  // Frees the region's graph and intermediates now.
  outputs.clear();
  detached.clear();

  std::vector<at::Tensor> boundary;
  for (size_t i : state->grad_inputs) boundary.push_back(inputs[i]);
  boundary.insert(boundary.end(), state->leaves.begin(), state->leaves.end());
  state->pending_inputs = inputs;
  auto capsule = c10::IValue::make_capsule(state);
  torch::autograd::variable_list node_outputs = CheckpointFunction::apply(at::TensorList(boundary), capsule);
  std::vector<at::Tensor> result(state->output_meta.size());
  for (size_t k = 0; k < node_outputs.size(); ++k) result[state->node_outputs[k]] = std::move(node_outputs[k]);
  return result;
}

}  // namespace detail

std::vector<std::string> selective_checkpoint_ops() {
  return {"aten::mm",
          "aten::addmm",
          "aten::bmm",
          "aten::baddbmm",
          "aten::_scaled_dot_product_flash_attention",
          "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_efficient_attention",
          "aten::_scaled_dot_product_cudnn_attention"};
}

void checkpoint_module(torch::nn::Module& module, CheckpointOptions options) {
  TORCH_CHECK(!is_checkpointed(module), "fsdp::checkpoint_module: module '", module.name(),
              "' is checkpointed already; apply checkpoint_module once per module");
  detail::set_forward_wrapper(
      module, [options](torch::nn::Module* m, const detail::TensorRegion& region, std::vector<at::Tensor> inputs) {
        return detail::checkpoint_region(options, m, region, std::move(inputs));
      });
  detail::set_module_state(module, detail::kModuleStateKey, std::make_shared<CheckpointOptions>(options));
}

bool is_checkpointed(const torch::nn::Module& module) {
  return detail::module_state(module, detail::kModuleStateKey) != nullptr;
}

}  // namespace fsdp
