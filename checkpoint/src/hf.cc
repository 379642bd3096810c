#include "checkpoint/hf.h"

#include <chrono>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "collectives/flight_recorder.h"
#include "io_util.h"
#include "load_core.h"

namespace fsdp::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::string hf_file_name(int index, int count) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", index, count);
  return buf;
}

namespace {

// Where export_hf puts each key: rank 0 plans the files from global shapes
// and dtypes; the other ranks only take part in the gathers, for every key
// in order.
struct HfPlan {
  struct Key {
    std::string key;
    int file = -1;  // -1: tied to an earlier key, not written
  };
  std::vector<Key> keys;
  std::vector<std::vector<SafetensorsWriter::Entry>> files;
  nlohmann::ordered_json tied = nlohmann::ordered_json::object();
  int64_t total_size = 0;
};

HfPlan plan_hf_files(const StateDict& state_dict, bool writer_rank, int64_t max_shard_bytes) {
  HfPlan plan;
  if (!writer_rank) {
    for (const auto& [key, value] : state_dict) plan.keys.push_back({key, -1});
    return plan;
  }
  std::vector<std::pair<std::string, at::Tensor>> seen;
  int64_t current_bytes = 0;
  for (const auto& [key, value] : state_dict) {
    TORCH_CHECK(value.local().defined(), "checkpoint: export_hf: key '", key, "' holds an undefined tensor");
    if (auto to = detail::tied_to(seen, value.local())) {
      plan.tied[key] = *to;
      plan.keys.push_back({key, -1});
      continue;
    }
    seen.emplace_back(key, value.local());
    const std::vector<int64_t> shape = value.global_shape();
    int64_t bytes = static_cast<int64_t>(c10::elementSize(value.dtype()));
    for (int64_t s : shape) bytes *= s;
    if (plan.files.empty() || (current_bytes > 0 && current_bytes + bytes > max_shard_bytes)) {
      plan.files.emplace_back();
      current_bytes = 0;
    }
    plan.files.back().push_back({key, value.dtype(), shape});
    current_bytes += bytes;
    plan.total_size += bytes;
    plan.keys.push_back({key, static_cast<int>(plan.files.size()) - 1});
  }
  return plan;
}

// Rank 0's end of an export: the last file (or an empty one for an empty
// state dict, still loadable), then the index.
void finish_hf_export(std::unique_ptr<SafetensorsWriter> writer, const std::string& dir,
                      const std::map<std::string, std::string>& metadata, int64_t total_size,
                      nlohmann::ordered_json weight_map, const ExportOptions& options, SaveResult& result) {
  if (writer) {
    result.files.push_back(writer->finish(options.fsync));
  } else {
    SafetensorsWriter empty(detail::join_path(dir, hf_file_name(1, 1)), {}, metadata);
    result.files.push_back(empty.finish(options.fsync));
  }
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total_size}};
  index["weight_map"] = std::move(weight_map);
  WrittenFile rec;
  rec.path = detail::join_path(dir, "model.safetensors.index.json");
  detail::write_text_file(rec.path, index.dump(2) + "\n", options.fsync, &rec.size, &rec.crc32);
  result.files.push_back(rec);
  if (options.fsync) detail::fsync_dir(dir);
  for (const auto& f : result.files) result.bytes += f.size;
}

}  // namespace

SaveResult export_hf(const StateDict& state_dict, const std::string& dir,
                     const std::shared_ptr<collectives::Communicator>& group, const ExportOptions& options) {
  const auto start = Clock::now();
  TORCH_CHECK(group != nullptr, "checkpoint: export_hf needs a communicator");
  TORCH_CHECK(options.max_shard_bytes > 0, "checkpoint: export_hf: max_shard_bytes must be positive, got ",
              options.max_shard_bytes);
  const bool writer_rank = group->rank() == 0;
  if (writer_rank) {
    TORCH_CHECK(detail::is_directory(dir), "checkpoint: export_hf: '", dir, "' is not a directory (create it first)");
  }
  const HfPlan plan = plan_hf_files(state_dict, writer_rank, options.max_shard_bytes);

  SaveResult result;
  std::map<std::string, std::string> metadata = options.metadata;
  if (!plan.tied.empty()) metadata[kTiedMetadataKey] = plan.tied.dump();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::unique_ptr<SafetensorsWriter> writer;
  int open_file = -1;
  const int file_count = static_cast<int>(plan.files.size());
  size_t i = 0;
  for (const auto& [key, value] : state_dict) {
    const HfPlan::Key& p = plan.keys[i++];
    // Gathered on every rank of the mesh, whatever rank 0 does with it.
    at::Tensor full = value.is_dtensor() ? value.dtensor().full_tensor() : value.local();
    if (!writer_rank || p.file < 0) continue;
    if (p.file != open_file) {
      if (writer) result.files.push_back(writer->finish(options.fsync));
      open_file = p.file;
      writer = std::make_unique<SafetensorsWriter>(detail::join_path(dir, hf_file_name(open_file + 1, file_count)),
                                                   plan.files[open_file], metadata);
    }
    writer->write(key, full);
    weight_map[key] = hf_file_name(open_file + 1, file_count);
  }
  if (writer_rank) {
    finish_hf_export(std::move(writer), dir, metadata, plan.total_size, std::move(weight_map), options, result);
  }
  {
    const collectives::CollectiveLabel label("checkpoint: export_hf commit");
    // Rank 0 writes the index meanwhile: bounded by the group's timeout.
    group->barrier().wait(group->timeout());
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

LoadResult import_hf(StateDict& target, const std::string& dir, const LoadOptions& options) {
  const auto start = Clock::now();
  TORCH_CHECK(detail::is_regular_file(detail::join_path(dir, "model.safetensors.index.json")) ||
                  detail::is_regular_file(detail::join_path(dir, "model.safetensors")),
              "checkpoint: import_hf: '", dir,
              "' has neither model.safetensors.index.json nor model.safetensors (for a sharded checkpoint use "
              "load_sharded)");
  const detail::SavedIndex index = detail::SavedIndex::build(dir);
  LoadResult result = detail::load_into(target, index, options);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace fsdp::checkpoint
