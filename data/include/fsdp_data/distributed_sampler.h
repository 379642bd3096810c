// Which samples of a dataset a data-parallel rank reads: the counterpart of
// PyTorch's torch.utils.data.DistributedSampler, and the split of one global
// batch into equal rank slices (target fsdp2cpp::data).
//
// DistributedSampler gives rank r of n the same indices, in the same order,
// as PyTorch's DistributedSampler(dataset, num_replicas=n, rank=r, shuffle,
// seed, drop_last) after set_epoch(epoch): the shuffle is torch.randperm with
// a CPU generator seeded with seed + epoch, padding repeats indices from the
// start of the (shuffled) list, drop_last drops its tail, and rank r takes
// every n-th index from position r. Every rank gets num_samples() indices,
// so the mean of the ranks' mean losses is the mean over all their samples.
// Ranks with the same (dataset size, num_replicas, seed, epoch, shuffle,
// drop_last) together read each sample once per epoch (plus the padding, or
// less the dropped tail). It yields indices; reading the samples is yours.
// A rank can build any other rank's sampler: nothing is communicated.
//
// A training loop over epochs (examples/downstream/main.cc):
//
//   fsdp::data::DistributedSamplerOptions sampling;
//   sampling.seed = 7;  // the same on every rank
//   fsdp::data::DistributedSampler sampler(dataset.size(0), world_size, rank, sampling);
//   ...
//   sampler.set_epoch(epoch);  // a new shuffle each epoch, as in PyTorch
//   const std::vector<int64_t> mine = sampler.indices();
//
// Under HSDP every rank of the world is a data-parallel rank (both mesh
// dims split the batch): num_replicas is the world size, rank the global
// rank.
//
// split_global_batch is for a loop that draws one global batch per step
// (the trainer's): rank r of n takes rows [r * B/n, (r+1) * B/n), the
// torch.chunk slice, so the global batch does not depend on n.
//
// Errors throw c10::Error (TORCH_CHECK) naming the dataset or batch size,
// the ranks and what to do. Thread safety: const methods may be called
// concurrently; set_epoch may not race with them.
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp::data {

// PyTorch's DistributedSampler arguments other than the dataset and ranks,
// with its defaults.
struct DistributedSamplerOptions {
  // Shuffle the indices (torch.randperm seeded with seed + epoch); false:
  // 0, 1, 2, ... in order.
  bool shuffle = true;
  // The same on every rank.
  int64_t seed = 0;
  // true: drop the tail so that the dataset divides evenly into ranks (each
  // rank gets dataset_size / num_replicas samples). false: pad, repeating
  // indices from the start, up to a multiple of num_replicas (each rank gets
  // ceil(dataset_size / num_replicas)).
  bool drop_last = false;
};

class DistributedSampler {
 public:
  // The sampler of data-parallel rank `rank` of `num_replicas` over the
  // indices [0, dataset_size). The epoch starts at 0.
  //
  // REQUIRES: num_replicas >= 1, 0 <= rank < num_replicas.
  // Throws c10::Error for those, for dataset_size < 0, and when a rank would
  // get no sample: an empty dataset, or drop_last with fewer samples than
  // ranks (PyTorch gives such ranks an empty list; a rank without data
  // computes a loss of nan or waits in a collective the others skip). The
  // message names the dataset size, the ranks and what to do.
  DistributedSampler(int64_t dataset_size, int64_t num_replicas, int64_t rank, DistributedSamplerOptions options = {});

  // Sets the epoch the next indices() shuffles for (PyTorch's set_epoch).
  // Call it at the start of each epoch with the same value on every rank;
  // without it every epoch has epoch 0's order.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch, num_samples() of them, each
  // in [0, dataset_size): list(iter(sampler)) in PyTorch.
  std::vector<int64_t> indices() const;

  // Indices per rank (len(sampler) in PyTorch), the same on every rank.
  int64_t num_samples() const { return num_samples_; }
  // num_samples() * num_replicas(): the dataset after padding or dropping.
  int64_t total_size() const { return num_samples_ * num_replicas_; }

  int64_t dataset_size() const { return dataset_size_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  DistributedSamplerOptions options_;
  int64_t num_samples_;
  int64_t epoch_ = 0;
};

// A rank's rows of a global batch: rows [begin, begin + rows).
struct BatchSlice {
  int64_t begin = 0;
  int64_t rows = 0;
};

// The rows of a `global_batch`-row batch that data-parallel rank `rank` of
// `num_replicas` takes: [rank * B/n, (rank+1) * B/n), the torch.chunk (and
// DTensor Shard(0)) slice. Equal slices keep the mean of the ranks' mean
// losses equal to the global batch's mean loss.
//
// REQUIRES: num_replicas >= 1, 0 <= rank < num_replicas.
// Throws c10::Error for those, when the batch has fewer rows than there are
// ranks (some ranks would get no row: a loss of nan), and when the rows do
// not divide evenly; the message names the batch size, the ranks and what
// to do.
BatchSlice split_global_batch(int64_t global_batch, int64_t num_replicas, int64_t rank);

}  // namespace fsdp::data
