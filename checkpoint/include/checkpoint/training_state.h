// A whole training state, saved and loaded with one call each: the model,
// the optimizer, the user's own tensors and JSON-able values, and random
// number generators, as PyTorch's `dcp.save({"model": m, "optim": o, ...})`
// does with Stateful objects.
//
// The items are registered once, by reference: a Stateful for the model and
// one for the optimizer (checkpoint/fsdp_state.h adapts fully_shard models
// and their optimizers), the user's values, a tensor and a generator
// (tests/checkpoint/training_state_test.cc):
//
//   state.add("model", model)
//       .add("optim", optim)
//       .add_int64("step", u.step)
//       .add_double("lr_scale", u.lr_scale)
//       .add_string("run_name", u.run_name)
//       .add_json("schedule", u.schedule)
//       .add_bool("warmed_up", u.warmed_up)
//       .add_tensor("step_marks", u.step_marks)
//       .add_rng("cpu_rng", at::detail::getDefaultCPUGenerator());
//
// Then a save is one call on every rank, and so is a load, at any world size
// or mesh (tests/checkpoint/training_state_test.cc):
//
//   ckpt::ModelState model_state(*model);
//   ckpt::OptimizerState optim_state(*model, optim);
//   ...
//   const auto saved = ckpt::save_training_state(root.path(), kStepsBeforeSave, state, ctx.world_group(), options);
//   ...
//   const auto loaded = ckpt::load_latest_training_state(root.path(), state, ctx.world_group());
//
// load_latest_training_state returns nullopt when ROOT holds no checkpoint
// yet (a first run), so the same program starts and resumes.
//
// What goes where, in the formats of checkpoint_dir.h and sharded.h:
//
//   ROOT/step-N/manifest.json        "extra": the JSON values, each Stateful's JSON members,
//                                    the generators' states (hex strings), and
//                                    "training_state": {"version": 1, "items": {name: {"kind": ...}}}
//   ROOT/step-N/<stateful name>/     its tensors, save_sharded (the DCP HuggingFaceStorageWriter
//                                    layout: "model/" and "optim/" are what PyTorch reads)
//   ROOT/step-N/tensors/             the tensors added with add_tensor (save_sharded)
//
// Everything is written into ROOT/.tmp-step-N and committed atomically by a
// CheckpointWriter (checkpoint_dir.h): a save that dies leaves the previous
// checkpoint the newest complete one.
//
// Generators: a generator's state is saved from rank 0 and restored on every
// rank (the ranks of an SPMD run seed their generators alike). A run that
// seeds each rank's generator differently keeps those per-rank states itself.
//
// This header knows no FSDP: the model and the optimizer come in through the
// Stateful interface, implemented for fully_shard models in
// checkpoint/fsdp_state.h (library fsdp2cpp::checkpoint_fsdp), as
// torch.distributed.checkpoint takes anything with state_dict() and
// load_state_dict().
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "collectives/communicator.h"
#include "device_mesh/state_dict.h"

namespace fsdp::checkpoint {

// The manifest's "extra" key that describes a training state, and the
// subdirectory of the tensors added with add_tensor.
inline constexpr const char* kTrainingStateKey = "training_state";
inline constexpr const char* kUserTensorsDir = "tensors";

// What a Stateful hands over and gets back.
struct StatefulState {
  // Tensors and DTensors, saved with save_sharded into ROOT/step-N/<name>/.
  // On load they are filled in place, so their local tensors should share
  // storage with the live state (fsdp::get_model_state_dict's do).
  StateDict tensors;
  // JSON values (member name -> JSON text of any type), stored as members
  // of the manifest's "extra", beside the values of the other items: member
  // names must be unique across the whole training state.
  std::map<std::string, std::string> json;
};

// Stateful: something a training state saves and loads as a unit (PyTorch's
// torch.distributed.checkpoint.stateful.Stateful).
class Stateful {
 public:
  virtual ~Stateful() = default;
  // The current state. Called on save, and on load to get the targets the
  // saved tensors are read into. Collective if the implementation is
  // (get_model_state_dict is not, get_optimizer_state_dict may create
  // state).
  virtual StatefulState state_dict() = 0;
  // Applies `state`: the tensors state_dict() returned, now holding the saved
  // values, and the saved JSON members (as text; exactly the members saved).
  virtual void load_state_dict(const StatefulState& state) = 0;
};

// TrainingState: the named items a save writes and a load restores. It holds
// references: every registered object must outlive the TrainingState (or at
// least each save and load that uses it).
//
// Names are plain file names ("model", "optim"; no '/', not starting with
// '.'); each name, and each JSON member of a Stateful, is unique over the
// state, "training_state" and "tensors" are reserved. Breaking these throws
// c10::Error naming the name, at registration or (for JSON members) at save.
// Not thread-safe.
class TrainingState {
 public:
  // A Stateful: its tensors in ROOT/step-N/<name>/, its JSON in "extra".
  TrainingState& add(std::string name, Stateful& item);
  // A tensor or DTensor of the user's: saved under `name` in
  // ROOT/step-N/tensors/ (a plain tensor by rank 0: it must be the same on
  // every rank), loaded in place (same shape and dtype; the handle keeps its
  // storage, so a copy of the handle sees the loaded values).
  TrainingState& add_tensor(std::string name, StateValue tensor);
  // JSON-able values, stored as extra[name]. `json_text` is a JSON document
  // of any type, replaced by the saved text on load.
  TrainingState& add_json(std::string name, std::string& json_text);
  TrainingState& add_int64(std::string name, int64_t& value);
  TrainingState& add_double(std::string name, double& value);
  TrainingState& add_string(std::string name, std::string& value);
  TrainingState& add_bool(std::string name, bool& value);
  // A random number generator (CPU or CUDA; at::Generator is a shared
  // handle): its get_state() from rank 0, stored as a hex string in
  // extra[name]; set_state() on every rank at load, so the next random
  // numbers are those the saving run would have drawn.
  TrainingState& add_rng(std::string name, at::Generator generator);

  // The registered names, in order.
  std::vector<std::string> names() const;

  struct Item;  // defined in training_state.cc

  TrainingState();
  ~TrainingState();
  TrainingState(TrainingState&&) noexcept;
  TrainingState& operator=(TrainingState&&) noexcept;

 private:
  friend struct TrainingStateAccess;
  TrainingState& add_item(Item item);
  std::vector<Item> items_;
};

struct TrainingStateSaveOptions {
  // A description of the mesh, recorded in the manifest ("2x2 (replicate, shard)").
  std::string mesh;
  // After the commit, rank 0 keeps the newest `keep` checkpoints of ROOT
  // (0: all). See prune_checkpoints.
  int64_t keep = 0;
  bool fsync = true;
  // How long the save's synchronisation waits for the other ranks.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

struct TrainingStateSaveResult {
  std::string dir;    // ROOT/step-N
  int64_t bytes = 0;  // bytes of tensor files this rank wrote, headers included
  double seconds = 0;
};

// save_training_state()
//
// Saves every item of `state` as ROOT/step-`step`, atomically: the files are
// written into ROOT/.tmp-step-N, each rank its own pieces (save_sharded),
// then the manifest with the JSON values, the generators and a description
// of the items is written last and the directory renamed (CheckpointWriter).
// An older ROOT/step-N is replaced.
//
// Collective over `group` (all ranks of the run, same root, step and items).
// Each Stateful's state_dict() is called once, in registration order.
// Throws: c10::Error naming the item for a Stateful JSON member that does
// not parse or whose name clashes with another item's, a JSON value that
// does not parse, a tensor that cannot be saved (save_sharded's errors), I/O
// errors naming the file, and a rank that does not arrive within the timeout.
// A failed save leaves ROOT/.tmp-step-N (ignored by loaders).
TrainingStateSaveResult save_training_state(const std::string& root, int64_t step, TrainingState& state,
                                            const std::shared_ptr<collectives::Communicator>& group,
                                            const TrainingStateSaveOptions& options = {});

// What AsyncTrainingStateSaver::save() did on the calling thread.
struct AsyncSaveStaged {
  int64_t staged_bytes = 0;    // host memory the staged copies hold (kept by the saver for the next save)
  int64_t reused_bytes = 0;    // of those, bytes copied into buffers kept from the previous save
  double blocked_seconds = 0;  // how long save() blocked the caller (staging, and waiting for the previous save)
};

// AsyncTrainingStateSaver: save_training_state on a background thread, so
// that training continues while the files are written.
//
// save() collects every item on the calling thread (state_dict(), values,
// generators), copies each tensor's local piece into host memory (tied
// values share one copy), and returns; a background thread then writes the
// files and commits, exactly as save_training_state does (same files, same
// atomic commit: a process that dies before the commit leaves
// ROOT/.tmp-step-N and the previous checkpoint the newest complete one). The
// files hold the values at the time save() returned.
// At most one save is in flight: save() first waits for the previous one.
//
// Staging buffers are kept between saves, as PyTorch's async_save does with
// cache_staged_state_dict: a tensor saved under the same item and key with
// the same sizes and dtype is copied into the buffer of the previous save
// (already paged in, so the copy runs at memory speed), any other gets a new
// one. A buffer is reused only after the write that read it has finished (the
// wait above). So the saver holds about one staged state of host memory
// from the first save until it is destroyed. CUDA tensors are staged into
// pinned memory (asynchronous copies, then one synchronisation per device
// before save() returns).
//
// REQUIRES: `group` is a communicator of the saver's own, used by nothing
// else (make it with World::new_group(world->all_ranks(), c10::kCPU) on
// every rank, in the same order): the background thread runs the commit's
// barriers on it while the training thread runs its own collectives, which
// on a shared communicator would interleave differently on each rank (as
// PyTorch's async_save wants a process group of its own). Every rank makes
// the same save() and wait() calls. Not thread-safe: call it from one
// thread.
//
// Errors: save() throws the item errors of save_training_state before
// anything starts, and rethrows the previous save's error (this save is then
// not started); wait() rethrows the background save's error (an I/O error
// naming the file, a rank that did not arrive within options.timeout). The
// destructor waits for a save in flight and prints its error to stderr.
class AsyncTrainingStateSaver {
 public:
  explicit AsyncTrainingStateSaver(std::shared_ptr<collectives::Communicator> group);
  ~AsyncTrainingStateSaver();
  AsyncTrainingStateSaver(const AsyncTrainingStateSaver&) = delete;
  AsyncTrainingStateSaver& operator=(const AsyncTrainingStateSaver&) = delete;

  // Stages `state` and starts writing ROOT/step-`step` in the background.
  AsyncSaveStaged save(const std::string& root, int64_t step, TrainingState& state,
                       const TrainingStateSaveOptions& options = {});
  // Blocks until the save in flight is committed and returns its result;
  // nullopt when none was in flight. Rethrows its error.
  std::optional<TrainingStateSaveResult> wait();
  // A save was started and not yet waited for (it may have finished).
  bool pending() const { return in_flight_.valid(); }

 private:
  struct StagingBuffers;  // training_state.cc

  std::shared_ptr<collectives::Communicator> group_;
  // Read by the write in flight; touched by save() only after wait().
  std::unique_ptr<StagingBuffers> staging_;
  std::future<TrainingStateSaveResult> in_flight_;
};

struct TrainingStateLoadOptions {
  // Rank 0 checks every file's size and CRC32 against the manifest before
  // anything is read (verify_checkpoint), and all ranks learn the verdict.
  bool verify = true;
  // Every registered item must be in the checkpoint; without strict, absent
  // ones are left as they are and listed in the result. Items the checkpoint
  // holds and the state does not register are never an error (they are
  // listed), as dcp.load reads only the keys it is given.
  bool strict = true;
  // Passed to load_sharded for each directory: every tensor of a Stateful
  // must be in the files (and the files hold no others).
  bool strict_tensors = true;
};

struct TrainingStateLoadResult {
  std::string dir;                          // ROOT/step-N that was loaded
  int64_t step = 0;                         // N
  int64_t saved_world_size = 0;             // the world size at save
  std::string saved_mesh;                   // TrainingStateSaveOptions::mesh at save
  std::vector<std::string> missing_items;   // registered, not in the checkpoint (not strict)
  std::vector<std::string> unloaded_items;  // in the checkpoint, not registered
  int64_t bytes_read = 0;                   // tensor bytes this rank read
  double seconds = 0;
};

// load_training_state()
//
// Loads the checkpoint directory `dir` (ROOT/step-N, written by
// save_training_state at any world size or mesh) into `state`: each
// Stateful's tensors are read into the tensors its state_dict() returns (in
// place, only the rows this rank holds: load_sharded) and handed to its
// load_state_dict() with its JSON members; user tensors are filled in place;
// values are assigned; generators get rank 0's saved state on every rank.
//
// Before anything is loaded: rank 0 verifies the files (options.verify) and
// every rank checks that each registered item is in the checkpoint with the
// same kind and, for typed values, the same JSON type. Items are then loaded
// in registration order; an error while reading a Stateful's files (a shape
// or key mismatch: load_sharded validates a directory before copying from
// it) can leave the items before it loaded.
//
// Collective over `group` (the ranks of the loading run, any number).
// Throws: c10::Error that says what to do: a missing `dir` or manifest; a
// manifest not written by save_training_state; an item absent from the
// checkpoint (strict), naming it and listing what the checkpoint holds; an
// item registered with another kind or type than saved, naming both; a
// damaged file (on rank 0 naming the file and the checksum; on the other
// ranks saying that rank 0 found the checkpoint damaged); load_sharded's
// errors.
TrainingStateLoadResult load_training_state(const std::string& dir, TrainingState& state,
                                            const std::shared_ptr<collectives::Communicator>& group,
                                            const TrainingStateLoadOptions& options = {});

// load_latest_training_state()
//
// load_training_state() of the newest complete checkpoint in `root`
// (find_latest_checkpoint: unfinished .tmp-step-N saves are ignored), or
// nullopt, touching nothing, when `root` holds none (a first run; `root` may
// not exist). Collective: the ranks check that they see the same newest
// checkpoint.
// Throws: as load_training_state; c10::Error when the ranks see different
// newest checkpoints.
std::optional<TrainingStateLoadResult> load_latest_training_state(
    const std::string& root, TrainingState& state, const std::shared_ptr<collectives::Communicator>& group,
    const TrainingStateLoadOptions& options = {});

}  // namespace fsdp::checkpoint
