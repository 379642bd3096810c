// FSDPState's misuse diagnostics: the checks that name a wrong use of
// fully_shard where it happens instead of letting it fail far from the cause
// (or silently train wrong): a root that cannot be one, ranks that built
// different models, a sharded module called around its hooks (found from
// autograd's nodes, or from the shapes in LibTorch's error text), and
// fully_shard forgotten on the model that contains the sharded blocks.
// The methods are FSDPState's (fsdp_state.h), for its state.
#include "fsdp_state.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <mutex>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "collectives/divergence.h"
#include "phase.h"

namespace fsdp::detail {

void FSDPState::check_can_be_root() {
  auto root_module = module();
  if (auto p = parent()) {
    TORCH_CHECK(false, "fsdp2: module '", root_module->name(),
                "' ran its forward hooks before the sharded module that contains it ('", top()->module()->name(),
                "', the root). The outer module's forward was called around its hooks (e.g. model->forward(x) or a "
                "TORCH_MODULE holder): call the root through fsdp::call_module(model, ...), declare its holder with "
                "FSDP2CPP_MODULE, or use fsdp::Sequential, so that fully_shard can run it.");
  }
  if (modules_.size() > 1) {
    std::string names;
    for (const auto& m : modules()) names += (names.empty() ? "" : ", ") + m->name();
    TORCH_CHECK(false, "fsdp2: the modules [", names,
                "], sharded as one group by one fully_shard call, ran forward with no sharded module containing "
                "them, which would make the group the root. A group of several modules cannot be the root (as in "
                "FSDP2): apply fully_shard to a common ancestor of the modules (e.g. the whole model) before the "
                "first forward, and call that ancestor.");
  }
}

// [Note: the model fingerprint] Ranks that build different models (a config
// read differently, one layer more, a parameter frozen on one rank only,
// other fully_shard groups) would issue collectives of different sizes, or
// different numbers of them, and hang or fail far from the cause. The root's
// lazy init, the first point where every rank has named every parameter and
// before any collective of the model, compares one line per group and per
// parameter across the ranks of each mesh dim, and names the first
// difference on every rank.
void FSDPState::check_ranks_hold_the_same_model() const {
  std::vector<std::string> lines;
  for (const auto& weak : ctx_->all_states) {
    auto state = weak.lock();
    if (state->groups_.empty()) {
      lines.push_back(c10::str("fully_shard module '", state->fqn_, "' with no parameters"));
      continue;
    }
    for (const auto& group : state->groups_) {
      lines.push_back(c10::str("fully_shard group '", state->fqn_, "' of ", state->modules_.size(), " module(s) with ",
                               group->params().size(), " parameter(s) over a ", group->mesh().ndim(), "-D mesh of ",
                               group->mesh().size(), " rank(s), reshard_after_forward ",
                               group->settings().reshard_after_forward ? "true" : "false"));
      for (const auto& p : group->params()) {
        lines.push_back(c10::str("parameter '", p->fqn(), "' of shape ", c10::IntArrayRef(p->unsharded_shape()),
                                 ", dtype ", p->orig_dtype(), ", requires_grad ",
                                 p->param().requires_grad() ? "true" : "false", ", sharded on dim ", p->shard_dim()));
      }
    }
  }
  // A meta mesh is a dry run's (fsdp_plan): one rank simulated, no peers to compare with.
  if (mesh_.device_type() == c10::kMeta) return;
  PhaseScope phase("FSDP::lazy_init (model fingerprint)");
  for (int64_t dim = 0; dim < mesh_.ndim(); ++dim) {
    const auto& comm = mesh_.group(dim);
    if (comm->size() == 1) continue;
    collectives::check_ranks_agree(*comm, lines, "fsdp2: the sharded model");
  }
}

namespace {

// Whether `text` shows `shape` the way LibTorch's shape errors print one:
// "[4, 8]" (IntArrayRef), or "4x8" / "8x4" (matmul operands; weights enter
// them transposed).
bool mentions_shape(const std::string& text, const std::vector<int64_t>& shape) {
  if (text.find(c10::str(c10::IntArrayRef(shape))) != std::string::npos) return true;
  if (shape.size() != 2) return false;
  auto matrix = [&text](int64_t rows, int64_t cols) {
    const std::string needle = c10::str(rows, "x", cols);
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
      const bool starts = at == 0 || !std::isdigit(static_cast<unsigned char>(text[at - 1]));
      const size_t end = at + needle.size();
      const bool ends = end == text.size() || !std::isdigit(static_cast<unsigned char>(text[end]));
      if (starts && ends) return true;
    }
    return false;
  };
  return matrix(shape[0], shape[1]) || matrix(shape[1], shape[0]);
}

std::string message_of_current_exception() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

constexpr const char* kCallThroughHooks =
    "Call it through fsdp::call_module, declare its holder with FSDP2CPP_MODULE, or put it in an fsdp::Sequential.";

}  // namespace

std::string FSDPState::call_around_hooks_message(const std::string* error) const {
  // [Note: calls around the hooks] A sharded module whose forward ran outside
  // call_module computed with its shards. In grad mode autograd then made
  // the parameter's AccumulateGrad node at the sharded shape (fsdp2 only ever
  // lets it be made at the full shape), which is how such a call is caught at
  // the end of the root's forward. When an op fails on the sharded shapes
  // first (LayerNorm checks its weight before autograd sees it), the root's
  // forward error hook looks for the node, else for a sharded parameter's
  // shape in the op's message. Without autograd such a call fails on the
  // shapes (world size > 1), or is correct (world size 1, where the shard is
  // the whole parameter).
  std::string probable;
  for (const auto& weak : ctx_->all_states) {
    auto s = weak.lock();
    if (!s) continue;
    for (const auto& group : s->groups_) {
      if (group->is_unsharded()) continue;
      for (const auto& p : group->params()) {
        if (p->sharded_shape() == p->unsharded_shape()) continue;
        // Runs after every root forward: build the message only on a finding.
        auto used = [&] {
          const std::string module = s->is_root_.value_or(false)
                                         ? c10::str("the root module '", s->module()->name(), "'")
                                         : c10::str("module '", s->fqn_, "'");
          return c10::str("fsdp2: parameter '", p->fqn(), "' was used in forward while sharded (shape ",
                          c10::IntArrayRef(p->sharded_shape()), " of ", c10::IntArrayRef(p->unsharded_shape()),
                          "): ", module, " was ");
        };
        auto node = torch::autograd::impl::try_get_grad_accumulator(p->param());
        if (node && node->num_inputs() > 0) {
          const auto sym_shape = node->input_metadata(0).shape_as_dim_vector();
          std::vector<int64_t> shape;
          for (const auto& d : sym_shape) shape.push_back(d.guard_int(__FILE__, __LINE__));
          if (shape == p->sharded_shape()) {
            return c10::str(used(), "called around its hooks (e.g. module->forward(x) or a TORCH_MODULE holder). ",
                            kCallThroughHooks);
          }
        }
        if (probable.empty() && error != nullptr && mentions_shape(*error, p->sharded_shape())) {
          probable = c10::str(used(),
                              "probably called around its hooks (e.g. module->forward(x) or a TORCH_MODULE holder): "
                              "the error below shows that sharded shape. ",
                              kCallThroughHooks);
        }
      }
    }
  }
  return probable;
}

void FSDPState::check_no_call_around_hooks() const {
  const std::string message = call_around_hooks_message(nullptr);
  TORCH_CHECK(message.empty(), message);
}

namespace {

// The roots whose forward ran with autograd since the last backward started,
// each once, process-wide (the backward may run on another thread than the
// forward). See FSDPState::warn_if_several_roots.
struct RootsSinceBackward {
  std::mutex mutex;
  std::vector<std::weak_ptr<FSDPState>> roots;
  std::atomic<bool> warned{false};
};

RootsSinceBackward& roots_since_backward() {
  static RootsSinceBackward* roots = new RootsSinceBackward();  // never destroyed: used from exit-time destructors
  return *roots;
}

}  // namespace

void FSDPState::after_root_forward_with_grad() {
  if (!groups_.empty()) {
    const std::vector<FSDPParam*> params = all_params();
    root_param_nodes_.clear();  // not resize(): c10::weak_intrusive_ptr has no default constructor
    root_param_nodes_.reserve(params.size());
    for (const auto* param : params) {
      root_param_nodes_.push_back(
          torch_compat::weak_node(torch::autograd::impl::try_get_grad_accumulator(param->param())));
    }
  }
  RootsSinceBackward& r = roots_since_backward();
  if (r.warned.load()) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.roots.erase(std::remove_if(r.roots.begin(), r.roots.end(), [](const auto& w) { return w.expired(); }),
                r.roots.end());
  for (const auto& weak : r.roots) {
    if (weak.lock().get() == this) return;
  }
  r.roots.push_back(weak_from_this());
}

void FSDPState::warn_if_several_roots() {
  // [Note: several roots in one forward] fully_shard applied to the blocks
  // but not to the model that contains them makes each block a root of its
  // own: each all-gathers and reduces only its own parameters, and the
  // parameters outside the blocks (an embedding, a final norm) get no
  // reduction at all, so the ranks' copies of them drift apart while the
  // loss looks plausible. Nothing fails, so it is reported here: when the
  // forwards before a backward ran several roots. Separate models trained
  // together (a GAN's generator and discriminator) also do that, which is why
  // this is a warning, given once per process, and not an error. Roots whose
  // forward ran without autograd (a frozen teacher) are not counted.
  RootsSinceBackward& r = roots_since_backward();
  if (r.warned.load()) return;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& weak : r.roots) {
      if (auto s = weak.lock()) names.push_back(s->module()->name());
    }
    r.roots.clear();
    if (names.size() < 2 || r.warned.exchange(true)) return;
  }
  std::string list;
  for (const auto& name : names) list += (list.empty() ? "" : ", ") + name;
  TORCH_WARN("fsdp2: one forward ran ", names.size(), " fully_shard roots, the modules [", list,
             "]: each root all-gathers and reduces only its own parameters, so the parameters of a module that "
             "contains them and is not sharded (e.g. an embedding or a final norm) are never reduced and drift apart "
             "across ranks. If these are parts of one model, apply fully_shard to the model too, last (after its "
             "submodules), and call it through fsdp::call_module or an FSDP2CPP_MODULE holder. If they are separate "
             "models trained together, ignore this warning (given once per process).");
}

void FSDPState::check_root_called_through_hooks() const {
  // [Note: the root called around its hooks] When the root's forward runs
  // around its hooks (model->forward(x), a TORCH_MODULE holder), its own
  // parameters are used while sharded and the first fsdp2 code to run is the
  // pre-forward of a submodule called through its hooks, which then starts
  // the forward as a sharded submodule called on its own would (FSDP2
  // allows that). The two differ in whether the root's parameters were used:
  // in grad mode autograd made an AccumulateGrad node for each one used.
  // fsdp2 never keeps such a node, so a node that is alive now is either
  // still held by the graph of the root's last forward through its hooks
  // (remembered at its end) or was made since, on the shards: by this call.
  // This holds at every world size, world size 1 included, where the shard is
  // the whole parameter and the results are right but the same program fails
  // at 2+ ranks. Not caught: a root op that fails on the sharded shapes before
  // any submodule runs (an embedding's "index out of range": no fsdp2 code
  // runs before it), root parameters first used after the submodules (at 2+
  // ranks check_no_call_around_hooks finds those by their shape at the end
  // of the submodule's forward only when the use comes before it), and,
  // without autograd, a root whose ops fit the sharded shapes at 2+ ranks.
  std::shared_ptr<FSDPState> root = ctx_->all_states.empty() ? nullptr : ctx_->all_states.front().lock();
  if (!root || root.get() == this) return;
  // The root's parameters in group order, as root_param_nodes_; those of an
  // unsharded group are not checked.
  std::vector<FSDPParam*> params;
  std::vector<bool> check;
  for (const auto& g : root->groups_) {
    for (const auto& p : g->params()) {
      params.push_back(p.get());
      check.push_back(!g->is_unsharded());
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!check[i]) continue;
    auto node = torch::autograd::impl::try_get_grad_accumulator(params[i]->param());
    if (!node) continue;
    if (i < root->root_param_nodes_.size() && root->root_param_nodes_[i].lock() == node) continue;
    TORCH_CHECK(false, "fsdp2: the root module '", root->module()->name(),
                "' was called around its hooks (e.g. model->forward(x), or a TORCH_MODULE holder's model(x)): its "
                "parameter '",
                params[i]->fqn(), "' was used while sharded (this rank's shape ",
                c10::IntArrayRef(params[i]->sharded_shape()), " of ", c10::IntArrayRef(params[i]->unsharded_shape()),
                "), so its forward computed on this rank's shard, before its submodule '", fqn_,
                "' started the forward through its own hooks. Call the root through fsdp::call_module(model, ...), "
                "or declare its holder with FSDP2CPP_MODULE and call model(...).");
  }
}

void FSDPState::explain_forward_error() const {
  if (ctx_ == nullptr || ctx_->iter_forward_root != this) return;
  const std::string cause = message_of_current_exception();
  const std::string message = call_around_hooks_message(&cause);
  TORCH_CHECK(message.empty(), message, " The error this caused: ", cause);
}

}  // namespace fsdp::detail
