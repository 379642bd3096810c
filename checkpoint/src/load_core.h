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

  // Opens and validates every file of `dir` (the index's files when `dir`
  // has model.safetensors.index.json, else every *.safetensors).
  static SavedIndex build(const std::string& dir);
};

LoadResult load_into(StateDict& target, const SavedIndex& index, const LoadOptions& options);

// The earlier key whose tensor is the same memory as `t`, if any.
std::optional<std::string> tied_to(const std::vector<std::pair<std::string, at::Tensor>>& earlier, const at::Tensor& t);

}  // namespace fsdp::checkpoint::detail
