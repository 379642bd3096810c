#include "bench_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <regex>
#include <sstream>

#include <torch/cuda.h>

#include "fsdp2/activation_checkpoint.h"
#include "fsdp_common/child_process.h"
#include "fsdp_common/config.h"

namespace bench {

RunResult run_program(const std::string& program, const std::vector<std::string>& args,
                      const std::vector<std::string>& extra_env) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  return fsdp::run_child(argv, {extra_env});
}

std::vector<double> json_numbers(const std::string& text, const std::string& key) {
  std::vector<double> out;
  const std::regex re("\"" + key + R"re(":\s*([-+0-9.eE]+|nan|inf|NaN|Infinity))re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    out.push_back(std::strtod((*it)[1].str().c_str(), nullptr));
  }
  return out;
}

std::optional<double> json_number(const std::string& text, const std::string& key) {
  const std::vector<double> all = json_numbers(text, key);
  if (all.empty()) return std::nullopt;
  return all.front();
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ScratchDir::ScratchDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdp_bench.XXXXXX";
  if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
}

ScratchDir::~ScratchDir() {
  for (const auto& f : files_) {
    if (::unlink(f.c_str()) == 0) continue;
    // A directory of files (a run's malloc counter reports).
    if (DIR* d = ::opendir(f.c_str())) {
      while (const dirent* e = ::readdir(d)) ::unlinkat(::dirfd(d), e->d_name, 0);
      ::closedir(d);
      ::rmdir(f.c_str());
    }
  }
  if (!path_.empty()) ::rmdir(path_.c_str());
}

std::string ScratchDir::file(const std::string& name) {
  files_.push_back(path_ + "/" + name);
  return files_.back();
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string mib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", bytes / 1048576.0);
  return text;
}

std::string tail(const std::string& text, int lines) {
  size_t pos = text.size();
  for (int i = 0; i <= lines && pos != std::string::npos && pos > 0; ++i) pos = text.rfind('\n', pos - 1);
  return pos == std::string::npos || text.empty() ? text : text.substr(pos + 1);
}

Programs default_programs() {
  const char* python = std::getenv("FSDP2CPP_PYTHON");
  return {FSDP_BENCH_TRAINER, python != nullptr && *python != '\0' ? python : FSDP_BENCH_PYTHON, FSDP_BENCH_SCRIPT,
          FSDP_BENCH_MALLOC_COUNTER};
}

Programs programs_with(const std::string& trainer, const std::string& python, const std::string& script) {
  Programs programs = default_programs();
  if (!trainer.empty()) programs.trainer = trainer;
  if (!python.empty()) programs.python = python;
  if (!script.empty()) programs.script = script;
  return programs;
}

fsdp_train::TrainConfig model_shape(int64_t layers, int64_t dim, int64_t heads, int64_t seq_len, int64_t global_batch) {
  fsdp_train::TrainConfig c;
  c.layers = layers;
  c.dim = dim;
  c.heads = heads;
  c.seq_len = seq_len;
  c.global_batch = global_batch;
  c.clip = 0;
  return c;
}

std::vector<std::string> model_flags(const fsdp_train::TrainConfig& shape) {
  std::vector<std::string> flags = {
      "--layers",       std::to_string(shape.layers),       "--dim",     std::to_string(shape.dim),
      "--heads",        std::to_string(shape.heads),        "--seq-len", std::to_string(shape.seq_len),
      "--global-batch", std::to_string(shape.global_batch), "--clip",    std::to_string(shape.clip)};
  const fsdp_train::TrainConfig defaults;
  if (shape.kv_heads != defaults.kv_heads) flags.insert(flags.end(), {"--kv-heads", std::to_string(shape.kv_heads)});
  if (shape.hidden != defaults.hidden) flags.insert(flags.end(), {"--hidden", std::to_string(shape.hidden)});
  if (shape.param_dtype != defaults.param_dtype) flags.insert(flags.end(), {"--param-dtype", shape.param_dtype});
  return flags;
}

namespace {

std::vector<std::string> shape_flags(const fsdp_train::TrainConfig& shape, const RunOptions& options) {
  std::vector<std::string> flags = model_flags(shape);
  flags.insert(flags.end(), {"--steps", std::to_string(options.steps), "--threads", std::to_string(options.threads),
                             "--device", options.device, "--ac", options.ac});
  // fsdp_train refuses --ac-every without checkpointing.
  if (options.ac != "none") flags.insert(flags.end(), {"--ac-every", std::to_string(options.ac_every)});
  return flags;
}

std::string command_line(const std::string& program, const std::vector<std::string>& args) {
  std::string text = program;
  for (const auto& a : args) text += " " + a;
  return text;
}

Measured failure(const std::string& program, const std::vector<std::string>& args, const RunResult& run,
                 const std::string& why) {
  Measured m;
  // Enough lines to reach past a Python traceback of the parent (about 15)
  // to what a crashed child printed before it.
  m.error = why + " (exit code " + std::to_string(run.exit_code) + "): " + command_line(program, args) + "\n" +
            tail(run.output, 60);
  return m;
}

// The environment a run's processes get on top of the caller's: the malloc
// counter's preload and its report directory, GLIBC_TUNABLES.
std::vector<std::string> run_env(const Programs& programs, const RunOptions& options, ScratchDir& dir,
                                 std::string* counter_dir) {
  std::vector<std::string> env;
  if (options.count_live_bytes) {
    *counter_dir = dir.file("malloc_counter");
    ::mkdir(counter_dir->c_str(), 0700);
    const char* preload = std::getenv("LD_PRELOAD");
    env.push_back("LD_PRELOAD=" + programs.malloc_counter +
                  (preload != nullptr && *preload != '\0' ? std::string(":") + preload : ""));
    env.push_back("FSDP_MALLOC_COUNTER_DIR=" + *counter_dir);
  }
  if (!options.glibc_tunables.empty()) env.push_back("GLIBC_TUNABLES=" + options.glibc_tunables);
  return env;
}

// The largest "peak_live_bytes" over the ranks' counter reports (files of
// processes with a RANK; the launchers' own are left out), removing the
// files. -1 when no rank wrote one.
double peak_live_over_ranks(const std::string& counter_dir) {
  double peak = -1;
  DIR* d = ::opendir(counter_dir.c_str());
  if (d == nullptr) return peak;
  std::vector<std::string> files;
  while (const dirent* e = ::readdir(d)) {
    if (std::string(e->d_name).rfind("malloc_counter.", 0) == 0) files.push_back(counter_dir + "/" + e->d_name);
  }
  ::closedir(d);
  for (const std::string& f : files) {
    const std::optional<std::string> text = read_file(f);
    ::unlink(f.c_str());
    if (!text || json_number(*text, "rank").value_or(-1) < 0) continue;
    peak = std::max(peak, json_number(*text, "peak_live_bytes").value_or(-1));
  }
  ::rmdir(counter_dir.c_str());
  return peak;
}

}  // namespace

Measured run_fsdp_train(const Programs& programs, const fsdp_train::TrainConfig& shape, const RunOptions& options) {
  ScratchDir dir;
  const std::string json = dir.file("run.json");
  std::vector<std::string> args = shape_flags(shape, options);
  args.insert(args.end(), {"--json", json, "--log-every", "1000000"});
  if (options.no_shard) {
    args.push_back("--no-shard");
  } else {
    args.insert(args.end(), {"--nproc", std::to_string(options.nproc)});
  }
  std::string counter_dir;
  const RunResult run = run_program(programs.trainer, args, run_env(programs, options, dir, &counter_dir));
  if (run.exit_code != 0) return failure(programs.trainer, args, run, "fsdp_train failed");
  const std::optional<std::string> text = read_file(json);
  const std::vector<double> tokens_per_s = text ? json_numbers(*text, "tokens_per_s") : std::vector<double>{};
  const std::vector<double> losses = text ? json_numbers(*text, "loss") : std::vector<double>{};
  const std::vector<double> peaks = text ? json_numbers(*text, "peak_mem_bytes") : std::vector<double>{};
  if (tokens_per_s.empty() || losses.size() != tokens_per_s.size() || peaks.empty()) {
    return failure(programs.trainer, args, run, "fsdp_train wrote no usable --json record");
  }
  std::vector<double> seconds;
  const double tokens = static_cast<double>(shape.global_batch * shape.seq_len);
  for (size_t i = 0; i < tokens_per_s.size(); ++i) {
    if (static_cast<int>(i) >= options.warmup_steps ||
        tokens_per_s.size() <= static_cast<size_t>(options.warmup_steps)) {
      seconds.push_back(tokens / tokens_per_s[i]);
    }
  }
  Measured m;
  m.ok = true;
  m.median_step_s = median(seconds);
  m.peak_bytes = peaks.back();
  m.loss_first = losses.front();
  m.loss_last = losses.back();
  if (options.count_live_bytes) {
    m.peak_live_bytes = peak_live_over_ranks(counter_dir);
    if (m.peak_live_bytes <= 0) return failure(programs.trainer, args, run, "no rank wrote a malloc counter report");
  }
  return m;
}

RunResult run_pytorch_script(const std::string& python, const std::vector<std::string>& args,
                             const std::function<std::vector<std::string>()>& make_env) {
  const auto attempt = [&] { return run_program(python, args, make_env ? make_env() : std::vector<std::string>{}); };
  RunResult run = attempt();
  if (run.exit_code == 0 && run.output.rfind("RESULT ") != std::string::npos) return run;
  std::fprintf(stderr,
               "bench: the PyTorch FSDP2 script failed (exit code %d); running it once more. The end of its "
               "output:\n%s\n",
               run.exit_code, tail(run.output, 60).c_str());
  return attempt();
}

Measured run_pytorch_fsdp2(const Programs& programs, const fsdp_train::TrainConfig& shape, const RunOptions& options) {
  std::vector<std::string> args = {programs.script,  "train",
                                   "--nproc",        std::to_string(options.nproc),
                                   "--warmup-steps", std::to_string(options.warmup_steps)};
  const std::vector<std::string> flags = shape_flags(shape, options);
  args.insert(args.end(), flags.begin(), flags.end());
  if (options.no_shard) args.push_back("--no-shard");
  if (options.ac == "selective") {
    std::string ops;
    for (const std::string& op : fsdp::selective_checkpoint_ops()) ops += (ops.empty() ? "" : ",") + op;
    args.insert(args.end(), {"--ac-save-ops", ops});
  }
  // One scratch directory per attempt; the last one's counter reports are
  // read below.
  std::deque<ScratchDir> dirs;  // deque: ScratchDir does not move
  std::string counter_dir;
  const RunResult run = run_pytorch_script(programs.python, args, [&] {
    dirs.emplace_back();
    return run_env(programs, options, dirs.back(), &counter_dir);
  });
  const size_t at = run.output.rfind("RESULT ");
  if (run.exit_code != 0 || at == std::string::npos) {
    return failure(programs.python, args, run, "the PyTorch FSDP2 script failed");
  }
  const std::string result = run.output.substr(at);
  Measured m;
  m.median_step_s = json_number(result, "median_step_s").value_or(0);
  m.peak_bytes = json_number(result, "peak_bytes").value_or(0);
  m.loss_first = json_number(result, "loss_first").value_or(0);
  m.loss_last = json_number(result, "loss_last").value_or(0);
  m.ok = m.median_step_s > 0 && m.peak_bytes > 0;
  if (!m.ok) return failure(programs.python, args, run, "the PyTorch FSDP2 script printed no usable RESULT");
  if (options.count_live_bytes) {
    m.peak_live_bytes = peak_live_over_ranks(counter_dir);
    if (m.peak_live_bytes <= 0) return failure(programs.python, args, run, "no rank wrote a malloc counter report");
  }
  return m;
}

bool have_cuda_devices(int n) { return FSDP2CPP_WITH_CUDA && static_cast<int>(torch::cuda::device_count()) >= n; }

}  // namespace bench
