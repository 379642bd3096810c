// fsdp_plan: will the trainer's model fit, at any world size? A dry run of
// the trainer's own fully_shard runtime for one rank of a job of
// --world-size ranks (docs/planning.md):
//
//   fsdp_plan --world-size 128 --layers 32 --dim 4096 --heads 32 --seq-len 8192
//             --global-batch 256 --param-dtype bf16 --ac selective --memory-per-gpu 80GiB
//   (one command line)
//
// prints the rank's peak memory as the CUDA caching allocator would report
// it (allocated and reserved), what holds it, the phase where it falls, the
// collectives of a step, and with --memory-per-gpu the largest local batch
// that fits. --json writes the same as JSON. The model flags are the
// trainer's (fsdp_train --help), parsed by the trainer's own code.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "command_line.h"
#include "config.h"
#include "fsdp_plan/dry_run.h"
#include "fsdp_plan/timeline.h"
#include "model_flags.h"
#include "trainer_plan.h"

ABSL_FLAG(int, world_size, 8, "Ranks of the job to plan (any number: one rank is simulated).");
ABSL_FLAG(int, rank, 0, "The rank to simulate (its rows of uneven shards).");
ABSL_FLAG(int, steps, 2, "Steps to run (the second one holds the optimizer state).");
ABSL_FLAG(std::string, engine, "nccl", "nccl (a CUDA job) or gloo (a CPU job, to compare with a CPU run).");
ABSL_FLAG(std::string, memory_per_gpu, "",
          "Memory of one device, e.g. 80GiB, 96GB, 24576MiB: also search the largest local batch that fits.");
ABSL_FLAG(std::string, json, "", "Write the report as JSON to this file ('-' for stdout).");
ABSL_FLAG(std::string, device, "h100",
          "The device profile of the time model: h100, h100-hbm2e-500w, h200, or cpu (this machine, measured now).");
ABSL_FLAG(int, gpus_per_node, 8, "Ranks per node (NVLink within, the network across).");
ABSL_FLAG(std::string, trace, "", "Write the simulated timeline of the last step as a Chrome trace (Perfetto).");
ABSL_FLAG(bool, compare, false,
          "Also plan the settings a user weighs (reshard after forward, prefetch depth, activation checkpointing, "
          "mixed precision) and print them side by side.");
// The model and sharding flags are the trainer's (model_flags.h).

namespace {

fsdp_train::TrainConfig config_from_flags() {
  fsdp_train::TrainConfig c;
  fsdp_train::apply_model_flags(c);
  return c;
}

// "80GiB", "96GB", "24576MiB", "1e9" (bytes without a unit would be too easy
// to get wrong: a bare number is GiB). Returns -1 when malformed.
int64_t parse_memory(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !(value > 0)) return -1;
  static const std::map<std::string, double> units = {
      {"", 1 << 30},    {"GiB", 1 << 30}, {"G", 1 << 30},          {"GB", 1e9},
      {"MiB", 1 << 20}, {"MB", 1e6},      {"TiB", 1099511627776.0}};
  const auto unit = units.find(end);
  if (unit == units.end()) return -1;
  return static_cast<int64_t>(std::llround(value * unit->second));
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// Whether --device names a profile and --gpus-per-node is one (printing
// which flag is wrong when not), checked before any work starts.
bool device_flags_ok() {
  const std::string name = absl::GetFlag(FLAGS_device);
  if (name != "cpu" && !fsdp_plan::device_profile(name)) {
    std::string names;
    for (const std::string& n : fsdp_plan::device_profile_names()) names += n + ", ";
    std::fprintf(stderr, "fsdp_plan: --device '%s' is not a device profile; use one of %scpu\n", name.c_str(),
                 names.c_str());
    return false;
  }
  if (const int per_node = absl::GetFlag(FLAGS_gpus_per_node); per_node < 1) {
    std::fprintf(stderr, "fsdp_plan: --gpus-per-node must be at least 1 (got %d)\n", per_node);
    return false;
  }
  return true;
}

// The profile --device names, for the kernels of `ops` (a CPU profile times
// them). REQUIRES: device_flags_ok().
fsdp_plan::DeviceProfile profile_from_flags(const fsdp_train::TrainConfig& config, int world_size,
                                            const std::vector<fsdp_plan::OpRecord>& ops) {
  const std::string name = absl::GetFlag(FLAGS_device);
  if (name == "cpu") {
    // The ranks of a CPU job share this machine, as fsdp_train --nproc runs them.
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int threads = config.threads > 0 ? static_cast<int>(config.threads) : std::max(1, cores / world_size);
    return fsdp_plan::measure_cpu_profile(world_size, threads, ops);
  }
  fsdp_plan::DeviceProfile profile = *fsdp_plan::device_profile(name);
  profile.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  return profile;
}

// The settings a user weighs, each changed alone from `base`: reshard after
// forward, prefetch depth, activation checkpointing, mixed precision, and in
// a CUDA job CPU offload.
std::vector<std::pair<std::string, fsdp_train::TrainConfig>> variants(const fsdp_train::TrainConfig& base,
                                                                      bool cuda_job) {
  std::vector<std::pair<std::string, fsdp_train::TrainConfig>> out = {{"as given", base}};
  const auto add = [&](const std::string& name, fsdp_train::TrainConfig c) {
    for (const auto& [_, other] : out) {
      if (other.reshard_after_forward == c.reshard_after_forward && other.prefetch == c.prefetch && other.ac == c.ac &&
          other.param_dtype == c.param_dtype && other.reduce_dtype == c.reduce_dtype &&
          other.cpu_offload == c.cpu_offload) {
        return;
      }
    }
    out.emplace_back(name, c);
  };
  fsdp_train::TrainConfig c = base;
  c.reshard_after_forward = !base.reshard_after_forward;
  add(std::string("reshard after forward ") + (c.reshard_after_forward ? "yes" : "no"), c);
  for (const int64_t prefetch : {0, 2}) {
    c = base;
    c.prefetch = prefetch;
    add(prefetch == 0 ? std::string("prefetch implicit") : "prefetch " + std::to_string(prefetch), c);
  }
  for (const char* ac : {"none", "selective", "torchtitan", "full"}) {
    c = base;
    c.ac = ac;
    add(std::string("ac ") + ac, c);
  }
  c = base;
  c.param_dtype = "bf16";
  c.reduce_dtype = "fp32";
  add("bf16 params, fp32 reduce", c);
  c = base;
  c.param_dtype = "fp32";
  c.reduce_dtype = "fp32";
  add("fp32 params and reduce", c);
  if (cuda_job) {
    c = base;
    c.cpu_offload = !base.cpu_offload;
    add(c.cpu_offload ? "cpu offload" : "no cpu offload", c);
  }
  return out;
}

void print_comparison(const fsdp_train::TrainConfig& base, const fsdp_plan::DryRunOptions& options, int64_t local_batch,
                      int steps, const fsdp_plan::DeviceProfile& profile) {
  std::printf("settings compared (rank %d, local batch %lld, %s)\n", options.rank, static_cast<long long>(local_batch),
              profile.name.c_str());
  std::printf("  %-28s %12s %12s %10s %12s %12s\n", "setting", "reserved MiB", "step ms", "tokens/s", "exposed ms",
              "MFU %");
  for (const auto& [name, c] : variants(base, /*cuda_job=*/options.engine == fsdp::collectives::BackendKind::kNccl)) {
    const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(c, options, local_batch, steps);
    // A measured profile times this variant's own kernels.
    const fsdp_plan::DeviceProfile variant_profile =
        profile.host_computes ? profile_from_flags(c, options.world_size, plan.ops) : profile;
    const fsdp_plan::StepTime time = fsdp_plan_tool::simulate_trainer(plan, c, local_batch, steps, variant_profile);
    std::printf("  %-28s %12.1f %12.1f %10.0f %12.1f %12.1f\n", name.c_str(), mib(plan.memory.peak_reserved),
                time.step_s * 1e3, time.tokens_per_s, time.exposed_communication_s * 1e3, 100 * time.mfu);
  }
}

// What the flags ask for, checked.
struct Request {
  fsdp_train::TrainConfig config;
  fsdp_plan::DryRunOptions options;
  std::string engine;
  int64_t memory_bytes = 0;  // 0: no --memory-per-gpu
  int steps = 2;
  int64_t local_batch = 0;
};

// The request the flags make; nullopt (after printing which flag is wrong)
// when they do not make one.
std::optional<Request> request_from_flags() {
  Request r;
  r.config = config_from_flags();
  const int world_size = absl::GetFlag(FLAGS_world_size);
  if (world_size < 1) {
    std::fprintf(stderr, "fsdp_plan: --world-size must be at least 1 (got %d)\n", world_size);
    return std::nullopt;
  }
  r.engine = absl::GetFlag(FLAGS_engine);
  if (r.engine != "nccl" && r.engine != "gloo") {
    std::fprintf(stderr, "fsdp_plan: --engine must be nccl or gloo (got '%s')\n", r.engine.c_str());
    return std::nullopt;
  }
  if (r.config.cpu_offload && r.engine == "gloo") {
    std::fprintf(stderr,
                 "fsdp_plan: --cpu-offload plans a CUDA job, but --engine gloo plans a CPU job, whose shards already "
                 "live in host memory; drop one of them\n");
    return std::nullopt;
  }
  // The job the trainer's checks see: NCCL's semantics plan a CUDA job.
  r.config.device = r.engine == "nccl" ? "cuda" : "cpu";
  if (const absl::Status ok = fsdp_train::validate(r.config, world_size); !ok.ok()) {
    std::fprintf(stderr, "fsdp_plan: %s\n", std::string(ok.message()).c_str());
    return std::nullopt;
  }
  r.options.world_size = world_size;
  r.options.rank = absl::GetFlag(FLAGS_rank);
  if (r.options.rank < 0 || r.options.rank >= world_size) {
    std::fprintf(stderr, "fsdp_plan: --rank %d is not a rank of --world-size %d\n", r.options.rank, world_size);
    return std::nullopt;
  }
  r.options.engine = r.engine == "nccl" ? fsdp::collectives::BackendKind::kNccl : fsdp::collectives::BackendKind::kGloo;
  if (const std::string text = absl::GetFlag(FLAGS_memory_per_gpu); !text.empty()) {
    r.memory_bytes = parse_memory(text);
    if (r.memory_bytes < 0) {
      std::fprintf(stderr, "fsdp_plan: --memory-per-gpu '%s' is not a size such as 80GiB, 96GB or 24576MiB\n",
                   text.c_str());
      return std::nullopt;
    }
  }
  r.steps = absl::GetFlag(FLAGS_steps);
  if (r.steps < 1) {
    std::fprintf(stderr, "fsdp_plan: --steps must be at least 1 (got %d)\n", r.steps);
    return std::nullopt;
  }
  if (!device_flags_ok()) return std::nullopt;
  r.local_batch = r.config.global_batch / world_size;
  return r;
}

// What the dry run and the simulation say.
struct Answer {
  fsdp_plan_tool::TrainerPlan plan;
  fsdp_plan::DeviceProfile profile;
  fsdp_plan::StepTime time;
  std::map<std::string, std::pair<int64_t, int64_t>> per_op;  // the last step's collectives: count, bytes
  int64_t fitting = -1;                                       // the largest local batch, with --memory-per-gpu
};

Answer answer(const Request& r) {
  Answer a;
  a.plan = fsdp_plan_tool::plan_trainer(r.config, r.options, r.local_batch, r.steps);
  a.profile = profile_from_flags(r.config, r.options.world_size, a.plan.ops);
  a.time = fsdp_plan_tool::simulate_trainer(a.plan, r.config, r.local_batch, r.steps, a.profile);
  for (const auto& c : a.plan.collectives) {
    if (c.step != r.steps) continue;
    auto& [count, bytes] = a.per_op[c.op];
    ++count;
    bytes += c.bytes;
  }
  if (r.memory_bytes > 0) a.fitting = fsdp_plan_tool::largest_local_batch(r.config, r.options, r.memory_bytes);
  return a;
}

void print_report(const Request& r, const Answer& a) {
  const fsdp_train::TrainConfig& c = r.config;
  const int world_size = r.options.world_size;
  std::printf("fsdp_plan: rank %d of %d (%s semantics), mesh %s\n", r.options.rank, world_size, r.engine.c_str(),
              c.mesh.empty() ? ("1x" + std::to_string(world_size)).c_str() : c.mesh.c_str());
  std::printf(
      "  model   %lld layers, dim %lld, %lld heads (%lld key/value), SwiGLU hidden %lld, vocab %lld, seq %lld: %lld "
      "parameters (%lld on this rank)\n",
      static_cast<long long>(c.layers), static_cast<long long>(c.dim), static_cast<long long>(c.heads),
      static_cast<long long>(c.kv_heads > 0 ? c.kv_heads : c.heads), static_cast<long long>(fsdp_train::hidden_size(c)),
      static_cast<long long>(c.vocab), static_cast<long long>(c.seq_len), static_cast<long long>(a.plan.parameters),
      static_cast<long long>(a.plan.local_parameters));
  std::printf(
      "  step    local batch %lld, param dtype %s, reduce dtype %s, reshard after forward %s%s, ac %s; %d steps\n",
      static_cast<long long>(r.local_batch), c.param_dtype.c_str(), c.reduce_dtype.c_str(),
      c.reshard_after_forward ? "yes" : "no",
      c.prefetch > 0 ? (", prefetch " + std::to_string(c.prefetch)).c_str() : "", c.ac.c_str(), r.steps);
  std::printf("memory of rank %d\n%s", r.options.rank, fsdp_plan::format_memory(a.plan.memory).c_str());
  std::printf("collectives of step %d\n", r.steps);
  for (const auto& [op, cb] : a.per_op) {
    std::printf("  %-34s %5lld calls  %10.1f MiB\n", op.c_str(), static_cast<long long>(cb.first), mib(cb.second));
  }
  std::printf("time of step %d on %s\n  profile         %s\n%s", r.steps, a.profile.name.c_str(),
              a.profile.sources.c_str(), fsdp_plan::format_time(a.time).c_str());
  if (r.memory_bytes > 0) {
    std::printf("fits in %.1f GiB per device: ", static_cast<double>(r.memory_bytes) / (1 << 30));
    if (a.fitting == 0) {
      std::printf("no: even a local batch of 1 needs more (reserved)\n");
    } else {
      std::printf("local batch up to %lld (global %lld), by peak reserved memory\n", static_cast<long long>(a.fitting),
                  static_cast<long long>(a.fitting * world_size));
    }
  }
}

void write_json(const std::string& path, const Request& r, const Answer& a) {
  nlohmann::ordered_json j;
  j["world_size"] = r.options.world_size;
  j["rank"] = r.options.rank;
  j["engine"] = r.engine;
  j["mesh"] = r.config.mesh;
  j["local_batch"] = r.local_batch;
  j["parameters"] = a.plan.parameters;
  j["local_parameters"] = a.plan.local_parameters;
  j["memory"] = nlohmann::ordered_json::parse(fsdp_plan::memory_json(a.plan.memory));
  nlohmann::ordered_json ops = nlohmann::ordered_json::object();
  for (const auto& [op, cb] : a.per_op) ops[op] = {{"calls", cb.first}, {"bytes", cb.second}};
  j["collectives_per_step"] = ops;
  j["time"] = nlohmann::ordered_json::parse(fsdp_plan::time_json(a.time));
  if (r.memory_bytes > 0) {
    j["memory_per_gpu_bytes"] = r.memory_bytes;
    j["largest_local_batch"] = a.fitting;
  }
  if (path == "-") {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::ofstream(path) << j.dump(2) << "\n";
  }
}

}  // namespace

int run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "fsdp_plan: a dry run of the trainer's fully_shard runtime for one rank of a job of --world-size ranks; "
      "prints its peak memory, what holds it, the largest local batch that fits --memory-per-gpu, and the "
      "simulated time of a step on --device.");
  fsdp_train::parse_command_line(argc, argv);
  const std::optional<Request> request = request_from_flags();
  if (!request) return 2;
  const Answer a = answer(*request);
  print_report(*request, a);
  if (absl::GetFlag(FLAGS_compare)) {
    print_comparison(request->config, request->options, request->local_batch, request->steps, a.profile);
  }
  if (const std::string path = absl::GetFlag(FLAGS_trace); !path.empty()) {
    std::ofstream(path) << fsdp_plan::chrome_trace(a.time) << "\n";
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) write_json(path, *request, a);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "fsdp_plan: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_plan: %s\n", e.what());
  }
  return 1;
}
