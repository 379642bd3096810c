#include "config.h"

#include <sys/stat.h>

#include <cctype>
#include <string>

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "fsdp_data/distributed_sampler.h"
#include "profile.h"

namespace fsdp_train {

namespace {

absl::Status flag_error(const std::string& message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::StatusOr<MeshShape> parse_mesh(const std::string& text, int64_t world_size) {
  if (text.empty()) return MeshShape{1, world_size};
  const size_t x = text.find('x');
  MeshShape shape;
  if (x == std::string::npos || !absl::SimpleAtoi(text.substr(0, x), &shape.replicate) ||
      !absl::SimpleAtoi(text.substr(x + 1), &shape.shard) || shape.replicate < 1 || shape.shard < 1) {
    return flag_error(absl::StrCat("--mesh must be RxS with positive R (replicate) and S (shard), e.g. 1x", world_size,
                                   " (got '", text, "')"));
  }
  if (shape.replicate * shape.shard != world_size) {
    return flag_error(absl::StrCat("--mesh ", text, " has ", shape.replicate * shape.shard,
                                   " ranks but the world size is ", world_size, "; R*S must equal the world size"));
  }
  return shape;
}

absl::StatusOr<std::optional<c10::ScalarType>> parse_dtype(const std::string& flag, const std::string& text) {
  if (text == "fp32") return std::optional<c10::ScalarType>();
  if (text == "bf16") return std::optional<c10::ScalarType>(c10::kBFloat16);
  if (text == "fp16") return std::optional<c10::ScalarType>(c10::kHalf);
  return flag_error(absl::StrCat("--", flag, " must be fp32, bf16 or fp16 (got '", text, "')"));
}

int64_t hidden_size(const TrainConfig& config) {
  if (config.hidden > 0) return config.hidden;
  const int64_t h = (8 * config.dim + 2) / 3;
  return (h + 15) / 16 * 16;
}

absl::Status validate_model(const TrainConfig& c) {
  if (c.layers < 1) return flag_error(absl::StrCat("--layers must be >= 1 (got ", c.layers, ")"));
  if (c.dim < 2) return flag_error(absl::StrCat("--dim must be >= 2 (got ", c.dim, ")"));
  if (c.heads < 1) return flag_error(absl::StrCat("--heads must be >= 1 (got ", c.heads, ")"));
  if (c.dim % c.heads != 0) {
    return flag_error(absl::StrCat("--heads must divide --dim (got ", c.dim, " and ", c.heads, ")"));
  }
  if ((c.dim / c.heads) % 2 != 0) {
    return flag_error(absl::StrCat("--dim / --heads (the head size) must be even for rotary embeddings (got ", c.dim,
                                   " / ", c.heads, " = ", c.dim / c.heads, ")"));
  }
  if (c.kv_heads < 0) {
    return flag_error(absl::StrCat("--kv-heads must be >= 0 (0: as many as --heads; got ", c.kv_heads, ")"));
  }
  if (c.kv_heads > 0 && c.heads % c.kv_heads != 0) {
    return flag_error(absl::StrCat("--kv-heads must divide --heads (got ", c.heads, " and ", c.kv_heads,
                                   "): each key/value head serves an equal group of query heads"));
  }
  if (c.hidden < 0) return flag_error(absl::StrCat("--hidden must be >= 0 (got ", c.hidden, ")"));
  if (c.vocab < 256) {
    return flag_error(
        absl::StrCat("--vocab must be >= 256, the byte-level corpus's 256 token values (got ", c.vocab, ")"));
  }
  return absl::OkStatus();
}

namespace {

// validate()'s checks by group of flags, in the order validate() runs them.

// The world size and how much data a step takes.
absl::Status check_batch_flags(const TrainConfig& c, int64_t world_size) {
  if (world_size < 1) return flag_error(absl::StrCat("the world size must be >= 1 (got ", world_size, ")"));
  if (c.steps < 1) return flag_error(absl::StrCat("--steps must be >= 1 (got ", c.steps, ")"));
  if (c.global_batch < 1) return flag_error(absl::StrCat("--global-batch must be >= 1 (got ", c.global_batch, ")"));
  // The split the trainer makes (data.cc), refused here before any rank starts:
  // more ranks than rows, or rows that do not divide evenly.
  try {
    fsdp::data::split_global_batch(c.global_batch, world_size, 0);
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    const std::string prefix = "split_global_batch: ";
    if (why.rfind(prefix, 0) == 0) why.erase(0, prefix.size());
    return flag_error(absl::StrCat("--global-batch must split evenly over the data-parallel ranks (got ",
                                   c.global_batch, " for ", world_size, " ranks): ", why));
  }
  if (c.seq_len < 2) return flag_error(absl::StrCat("--seq-len must be >= 2 (got ", c.seq_len, ")"));
  return absl::OkStatus();
}

// AdamW and its schedule.
absl::Status check_optimizer_flags(const TrainConfig& c) {
  if (!(c.lr > 0)) return flag_error(absl::StrCat("--lr must be > 0 (got ", c.lr, ")"));
  if (!(c.weight_decay >= 0)) {
    return flag_error(absl::StrCat("--weight-decay must be >= 0 (got ", c.weight_decay, ")"));
  }
  if (c.warmup < 0) return flag_error(absl::StrCat("--warmup must be >= 0 (got ", c.warmup, ")"));
  if (!(c.clip >= 0)) return flag_error(absl::StrCat("--clip must be >= 0 (got ", c.clip, ")"));
  return absl::OkStatus();
}

// Where and how each rank computes: device, logging, threads, activation checkpointing.
absl::Status check_compute_flags(const TrainConfig& c) {
  if (c.device != "cpu" && c.device != "cuda") {
    return flag_error(absl::StrCat("--device must be cpu or cuda (got '", c.device, "')"));
  }
  if (c.log_every < 1) return flag_error(absl::StrCat("--log-every must be >= 1 (got ", c.log_every, ")"));
  if (c.threads < 0) return flag_error(absl::StrCat("--threads must be >= 0 (got ", c.threads, ")"));
  if (c.ac != "none" && c.ac != "full" && c.ac != "selective" && c.ac != "torchtitan") {
    return flag_error(absl::StrCat("--ac must be none, full, selective or torchtitan (got '", c.ac, "')"));
  }
  if (c.ac_every < 1) return flag_error(absl::StrCat("--ac-every must be >= 1 (got ", c.ac_every, ")"));
  if (c.ac_every != 1 && c.ac == "none") {
    return flag_error(
        absl::StrCat("--ac-every ", c.ac_every, " says which blocks --ac checkpoints; add --ac full or selective"));
  }
  return absl::OkStatus();
}

// fully_shard's options: mesh, mixed precision, offload, the all-gather's dtype.
absl::Status check_sharding_flags(const TrainConfig& c, int64_t world_size) {
  if (auto mesh = parse_mesh(c.mesh, world_size); !mesh.ok()) return mesh.status();
  if (auto d = parse_dtype("param-dtype", c.param_dtype); !d.ok()) return d.status();
  if (auto d = parse_dtype("reduce-dtype", c.reduce_dtype); !d.ok()) return d.status();
  if (c.cpu_offload && c.device != "cuda") {
    return flag_error(absl::StrCat("--cpu-offload needs --device cuda (got --device ", c.device,
                                   "): on the CPU the shards already live in host memory"));
  }
  if (c.cpu_offload && c.no_shard) return flag_error("--no-shard: --cpu-offload is a fully_shard option; drop it");
  if (c.prefetch < 0) return flag_error(absl::StrCat("--prefetch must be >= 0 (got ", c.prefetch, ")"));
  if (c.prefetch > 0 && c.no_shard)
    return flag_error("--no-shard gathers nothing: --prefetch is for fully_shard; drop it");
  if (c.all_gather_dtype != "param" && c.all_gather_dtype != "int8") {
    return flag_error(absl::StrCat("--all-gather-dtype must be param or int8 (got '", c.all_gather_dtype, "')"));
  }
  if (c.no_shard && (c.all_gather_dtype != "param" || c.compare_all_gather)) {
    return flag_error(
        "--no-shard gathers nothing: --all-gather-dtype and --compare-all-gather are fully_shard "
        "options; drop them");
  }
  if (c.compare_all_gather && c.all_gather_dtype != "int8") {
    return flag_error(
        absl::StrCat("--compare-all-gather compares the plain all-gather with --all-gather-dtype int8 "
                     "(got --all-gather-dtype ",
                     c.all_gather_dtype, "); add --all-gather-dtype int8"));
  }
  return absl::OkStatus();
}

// Checkpoints: saving, resuming, stopping early, starting from given weights.
absl::Status check_checkpoint_flags(const TrainConfig& c) {
  if (c.compare_all_gather && (!c.save_dir.empty() || c.resume || !c.export_hf.empty() || !c.profile_dir.empty())) {
    return flag_error(
        "--compare-all-gather trains twice from scratch: it takes no --save-dir, --resume, "
        "--export-hf or --profile");
  }
  if (c.resume && c.save_dir.empty()) {
    return flag_error("--resume needs --save-dir (the directory whose newest checkpoint to continue from)");
  }
  if (c.save_every != 0 && c.save_dir.empty()) {
    return flag_error(absl::StrCat("--save-every needs --save-dir (got --save-every ", c.save_every, ")"));
  }
  if (c.async_save && c.save_dir.empty()) return flag_error("--async-save needs --save-dir (where to write)");
  if (c.save_every < 0) return flag_error(absl::StrCat("--save-every must be >= 0 (got ", c.save_every, ")"));
  if (c.keep < 0) return flag_error(absl::StrCat("--keep must be >= 0 (0 keeps every checkpoint; got ", c.keep, ")"));
  if (c.stop_after < 0 || c.stop_after > c.steps) {
    return flag_error(absl::StrCat("--stop-after must be between 1 and --steps (", c.steps, "); got ", c.stop_after));
  }
  struct stat st {};
  if (!c.init_from.empty() && !(::stat(c.init_from.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
    return flag_error(absl::StrCat("--init-from: '", c.init_from,
                                   "' is not a directory (a Hugging Face export, a checkpoint step-N, or a "
                                   "--save-dir)"));
  }
  return absl::OkStatus();
}

// --no-shard: one rank, and none of fully_shard's options.
absl::Status check_no_shard_flags(const TrainConfig& c, int64_t world_size) {
  if (!c.no_shard) return absl::OkStatus();
  if (world_size != 1) {
    return flag_error(absl::StrCat("--no-shard trains the unsharded model on one rank (got ", world_size,
                                   " ranks); drop --nproc or use --nproc 1"));
  }
  if (!c.mesh.empty()) return flag_error(absl::StrCat("--no-shard takes no --mesh (got '", c.mesh, "')"));
  if (c.param_dtype != "fp32" || c.reduce_dtype != "fp32") {
    return flag_error(
        absl::StrCat("--no-shard trains in fp32: --param-dtype and --reduce-dtype are fully_shard's "
                     "mixed precision (got ",
                     c.param_dtype, " and ", c.reduce_dtype, ")"));
  }
  if (!c.reshard_after_forward) {
    return flag_error("--no-shard: --no-reshard-after-forward is a fully_shard option; drop it");
  }
  return absl::OkStatus();
}

// --profile and --profile-steps.
absl::Status check_profile_flags(const TrainConfig& c) {
  if (c.profile_dir.empty() && !c.profile_steps.empty()) {
    return flag_error(
        absl::StrCat("--profile-steps ", c.profile_steps, " needs --profile DIR (where to write the trace)"));
  }
  if (!c.profile_dir.empty()) {
    if (auto s = parse_profile_steps(c.profile_steps, c.steps); !s.ok()) return s.status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status validate(const TrainConfig& c, int64_t world_size) {
  // The groups in this order, each stopping at its first failure: the
  // message names the first bad flag.
  absl::Status status = check_batch_flags(c, world_size);
  if (status.ok()) status = validate_model(c);
  if (status.ok()) status = check_optimizer_flags(c);
  if (status.ok()) status = check_compute_flags(c);
  if (status.ok()) status = check_sharding_flags(c, world_size);
  if (status.ok()) status = check_checkpoint_flags(c);
  if (status.ok()) status = check_no_shard_flags(c, world_size);
  if (status.ok()) status = check_profile_flags(c);
  return status;
}

absl::Status check_device(const TrainConfig& config, int64_t local_ranks) {
  if (config.device != "cuda") return absl::OkStatus();
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  if (gpus == 0) {
    return absl::FailedPreconditionError(
        "--device cuda: CUDA is not available here (no GPU visible, or a CPU-only build); use --device cpu");
  }
  if (local_ranks > gpus) {
    return absl::FailedPreconditionError(absl::StrCat("--device cuda runs one rank per GPU, but ", local_ranks,
                                                      " local ranks were asked for and ", gpus,
                                                      " GPU(s) are visible; lower --nproc"));
  }
  return absl::OkStatus();
}

std::vector<std::string> normalize_flag_names(int argc, const char* const* argv) {
  std::vector<std::string> out;
  out.reserve(argc);
  bool verbatim = false;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i == 0 || verbatim) {
      out.push_back(std::move(arg));
      continue;
    }
    if (arg == "--") {
      verbatim = true;
      out.push_back(std::move(arg));
      continue;
    }
    const size_t dashes = arg.rfind("--", 0) == 0 ? 2 : (arg.rfind('-', 0) == 0 ? 1 : 0);
    // Only flag names: "-1e-3" (a negative value) and "value-with-dashes" stay.
    if (dashes == 0 || arg.size() <= dashes || !std::isalpha(static_cast<unsigned char>(arg[dashes]))) {
      out.push_back(std::move(arg));
      continue;
    }
    const size_t end = std::min(arg.find('=', dashes), arg.size());
    std::string name = arg.substr(dashes, end - dashes);
    for (char& ch : name) {
      if (ch == '-') ch = '_';
    }
    // --no-foo-bar: Abseil's negation of a bool flag is --nofoo_bar.
    if (name.rfind("no_", 0) == 0 && absl::FindCommandLineFlag(name) == nullptr &&
        absl::FindCommandLineFlag(name.substr(3)) != nullptr) {
      name = "no" + name.substr(3);
    }
    out.push_back(arg.substr(0, dashes) + name + arg.substr(end));
  }
  return out;
}

std::vector<std::string> remove_flag(const std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (i > 0 && (a == "--" + name || a == "-" + name)) {
      ++i;  // and its value
      continue;
    }
    if (i > 0 && (a.rfind("--" + name + "=", 0) == 0 || a.rfind("-" + name + "=", 0) == 0)) continue;
    if (a == "--") {  // the rest is not flags
      out.insert(out.end(), args.begin() + i, args.end());
      break;
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace fsdp_train
