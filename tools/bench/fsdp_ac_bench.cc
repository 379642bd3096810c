// fsdp_ac_bench: activation checkpointing (issue 31) in fsdp2cpp against
// PyTorch FSDP2, on the same model in the same run.
//
// For each model of --models and each mode of --ac-modes (none, full,
// selective), trains the model under fsdp2cpp (fsdp_train --ac) and under
// PyTorch FSDP2 (tools/bench/python/fsdp2_bench.py --ac: checkpoint_wrapper,
// i.e. torch.utils.checkpoint(use_reentrant=False), around each block; for
// selective with torchtitan's op-level context saving the outputs of
// fsdp::selective_checkpoint_ops()) on --nproc ranks, and prints one table
// per model, one row per mode:
//   - peak memory per rank (the largest over the ranks): "live", the peak of
//     bytes held through malloc (libfsdp_malloc_counter.so preloaded into
//     both systems, as fsdp_memory_bench), and "rss", the max resident set;
//   - "act", the activation memory: the part of the live peak that grows with
//     the batch. Each mode is also trained at half the rows per rank, and
//     act = 2 x (live peak - live peak at half the rows), which holds what
//     is proportional to the rows (saved activations, the recomputed block's
//     intermediates, the logits and their gradients) and cancels what is
//     not (parameters, gradients, optimizer state, unsharded groups, the
//     runtime's and the interpreter's own heap);
//   - the median step time (slowest rank) and, per system, its ratio to the
//     same system without checkpointing ("/none");
//   - ours / PyTorch ("o/p") of each figure.
// On CUDA (--device cuda) the memory columns are the caching allocator's
// peak (live, act); rss is not measured.
//
// --repeats R runs every mode's two systems R times, the modes in rotating
// order and the systems alternating, and prints the medians (the half-row
// runs are made once).
//
//   fsdp_ac_bench                             both models, 2 ranks, 8 steps per run (2 untimed)
//   fsdp_ac_bench --models deep --repeats 3   the deep model only, medians of 3
//   fsdp_ac_bench --quick                     a short smoke run (tiny model, no act runs)
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "bench_util.h"
#include "command_line.h"
#include "config.h"

ABSL_FLAG(int, nproc, 2, "ranks per run");
ABSL_FLAG(std::string, models, "trainer,deep",
          "comma-separated: trainer (fsdp_train's default model), deep (--deep-layers blocks of dim 128 over "
          "--deep-seq-len tokens: activations dominate)");
ABSL_FLAG(int64_t, deep_layers, 8, "blocks of the deep model");
ABSL_FLAG(int64_t, deep_seq_len, 1024, "tokens per row of the deep model");
ABSL_FLAG(int64_t, deep_global_batch, 4, "rows per step of the deep model over all ranks");
ABSL_FLAG(std::string, ac_modes, "none,full,selective", "comma-separated --ac modes, one row each");
ABSL_FLAG(int64_t, ac_every, 1, "checkpoint blocks 0, N, 2N, ... (fsdp_train --ac-every)");
ABSL_FLAG(int, steps, 8, "steps per run, including the untimed warm-up steps");
ABSL_FLAG(int, warmup_steps, 2, "untimed first steps of each run");
ABSL_FLAG(int, repeats, 1, "runs of each system per mode, in rotating order; medians are printed");
ABSL_FLAG(std::string, device, "cpu", "cpu (Gloo) or cuda (NCCL, one GPU per rank)");
ABSL_FLAG(bool, quick, false,
          "tiny model, 2 steps, no half-row runs (act not measured): checks the program works, measures nothing");
ABSL_FLAG(std::string, trainer, "", "fsdp_train to run (default: the one built with this program)");
ABSL_FLAG(std::string, python, "", "Python with torch (default: the build's FSDP2CPP_PYTHON)");
ABSL_FLAG(std::string, script, "", "fsdp2_bench.py (default: the source tree's)");

namespace {

std::string describe(const fsdp_train::TrainConfig& s) {
  char text[128];
  std::snprintf(text, sizeof(text), "%lld blocks, dim %lld, %lld heads, seq %lld, global batch %lld",
                static_cast<long long>(s.layers), static_cast<long long>(s.dim), static_cast<long long>(s.heads),
                static_cast<long long>(s.seq_len), static_cast<long long>(s.global_batch));
  return text;
}

// One system's figures for one mode, over the repeats.
struct Figures {
  std::vector<double> live, rss, step_s;
  double live_half = -1;  // the live peak at half the rows; < 0: not measured
  double act() const { return live_half < 0 ? -1 : 2 * (bench::median(live) - live_half); }
};

// "%*.1f" of MiB, or "-" where not measured (negative).
std::string mib_cell(double bytes, int width) {
  char text[32];
  if (bytes < 0) {
    std::snprintf(text, sizeof(text), "%*s", width, "-");
  } else {
    std::snprintf(text, sizeof(text), "%*.1f", width, bytes / 1048576.0);
  }
  return text;
}

std::string ratio_cell(double a, double b, int width) {
  char text[32];
  if (a < 0 || b <= 0) {
    std::snprintf(text, sizeof(text), "%*s", width, "-");
  } else {
    std::snprintf(text, sizeof(text), "%*.2f", width, a / b);
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "activation checkpointing: peak memory and step time, fsdp2cpp vs PyTorch FSDP2 (see docs/benchmarks.md)");
  const std::vector<std::string> args = fsdp_train::parse_command_line(argc, argv);

  const bench::Programs programs =
      bench::programs_with(absl::GetFlag(FLAGS_trainer), absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_script));

  const bool quick = absl::GetFlag(FLAGS_quick);
  const int nproc = absl::GetFlag(FLAGS_nproc);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  bench::RunOptions options;
  options.nproc = nproc;
  options.device = absl::GetFlag(FLAGS_device);
  options.count_live_bytes = options.device == "cpu";
  options.steps = quick ? 2 : absl::GetFlag(FLAGS_steps);
  options.warmup_steps = quick ? 1 : absl::GetFlag(FLAGS_warmup_steps);
  options.ac_every = absl::GetFlag(FLAGS_ac_every);
  if (nproc < 1 || repeats < 1 || options.ac_every < 1 || options.warmup_steps < 0 ||
      options.steps <= options.warmup_steps || (options.device != "cpu" && options.device != "cuda")) {
    std::fprintf(stderr,
                 "fsdp_ac_bench: need --nproc, --repeats and --ac-every >= 1, --steps > --warmup-steps >= 0 and "
                 "--device cpu or cuda\n");
    return 2;
  }
  if (options.device == "cuda" && !bench::have_cuda_devices(nproc)) {
    std::fprintf(stderr, "fsdp_ac_bench: --device cuda needs %d GPUs\n", nproc);
    return 2;
  }
  std::vector<std::string> modes;
  for (const auto& part : absl::StrSplit(absl::GetFlag(FLAGS_ac_modes), ',', absl::SkipEmpty())) {
    if (part != "none" && part != "full" && part != "selective") {
      std::fprintf(stderr, "fsdp_ac_bench: --ac-modes takes none, full and selective (got '%s')\n",
                   std::string(part).c_str());
      return 2;
    }
    modes.emplace_back(part);
  }

  std::vector<bench::NamedShape> models;
  if (quick) models.push_back({"tiny", bench::model_shape(2, 32, 4, 16, 2 * nproc)});
  for (const auto& part : absl::StrSplit(absl::GetFlag(FLAGS_models), ',', absl::SkipEmpty())) {
    if (quick) break;
    if (part == "trainer") {
      const fsdp_train::TrainConfig defaults;
      models.push_back({"the trainer's default model", bench::model_shape(defaults.layers, defaults.dim, defaults.heads,
                                                                          defaults.seq_len, defaults.global_batch)});
    } else if (part == "deep") {
      models.push_back({"deep, long sequence",
                        bench::model_shape(absl::GetFlag(FLAGS_deep_layers), 128, 4, absl::GetFlag(FLAGS_deep_seq_len),
                                           absl::GetFlag(FLAGS_deep_global_batch))});
    } else {
      std::fprintf(stderr, "fsdp_ac_bench: --models takes trainer and/or deep (got '%s')\n", std::string(part).c_str());
      return 2;
    }
  }
  if (models.empty() || modes.empty()) {
    std::fprintf(stderr, "fsdp_ac_bench: --models and --ac-modes must name at least one each\n");
    return 2;
  }
  for (const bench::NamedShape& model : models) {
    if (model.shape.global_batch % nproc != 0 || model.shape.global_batch / nproc < 2) {
      std::fprintf(stderr,
                   "fsdp_ac_bench: %s has a global batch of %lld: it needs at least 2 rows per rank, divisible by "
                   "--nproc %d (act compares with half the rows)\n",
                   model.name.c_str(), static_cast<long long>(model.shape.global_batch), nproc);
      return 2;
    }
  }

  std::printf(
      "fsdp_ac_bench: %d ranks on %s, 1 intra-op thread per rank, fp32, AdamW, no clipping; median step time over "
      "steps %d..%d (slowest rank); --ac-every %lld%s\n",
      nproc, options.device.c_str(), options.warmup_steps + 1, options.steps, static_cast<long long>(options.ac_every),
      quick ? " (--quick: measures nothing)" : "");
  if (repeats > 1) std::printf("%d repeats per mode, modes and systems in rotating order: medians\n", repeats);
  const auto measure = [&](int system, const fsdp_train::TrainConfig& shape, const bench::RunOptions& o) {
    bench::Measured m =
        system == 0 ? bench::run_fsdp_train(programs, shape, o) : bench::run_pytorch_fsdp2(programs, shape, o);
    if (!m.ok) {
      std::fprintf(stderr, "fsdp_ac_bench: %s\n", m.error.c_str());
      std::exit(1);
    }
    return m;
  };
  const auto with_ac = [&](const std::string& mode) {
    bench::RunOptions run = options;
    run.ac = mode;
    return run;
  };
  for (const bench::NamedShape& model : models) {
    std::printf("\n%s: %s\n", model.name.c_str(), describe(model.shape).c_str());
    std::fflush(stdout);
    // fig[mode][0]: fsdp2cpp, fig[mode][1]: PyTorch FSDP2. Each repeat runs
    // every mode, the modes in rotating order and the two systems in
    // alternating order, so that a change in the machine's load spreads over
    // the rows instead of landing on the last ones.
    std::vector<std::array<Figures, 2>> fig(modes.size());
    for (int r = 0; r < repeats; ++r) {
      for (size_t j = 0; j < modes.size(); ++j) {
        const size_t i = (j + static_cast<size_t>(r)) % modes.size();
        for (int k = 0; k < 2; ++k) {
          const int system = static_cast<int>((static_cast<size_t>(r + k) + i) % 2);
          const bench::Measured m = measure(system, model.shape, with_ac(modes[i]));
          fig[i][system].live.push_back(options.count_live_bytes ? m.peak_live_bytes : m.peak_bytes);
          fig[i][system].rss.push_back(options.count_live_bytes ? m.peak_bytes : -1);
          fig[i][system].step_s.push_back(m.median_step_s);
        }
      }
    }
    if (!quick) {
      fsdp_train::TrainConfig half = model.shape;
      half.global_batch /= 2;
      for (size_t i = 0; i < modes.size(); ++i) {
        bench::RunOptions short_run = with_ac(modes[i]);
        short_run.steps = std::min(options.steps, 3);  // the peak is reached in step 2 (AdamW's moments exist)
        short_run.warmup_steps = 1;
        for (int system = 0; system < 2; ++system) {
          const bench::Measured m = measure(system, half, short_run);
          fig[i][system].live_half = options.count_live_bytes ? m.peak_live_bytes : m.peak_bytes;
        }
      }
    }
    std::printf("%-10s %9s %9s %5s %9s %9s %5s %9s %9s %5s %9s %9s %5s %9s %9s\n", "ac", "ours live", "pt live", "o/p",
                "ours rss", "pt rss", "o/p", "ours act", "pt act", "o/p", "ours ms", "pt ms", "o/p", "ours/none",
                "pt/none");
    double none_s[2] = {-1, -1};
    for (size_t i = 0; i < modes.size(); ++i) {
      if (modes[i] == "none") {
        for (int system = 0; system < 2; ++system) none_s[system] = bench::median(fig[i][system].step_s);
      }
    }
    for (size_t i = 0; i < modes.size(); ++i) {
      double live[2], rss[2], act[2], s[2];
      for (int system = 0; system < 2; ++system) {
        const Figures& f = fig[i][system];
        live[system] = bench::median(f.live);
        rss[system] = bench::median(f.rss);
        act[system] = f.act();
        s[system] = bench::median(f.step_s);
      }
      std::printf("%-10s %s %s %s %s %s %s %s %s %s %9.1f %9.1f %s %s %s\n", modes[i].c_str(),
                  mib_cell(live[0], 9).c_str(), mib_cell(live[1], 9).c_str(), ratio_cell(live[0], live[1], 5).c_str(),
                  mib_cell(rss[0], 9).c_str(), mib_cell(rss[1], 9).c_str(), ratio_cell(rss[0], rss[1], 5).c_str(),
                  mib_cell(act[0], 9).c_str(), mib_cell(act[1], 9).c_str(), ratio_cell(act[0], act[1], 5).c_str(),
                  1e3 * s[0], 1e3 * s[1], ratio_cell(s[0], s[1], 5).c_str(), ratio_cell(s[0], none_s[0], 9).c_str(),
                  ratio_cell(s[1], none_s[1], 9).c_str());
    }
    std::fflush(stdout);
  }
  std::printf(
      "\nMiB per rank (max over ranks). live: peak of bytes held through malloc (libfsdp_malloc_counter.so in both "
      "systems; on cuda the caching allocator's peak); rss: max RSS; act: 2 x (live - live at half the rows per "
      "rank), what grows with the batch. ms: median step time. o/p: fsdp2cpp / PyTorch FSDP2. /none: step time "
      "over the same system's without checkpointing. Goals (issue 31): act o/p <= 1.1 and ms o/p "
      "<= 1 with full AC; full's /none near 1.33 (one more forward).\n");
  return 0;
}
