// Full (unsharded) export and import in the Hugging Face layout.
//
//   DIR/model-00001-of-00003.safetensors
//   DIR/model-00002-of-00003.safetensors
//   DIR/model-00003-of-00003.safetensors
//   DIR/model.safetensors.index.json
//       {"metadata": {"total_size": <tensor bytes>}, "weight_map": {"<fqn>": "<file>", ...}}
//
// what transformers' save_pretrained writes and from_pretrained, safetensors'
// load_file and PyTorch's HuggingFaceStorageReader read.
//
//   // every rank (collective): the full tensors are gathered one at a time
//   // and rank 0 writes them.
//   fsdp::checkpoint::export_hf(model_sd, "/out/hf", world_group);
//   // every rank, at any world size: each reads only its rows, no communication.
//   fsdp::checkpoint::import_hf(model_sd, "/out/hf");
//
// Tied values (see sharded.h) are written once, under the first key, and
// recorded in each file's __metadata__["FSDP2CPP_TIED"]; the index lists
// only the written keys.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "checkpoint/sharded.h"
#include "collectives/communicator.h"
#include "device_mesh/state_dict.h"

namespace fsdp::checkpoint {

struct ExportOptions {
  // A new file starts when the next tensor would take the current one past
  // this many bytes of data (a single larger tensor gets a file of its own).
  int64_t max_shard_bytes = int64_t{5} << 30;
  bool fsync = true;
  // Extra __metadata__ strings for every file ("format": "pt" is always set).
  std::map<std::string, std::string> metadata;
};

// export_hf()
//
// Writes `state_dict` as full tensors to `dir` in the Hugging Face layout.
// Collective over `group` (all ranks of every DTensor's mesh, in practice the
// world): for each key in order, a DTensor is gathered with full_tensor()
// (every rank holds that one full tensor for a moment, never the whole
// model) and rank 0 of `group` writes it; a plain tensor is rank 0's. Rank 0
// plans each file's header from the global shapes and dtypes before writing,
// then streams the tensors; the index is written last; a barrier ends the
// call, so every rank returns once the export is complete.
// REQUIRES: `dir` exists on rank 0; every rank passes the same keys in the
// same order.
// Returns: rank 0's files (other ranks: none) and the seconds taken.
// Throws: c10::Error naming the key (Partial placements are gathered as
// full_tensor() does: reduced) or the file on I/O errors.
SaveResult export_hf(const StateDict& state_dict, const std::string& dir,
                     const std::shared_ptr<collectives::Communicator>& group, const ExportOptions& options = {});

// import_hf()
//
// Loads a Hugging Face layout directory (model.safetensors.index.json and its
// files, or a single model.safetensors) into `target` in place: each entry
// reads only its own rows (pread), with no communication. Same checks and
// errors as load_sharded(); file names in the index that are not plain names
// inside `dir` are refused before any file is opened.
// Throws: as load_sharded(), and when `dir` has neither an index nor
// model.safetensors.
LoadResult import_hf(StateDict& target, const std::string& dir, const LoadOptions& options = {});

// The name of file `index` (1-based) of `count`: model-00001-of-00003.safetensors.
std::string hf_file_name(int index, int count);

}  // namespace fsdp::checkpoint
