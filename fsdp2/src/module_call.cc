#include "fsdp2/module_call.h"

#include <map>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "fsdp2/module_state.h"

namespace fsdp {
namespace {

// [Note: the module side table] LibTorch modules have no slot for hooks or
// for a runtime's per-module state (Python keeps both in the module's
// __dict__), and adding a child module would change named_modules() and
// serialization. So hooks and states live in this process-wide table, keyed
// by module address and validated with a weak reference, so that a new
// module at a dead module's address never inherits its entry. A module
// cannot say it was destroyed, so the entries of destroyed modules are
// dropped on the next registration, or by
// release_states_of_destroyed_modules().
struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<const detail::ModuleHooks> hooks;  // copy-on-write
  std::map<std::string, std::shared_ptr<void>> states;
};

class Registry {
 public:
  // Never destroyed: an exit-time destruction would free the states of
  // modules still registered (and of dead ones not yet swept) after
  // LibTorch's own statics, e.g. pinned host shards after the CUDA host
  // allocator (seen on a GPU: "Unrecognized stream" and SIGSEGV at exit).
  static Registry& instance() {
    static Registry* registry = new Registry();
    return *registry;
  }

  template <typename F>
  auto with_entry(torch::nn::Module& module, F&& f) {
    // Destroyed after the lock is released: a state's destructor may block
    // (a World's waits for its peers at the end) or call back in here.
    std::vector<Entry> dead;
    std::lock_guard<std::mutex> lock(mutex_);
    dead = sweep();
    Entry& e = entries_[&module];
    if (e.module.expired()) {
      std::weak_ptr<torch::nn::Module> weak;
      try {
        weak = module.shared_from_this();
      } catch (const std::bad_weak_ptr&) {
        entries_.erase(&module);
        TORCH_CHECK(false, "fsdp2: module '", module.name(),
                    "' is not owned by a std::shared_ptr; make it with std::make_shared or a module holder");
      }
      e = Entry{weak, nullptr, {}};
    }
    return f(e);
  }

  const Entry* find_locked(const torch::nn::Module& module) {
    auto it = entries_.find(&module);
    if (it == entries_.end() || it->second.module.expired()) return nullptr;
    return &it->second;
  }

  std::shared_ptr<const detail::ModuleHooks> hooks_of(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry* e = find_locked(module);
    return e ? e->hooks : nullptr;
  }

  std::shared_ptr<void> state_of(const torch::nn::Module& module, const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry* e = find_locked(module);
    if (!e) return nullptr;
    auto it = e->states.find(key);
    return it == e->states.end() ? nullptr : it->second;
  }

  std::vector<std::shared_ptr<void>> states_with_key(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<void>> result;
    for (const auto& [module, e] : entries_) {
      if (e.module.expired()) continue;
      auto it = e.states.find(key);
      if (it != e.states.end()) result.push_back(it->second);
    }
    return result;
  }

  HookId next_id() { return ++next_id_; }

  void release_destroyed() {
    std::vector<Entry> dead;
    std::lock_guard<std::mutex> lock(mutex_);
    dead = sweep();
  }

 private:
  // Moves the entries of destroyed modules out of the table: the caller
  // destroys them once it no longer holds the lock.
  std::vector<Entry> sweep() {
    std::vector<Entry> dead;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (it->second.module.expired()) {
        dead.push_back(std::move(it->second));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    return dead;
  }

  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Entry> entries_;
  HookId next_id_ = 0;
};

}  // namespace

namespace {

// Hooks are copy-on-write: a call in progress keeps the snapshot it took.
template <typename Edit>
auto edit_hooks(torch::nn::Module& module, Edit&& edit) {
  return Registry::instance().with_entry(module, [&](Entry& e) {
    auto hooks = e.hooks ? std::make_shared<detail::ModuleHooks>(*e.hooks) : std::make_shared<detail::ModuleHooks>();
    auto result = edit(*hooks);
    e.hooks = hooks->empty() ? nullptr : std::move(hooks);
    return result;
  });
}

}  // namespace

HookId register_forward_pre_hook(torch::nn::Module& module, ForwardPreHook hook) {
  TORCH_CHECK(hook, "fsdp2: register_forward_pre_hook got an empty hook");
  return edit_hooks(module, [&](detail::ModuleHooks& hooks) {
    const HookId id = Registry::instance().next_id();
    hooks.pre.emplace_back(id, std::move(hook));
    return id;
  });
}

HookId register_forward_hook(torch::nn::Module& module, ForwardHook hook) {
  TORCH_CHECK(hook, "fsdp2: register_forward_hook got an empty hook");
  return edit_hooks(module, [&](detail::ModuleHooks& hooks) {
    const HookId id = Registry::instance().next_id();
    hooks.post.emplace_back(id, std::move(hook));
    return id;
  });
}

HookId register_forward_error_hook(torch::nn::Module& module, ForwardErrorHook hook) {
  TORCH_CHECK(hook, "fsdp2: register_forward_error_hook got an empty hook");
  return edit_hooks(module, [&](detail::ModuleHooks& hooks) {
    const HookId id = Registry::instance().next_id();
    hooks.error.emplace_back(id, std::move(hook));
    return id;
  });
}

void remove_hook(torch::nn::Module& module, HookId id) {
  const bool removed = edit_hooks(module, [&](detail::ModuleHooks& hooks) {
    auto count = [&] { return hooks.pre.size() + hooks.post.size() + hooks.error.size(); };
    const size_t before = count();
    auto matches = [id](const auto& h) { return h.first == id; };
    hooks.pre.erase(std::remove_if(hooks.pre.begin(), hooks.pre.end(), matches), hooks.pre.end());
    hooks.post.erase(std::remove_if(hooks.post.begin(), hooks.post.end(), matches), hooks.post.end());
    hooks.error.erase(std::remove_if(hooks.error.begin(), hooks.error.end(), matches), hooks.error.end());
    return count() < before;
  });
  TORCH_CHECK(removed, "fsdp2: hook ", id, " is not registered on module '", module.name(), "'");
}

namespace detail {

void set_forward_wrapper(torch::nn::Module& module, ForwardWrapper wrapper) {
  edit_hooks(module, [&](ModuleHooks& hooks) {
    TORCH_CHECK(!wrapper || !hooks.wrapper, "fsdp2: module '", module.name(),
                "' already runs through a forward wrapper (e.g. fsdp::checkpoint_module was applied to it before); "
                "apply it once");
    hooks.wrapper = std::move(wrapper);
    return 0;
  });
}

}  // namespace detail

bool has_forward_hooks(const torch::nn::Module& module) { return Registry::instance().hooks_of(module) != nullptr; }

namespace detail {

std::shared_ptr<const ModuleHooks> hooks_of(const torch::nn::Module& module) {
  return Registry::instance().hooks_of(module);
}

void run_pre_hooks(const ModuleHooks& hooks, torch::nn::Module& module, TensorRefs& inputs) {
  for (const auto& [id, hook] : hooks.pre) hook(module, inputs);
}

void run_post_hooks(const ModuleHooks& hooks, torch::nn::Module& module, TensorRefs& inputs, TensorRefs& outputs) {
  for (const auto& [id, hook] : hooks.post) hook(module, inputs, outputs);
}

void run_error_hooks_and_rethrow(const ModuleHooks& hooks, torch::nn::Module& module) {
  for (const auto& [id, hook] : hooks.error) hook(module);
  throw;
}

at::Tensor call_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input) {
  auto hooks = hooks_of(sequential);
  TensorRefs inputs{&input};
  if (hooks) run_pre_hooks(*hooks, sequential, inputs);
  auto run_children = [&sequential](at::Tensor x) {
    for (auto& child : sequential) {
      auto child_hooks = hooks_of(*child.ptr());
      TensorRefs child_inputs{&x};
      if (child_hooks) run_pre_hooks(*child_hooks, *child.ptr(), child_inputs);
      auto run_child = [child](at::Tensor in) mutable { return child.forward<at::Tensor>(std::move(in)); };
      std::tuple<at::Tensor> args{x};
      at::Tensor y = child_hooks ? forward_with_error_hooks(
                                       *child_hooks, *child.ptr(),
                                       [&] { return call_forward(*child_hooks, *child.ptr(), run_child, args); })
                                 : child.forward<at::Tensor>(x);
      TensorRefs child_outputs{&y};
      if (child_hooks) run_post_hooks(*child_hooks, *child.ptr(), child_inputs, child_outputs);
      x = std::move(y);
    }
    return x;
  };
  std::tuple<at::Tensor> args{input};
  at::Tensor x = hooks ? forward_with_error_hooks(*hooks, sequential,
                                                  [&] { return call_forward(*hooks, sequential, run_children, args); })
                       : run_children(input);
  TensorRefs outputs{&x};
  if (hooks) run_post_hooks(*hooks, sequential, inputs, outputs);
  return x;
}

void set_module_state(torch::nn::Module& module, const std::string& key, std::shared_ptr<void> state) {
  Registry::instance().with_entry(module, [&](Entry& e) {
    if (state) {
      e.states[key] = std::move(state);
    } else {
      e.states.erase(key);
    }
  });
}

std::shared_ptr<void> module_state(const torch::nn::Module& module, const std::string& key) {
  return Registry::instance().state_of(module, key);
}

std::vector<std::shared_ptr<void>> module_states(const std::string& key) {
  return Registry::instance().states_with_key(key);
}

void release_states_of_destroyed_modules() { Registry::instance().release_destroyed(); }

}  // namespace detail
}  // namespace fsdp
