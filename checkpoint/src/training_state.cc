#include "checkpoint/training_state.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/internal/async_save_hook.h"
#include "checkpoint/sharded.h"
#include "collectives/flight_recorder.h"
#include "io_util.h"
#include "load_core.h"

namespace fsdp::checkpoint {

// The kinds of item, alternatives of one std::variant so that every
// std::visit of an item handles each kind or does not compile. Values are
// held by reference (the user's variables, never null). `kKind` is the name
// stored in the manifest ("training_state" -> "items" -> name -> "kind") and
// used in messages.
struct StatefulItem {
  static constexpr const char* kKind = "stateful";
  std::reference_wrapper<Stateful> stateful;
};
struct TensorItem {
  static constexpr const char* kKind = "tensor";
  StateValue tensor;
};
struct JsonItem {
  static constexpr const char* kKind = "json";
  std::reference_wrapper<std::string> text;
};
// A scalar of the user's, saved in the manifest's JSON: the four kinds
// differ only in the type they hold.
template <typename T, const char* Kind>
struct ScalarItem {
  static constexpr const char* kKind = Kind;
  std::reference_wrapper<T> value;
};
inline constexpr char kInt64[] = "int64";
inline constexpr char kDouble[] = "double";
inline constexpr char kString[] = "string";
inline constexpr char kBool[] = "bool";
using Int64Item = ScalarItem<int64_t, kInt64>;
using DoubleItem = ScalarItem<double, kDouble>;
using StringItem = ScalarItem<std::string, kString>;
using BoolItem = ScalarItem<bool, kBool>;
struct RngItem {
  static constexpr const char* kKind = "rng";
  at::Generator generator;
};

struct TrainingState::Item {
  std::string name;
  std::variant<StatefulItem, TensorItem, JsonItem, Int64Item, DoubleItem, StringItem, BoolItem, RngItem> value;
};

struct TrainingStateAccess {
  static std::vector<TrainingState::Item>& items(TrainingState& s) { return s.items_; }
};

namespace {

using Clock = std::chrono::steady_clock;
using Item = TrainingState::Item;
using collectives::Communicator;
using collectives::ReduceOp;
using nlohmann::json;

// Lets std::visit take one lambda per kind of item (the C++17 overload idiom).
template <typename... Handlers>
struct Overloaded : Handlers... {
  using Handlers::operator()...;
};
template <typename... Handlers>
Overloaded(Handlers...) -> Overloaded<Handlers...>;

const char* kind_name(const Item& item) {
  return std::visit([](const auto& value) { return std::decay_t<decltype(value)>::kKind; }, item.value);
}

const char* registering_call(const std::string& kind) {
  if (kind == "stateful") return "add(name, stateful)";
  if (kind == "tensor") return "add_tensor";
  if (kind == "json") return "add_json";
  if (kind == "int64") return "add_int64";
  if (kind == "double") return "add_double";
  if (kind == "string") return "add_string";
  if (kind == "bool") return "add_bool";
  if (kind == "rng") return "add_rng";
  return "an unknown call";
}

bool is_value_kind(const std::string& kind) {
  return kind == "json" || kind == "int64" || kind == "double" || kind == "string" || kind == "bool";
}

std::string to_hex(const at::Tensor& bytes_tensor) {
  static const char* const kDigits = "0123456789abcdef";
  const at::Tensor bytes_cpu = bytes_tensor.contiguous();
  const auto* bytes = bytes_cpu.data_ptr<uint8_t>();
  std::string hex;
  hex.reserve(static_cast<size_t>(bytes_cpu.numel()) * 2);
  for (int64_t i = 0; i < bytes_cpu.numel(); ++i) {
    hex += kDigits[bytes[i] >> 4];
    hex += kDigits[bytes[i] & 15];
  }
  return hex;
}

at::Tensor from_hex(const std::string& hex, const std::string& what) {
  TORCH_CHECK(hex.size() % 2 == 0, what, " is not a hex string of whole bytes (", hex.size(), " digits)");
  at::Tensor out = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  auto* bytes = out.data_ptr<uint8_t>();
  const auto digit = [&](char c) -> uint8_t {
    if (c >= '0' && c <= '9') return static_cast<uint8_t>(c - '0');
    TORCH_CHECK(c >= 'a' && c <= 'f', what, " is not a hex string (found '", c, "')");
    return static_cast<uint8_t>(c - 'a' + 10);
  };
  for (size_t i = 0; i < hex.size() / 2; ++i) {
    bytes[i] = static_cast<uint8_t>(digit(hex[2 * i]) << 4 | digit(hex[2 * i + 1]));
  }
  return out;
}

std::string generator_state_hex(at::Generator& gen) {
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  return to_hex(state);
}

// Rank 0 verifies `dir` (sizes, CRC32) and every rank learns the verdict,
// so a damaged checkpoint fails all ranks at once instead of leaving the
// others waiting in the next collective.
void verify_on_rank0(const std::string& dir, Communicator& group) {
  std::string error;
  if (group.rank() == 0) {
    try {
      verify_checkpoint(dir);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  }
  at::Tensor failed = at::tensor({error.empty() ? 0 : 1}, at::kInt);
  const collectives::CollectiveLabel label("checkpoint: verify on rank 0");
  // Rank 0 reads every file meanwhile: bounded by the group's timeout, not
  // by the divergence timeout (divergence.h).
  group.all_reduce(failed, ReduceOp::max()).wait(group.timeout());
  if (failed.item<int>() == 0) return;
  TORCH_CHECK(group.rank() != 0, error);
  TORCH_CHECK(false, "rank 0 found '", dir, "' damaged (its message names the file); resume from an older ",
              "checkpoint (remove this one) or restore the file");
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "nothing" : out;
}

// A value item as the manifest's extra stores it.
json saved_value(const JsonItem& item, const std::string& name) {
  return detail::parse_json_strict(item.text.get(), "save_training_state: the JSON value '" + name + "'");
}
template <typename T, const char* Kind>
json saved_value(const ScalarItem<T, Kind>& item, const std::string&) {
  return item.value.get();
}
json saved_value(const RngItem& item, const std::string&) {
  at::Generator gen = item.generator;
  return generator_state_hex(gen);
}

}  // namespace

// ---------------------------------------------------------------------------
// TrainingState

TrainingState::TrainingState() = default;
TrainingState::~TrainingState() = default;
TrainingState::TrainingState(TrainingState&&) noexcept = default;
TrainingState& TrainingState::operator=(TrainingState&&) noexcept = default;

TrainingState& TrainingState::add_item(Item item) {
  const std::string& name = item.name;
  TORCH_CHECK(detail::is_plain_file_name(name) && name[0] != '.', "TrainingState: the name '", name,
              "' is not a plain file name (no '/', not starting with '.'); items of a Stateful are stored in a ",
              "directory of that name");
  TORCH_CHECK(name != kTrainingStateKey && name != kUserTensorsDir, "TrainingState: the name '", name,
              "' is reserved (\"", kTrainingStateKey, "\" describes the state, \"", kUserTensorsDir,
              "/\" holds add_tensor's tensors); pick another");
  for (const auto& existing : items_) {
    TORCH_CHECK(existing.name != name, "TrainingState: '", name, "' is registered twice (first as ",
                kind_name(existing), ", now as ", kind_name(item), "); every item needs its own name");
  }
  items_.push_back(std::move(item));
  return *this;
}

TrainingState& TrainingState::add(std::string name, Stateful& stateful) {
  return add_item(Item{std::move(name), StatefulItem{stateful}});
}

TrainingState& TrainingState::add_tensor(std::string name, StateValue tensor) {
  return add_item(Item{std::move(name), TensorItem{std::move(tensor)}});
}

TrainingState& TrainingState::add_json(std::string name, std::string& json_text) {
  return add_item(Item{std::move(name), JsonItem{json_text}});
}

TrainingState& TrainingState::add_int64(std::string name, int64_t& value) {
  return add_item(Item{std::move(name), Int64Item{value}});
}

TrainingState& TrainingState::add_double(std::string name, double& value) {
  return add_item(Item{std::move(name), DoubleItem{value}});
}

TrainingState& TrainingState::add_string(std::string name, std::string& value) {
  return add_item(Item{std::move(name), StringItem{value}});
}

TrainingState& TrainingState::add_bool(std::string name, bool& value) {
  return add_item(Item{std::move(name), BoolItem{value}});
}

TrainingState& TrainingState::add_rng(std::string name, at::Generator generator) {
  TORCH_CHECK(generator.defined(), "TrainingState::add_rng('", name, "'): the generator is undefined");
  return add_item(Item{std::move(name), RngItem{std::move(generator)}});
}

std::vector<std::string> TrainingState::names() const {
  std::vector<std::string> out;
  for (const auto& item : items_) out.push_back(item.name);
  return out;
}

// ---------------------------------------------------------------------------
// Save

namespace internal {
namespace {
std::mutex& hook_mutex() {
  static std::mutex mutex;
  return mutex;
}
AsyncSaveHook& hook_slot() {
  static AsyncSaveHook hook;
  return hook;
}
}  // namespace

void set_async_save_hook_for_testing(AsyncSaveHook hook) {
  std::lock_guard<std::mutex> lock(hook_mutex());
  hook_slot() = std::move(hook);
}
}  // namespace internal

namespace {

void run_async_save_hook(internal::AsyncSavePoint point, int64_t step) {
  internal::AsyncSaveHook hook;
  {
    std::lock_guard<std::mutex> lock(internal::hook_mutex());
    hook = internal::hook_slot();
  }
  if (hook) hook(point, step);
}

// What a save writes, collected from the items: the manifest's extra and
// the tensors of each directory.
struct StagedState {
  std::string extra_json;
  std::vector<std::pair<std::string, StateDict>> dirs;
};

StagedState collect_items(TrainingState& state) {
  auto& items = TrainingStateAccess::items(state);

  // Collect every item's state before anything is written, so that a bad
  // item fails the save before the transaction starts.
  json extra = json::object();
  json described = json::object();
  std::vector<std::pair<const Item*, StatefulState>> statefuls;
  StateDict user_tensors;
  const auto claim = [&](const std::string& key, const std::string& owner) {
    TORCH_CHECK(key != kTrainingStateKey && !extra.contains(key), "save_training_state: ", owner, " stores '", key,
                "' in the manifest's extra, where ",
                key == kTrainingStateKey ? std::string("the training state's description") : "another item",
                " already is; rename the item or the member");
  };
  for (const Item& item : items) {
    const std::string& name = item.name;
    json entry = {{"kind", kind_name(item)}};
    std::visit(Overloaded{
                   [&](const StatefulItem& stateful) {
                     StatefulState s = stateful.stateful.get().state_dict();
                     json keys = json::array();
                     for (const auto& [key, text] : s.json) {
                       claim(key, "Stateful '" + name + "'");
                       extra[key] = detail::parse_json_strict(
                           text, "save_training_state: the JSON member '" + key + "' of Stateful '" + name + "'");
                       keys.push_back(key);
                     }
                     entry["json_keys"] = std::move(keys);
                     entry["tensors"] = static_cast<int64_t>(s.tensors.size());
                     statefuls.emplace_back(&item, std::move(s));
                   },
                   [&](const TensorItem& t) { user_tensors.insert(name, t.tensor); },
                   [&](const auto& value) {
                     claim(name, registering_call(kind_name(item)));
                     extra[name] = saved_value(value, name);
                   },
               },
               item.value);
    described[name] = std::move(entry);
  }
  extra[kTrainingStateKey] = {{"version", 1}, {"items", std::move(described)}};

  StagedState staged;
  for (auto& [item, st] : statefuls) staged.dirs.emplace_back(item->name, std::move(st.tensors));
  if (!user_tensors.empty()) staged.dirs.emplace_back(kUserTensorsDir, std::move(user_tensors));
  staged.extra_json = extra.dump();
  return staged;
}

// `async_hooks`: the background write of AsyncTrainingStateSaver, where
// tests may act (checkpoint/internal/async_save_hook.h).
TrainingStateSaveResult write_staged(const StagedState& staged, const std::string& root, int64_t step,
                                     const std::shared_ptr<Communicator>& group,
                                     const TrainingStateSaveOptions& options, bool async_hooks = false) {
  const auto start = Clock::now();
  if (async_hooks) run_async_save_hook(internal::AsyncSavePoint::kBeforeWrite, step);
  CheckpointWriterOptions writer_options;
  writer_options.fsync = options.fsync;
  writer_options.mesh = options.mesh;
  writer_options.timeout = options.timeout;
  CheckpointWriter writer(root, step, group, writer_options);
  SaveOptions save_options;
  save_options.fsync = options.fsync;
  TrainingStateSaveResult result;
  for (const auto& [name, tensors] : staged.dirs) {
    const SaveResult saved = save_sharded(tensors, writer.subdir(name), group->rank(), save_options);
    writer.record(saved);
    result.bytes += saved.bytes;
  }
  if (async_hooks) run_async_save_hook(internal::AsyncSavePoint::kBeforeCommit, step);
  result.dir = writer.commit(staged.extra_json);
  if (options.keep > 0 && group->rank() == 0) prune_checkpoints(root, options.keep);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

// [Note: staging buffers]
// The async save copies every local tensor to host memory before it
// returns, so that training may change the live tensors while the copy is
// written. Fresh memory for each save costs a page fault per 4 KiB page on
// first touch (the copy then ran at about 1.4 GB/s per rank on the
// development machine), and the pages are given back when the write ends.
// So the buffers are kept, keyed by "<directory>/<key>", and the next save
// of a tensor with the same sizes and dtype copies into the same buffer:
// PyTorch's BlockingAsyncStager(cache_staged_state_dict=True) and
// _StateDictStager's storage cache (torch/distributed/checkpoint/staging.py,
// _state_dict_stager.py) do the same. A buffer is the storage the write in
// flight reads, so save() refills buffers only after waiting for that write.
// CUDA tensors are staged into pinned memory, with non_blocking copies on the
// device's current stream and one synchronisation per device, as PyTorch's
// stager does (use_pinned_memory, use_non_blocking_copy).
struct StagingBuffer {
  at::Tensor host;
  bool pinned = false;
};

class Stager {
 public:
  explicit Stager(std::map<std::string, StagingBuffer>& previous) : previous_(previous) {}

  // The staged copy of `value`, saved as `name`. Values that share memory
  // (tied weights) share their copy, so save_sharded still writes them once.
  StateValue stage(const std::string& name, const StateValue& value) {
    const at::Tensor& local = value.local();
    at::Tensor host;
    const auto tie = std::make_tuple(local.has_storage() ? local.storage().data() : nullptr, local.storage_offset(),
                                     local.sizes().vec(), local.strides().vec());
    const auto found = local.numel() > 0 ? ties_.find(tie) : ties_.end();
    if (found != ties_.end()) {
      host = found->second;
    } else {
      host = copy(name, local);
      if (local.numel() > 0) ties_.emplace(tie, host);
    }
    if (!value.is_dtensor()) return host;
    const DTensor& dt = value.dtensor();
    return DTensor::from_local(host, dt.mesh(), dt.placements(), dt.shape());
  }

  // Waits for the device copies; then the staged values are complete.
  void synchronize() {
    for (const c10::Device& device : devices_) {
      c10::impl::getDeviceGuardImpl(device.type())->getStream(device).synchronize();
    }
    devices_.clear();
  }

  std::map<std::string, StagingBuffer> take_buffers() { return std::move(current_); }
  int64_t staged_bytes() const { return staged_bytes_; }
  int64_t reused_bytes() const { return reused_bytes_; }

 private:
  at::Tensor copy(const std::string& name, const at::Tensor& local) {
    const bool pinned = local.is_cuda();
    StagingBuffer buffer;
    const auto kept = previous_.find(name);
    if (kept != previous_.end()) {
      const at::Tensor& old = kept->second.host;
      if (kept->second.pinned == pinned && old.scalar_type() == local.scalar_type() && old.sizes() == local.sizes()) {
        buffer = kept->second;
        reused_bytes_ += static_cast<int64_t>(local.nbytes());
      }
      // Either way the previous save's entry is done with: a buffer that does
      // not fit is freed before its replacement is allocated.
      previous_.erase(kept);
    }
    if (!buffer.host.defined()) {
      buffer.host = at::empty(local.sizes(), at::TensorOptions().dtype(local.scalar_type()).pinned_memory(pinned));
      buffer.pinned = pinned;
    }
    // detach(): a copy_ from a tensor that requires grad would be recorded.
    buffer.host.copy_(local.detach(), /*non_blocking=*/pinned);
    if (pinned && std::find(devices_.begin(), devices_.end(), local.device()) == devices_.end()) {
      devices_.push_back(local.device());
    }
    staged_bytes_ += static_cast<int64_t>(local.nbytes());
    current_[name] = buffer;
    return buffer.host;
  }

  std::map<std::string, StagingBuffer>& previous_;
  std::map<std::string, StagingBuffer> current_;
  std::map<std::tuple<const void*, int64_t, std::vector<int64_t>, std::vector<int64_t>>, at::Tensor> ties_;
  std::vector<c10::Device> devices_;
  int64_t staged_bytes_ = 0;
  int64_t reused_bytes_ = 0;
};

}  // namespace

TrainingStateSaveResult save_training_state(const std::string& root, int64_t step, TrainingState& state,
                                            const std::shared_ptr<Communicator>& group,
                                            const TrainingStateSaveOptions& options) {
  TORCH_CHECK(group != nullptr, "save_training_state: the group is null; pass the run's world group");
  const auto start = Clock::now();
  TrainingStateSaveResult result = write_staged(collect_items(state), root, step, group, options);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

// ---------------------------------------------------------------------------
// AsyncTrainingStateSaver

// The buffers of the last save (see [Note: staging buffers]).
struct AsyncTrainingStateSaver::StagingBuffers {
  std::map<std::string, StagingBuffer> by_name;
};

AsyncTrainingStateSaver::AsyncTrainingStateSaver(std::shared_ptr<Communicator> group)
    : group_(std::move(group)), staging_(std::make_unique<StagingBuffers>()) {
  TORCH_CHECK(group_ != nullptr, "AsyncTrainingStateSaver: the group is null; pass a communicator of its own ",
              "(World::new_group(world->all_ranks(), c10::kCPU))");
}

AsyncTrainingStateSaver::~AsyncTrainingStateSaver() {
  if (!in_flight_.valid()) return;
  try {
    in_flight_.get();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "AsyncTrainingStateSaver: the save in flight at destruction failed: %s\n", e.what());
  }
}

AsyncSaveStaged AsyncTrainingStateSaver::save(const std::string& root, int64_t step, TrainingState& state,
                                              const TrainingStateSaveOptions& options) {
  const auto start = Clock::now();
  // At most one save in flight: finish (and report) the previous one
  // first. This wait is also what makes refilling its buffers safe.
  run_async_save_hook(internal::AsyncSavePoint::kBeforeWaitForPrevious, step);
  wait();
  StagedState staged = collect_items(state);
  Stager stager(staging_->by_name);
  for (auto& [dir, tensors] : staged.dirs) {
    StateDict host;
    for (const auto& [key, value] : tensors) host.insert(key, stager.stage(dir + "/" + key, value));
    tensors = std::move(host);
  }
  stager.synchronize();
  staging_->by_name = stager.take_buffers();
  AsyncSaveStaged out;
  out.staged_bytes = stager.staged_bytes();
  out.reused_bytes = stager.reused_bytes();
  in_flight_ = std::async(std::launch::async, [staged = std::move(staged), root, step, group = group_, options]() {
    return write_staged(staged, root, step, group, options, /*async_hooks=*/true);
  });
  out.blocked_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return out;
}

std::optional<TrainingStateSaveResult> AsyncTrainingStateSaver::wait() {
  if (!in_flight_.valid()) return std::nullopt;
  // get() leaves the future empty, also when it rethrows the save's error.
  return in_flight_.get();
}

// ---------------------------------------------------------------------------
// Load

namespace {

// What load_training_state reads from a checkpoint's manifest.
struct SavedTrainingState {
  CheckpointManifest manifest;
  std::string manifest_path;
  // The manifest's extra: the values, the Statefuls' JSON members, the
  // generators, and under kTrainingStateKey the description of the items.
  json extra;

  // name -> {"kind": ..., and for a Stateful "json_keys" and "tensors"}
  const json& items() const { return extra[kTrainingStateKey]["items"]; }
};

SavedTrainingState read_saved_training_state(const std::string& dir, Communicator& group,
                                             const TrainingStateLoadOptions& options) {
  TORCH_CHECK(detail::is_directory(dir), "load_training_state: the checkpoint directory '", dir,
              "' does not exist; pass a ROOT/step-N directory that save_training_state wrote, or call ",
              "load_latest_training_state(ROOT, ...), which starts fresh when ROOT holds no checkpoint");
  TORCH_CHECK(detail::is_regular_file(detail::join_path(dir, kManifestFileName)), "load_training_state: '", dir,
              "' has no ", kManifestFileName, ", so it is not a complete checkpoint (a save that did not finish ",
              "leaves ROOT/.tmp-step-N); load one that list_checkpoints(ROOT) lists");
  if (options.verify) verify_on_rank0(dir, group);
  SavedTrainingState saved;
  saved.manifest = read_manifest(dir);
  saved.manifest_path = detail::join_path(dir, kManifestFileName);
  saved.extra = detail::parse_json_strict(saved.manifest.extra_json, saved.manifest_path + " (extra)");
  const json& extra = saved.extra;
  TORCH_CHECK(extra.is_object() && extra.contains(kTrainingStateKey) && extra[kTrainingStateKey].is_object() &&
                  extra[kTrainingStateKey].contains("items") && extra[kTrainingStateKey]["items"].is_object(),
              "load_training_state: ", saved.manifest_path, " has no \"extra\": {\"", kTrainingStateKey,
              "\": {\"items\": ...}}, so save_training_state did not write it; load its directories with ",
              "load_sharded and its extra JSON with read_manifest instead");
  const json& description = extra[kTrainingStateKey];
  TORCH_CHECK(description.value("version", 0) == 1, "load_training_state: ", saved.manifest_path,
              " describes a training state of version ", description.value("version", 0),
              "; this library reads version 1: load it with the version that wrote it");
  return saved;
}

// Whether `v`, the saved value of a value or generator item, has a JSON
// type `item` can take.
bool takes_json_type(const Item& item, const json& v) {
  return std::visit(Overloaded{
                        [](const StatefulItem&) { return false; },
                        [](const TensorItem&) { return false; },
                        [](const JsonItem&) { return true; },
                        [&](const Int64Item&) { return v.is_number_integer(); },
                        [&](const DoubleItem&) { return v.is_number(); },
                        [&](const StringItem&) { return v.is_string(); },
                        [&](const BoolItem&) { return v.is_boolean(); },
                        [&](const RngItem&) { return v.is_string(); },
                    },
                    item.value);
}

// Checks that `item`, which the checkpoint holds, was saved as a kind it
// can be loaded as, and for a value, with a JSON type it takes.
void check_saved_as_registered(const Item& item, const SavedTrainingState& saved, const std::string& dir) {
  const std::string& name = item.name;
  const std::string registered = kind_name(item);
  const std::string saved_kind = saved.items()[name].value("kind", "?");
  const bool compatible = saved_kind == registered || (registered == "json" && is_value_kind(saved_kind));
  TORCH_CHECK(compatible, "load_training_state: '", name, "' in ", dir, " was saved as ", saved_kind, " (with ",
              registering_call(saved_kind), ") but is registered as ", registered, " (with ",
              registering_call(registered), "); register it with ", registering_call(saved_kind),
              " or give this item another name");
  if (!is_value_kind(saved_kind) && saved_kind != "rng") return;
  TORCH_CHECK(saved.extra.contains(name), "load_training_state: ", saved.manifest_path, " describes '", name,
              "' but its extra holds no value for it; the manifest was edited or damaged");
  const json& v = saved.extra[name];
  TORCH_CHECK(takes_json_type(item, v), "load_training_state: '", name, "' in ", saved.manifest_path, " is a JSON ",
              v.type_name(), ", not the ", registered,
              " it is registered as; register it with add_json to read any value");
}

// Checks every registered item before any is loaded, and returns those the
// checkpoint holds. Lists in `result` the registered items it lacks (when
// not strict) and the items it holds that are not registered.
std::vector<const Item*> check_items(const std::vector<Item>& items, const SavedTrainingState& saved,
                                     const std::string& dir, bool strict, TrainingStateLoadResult& result) {
  std::vector<std::string> saved_names;
  for (const auto& [name, entry] : saved.items().items())
    saved_names.push_back(name + " (" + entry.value("kind", "?") + ")");
  std::vector<const Item*> present;
  for (const Item& item : items) {
    const std::string& name = item.name;
    if (!saved.items().contains(name)) {
      TORCH_CHECK(!strict, "load_training_state: ", dir, " holds no '", name, "' (registered with ",
                  registering_call(kind_name(item)), "); it holds: ", join_names(saved_names),
                  ". Register only what was saved, rename the item to its saved name, or load with strict = false ",
                  "to leave it as it is");
      result.missing_items.push_back(name);
      continue;
    }
    check_saved_as_registered(item, saved, dir);
    present.push_back(&item);
  }
  for (const auto& [name, entry] : saved.items().items()) {
    const bool registered = std::any_of(items.begin(), items.end(), [&](const Item& i) { return i.name == name; });
    if (!registered) result.unloaded_items.push_back(name);
  }
  return present;
}

// Reads the Stateful's tensors in place from dir/<name>/ and hands them,
// with its saved JSON members, to its load_state_dict(). Returns the
// bytes read.
int64_t load_stateful(Stateful& stateful, const std::string& name, const SavedTrainingState& saved,
                      const std::string& dir, const LoadOptions& load_options) {
  StatefulState s = stateful.state_dict();
  const json& entry = saved.items()[name];
  int64_t bytes_read = 0;
  if (!s.tensors.empty() || entry.value("tensors", int64_t{0}) > 0) {
    const detail::SavedIndex index = detail::SavedIndex::build(detail::join_path(dir, name));
    const LoadResult loaded =
        detail::load_into(s.tensors, index, load_options, "TrainingStateLoadOptions::strict_tensors");
    bytes_read = loaded.bytes_read;
  }
  s.json.clear();
  for (const auto& key : entry.value("json_keys", json::array())) {
    const std::string k = key.get<std::string>();
    TORCH_CHECK(saved.extra.contains(k), "load_training_state: ", saved.manifest_path, " lists '", k,
                "' for Stateful '", name, "' but its extra does not hold it; the manifest was edited or damaged");
    s.json[k] = saved.extra[k].dump();
  }
  stateful.load_state_dict(s);
  return bytes_read;
}

void restore_generator(const at::Generator& generator, const std::string& name, const SavedTrainingState& saved) {
  const at::Tensor bytes =
      from_hex(saved.extra[name].get<std::string>(), "load_training_state: the generator state '" + name + "'");
  at::Generator gen = generator;
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "load_training_state: the generator state '", name, "' in ", saved.manifest_path,
                " does not fit the registered generator (", gen.device(),
                "); register the same kind of generator that was saved: ", e.what_without_backtrace());
  }
}

// Loads one checked item. The tensors of add_tensor are only gathered into
// `user_tensors`: they are read together, from one directory.
void load_item(const Item& item, const SavedTrainingState& saved, const std::string& dir,
               const LoadOptions& load_options, StateDict& user_tensors, TrainingStateLoadResult& result) {
  const std::string& name = item.name;
  std::visit(Overloaded{
                 [&](const StatefulItem& s) {
                   result.bytes_read += load_stateful(s.stateful.get(), name, saved, dir, load_options);
                 },
                 [&](const TensorItem& t) { user_tensors.insert(name, t.tensor); },
                 [&](const JsonItem& j) { j.text.get() = saved.extra[name].dump(); },
                 [&](const RngItem& r) { restore_generator(r.generator, name, saved); },
                 // The four scalar kinds (the other kinds match their own, non-template, handlers first).
                 [&](const auto& scalar) {
                   using T = std::decay_t<decltype(scalar.value.get())>;
                   scalar.value.get() = saved.extra[name].get<T>();
                 },
             },
             item.value);
}

}  // namespace

TrainingStateLoadResult load_training_state(const std::string& dir, TrainingState& state,
                                            const std::shared_ptr<Communicator>& group,
                                            const TrainingStateLoadOptions& options) {
  TORCH_CHECK(group != nullptr, "load_training_state: the group is null; pass the run's world group");
  const auto start = Clock::now();
  const SavedTrainingState saved = read_saved_training_state(dir, *group, options);

  TrainingStateLoadResult result;
  result.dir = dir;
  result.step = saved.manifest.step;
  result.saved_world_size = saved.manifest.world_size;
  result.saved_mesh = saved.manifest.mesh;
  const std::vector<const Item*> present =
      check_items(TrainingStateAccess::items(state), saved, dir, options.strict, result);

  LoadOptions load_options;
  load_options.strict = options.strict_tensors;
  StateDict user_tensors;
  for (const Item* item : present) load_item(*item, saved, dir, load_options, user_tensors, result);
  if (!user_tensors.empty()) {
    // Not strict: the directory may hold tensors this state does not
    // register; those it registers were checked above to be saved.
    LoadOptions tensor_options;
    tensor_options.strict = false;
    const LoadResult loaded = load_sharded(user_tensors, detail::join_path(dir, kUserTensorsDir), tensor_options);
    result.bytes_read += loaded.bytes_read;
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

std::optional<TrainingStateLoadResult> load_latest_training_state(const std::string& root, TrainingState& state,
                                                                  const std::shared_ptr<Communicator>& group,
                                                                  const TrainingStateLoadOptions& options) {
  TORCH_CHECK(group != nullptr, "load_latest_training_state: the group is null; pass the run's world group");
  const auto latest = find_latest_checkpoint(root);
  // Every rank must agree on the checkpoint (a save could complete between
  // two ranks' directory scans only if another job writes there).
  const int64_t step = latest ? latest->step : -1;
  at::Tensor steps = at::tensor({step, -step}, at::kLong);
  const collectives::CollectiveLabel label("checkpoint: agree on the newest step");
  group->all_reduce(steps, ReduceOp::max()).wait();
  TORCH_CHECK(steps[0].item<int64_t>() == -steps[1].item<int64_t>(),
              "load_latest_training_state: the ranks see different newest checkpoints in '", root,
              "' (is another run writing there? do all ranks see the same file system?)");
  if (!latest) return std::nullopt;
  return load_training_state(latest->path, state, group, options);
}

}  // namespace fsdp::checkpoint
