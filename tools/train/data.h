// The trainer's data: byte-level language modelling over a text corpus, with
// global batches that do not depend on the world size.
//
// Global batch `step` is a fixed function of (seed, step): a generator seeded
// from both picks `global_batch` start offsets into the corpus, and row i is
// corpus[offset_i, offset_i + seq_len] (inputs) shifted by one (targets).
// Data-parallel rank r of n takes rows [r * B/n, (r+1) * B/n), the
// torch.chunk slice (fsdp::data::split_global_batch, fsdp_data/
// distributed_sampler.h), so the union over ranks is the global batch
// whatever n is, and (with equal row counts) the mean of the ranks' mean
// losses is the global batch's mean loss. More ranks than rows, or rows that
// do not divide evenly, are an error (validate() in config.h reports it as a
// flag error before any rank starts).
//
//   auto corpus = fsdp_train::load_corpus("");          // the shipped corpus
//   fsdp_train::BatchSampler sampler(corpus->bytes, 16, 64, /*seed=*/0);
//   fsdp_train::Batch local = sampler.local_batch(step, rank, world_size);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace fsdp_train {

struct Corpus {
  at::Tensor bytes;    // uint8, 1-D, on CPU
  std::string source;  // the file it came from, or a description
};

// The corpus file baked in at build time (data/tiny_corpus.txt of the source tree).
std::string default_corpus_path();

// Loads `path` as bytes. An empty path means the default corpus, or, when
// that file is missing (an installed binary without the source tree), a
// generated one. Fails, naming --data, when `path` cannot be read or is too
// short for `min_bytes`.
absl::StatusOr<Corpus> load_corpus(const std::string& path, int64_t min_bytes = 2);

// A deterministic made-up English-like text of about `bytes` bytes, the
// fallback when no corpus file is found.
std::string generated_text(int64_t bytes);

struct Batch {
  at::Tensor inputs;   // int64 [rows, seq_len]
  at::Tensor targets;  // int64 [rows, seq_len]: inputs shifted by one
};

class BatchSampler {
 public:
  // REQUIRES: bytes.numel() > seq_len + 1 (load_corpus checks it).
  BatchSampler(at::Tensor bytes, int64_t global_batch, int64_t seq_len, int64_t seed);

  // The start offsets of the rows of global batch `step` (global_batch of them).
  std::vector<int64_t> offsets(int64_t step) const;

  // Rows [index's torch.chunk slice of `parts`] of global batch `step`, on CPU.
  // REQUIRES: global_batch divisible by parts, 0 <= index < parts; throws
  // c10::Error (from split_global_batch) otherwise.
  Batch local_batch(int64_t step, int64_t index, int64_t parts) const;

  int64_t global_batch() const { return global_batch_; }
  int64_t seq_len() const { return seq_len_; }

 private:
  at::Tensor bytes_;
  int64_t global_batch_;
  int64_t seq_len_;
  int64_t seed_;
};

}  // namespace fsdp_train
