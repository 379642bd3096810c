#include "fsdp_data/distributed_sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randperm.h>
#include <c10/util/Exception.h>

namespace fsdp::data {

namespace {

void check_ranks(const char* what, int64_t num_replicas, int64_t rank) {
  TORCH_CHECK(num_replicas >= 1, what, ": num_replicas must be >= 1 (got ", num_replicas,
              "); pass the number of data-parallel ranks (the world size)");
  TORCH_CHECK(rank >= 0 && rank < num_replicas, what, ": invalid rank ", rank, ", rank should be in the interval [0, ",
              num_replicas - 1, "] for num_replicas = ", num_replicas);
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
  check_ranks("DistributedSampler", num_replicas, rank);
  TORCH_CHECK(dataset_size >= 0, "DistributedSampler: dataset_size must be >= 0 (got ", dataset_size, ")");
  TORCH_CHECK(dataset_size > 0, "DistributedSampler: the dataset is empty, so none of the ", num_replicas,
              " ranks would get a sample; check the dataset (its path or its filter)");
  // PyTorch: with drop_last and a size that does not divide, ceil((N - n) / n)
  // samples per rank, which is floor(N / n); else ceil(N / n).
  num_samples_ = options.drop_last ? dataset_size / num_replicas : (dataset_size + num_replicas - 1) / num_replicas;
  TORCH_CHECK(num_samples_ > 0, "DistributedSampler: a dataset of ", dataset_size, " samples over ", num_replicas,
              " ranks with drop_last = true gives every rank 0 samples (rank ", rank,
              " would get nothing and compute a loss of nan); use at least ", num_replicas, " samples, at most ",
              dataset_size, " ranks, or drop_last = false (which pads by repeating samples)");
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order(dataset_size_);
  if (options_.shuffle) {
    // torch.Generator().manual_seed(seed + epoch); torch.randperm(N, generator=g).
    // manual_seed takes a negative seed modulo 2^64, as this unsigned sum
    // does (without signed overflow).
    const uint64_t seed = static_cast<uint64_t>(options_.seed) + static_cast<uint64_t>(epoch_);
    at::Generator gen = at::detail::createCPUGenerator(seed);
    const at::Tensor perm = at::randperm(dataset_size_, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    order.assign(p, p + dataset_size_);
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) order[i] = i;
  }
  // Padding (drop_last = false) appends order[0], order[1], ... (the list
  // repeated as often as needed); drop_last keeps the first total_size(). Either
  // way position i of the padded list is order[i % N]. Rank r takes positions
  // r, r + n, r + 2n, ... (indices[rank:total_size:num_replicas]).
  std::vector<int64_t> mine(num_samples_);
  for (int64_t k = 0; k < num_samples_; ++k) mine[k] = order[(rank_ + k * num_replicas_) % dataset_size_];
  return mine;
}

BatchSlice split_global_batch(int64_t global_batch, int64_t num_replicas, int64_t rank) {
  check_ranks("split_global_batch", num_replicas, rank);
  TORCH_CHECK(global_batch >= num_replicas, "split_global_batch: a global batch of ", global_batch, " rows over ",
              num_replicas, " data-parallel ranks leaves ranks ", global_batch < 0 ? 0 : global_batch, "..",
              num_replicas - 1,
              " without a row (a rank without rows computes a loss of nan); use a global batch of at least ",
              num_replicas, " rows (a multiple of ", num_replicas, ") or fewer ranks");
  TORCH_CHECK(global_batch % num_replicas == 0, "split_global_batch: a global batch of ", global_batch,
              " rows does not split evenly over ", num_replicas,
              " data-parallel ranks (unequal slices would weight the ranks' losses unequally); use a multiple of ",
              num_replicas, " rows (", global_batch / num_replicas * num_replicas, " or ",
              (global_batch / num_replicas + 1) * num_replicas, ") or a number of ranks that divides ", global_batch);
  const int64_t rows = global_batch / num_replicas;
  return {rank * rows, rows};
}

}  // namespace fsdp::data
