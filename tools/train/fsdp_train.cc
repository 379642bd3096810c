// fsdp_train: a small Llama-style transformer trained with fully_shard, the
// main job of fsdp2cpp (`make demo` runs `fsdp_train --nproc 2`).
//
//   fsdp_train --nproc 2                      2 local ranks on CPU (Gloo), defaults
//   fsdp_train --nproc 4 --steps 50 --json out.json
//   fsdp_train --nproc 4 --max-restarts 3 --save-dir runs/a --save-every 50 --resume
//                                             a failed rank restarts all 4, from the newest checkpoint
//   fsdp_train                                one rank (no launcher, no torchrun)
//   torchrun --nproc-per-node 2 --no-python fsdp_train --steps 50
//                                             torchrun starts the ranks (env://)
//   fsdp_train --nproc 2 --device cuda        NCCL, one rank per GPU
//   MASTER_ADDR=node0 MASTER_PORT=29500 srun --ntasks 4 fsdp_train
//                                             srun starts the ranks (env:// from SLURM_*)
//
// Flags may be spelled with dashes or underscores (--global-batch 8 or
// --global_batch=8); --help lists them. Bad values fail before anything
// starts, with a message that names the flag. See docs/trainer.md.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "collectives/world.h"
#include "command_line.h"
#include "config.h"
#include "data.h"
#include "fsdp2/fully_shard.h"
#include "launch/launch.h"
#include "model_flags.h"
#include "profile.h"
#include "trainer.h"

namespace {
const fsdp_train::TrainConfig kDefaults;
}  // namespace

// Optional so that "not given" is visible: without it, a process whose
// environment names its rank (torchrun) runs as that rank.
ABSL_FLAG(std::optional<int>, nproc, std::nullopt,
          "Start this many local ranks (fork + exec of this program, as torchrun would). Without it, run as the "
          "rank that RANK/WORLD_SIZE name (torchrun), or as a single rank.");
ABSL_FLAG(int, max_restarts, 0,
          "With --nproc: when a rank fails, stop all ranks and start them again, up to this many times "
          "(torchrun's --max-restarts); with --save-dir, needs --resume so a restart continues from the newest "
          "checkpoint.");
ABSL_FLAG(int64_t, steps, kDefaults.steps, "Optimizer steps.");
ABSL_FLAG(double, lr, kDefaults.lr, "Peak learning rate (AdamW; linear warm-up, cosine decay to lr/10).");
ABSL_FLAG(double, weight_decay, kDefaults.weight_decay, "AdamW weight decay.");
ABSL_FLAG(int64_t, warmup, kDefaults.warmup, "Warm-up steps.");
ABSL_FLAG(int64_t, seed, kDefaults.seed, "Seed of the initial parameters and of the batches.");
ABSL_FLAG(std::string, device, kDefaults.device, "cpu (Gloo) or cuda (NCCL, one rank per GPU).");
ABSL_FLAG(std::string, json, "", "Write the per-step losses, throughput and memory to this JSON file (rank 0).");
ABSL_FLAG(std::string, data, "", "Train on this text file (bytes); default: the corpus in the source tree's data/.");
ABSL_FLAG(int64_t, log_every, kDefaults.log_every, "Print a progress line every this many steps.");
ABSL_FLAG(std::string, all_gather_dtype, kDefaults.all_gather_dtype,
          "param or int8: int8 all-gathers the blocks' parameters as int8 with an fp32 scale per 256 values "
          "(fsdp::Int8AllGather), dequantized before use; the root's all-gather is not quantized.");
ABSL_FLAG(bool, compare_all_gather, kDefaults.compare_all_gather,
          "Train twice in one run, with the plain and the int8 all-gather (needs --all-gather-dtype int8), and "
          "print bytes all-gathered per step, step time and the loss curves' largest difference.");
ABSL_FLAG(bool, no_shard, kDefaults.no_shard,
          "Train the same model without fully_shard on one rank (the unsharded baseline of the benchmarks).");
ABSL_FLAG(std::string, save_dir, "",
          "Write checkpoints to DIR/step-N (sharded safetensors, atomic); see --save-every, --keep, --resume.");
ABSL_FLAG(int64_t, save_every, 0, "Save a checkpoint every this many steps (0: only after the last step).");
ABSL_FLAG(int64_t, keep, 0, "Keep only the newest this many checkpoints in --save-dir (0: keep all).");
ABSL_FLAG(bool, async_save, false,
          "Write checkpoints on a background thread: the step is blocked only while the shards are copied to host "
          "memory (at most one save in flight; the last is waited for at the end).");
ABSL_FLAG(bool, resume, false,
          "Continue from the newest complete checkpoint in --save-dir (at any --nproc / --mesh); a first run "
          "when there is none.");
ABSL_FLAG(std::string, export_hf, "",
          "After the last step, write the full model to this directory in the Hugging Face safetensors layout.");
ABSL_FLAG(std::string, init_from, "",
          "Start from these weights: a Hugging Face export, a checkpoint step-N directory, or a --save-dir.");
ABSL_FLAG(int64_t, stop_after, 0,
          "Stop after this step (the schedule still spans --steps), as a preempted run would; 0: run to --steps.");
ABSL_FLAG(std::string, profile, "",
          "Write a Kineto trace (Chrome trace JSON for Perfetto / chrome://tracing) of some steps to "
          "DIR/trace_rank<R>.json, with the FSDP phases labelled.");
ABSL_FLAG(std::string, profile_steps, "", "A:B: the steps --profile records (1-based, inclusive); default 2:3.");

namespace {

fsdp_train::TrainConfig config_from_flags() {
  fsdp_train::TrainConfig c;
  fsdp_train::apply_model_flags(c);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.device = absl::GetFlag(FLAGS_device);
  c.json_path = absl::GetFlag(FLAGS_json);
  c.data_path = absl::GetFlag(FLAGS_data);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.no_shard = absl::GetFlag(FLAGS_no_shard);
  c.all_gather_dtype = absl::GetFlag(FLAGS_all_gather_dtype);
  c.compare_all_gather = absl::GetFlag(FLAGS_compare_all_gather);
  c.save_dir = absl::GetFlag(FLAGS_save_dir);
  c.save_every = absl::GetFlag(FLAGS_save_every);
  c.keep = absl::GetFlag(FLAGS_keep);
  c.async_save = absl::GetFlag(FLAGS_async_save);
  c.resume = absl::GetFlag(FLAGS_resume);
  c.export_hf = absl::GetFlag(FLAGS_export_hf);
  c.init_from = absl::GetFlag(FLAGS_init_from);
  c.stop_after = absl::GetFlag(FLAGS_stop_after);
  c.profile_dir = absl::GetFlag(FLAGS_profile);
  c.profile_steps = absl::GetFlag(FLAGS_profile_steps);
  return c;
}

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  int out = 0;
  return value != nullptr && absl::SimpleAtoi(value, &out) ? out : fallback;
}

// A one-rank world without a launcher: an env:// rendezvous with itself on a
// free local port.
std::shared_ptr<fsdp::collectives::World> single_rank_world() {
  TORCH_CHECK(fsdp::launch::set_single_rank_environment(),
              "fsdp_train: cannot find a free port on 127.0.0.1 for the single-rank rendezvous");
  return fsdp::collectives::World::from_env();
}

int fail(const std::string& message, int code) {
  std::fprintf(stderr, "fsdp_train: %s\n", message.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains a small transformer with fsdp2cpp's fully_shard.\n"
      "  fsdp_train --nproc 2 [flags]        start 2 local ranks\n"
      "  torchrun --nproc-per-node 2 --no-python fsdp_train [flags]\n"
      "Flags may be written with dashes or underscores (--global-batch / --global_batch).");
  // Abseil's flag names use underscores; accept dashes too.
  std::vector<std::string> positional;
  std::vector<std::string> args = fsdp_train::parse_command_line(argc, argv, &positional);
  if (positional.size() > 1) return fail("unexpected argument '" + positional[1] + "' (see --help)", 2);

  const fsdp_train::TrainConfig config = config_from_flags();
  const std::optional<int> nproc = absl::GetFlag(FLAGS_nproc);
  // srun starts every task with SLURM_PROCID; World::from_env reads Slurm's
  // variables when RANK is unset (a one-task srun stays a single rank).
  const bool srun_rank =
      std::getenv("RANK") == nullptr && std::getenv("SLURM_PROCID") != nullptr && env_int("SLURM_NTASKS", 1) > 1;
  const bool torchrun_rank = (std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr) || srun_rank;
  if (nproc && *nproc < 1) return fail("--nproc must be >= 1 (got " + std::to_string(*nproc) + ")", 2);
  const int max_restarts = absl::GetFlag(FLAGS_max_restarts);
  if (max_restarts < 0) return fail("--max-restarts must be >= 0 (got " + std::to_string(max_restarts) + ")", 2);
  if (max_restarts > 0 && !nproc) {
    return fail(
        "--max-restarts needs --nproc (it restarts the ranks --nproc starts; under torchrun, pass "
        "--max-restarts to torchrun and --resume to fsdp_train)",
        2);
  }
  if (max_restarts > 0 && !config.save_dir.empty() && !config.resume) {
    return fail(
        "--max-restarts with --save-dir needs --resume, so that a restarted group continues from its newest "
        "checkpoint instead of starting again at step 1",
        2);
  }
  const int world_size =
      nproc ? *nproc : (srun_rank ? env_int("SLURM_NTASKS", 1) : (torchrun_rank ? env_int("WORLD_SIZE", 1) : 1));
  const int local_ranks = nproc ? *nproc
                                : (srun_rank ? env_int("SLURM_NTASKS_PER_NODE", 1)
                                             : (torchrun_rank ? env_int("LOCAL_WORLD_SIZE", world_size) : 1));
  const char* rank_var = srun_rank ? "SLURM_PROCID" : "RANK";

  // Everything that can be checked is checked before any rank starts.
  if (const absl::Status s = fsdp_train::validate(config, world_size); !s.ok())
    return fail(std::string(s.message()), 2);
  if (const absl::Status s = fsdp_train::check_device(config, local_ranks); !s.ok()) {
    return fail(std::string(s.message()), 2);
  }
  if (const auto corpus = fsdp_train::load_corpus(config.data_path, config.seq_len + 2); !corpus.ok()) {
    return fail(std::string(corpus.status().message()), 2);
  }
  // Rank 0 (or the launcher) writes --json: fail now, not after training.
  if (!config.json_path.empty() && (!torchrun_rank || env_int(rank_var, 0) == 0)) {
    if (std::FILE* f = std::fopen(config.json_path.c_str(), "a")) {
      std::fclose(f);
    } else {
      return fail("--json: cannot write '" + config.json_path + "': " + std::strerror(errno), 2);
    }
  }
  if (!config.profile_dir.empty()) {
    if (const absl::Status s = fsdp_train::prepare_profile_dir(config.profile_dir); !s.ok()) {
      return fail(std::string(s.message()), 2);
    }
  }
  if (nproc) {
    // The ranks see neither flag: they are the launcher's.
    return fsdp::launch::launch_local_ranks(
        *nproc, fsdp_train::remove_flag(fsdp_train::remove_flag(args, "nproc"), "max_restarts"), max_restarts);
  }

  const std::string who = torchrun_rank ? std::string("[rank ") + std::getenv(rank_var) + "] " : "";
  try {
    auto world = torchrun_rank ? fsdp::collectives::World::from_env() : single_rank_world();
    if (config.compare_all_gather) {
      fsdp_train::compare_all_gather_dtypes(config, world);
    } else {
      fsdp_train::run_training(config, world);
    }
    // The model is gone; its FSDP states, and their hold on the World, go
    // now, so that the World is destroyed here and not left to exit.
    fsdp::release_fsdp_state_of_destroyed_modules();
    return 0;
  } catch (const c10::Error& e) {
    return fail(who + "error: " + e.what_without_backtrace(), 1);
  } catch (const std::exception& e) {
    return fail(who + "error: " + e.what(), 1);
  }
}
