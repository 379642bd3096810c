// Helpers of the side-by-side benchmarks (fsdp_memory_bench, fsdp_speed_bench,
// fsdp_overhead_bench): run a program and capture what it prints, read the
// numbers fsdp_train's --json and the PyTorch script's RESULT line carry, and
// format table cells.
//
//   bench::RunResult r = bench::run_program(python, {script, "train", "--nproc", "2"});
//   std::optional<double> step = bench::json_number(r.output, "median_step_s");
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "config.h"
#include "fsdp_common/child_process.h"

namespace bench {

// exit_code and output (stdout and stderr, interleaved) are what is used.
using RunResult = fsdp::ChildResult;

// Runs `program` with `args` (fsdp::run_child: no shell, the caller's
// environment without the rendezvous variables, so that it never joins the
// caller's job) plus `extra_env` ("NAME=value" entries, replacing variables of
// the same name), and waits for it.
RunResult run_program(const std::string& program, const std::vector<std::string>& args,
                      const std::vector<std::string>& extra_env = {});

// Runs fsdp2_bench.py (PyTorch FSDP2) with `args` and, when it fails (an exit
// code other than 0, or no "RESULT " line), once more, saying so on stderr
// with the end of the failed run's output. A rank of that script was seen to
// die of SIGABRT in CI runs, with and without the malloc counter, with no
// message (cause not found): one retry keeps the row, the notice keeps the
// evidence. `make_env` gives each attempt its environment (called once per
// attempt, so each can have fresh scratch files); none when empty.
RunResult run_pytorch_script(const std::string& python, const std::vector<std::string>& args,
                             const std::function<std::vector<std::string>()>& make_env = {});

// The number after `"key":` in `text` (the first occurrence), if any.
std::optional<double> json_number(const std::string& text, const std::string& key);
// Every number after `"key":` in `text`, in order.
std::vector<double> json_numbers(const std::string& text, const std::string& key);

// The whole file, or nullopt when it cannot be read.
std::optional<std::string> read_file(const std::string& path);

// A scratch file path in a fresh directory under $TMPDIR (or /tmp); the
// directory and what is in it are removed with the object.
class ScratchDir {
 public:
  ScratchDir();
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name);

 private:
  std::string path_;
  std::vector<std::string> files_;
};

double median(std::vector<double> values);

// "12.3" MiB of `bytes`.
std::string mib(double bytes);

// The last `lines` lines of `text`, for error messages.
std::string tail(const std::string& text, int lines = 15);

// Where the programs a side-by-side run starts live. The defaults are
// compiled in (the build's fsdp_train, the build's Python or $FSDP2CPP_PYTHON
// when set, the script in the source tree); each benchmark has flags to
// override them.
struct Programs {
  std::string trainer;  // fsdp_train
  std::string python;   // a Python with torch
  std::string script;   // tools/bench/python/fsdp2_bench.py
  // libfsdp_malloc_counter.so (malloc_counter/malloc_counter.cc), preloaded
  // into the ranks when RunOptions::count_live_bytes is set.
  std::string malloc_counter;
};
Programs default_programs();
// default_programs() with each non-empty argument in place of its default
// (the benchmarks' --trainer, --python and --script flags).
Programs programs_with(const std::string& trainer, const std::string& python, const std::string& script);

// The trainer's model and batch as fsdp_train's configuration: `layers`
// blocks of width `dim` with `heads` heads, `global_batch` sequences of
// `seq_len` tokens per step, without gradient clipping (the benchmarks time
// the sharded step, and PyTorch's side clips nothing).
fsdp_train::TrainConfig model_shape(int64_t layers, int64_t dim, int64_t heads, int64_t seq_len, int64_t global_batch);

// A benchmark's row label and the model it trains.
struct NamedShape {
  std::string name;
  fsdp_train::TrainConfig shape;
};

// The flags of fsdp_train (and fsdp_plan) that give `shape`: --layers,
// --dim, --heads, --seq-len, --global-batch and --clip, and --kv-heads,
// --hidden and --param-dtype where they are not the trainer's defaults.
std::vector<std::string> model_flags(const fsdp_train::TrainConfig& shape);

// One training run's figures.
struct Measured {
  bool ok = false;
  std::string error;         // when !ok: the command and its output's tail
  double median_step_s = 0;  // median over the steps after the warm-up steps, slowest rank
  double peak_bytes = 0;     // max over ranks: max RSS (CPU) or allocator peak (CUDA)
  // Max over ranks of the peak of live malloc bytes (RunOptions::
  // count_live_bytes), 0 when not counted.
  double peak_live_bytes = 0;
  double loss_first = 0, loss_last = 0;
};

struct RunOptions {
  int nproc = 1;
  bool no_shard = false;  // fsdp_train --no-shard / the script's --no-shard (nproc 1)
  std::string device = "cpu";
  int steps = 10;        // including warm-up
  int warmup_steps = 2;  // untimed
  int threads = 1;       // intra-op threads per rank
  // Preload Programs::malloc_counter into every process of the run and
  // report the ranks' peak of live malloc bytes (Measured::peak_live_bytes).
  bool count_live_bytes = false;
  // GLIBC_TUNABLES for the run's processes (e.g.
  // "glibc.malloc.mmap_threshold=131072"); empty: the caller's environment.
  std::string glibc_tunables;
  // Activation checkpointing of blocks 0, ac_every, 2 ac_every, ...:
  // fsdp_train --ac / the script's --ac (none | full | selective). The
  // script's selective policy is given fsdp::selective_checkpoint_ops(), so
  // both systems keep the outputs of the same ops.
  std::string ac = "none";
  int64_t ac_every = 1;
};

// fsdp_train with `shape` and `options` (--json, parsed).
Measured run_fsdp_train(const Programs& programs, const fsdp_train::TrainConfig& shape, const RunOptions& options);
// The same model and loop under PyTorch FSDP2 (fsdp2_bench.py train).
Measured run_pytorch_fsdp2(const Programs& programs, const fsdp_train::TrainConfig& shape, const RunOptions& options);

// Whether this machine has `n` CUDA devices for the CUDA rows.
bool have_cuda_devices(int n);

}  // namespace bench
