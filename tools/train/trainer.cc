#include "trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpointing.h"
#include "collectives/communicator.h"
#include "collectives/flight_recorder.h"
#include "data.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/activation_checkpoint.h"
#include "fsdp2/clip_grad.h"
#include "fsdp2/custom_collectives.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp_common/config.h"
#include "init.h"
#include "model.h"
#include "profile.h"
#include "report.h"

#if FSDP2CPP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace fsdp_train {

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::collectives::Communicator;
using fsdp::collectives::ReduceOp;

template <typename T>
T value_or_throw(absl::StatusOr<T> result) {
  if (!result.ok()) throw std::runtime_error(std::string(result.status().message()));
  return *std::move(result);
}

// Linear warm-up to --lr over --warmup steps, then cosine decay to lr / 10.
double learning_rate(const TrainConfig& c, int64_t step) {
  if (step <= c.warmup) return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup);
  const double progress =
      static_cast<double>(step - c.warmup) / static_cast<double>(std::max<int64_t>(1, c.steps - c.warmup));
  return c.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

// This process's peak memory: the caching allocator's peak on CUDA, the
// peak resident set size (getrusage) on CPU.
int64_t peak_memory_bytes(const c10::Device& device) {
#if FSDP2CPP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
#endif
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

// Host time blocked waiting for FSDP's all-gathers and reduce-scatters (on
// CPU: the communication not hidden behind compute).
struct CommSeconds {
  double all_gather = 0;
  double reduce_scatter = 0;
};
CommSeconds exposed_comm_seconds(const fsdp::FSDPModule& root) {
  const fsdp::RuntimeStats stats = root.runtime_stats();
  return {stats.all_gather_wait_seconds, stats.reduce_scatter_wait_seconds};
}

// Labels of the trainer's own collectives, so that a divergence report says
// what a rank waiting on the metrics group is doing (docs/debugging.md).
constexpr char kStepMetricsLabel[] = "fsdp_train: step metrics";
constexpr char kRunSummaryLabel[] = "fsdp_train: run summary";

// Every rank's `values` (same length on each), rank-major, on every rank.
template <typename T>
std::vector<T> all_gather(Communicator& group, const std::vector<T>& values, const char* label) {
  const fsdp::collectives::CollectiveLabel scope(label);
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  const at::Tensor input = at::tensor(values, dtype);
  at::Tensor output = at::empty({group.size() * static_cast<int64_t>(values.size())}, dtype);
  group.all_gather_into_tensor(output, input).wait();
  return std::vector<T>(output.data_ptr<T>(), output.data_ptr<T>() + output.numel());
}

template <typename T>
T all_reduce(Communicator& group, T value, ReduceOp op, const char* label) {
  const fsdp::collectives::CollectiveLabel scope(label);
  at::Tensor t = at::tensor({value}, c10::CppTypeToScalarType<T>::value);
  group.all_reduce(t, op).wait();
  return t.item<T>();
}

c10::Device rank_device(const TrainConfig& config, const fsdp::collectives::World& world) {
  if (config.device == "cpu") return c10::Device(c10::kCPU);
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK(gpus > 0, "--device cuda: CUDA is not available on this machine; use --device cpu");
  TORCH_CHECK(world.local_rank() < gpus, "--device cuda: local rank ", world.local_rank(), " has no GPU (", gpus,
              " visible); start at most one rank per GPU");
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank()));
  // NCCL communicators bind to the current device: set it before any group.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  return device;
}

void print_header(const TrainConfig& c, const fsdp::DeviceMesh& mesh, const Corpus& corpus, const ModelConfig& m,
                  int64_t params, int64_t local_params, int world_size) {
  std::printf("fsdp_train: %d rank%s on %s (%s), mesh %s\n", world_size, world_size == 1 ? "" : "s", c.device.c_str(),
              c.device == "cuda" ? "NCCL" : "Gloo", mesh.to_string().c_str());
  // "4 heads", or with grouped-query attention "32 heads (8 KV)".
  const std::string kv_heads = kv_head_count(m) == m.heads ? "" : " (" + std::to_string(kv_head_count(m)) + " KV)";
  std::printf(
      "  model   %lld layers, dim %lld, %lld heads%s, SwiGLU hidden %lld, vocab %lld: %s parameters (%s on rank 0)\n",
      static_cast<long long>(m.layers), static_cast<long long>(m.dim), static_cast<long long>(m.heads),
      kv_heads.c_str(), static_cast<long long>(m.hidden), static_cast<long long>(m.vocab),
      format_count(static_cast<double>(params)).c_str(), format_count(static_cast<double>(local_params)).c_str());
  std::printf("  data    %s (%s bytes); global batch %lld x %lld tokens, %lld rows per rank\n", corpus.source.c_str(),
              format_count(static_cast<double>(corpus.bytes.numel())).c_str(), static_cast<long long>(c.global_batch),
              static_cast<long long>(c.seq_len), static_cast<long long>(c.global_batch / world_size));
  std::printf(
      "  optim   AdamW lr %g (warm-up %lld, cosine to lr/10), weight decay %g, clip %g; %lld steps, seed %lld\n", c.lr,
      static_cast<long long>(c.warmup), c.weight_decay, c.clip, static_cast<long long>(c.steps),
      static_cast<long long>(c.seed));
  if (c.no_shard) {
    std::printf("  fsdp    none (--no-shard: the same model unsharded, one rank)\n");
  } else {
    std::printf(
        "  fsdp    fully_shard on %lld blocks + root, reshard_after_forward=%s, param dtype %s, reduce dtype "
        "%s%s%s%s\n",
        static_cast<long long>(m.layers), c.reshard_after_forward ? "true" : "false", c.param_dtype.c_str(),
        c.reduce_dtype.c_str(), c.cpu_offload ? ", CPU offload" : "",
        c.all_gather_dtype == "int8" ? ", int8 all-gather (blocks)" : "",
        c.prefetch > 0 ? (", prefetch " + std::to_string(c.prefetch) + " blocks").c_str() : "");
  }
  if (c.ac != "none") {
    const int64_t checkpointed = (m.layers + c.ac_every - 1) / c.ac_every;
    std::printf("  ac      %s activation checkpointing of %lld of %lld blocks (every %lld)\n", c.ac.c_str(),
                static_cast<long long>(checkpointed), static_cast<long long>(m.layers),
                static_cast<long long>(c.ac_every));
  }
  std::fflush(stdout);
}

// The model and, unless --no-shard, its fully_shard root.
struct ShardedModel {
  std::shared_ptr<Transformer> model;
  std::optional<fsdp::FSDPModule> root;
};

ShardedModel build_model(const TrainConfig& c, const ModelConfig& mc, const fsdp::DeviceMesh& mesh,
                         const c10::Device& device) {
  // Deferred init: the model is built block by block, each block initialised
  // from (seed, parameter FQN) and sharded before the next one exists, so no
  // rank holds all of the model and the initial values are the same at every
  // world size. The root then takes the remaining parameters (embeddings,
  // final norm, output). --no-shard builds the same values and shards nothing.
  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  options.mp_policy.param_dtype = value_or_throw(parse_dtype("param-dtype", c.param_dtype));
  options.mp_policy.reduce_dtype = value_or_throw(parse_dtype("reduce-dtype", c.reduce_dtype));
  options.offload_policy.offload_to_cpu = c.cpu_offload;
  fsdp::FullyShardOptions block_options = options;
  block_options.reshard_after_forward = c.reshard_after_forward;
  // --all-gather-dtype int8: one Int8AllGather for every block. The root
  // (token embedding, final norm, output projection) is left unquantized:
  // its all-gather runs once a step (the root is not resharded after
  // forward), and the embedding and the logits are where a quantization
  // error reaches the loss most directly.
  const std::shared_ptr<fsdp::AllGather> block_all_gather =
      c.all_gather_dtype == "int8" ? std::make_shared<fsdp::Int8AllGather>() : nullptr;
  // --ac: blocks 0, N, 2N, ... are checkpointed, then sharded (the order
  // users apply them; fully_shard's hooks run outside the checkpoint either
  // way). Selective keeps the matmuls' and attention's outputs.
  const fsdp::CheckpointOptions ac_options = checkpoint_options(c);
  int64_t block_index = 0;
  std::function<void(Block&)> on_block = [&](Block& block) {
    if (c.ac != "none" && block_index % c.ac_every == 0) fsdp::checkpoint_module(*block, ac_options);
    ++block_index;
    if (c.no_shard) return;
    fsdp::FSDPModule sharded = fsdp::fully_shard(block, block_options);
    if (block_all_gather) sharded.set_custom_all_gather(block_all_gather);
  };
  ShardedModel out;
  out.model = build_transformer(mc, c.seed, device, on_block);
  if (!c.no_shard) {
    out.root = fsdp::fully_shard(out.model, options);
    set_block_prefetch(*out.model, c.prefetch);
  }
  return out;
}

// The mesh: 1-D over all ranks, or (--mesh RxS, R > 1) 2-D for HSDP.
fsdp::DeviceMesh make_mesh(const TrainConfig& c, const std::shared_ptr<fsdp::collectives::World>& world,
                           const c10::Device& device) {
  const int world_size = world->size();
  const MeshShape shape = value_or_throw(parse_mesh(c.mesh, world_size));
  return shape.replicate > 1
             ? fsdp::init_device_mesh(world, device.type(), {shape.replicate, shape.shard}, {"replicate", "shard"})
             : fsdp::init_device_mesh(world, device.type(), {world_size}, {"shard"});
}

// One optimizer step of step `step` on this rank's `batch`; returns this
// rank's loss.
double train_step(const TrainConfig& c, int64_t step, const Batch& batch, const c10::Device& device,
                  ShardedModel& sharded, torch::optim::AdamW& optim) {
  Transformer& model = *sharded.model;
  std::optional<fsdp::FSDPModule>& root = sharded.root;
  for (auto& group : optim.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(c, step));
  }
  const at::Tensor inputs = batch.inputs.to(device), targets = batch.targets.to(device);

  optim.zero_grad();
  const at::Tensor logits = fsdp::call_module(model, inputs);  // the root, through its FSDP hooks
  const at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
  loss.backward();
  if (c.clip > 0 && root) fsdp::clip_grads_with_norm_(*root, c.clip, fsdp::get_total_norm(*root));  // no host sync
  if (c.clip > 0 && !root) torch::nn::utils::clip_grad_norm_(model.parameters(), c.clip);
  optim.step();
  return loss.item<double>();
}

// The record of step `step`, the same on every rank (collective over
// `metrics`). The global batch's loss: every rank has the same number of
// rows, so the mean of the ranks' means is the global mean.
StepRecord record_step(Communicator& metrics, int64_t step, double local_loss, double seconds,
                       const c10::Device& device, double tokens_per_step) {
  StepRecord record;
  record.step = step;
  record.loss = all_reduce(metrics, local_loss, ReduceOp::sum(), kStepMetricsLabel) / metrics.size();
  record.peak_mem_bytes = all_reduce(metrics, peak_memory_bytes(device), ReduceOp::max(), kStepMetricsLabel);
  record.seconds = all_reduce(metrics, seconds, ReduceOp::max(), kStepMetricsLabel);
  record.tokens_per_s = tokens_per_step / record.seconds;
  return record;
}

TrainingResult training_result(const std::vector<StepRecord>& records, const std::optional<fsdp::FSDPModule>& root) {
  TrainingResult result;
  result.records = records;
  if (root) {
    const fsdp::RuntimeStats stats = root->runtime_stats();
    const double steps = static_cast<double>(records.size());
    result.all_gather_bytes_per_step = static_cast<double>(stats.all_gather_bytes) / steps;
    result.all_gathers_per_step = static_cast<double>(stats.all_gathers) / steps;
  }
  return result;
}

// Rank 0's summary of the run. `times` holds each rank's all-gather wait,
// reduce-scatter wait and total step seconds, `peaks` each rank's peak memory.
void print_summary(const TrainConfig& c, const fsdp::DeviceMesh& mesh, const c10::Device& device,
                   const std::vector<StepRecord>& records, const TrainingResult& result, bool sharded,
                   const std::vector<double>& times, const std::vector<int64_t>& peaks) {
  const int world_size = static_cast<int>(peaks.size());
  const double tokens_per_step = static_cast<double>(c.global_batch * c.seq_len);
  double ag = 0, rs = 0, total = 0;
  for (int r = 0; r < world_size; ++r) {
    ag += times[3 * r] / world_size;
    rs += times[3 * r + 1] / world_size;
    total += times[3 * r + 2] / world_size;
  }
  double timed = 0;
  for (size_t i = 0; i < records.size(); ++i) timed += i > 0 || records.size() == 1 ? records[i].seconds : 0.0;
  const double timed_steps = records.size() > 1 ? static_cast<double>(records.size() - 1) : 1.0;
  std::vector<std::string> peak_text;
  for (int r = 0; r < world_size; ++r) peak_text.push_back(absl::StrFormat("rank %d %s", r, format_bytes(peaks[r])));
  const double exposed = ag + rs;
  std::printf("summary\n");
  std::printf("  world size    %d, mesh %s\n", world_size, mesh.to_string().c_str());
  std::printf("  loss          %.4f (step %lld) -> %.4f (step %lld)\n", records.front().loss,
              static_cast<long long>(records.front().step), records.back().loss,
              static_cast<long long>(records.back().step));
  std::printf("  throughput    %s tokens/s mean%s\n", format_count(tokens_per_step * timed_steps / timed).c_str(),
              records.size() > 1 ? " (the first step of the run is warm-up)" : "");
  std::printf("  step time     %.2f s (mean over ranks)\n", total);
  std::printf("  exposed comm  %.2f s (%.1f%%): all-gather wait %.2f s, reduce-scatter wait %.2f s%s\n", exposed,
              100.0 * exposed / total, ag, rs, device.is_cuda() ? " (host-blocked only; on CUDA use a profiler)" : "");
  std::printf("  compute+rest  %.2f s (%.1f%%)\n", total - exposed, 100.0 * (total - exposed) / total);
  std::printf("  peak memory   %s (%s)\n", absl::StrJoin(peak_text, ", ").c_str(),
              device.is_cuda() ? "CUDA caching allocator" : "max RSS");
  if (sharded) {
    std::printf("  all-gather    %s received per step by rank 0 (%.0f all-gathers%s)\n",
                format_bytes(static_cast<int64_t>(result.all_gather_bytes_per_step)).c_str(),
                result.all_gathers_per_step, c.all_gather_dtype == "int8" ? ", the blocks' in int8" : "");
  }
}

// Saves the training state after `step` (in the background with
// --async-save, when `background` is set).
void save_step(const TrainConfig& c, int64_t step, int world_size, const std::string& mesh_text,
               torch::nn::Module& model, torch::optim::Optimizer& optim, BackgroundCheckpointer* background,
               const std::shared_ptr<Communicator>& metrics) {
  TrainingProgress saved;
  saved.step = step;
  saved.world_size = world_size;
  saved.mesh = mesh_text;
  saved.samples_seen = step * c.global_batch;
  if (background != nullptr) {
    background->save(saved, model, optim);
  } else {
    save_checkpoint(c.save_dir, c.keep, saved, model, optim, metrics);
  }
}

// The run's summary on rank 0, and --json. Collective over `metrics`: every
// rank's peak memory and timings are gathered.
void report_run(const TrainConfig& c, const fsdp::DeviceMesh& mesh, const c10::Device& device,
                const std::vector<StepRecord>& records, const TrainingResult& result,
                const std::optional<fsdp::FSDPModule>& root, Communicator& metrics, double step_seconds_total) {
  const std::vector<int64_t> peaks =
      all_gather(metrics, std::vector<int64_t>{peak_memory_bytes(device)}, kRunSummaryLabel);
  const CommSeconds comm = root ? exposed_comm_seconds(*root) : CommSeconds{};
  const std::vector<double> times = all_gather(
      metrics, std::vector<double>{comm.all_gather, comm.reduce_scatter, step_seconds_total}, kRunSummaryLabel);
  if (metrics.rank() != 0) return;
  print_summary(c, mesh, device, records, result, root.has_value(), times, peaks);
  std::fflush(stdout);
  if (c.json_path.empty()) return;
  const absl::Status written = write_json(c.json_path, static_cast<int>(peaks.size()), mesh.to_string(), records);
  if (!written.ok()) throw std::runtime_error(std::string(written.message()));
  std::printf("  json          %s\n", c.json_path.c_str());
  std::fflush(stdout);
}

}  // namespace

void set_block_prefetch(const Transformer& model, int64_t prefetch) {
  if (prefetch <= 0) return;
  std::vector<fsdp::FSDPModule> blocks;
  for (const Block& block : model.blocks) {
    std::optional<fsdp::FSDPModule> sharded = fsdp::fsdp_module_of(*block);
    TORCH_CHECK(sharded.has_value(), "set_block_prefetch: a block is not fully_shard-ed; shard the blocks first");
    blocks.push_back(*sharded);
  }
  const auto n = static_cast<int64_t>(blocks.size());
  for (int64_t i = 0; i < n; ++i) {
    std::vector<fsdp::FSDPModule> ahead, behind;
    for (int64_t k = 1; k <= prefetch; ++k) {
      if (i + k < n) ahead.push_back(blocks[static_cast<size_t>(i + k)]);
      if (i - k >= 0) behind.push_back(blocks[static_cast<size_t>(i - k)]);
    }
    blocks[static_cast<size_t>(i)].set_modules_to_forward_prefetch(ahead);
    blocks[static_cast<size_t>(i)].set_modules_to_backward_prefetch(behind);
  }
}

fsdp::CheckpointOptions checkpoint_options(const TrainConfig& c) {
  fsdp::CheckpointOptions options;
  if (c.ac == "selective" || c.ac == "torchtitan") options.save_ops = fsdp::selective_checkpoint_ops();
  options.save_every_other_mm = c.ac == "torchtitan";
  return options;
}

ModelConfig model_config(const TrainConfig& c) {
  ModelConfig mc;
  mc.vocab = c.vocab;
  mc.dim = c.dim;
  mc.layers = c.layers;
  mc.heads = c.heads;
  mc.kv_heads = c.kv_heads;
  mc.hidden = hidden_size(c);
  mc.max_seq_len = c.seq_len;
  return mc;
}

TrainingResult run_training(const TrainConfig& c, const std::shared_ptr<fsdp::collectives::World>& world) {
  const int rank = world->rank(), world_size = world->size();
  const c10::Device device = rank_device(c, *world);
  // Ranks on one machine share its cores.
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(c.threads > 0 ? c.threads : std::max<int64_t>(1, cores / world->local_size())));

  const Corpus corpus = value_or_throw(load_corpus(c.data_path, c.seq_len + 2));
  const BatchSampler sampler(corpus.bytes, c.global_batch, c.seq_len, c.seed);

  const fsdp::DeviceMesh mesh = make_mesh(c, world, device);
  // A CPU group over all ranks for the metrics (loss, memory, timings).
  const std::shared_ptr<Communicator> metrics = world->new_group(world->all_ranks(), c10::kCPU);

  const ModelConfig mc = model_config(c);
  const int64_t params = parameter_count(mc);
  ShardedModel sharded = build_model(c, mc, mesh, device);
  const std::shared_ptr<Transformer>& model = sharded.model;
  std::optional<fsdp::FSDPModule>& root = sharded.root;

  // The optimizer comes after fully_shard: it must see the sharded parameters.
  torch::optim::AdamW optim(model->parameters(),
                            torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(c.weight_decay));
  int64_t local_params = 0;
  for (const auto& p : model->parameters()) local_params += p.numel();

  if (rank == 0) print_header(c, mesh, corpus, mc, params, local_params, world_size);

  // Checkpoints: a resumed run continues after the step it was saved at;
  // the batches and the schedule depend on the step alone, so it trains as
  // the uninterrupted run would.
  int64_t first_step = 1;
  TrainingProgress resumed;
  if (c.resume) resumed = resume_from_latest(c.save_dir, *model, optim, metrics);
  if (resumed.step > 0) {
    first_step = resumed.step + 1;
  } else if (!c.init_from.empty()) {
    init_model_from(c.init_from, *model, metrics);
  }
  const int64_t last_step = c.stop_after > 0 ? c.stop_after : c.steps;
  const auto checkpoint_due = [&](int64_t step) {
    return !c.save_dir.empty() && (step == last_step || (c.save_every > 0 && step % c.save_every == 0));
  };
  const std::string mesh_text = mesh.to_string();
  // --async-save: the background writer's barriers need a group of their
  // own, made by every rank (collective) before the loop.
  std::unique_ptr<BackgroundCheckpointer> background;
  if (c.async_save) {
    background = std::make_unique<BackgroundCheckpointer>(c.save_dir, c.keep, metrics,
                                                          world->new_group(world->all_ranks(), c10::kCPU));
  }

  Progress progress(c.steps, c.log_every);
  std::vector<StepRecord> records;
  const double tokens_per_step = static_cast<double>(c.global_batch * c.seq_len);
  double step_seconds_total = 0;
  // --profile (profile.h): a Kineto trace of the steps of --profile-steps.
  const std::optional<fsdp::ProfilerOptions> profile = profiler_options(c, rank, device, first_step);
  std::optional<fsdp::Profiler> profiler;
  if (profile) profiler.emplace(*profile);
  for (int64_t step = first_step; step <= last_step; ++step) {
    const auto start = Clock::now();
    // This rank's rows of global batch `step`.
    const Batch batch = sampler.local_batch(step, rank, world_size);
    const double local_loss = train_step(c, step, batch, device, sharded, optim);
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    step_seconds_total += seconds;

    const StepRecord record = record_step(*metrics, step, local_loss, seconds, device, tokens_per_step);
    records.push_back(record);
    if (rank == 0) progress.update(record);
    if (profiler) profiler->step();
    if (checkpoint_due(step)) save_step(c, step, world_size, mesh_text, *model, optim, background.get(), metrics);
  }
  if (background) background->finish();
  if (rank == 0) progress.finish();
  if (profiler) profiler->stop();
  if (rank == 0 && profiler && !profiler->traces_written().empty()) {
    std::printf("  profile       %s\n", describe_profile(*profile, profiler->traces_written().front()).c_str());
  }
  if (!c.export_hf.empty()) export_model_hf(c.export_hf, *model, metrics);
  if (records.empty()) {
    if (rank == 0) {
      std::printf("nothing to train: the checkpoint is at step %lld of %lld\n", static_cast<long long>(resumed.step),
                  static_cast<long long>(last_step));
      std::fflush(stdout);
    }
    return {};
  }
  const TrainingResult result = training_result(records, root);
  report_run(c, mesh, device, records, result, root, *metrics, step_seconds_total);
  return result;
}

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// Step seconds (slowest rank) without the first step, a warm-up.
std::vector<double> timed_steps(const std::vector<StepRecord>& records) {
  std::vector<double> seconds;
  for (size_t i = records.size() > 1 ? 1 : 0; i < records.size(); ++i) seconds.push_back(records[i].seconds);
  return seconds;
}

}  // namespace

void compare_all_gather_dtypes(const TrainConfig& config, const std::shared_ptr<fsdp::collectives::World>& world) {
  TORCH_CHECK(config.all_gather_dtype == "int8", "compare_all_gather_dtypes: --all-gather-dtype must be int8");
  TrainConfig plain = config;
  plain.all_gather_dtype = "param";
  plain.compare_all_gather = false;
  plain.json_path.clear();
  TrainConfig int8 = config;
  int8.compare_all_gather = false;
  int8.json_path.clear();
  const int rank = world->rank();
  if (rank == 0) std::printf("== run 1 of 2: all-gather in the param dtype (%s)\n", config.param_dtype.c_str());
  const TrainingResult a = run_training(plain, world);
  if (rank == 0) std::printf("== run 2 of 2: int8 all-gather (blocks)\n");
  const TrainingResult b = run_training(int8, world);
  if (rank != 0 || a.records.empty() || a.records.size() != b.records.size()) return;
  double max_diff = 0;
  int64_t max_diff_step = 0;
  for (size_t i = 0; i < a.records.size(); ++i) {
    const double d = std::abs(a.records[i].loss - b.records[i].loss);
    if (d > max_diff) {
      max_diff = d;
      max_diff_step = a.records[i].step;
    }
  }
  const double ta = median(timed_steps(a.records)), tb = median(timed_steps(b.records));
  std::printf("all-gather comparison (%d rank%s, %s, %zu steps, param dtype %s)\n", world->size(),
              world->size() == 1 ? "" : "s", config.device.c_str(), a.records.size(), config.param_dtype.c_str());
  std::printf("  %-22s %18s %12s %11s\n", "all-gather", "bytes/step/rank", "step (med)", "final loss");
  std::printf("  %-22s %18s %10.3f s %11.4f\n", ("param (" + config.param_dtype + ")").c_str(),
              format_bytes(static_cast<int64_t>(a.all_gather_bytes_per_step)).c_str(), ta, a.records.back().loss);
  std::printf("  %-22s %18s %10.3f s %11.4f\n", "int8 (blocks)",
              format_bytes(static_cast<int64_t>(b.all_gather_bytes_per_step)).c_str(), tb, b.records.back().loss);
  std::printf("  ratio int8/param       %18.3f %12.3f\n",
              a.all_gather_bytes_per_step > 0 ? b.all_gather_bytes_per_step / a.all_gather_bytes_per_step : 0.0,
              ta > 0 ? tb / ta : 0.0);
  std::printf("  max |loss difference|  %.4f (step %lld); final loss difference %+.4f\n", max_diff,
              static_cast<long long>(max_diff_step), b.records.back().loss - a.records.back().loss);
  std::fflush(stdout);
}

}  // namespace fsdp_train
