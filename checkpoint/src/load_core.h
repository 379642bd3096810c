// Internals shared by the sharded and Hugging Face loaders: what a directory
// of safetensors files holds, and the in-place load of a StateDict from it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"

namespace fsdp::checkpoint::detail {

struct SavedPiece {
  size_t file;                  // index into SavedIndex::files
  std::vector<int64_t> offset;  // saved_offsets
  std::vector<int64_t> shape;   // the piece's shape in its file
};

struct SavedTensor {
  c10::ScalarType dtype;
  std::vector<int64_t> global_shape;  // max(offset + shape) over the pieces
  std::vector<SavedPiece> pieces;
};

struct SavedIndex {
  std::string dir;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, SavedTensor> tensors;
  std::vector<std::string> order;              // keys in first-seen order
  std::map<std::string, std::string> aliases;  // tied key -> saved key
  // The safetensors files a checkpoint manifest lists for `dir` (its own
  // manifest.json, or that of the checkpoint `dir` is a subdirectory of, as
  // ROOT/step-N/model), plain names; nullopt when no readable manifest lists
  // any. What a missing file is told by (missing_shard_file_hint).
  std::optional<std::vector<std::string>> manifest_files;
  std::string manifest_path;

  // Opens and validates every file of `dir` (the index's files when `dir`
  // has model.safetensors.index.json, else every *.safetensors).
  static SavedIndex build(const std::string& dir);
};

// `strict_option` is how the caller's user turns strictness off, named in
// the error for missing or unexpected keys (load_training_state's is
// TrainingStateLoadOptions::strict_tensors).
LoadResult load_into(StateDict& target, const SavedIndex& index, const LoadOptions& options,
                     const char* strict_option = "LoadOptions::strict");

// The earlier key whose tensor is the same memory as `t`, if any.
std::optional<std::string> tied_to(const std::vector<std::pair<std::string, at::Tensor>>& earlier, const at::Tensor& t);

}  // namespace fsdp::checkpoint::detail
