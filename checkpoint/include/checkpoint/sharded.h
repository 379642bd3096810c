// Sharded checkpoints: every rank writes the pieces it owns; a load at any
// world size or mesh reads back only the rows each rank needs.
//
// The layout is the one PyTorch's
// torch.distributed.checkpoint.HuggingFaceStorageWriter(save_distributed=True)
// writes and HuggingFaceStorageReader reads: rank r writes
//   shard-{r+1:05d}-model-00001-of-00001.safetensors
// holding its local piece of each tensor under the tensor's FQN, with
//   __metadata__["DCP_SHARDING_INFO"] = '{"<fqn>": {"saved_offsets": [row0, 0, ...]}, ...}'
//   __metadata__["DCP_VERSION"] = "1.0", __metadata__["format"] = "pt".
// A reader rebuilds each tensor's global shape as max(saved_offsets + shape)
// over all files of the directory.
//
//   // every rank, after the directory exists:
//   auto saved = fsdp::checkpoint::save_sharded(model_sd, dir + "/model", world->rank());
//   // later, at any world size, into state dicts whose local tensors share
//   // storage with live parameters:
//   fsdp::checkpoint::load_sharded(model_sd, dir + "/model");
//
// Which ranks write (so that each element is stored once):
//   - a DTensor piece is written by a rank whose coordinate is 0 on every
//     mesh dim where the DTensor is Replicate (under HSDP, replicate index
//     0); empty pieces are not written, except by the rank at coordinate 0 of
//     a tensor with no elements (so that its key exists);
//   - a plain tensor (replicated by definition) is written by global rank 0.
// A DTensor with a Partial placement is refused (reduce it first).
//
// Tied values: two keys whose local tensors are the same memory (same
// storage, offset, sizes and strides, non-empty) are written once, under the
// first key; __metadata__["FSDP2CPP_TIED"] = '{"<alias>": "<first key>"}'
// records the others. load_sharded resolves an alias to the key it names.
// PyTorch's reader does not know the alias: the alias key is absent there
// (as Hugging Face files omit tied weights); load with strict=False in
// Python and tie the weights, as transformers does.
//
// Keep other safetensors files (the optimizer's) in another directory: the
// reader takes every *.safetensors of the directory as part of one state
// dict, as PyTorch's does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "device_mesh/state_dict.h"

namespace fsdp::checkpoint {

// The metadata key that lists tied aliases ({alias: key}, JSON).
inline constexpr const char* kTiedMetadataKey = "FSDP2CPP_TIED";

struct SaveOptions {
  // fsync each file before returning (a checkpoint's durability depends on it).
  bool fsync = true;
};

// What a save wrote.
struct SaveResult {
  std::vector<WrittenFile> files;  // empty when this rank had nothing to write
  int64_t bytes = 0;               // bytes written by this rank, headers included
  double seconds = 0;
};

struct LoadOptions {
  // Missing keys (in the target, not saved) and unexpected keys (saved, not
  // in the target) are an error listing them; without strict they are
  // reported in LoadResult and skipped.
  bool strict = true;
};

struct LoadResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
  int64_t files = 0;       // files opened
  int64_t bytes_read = 0;  // tensor bytes read by this rank
  double seconds = 0;
};

// The file name rank `rank` writes: shard-{rank+1:05d}-model-00001-of-00001.safetensors.
std::string sharded_file_name(int rank);

// save_sharded()
//
// Writes this rank's pieces of `state_dict` to `dir`/sharded_file_name(rank),
// one tensor at a time (the local tensors are not copied unless they are not
// contiguous CPU memory). Not collective: no communication, so ranks may
// finish at different times; a caller that needs every file to exist
// synchronises afterwards (CheckpointWriter::commit does).
// REQUIRES: `dir` exists; `rank` is this process's global rank (checked
// against each DTensor's mesh).
// Throws: c10::Error naming the key for Partial placements or unsupported
// dtypes, and naming the file on I/O errors (the partial file is removed).
SaveResult save_sharded(const StateDict& state_dict, const std::string& dir, int rank, const SaveOptions& options = {});

// load_sharded()
//
// Loads `dir` into `target`, in place: for every target entry, the saved
// pieces that overlap the entry's region (its local_offset() and local()
// shape in the global tensor) are read with pread of just the overlapping
// rows and copied into target.local(), which keeps its storage (it may be a
// live parameter's shard). A target at another world size or mesh than the
// save overlaps several saved pieces; a plain tensor target reads the whole
// tensor. No communication.
//
// `dir` may hold any set of safetensors files: a sharded save (with
// DCP_SHARDING_INFO, ours or PyTorch's), a Hugging Face export (with
// model.safetensors.index.json, whose file names must be plain names in
// `dir`), or a single model.safetensors.
//
// Everything is validated before the first value is copied: every file's
// header, the keys (strict), each key's global shape and dtype against the
// target's, and that the saved pieces cover each target region exactly once.
// Throws: c10::Error naming the file and key for a bad file; listing the keys
// (strict) for missing/unexpected keys; naming the key and both shapes or
// dtypes for a mismatch; naming the key and region for rows no file holds.
LoadResult load_sharded(StateDict& target, const std::string& dir, const LoadOptions& options = {});

}  // namespace fsdp::checkpoint
