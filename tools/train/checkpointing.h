// The trainer's checkpoints: save, resume, export and initialise, over
// fsdp2's state dicts (fsdp2/state_dict.h) and the checkpoint layer's files
// (checkpoint/), saved and loaded with one call each
// (checkpoint/training_state.h). See docs/checkpoints.md.
//
//   SAVE_DIR/step-N/                    one complete checkpoint (atomic: written as .tmp-step-N, renamed)
//     manifest.json                     files, sizes, CRC32, world size, mesh, step, and "extra":
//                                       {"param_groups": [...], "progress": {...},
//                                        "cpu_rng_state": "<hex>", "training_state": {...}}
//     model/shard-0000R-model-00001-of-00001.safetensors   each rank's rows of every parameter
//     optim/shard-0000R-model-00001-of-00001.safetensors   state.<fqn>.{step,exp_avg,exp_avg_sq}
//
// Every function here is collective over all ranks of the run (they call
// get_model_state_dict and friends, and synchronise through `group`), and
// prints one progress line on rank 0 with bytes and seconds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "checkpoint/training_state.h"
#include "collectives/communicator.h"

namespace fsdp_train {

// What a run needs to continue where a checkpoint left it.
struct TrainingProgress {
  int64_t step = 0;          // optimizer steps completed
  int64_t world_size = 0;    // at save
  std::string mesh;          // at save ("2x2 (replicate, shard)")
  int64_t samples_seen = 0;  // data position: sequences consumed (step * global batch)
  // The default CPU generator's state (hex), restored on resume. The
  // trainer draws its batches and initial values from generators of their
  // own seeded by (seed, step) and (seed, FQN), so this only matters to code
  // added to the loop that uses the global generator (dropout, say).
  std::string cpu_rng_state;
};

// Saves `model` and `optimizer` after `progress.step` steps as
// SAVE_DIR/step-N, then keeps the newest `keep` checkpoints (keep <= 0: all).
void save_checkpoint(const std::string& save_dir, int64_t keep, const TrainingProgress& progress,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const std::shared_ptr<fsdp::collectives::Communicator>& group);

// --async-save: checkpoints staged to host memory by the step and written by
// a background thread while training goes on
// (fsdp::checkpoint::AsyncTrainingStateSaver). At most one is in flight: a
// save first waits for the previous one and reports it; finish() waits for
// the last. `writer_group` is a communicator of the saver's own (its
// barriers run on the background thread), `metrics` the trainer's group for
// the reports. Every call is collective.
class BackgroundCheckpointer {
 public:
  BackgroundCheckpointer(std::string save_dir, int64_t keep, std::shared_ptr<fsdp::collectives::Communicator> metrics,
                         std::shared_ptr<fsdp::collectives::Communicator> writer_group);
  ~BackgroundCheckpointer();
  BackgroundCheckpointer(const BackgroundCheckpointer&) = delete;
  BackgroundCheckpointer& operator=(const BackgroundCheckpointer&) = delete;

  void save(const TrainingProgress& progress, torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // Waits for the save in flight (if any) and prints where it went; rethrows
  // its error.
  void finish();

 private:
  void report_finished();

  std::string save_dir_;
  int64_t keep_;
  std::shared_ptr<fsdp::collectives::Communicator> metrics_;
  fsdp::checkpoint::AsyncTrainingStateSaver saver_;
};

// Loads the newest complete checkpoint of `save_dir` (verified against its
// manifest first) into `model` and `optimizer`, at any world size or mesh,
// and returns its progress; progress.step == 0 when `save_dir` holds none
// (a first run). Unfinished saves (.tmp-step-N) are ignored.
TrainingProgress resume_from_latest(const std::string& save_dir, torch::nn::Module& model,
                                    torch::optim::Optimizer& optimizer,
                                    const std::shared_ptr<fsdp::collectives::Communicator>& group);

// Loads model weights only (--init-from) from `dir`: a Hugging Face layout
// (model.safetensors.index.json or model.safetensors), one of our
// checkpoints (SAVE_DIR/step-N, its model/ folder), a save directory (its
// newest checkpoint), or a PyTorch HuggingFaceStorageWriter directory.
void init_model_from(const std::string& dir, torch::nn::Module& model,
                     const std::shared_ptr<fsdp::collectives::Communicator>& group);

// Writes the full model in the Hugging Face layout to `dir` (--export-hf),
// one tensor at a time.
void export_model_hf(const std::string& dir, torch::nn::Module& model,
                     const std::shared_ptr<fsdp::collectives::Communicator>& group);

}  // namespace fsdp_train
