// A downstream program: TinyLM (tiny_lm.h) trained with fully_shard at any
// world size, FSDP or HSDP, and checked against the same model trained
// without sharding on the global batch. Exits 1 when they differ. Each rank
// reads its share of a small dataset through fsdp::data::DistributedSampler
// (PyTorch's DistributedSampler), a new shuffle each epoch.
//
//   tiny_lm_train --nproc 2                              2 local ranks, FSDP
//   tiny_lm_train --nproc 2 --profile prof               and a Kineto trace per rank
//   fsdprun --nproc 4 --mesh 2x2 -- tiny_lm_train        HSDP: 2 replicas x 2 shards
//   torchrun --nproc-per-node 4 --no-python tiny_lm_train
//
// Built by the fsdp2cpp build (examples/) and, as a separate project that
// finds the installed package (CMakeLists.txt here), by the install test.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tensor.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "collectives/world.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "fsdp2/profiler.h"
#include "fsdp_data/distributed_sampler.h"
#include "launch/launch.h"
#include "tiny_lm.h"

namespace {

constexpr int kEpochs = 2;
// 12 sequences of 9 tokens; each rank takes up to 3 of its samples a step.
constexpr int64_t kDatasetSize = 12, kBatchPerRank = 3, kSeq = 9;
constexpr double kTolerance = 1e-5;

// The dataset: the same on every rank.
at::Tensor make_dataset(int64_t vocab) {
  torch::manual_seed(1000);
  return at::randint(vocab, {kDatasetSize, kSeq});
}

// The rows of `dataset` at indices[begin, begin + rows).
at::Tensor rows_at(const at::Tensor& dataset, const std::vector<int64_t>& indices, int64_t begin, int64_t rows) {
  const std::vector<int64_t> picked(indices.begin() + begin, indices.begin() + begin + rows);
  return dataset.index_select(0, at::tensor(picked, at::kLong));
}

at::Tensor next_token_loss(tiny_lm::TinyLM& model, const at::Tensor& tokens) {
  const at::Tensor inputs = tokens.narrow(1, 0, kSeq - 1), targets = tokens.narrow(1, 1, kSeq - 1);
  const at::Tensor logits = fsdp::call_module(model, inputs);  // the root, through its hooks
  return at::cross_entropy_loss(logits.flatten(0, 1), targets.flatten());
}

}  // namespace

int main(int argc, char** argv) {
  if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;
  std::optional<std::string> profile_dir;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--profile" && i + 1 < argc) {
      profile_dir = argv[++i];
      continue;
    }
    std::fprintf(stderr, "usage: tiny_lm_train [--nproc N] [--profile DIR]\nunknown argument '%s'\n", argv[i]);
    return 2;
  }
  auto world = fsdp::collectives::World::from_env();
  const int rank = world->rank(), world_size = world->size();

  // FSDP2CPP_MESH=RxS (fsdprun --mesh RxS): HSDP, R replicas of S shards.
  const std::vector<int64_t> shape = fsdp::launch::mesh_shape_from_env(world_size);
  const fsdp::DeviceMesh mesh = shape.size() == 2
                                    ? fsdp::init_device_mesh(world, c10::kCPU, shape, {"replicate", "shard"})
                                    : fsdp::init_device_mesh(world, c10::kCPU, shape, {"shard"});

  const tiny_lm::Config config;
  torch::manual_seed(0);  // every rank builds the same full model
  auto model = std::make_shared<tiny_lm::TinyLM>(config);
  torch::manual_seed(0);
  auto reference = std::make_shared<tiny_lm::TinyLM>(config);  // never sharded

  fsdp::FullyShardOptions options;
  options.mesh = mesh;
  fsdp::fully_shard(model->stem, options);  // a Sequential is a module like any other
  for (auto& block : model->residuals) fsdp::fully_shard(block, options);
  // The root's group takes the rest: the embedding and norm, so the tied
  // output projection lives in the same group as the embedding it reuses.
  fsdp::FSDPModule root = fsdp::fully_shard(model, options);

  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  torch::optim::AdamW optim(model->parameters(), adamw);
  torch::optim::AdamW reference_optim(reference->parameters(), adamw);
  auto metrics = world->new_group(world->all_ranks(), c10::kCPU);

  // This rank's samples. Every rank is a data-parallel rank (both mesh dims
  // split the batch): num_replicas is the world size, rank the global rank.
  const at::Tensor dataset = make_dataset(config.vocab);
  fsdp::data::DistributedSamplerOptions sampling;
  sampling.seed = 7;  // the same on every rank
  fsdp::data::DistributedSampler sampler(dataset.size(0), world_size, rank, sampling);
  if (rank == 0) {
    std::printf("%lld samples over %d ranks: %lld per rank, up to %lld per step\n",
                static_cast<long long>(dataset.size(0)), world_size, static_cast<long long>(sampler.num_samples()),
                static_cast<long long>(kBatchPerRank));
  }

  // --profile DIR: each rank writes DIR/trace_rank<R>.json, a Kineto trace of
  // steps 1 and 2 with the FSDP phases labelled, for Perfetto or
  // chrome://tracing.
  std::optional<fsdp::Profiler> profiler;
  if (profile_dir) {
    fsdp::ProfilerOptions profiling;
    profiling.trace_dir = *profile_dir;
    profiling.rank = rank;
    profiling.schedule.wait = 0;
    profiling.schedule.warmup = 1;  // step 0 (and lazy initialization): the profiler starts up
    profiling.schedule.active = 2;  // steps 1 and 2: recorded
    profiler.emplace(profiling);
  }

  double worst = 0;
  int step = 0;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    sampler.set_epoch(epoch);  // a new shuffle each epoch, as in PyTorch
    const std::vector<int64_t> mine = sampler.indices();
    // The global batch of the unsharded reference: every rank's samples. A
    // sampler is a function of its arguments, so any rank can compute them.
    std::vector<int64_t> everyone;
    for (int64_t r = 0; r < world_size; ++r) {
      fsdp::data::DistributedSampler other(dataset.size(0), world_size, r, sampling);
      other.set_epoch(epoch);
      const std::vector<int64_t> theirs = other.indices();
      everyone.insert(everyone.end(), theirs.begin(), theirs.end());
    }
    // Every rank has num_samples() indices, so every rank takes the same
    // number of rows at each step and the mean of the ranks' losses is the
    // global batch's loss.
    for (int64_t begin = 0; begin < sampler.num_samples(); begin += kBatchPerRank, ++step) {
      const int64_t rows = std::min(kBatchPerRank, sampler.num_samples() - begin);
      at::Tensor loss = next_token_loss(*model, rows_at(dataset, mine, begin, rows));
      loss.backward();
      optim.step();
      optim.zero_grad();
      at::Tensor global_loss = loss.detach().clone();
      metrics->all_reduce(global_loss, fsdp::collectives::ReduceOp::avg()).wait();

      std::vector<int64_t> global_rows;
      for (int64_t r = 0; r < world_size; ++r) {
        const auto first = everyone.begin() + r * sampler.num_samples() + begin;
        global_rows.insert(global_rows.end(), first, first + rows);
      }
      at::Tensor expected = next_token_loss(*reference, rows_at(dataset, global_rows, 0, rows * world_size));
      expected.backward();
      reference_optim.step();
      reference_optim.zero_grad();

      const double got = global_loss.item<double>(), want = expected.item<double>();
      worst = std::max(worst, std::abs(got - want));
      if (rank == 0) std::printf("step %d loss %.6f unsharded %.6f\n", step, got, want);
      if (profiler) profiler->step();
    }
  }
  if (profiler) {
    profiler->stop();  // a run of 2 steps (4 ranks) writes step 1 alone
    for (const std::string& trace : profiler->traces_written()) std::printf("profile: %s\n", trace.c_str());
  }

  // A method other than forward reads the parameters directly: outside
  // forward they are this rank's shards, so gather them around the call.
  root.unshard();
  const at::Tensor norms = model->embedding_norms();
  root.reshard();
  const double norm_error = (norms - reference->embedding_norms()).abs().max().item<double>();
  if (rank == 0) std::printf("embedding norms: max |sharded - unsharded| = %.2e\n", norm_error);
  worst = std::max(worst, norm_error);
  if (rank == 0) {
    std::printf("%s: %d ranks, %s, max |loss - unsharded| = %.2e\n", worst <= kTolerance ? "OK" : "MISMATCH",
                world_size, mesh.to_string().c_str(), worst);
  }
  return worst <= kTolerance ? 0 : 1;
}
