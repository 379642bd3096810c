#include "checkpoint/sharded.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_dir.h"
#include "io_util.h"
#include "load_core.h"

namespace fsdp::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kShardingInfoKey = "DCP_SHARDING_INFO";
constexpr const char* kIndexFileName = "model.safetensors.index.json";

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::ostringstream out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i == 8) {
      out << ", ... (" << keys.size() - 8 << " more)";
      break;
    }
    out << (i ? ", " : "") << "'" << keys[i] << "'";
  }
  return out.str();
}

std::string base_name(const std::string& path) { return path.substr(path.find_last_of('/') + 1); }

// The files the manifest of a checkpoint lists for `dir` (see
// SavedIndex::manifest_files), and that manifest's path. A manifest that
// cannot be read is as none: it only sharpens an error message here.
std::optional<std::vector<std::string>> manifest_files_for(const std::string& dir, std::string* manifest_path) {
  std::string trimmed = dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const size_t slash = trimmed.find_last_of('/');
  const std::string parent = slash == std::string::npos ? "." : slash == 0 ? "/" : trimmed.substr(0, slash);
  const std::string sub = slash == std::string::npos ? trimmed : trimmed.substr(slash + 1);
  // (directory holding manifest.json, prefix of this directory's files in it)
  const std::pair<std::string, std::string> candidates[] = {{trimmed, ""}, {parent, sub + "/"}};
  for (const auto& [holder, prefix] : candidates) {
    if (!detail::is_regular_file(detail::join_path(holder, kManifestFileName))) continue;
    std::vector<std::string> files;
    try {
      for (const auto& f : read_manifest(holder).files) {
        if (f.path.rfind(prefix, 0) != 0) continue;
        const std::string name = f.path.substr(prefix.size());
        if (name.find('/') == std::string::npos && name.size() > 12 &&
            name.compare(name.size() - 12, 12, ".safetensors") == 0) {
          files.push_back(name);
        }
      }
    } catch (const std::exception&) {
      continue;
    }
    if (files.empty()) continue;
    *manifest_path = detail::join_path(holder, kManifestFileName);
    return files;
  }
  return std::nullopt;
}

// What a directory says about a missing file, for a load that found too few
// saved elements or keys. With a manifest (SavedIndex::manifest_files): the
// listed files that are not there, or nothing when all are (the model then
// differs from the one saved, and the shapes in the error say how). Without
// one, for DCP's sharded files (shard-NNNNN-model-00001-of-00001, one per
// writing rank, numbered from 1): the numbers missing below the highest one
// present, named exactly; else, when the saved global shape comes out too
// small, the file after the highest one (the files record no world size or
// global shape, so nothing tells a missing last file from a model saved with
// smaller sizes, and the hint says both). Empty for other layouts.
std::string missing_shard_file_hint(const detail::SavedIndex& index, bool saved_shape_too_small) {
  if (index.manifest_files.has_value()) {
    std::set<std::string> names;
    for (const auto& f : index.files) names.insert(base_name(f->path()));
    std::vector<std::string> absent;
    for (const auto& listed : *index.manifest_files) {
      if (names.count(listed) == 0) absent.push_back(listed);
    }
    if (absent.empty()) return "";
    return c10::str(": '", index.dir, "' lacks ", join_keys(absent), ", which ", index.manifest_path,
                    " lists; copy the whole checkpoint directory");
  }
  std::set<int> present;
  for (const auto& f : index.files) {
    const std::string name = base_name(f->path());
    const int number = name.size() > 11 ? static_cast<int>(std::strtol(name.substr(6, 5).c_str(), nullptr, 10)) : 0;
    if (number < 1 || name != sharded_file_name(number - 1)) return "";
    present.insert(number);
  }
  if (present.empty()) return "";
  const int highest = *present.rbegin();
  std::vector<std::string> gaps;
  for (int n = 1; n < highest; ++n) {
    if (present.count(n) == 0) gaps.push_back(sharded_file_name(n - 1));
  }
  if (!gaps.empty()) {
    return c10::str(": '", index.dir, "' lacks ", join_keys(gaps), " (its shard files go up to ",
                    sharded_file_name(highest - 1), "); copy the whole directory");
  }
  if (!saved_shape_too_small) return "";
  return c10::str(": '", index.dir, "' holds ", sharded_file_name(0), " to ", sharded_file_name(highest - 1),
                  " and no manifest lists its files, so either the model was saved with smaller sizes than the "
                  "target's or ",
                  sharded_file_name(highest),
                  " (the next writing rank's file, or more after it) is missing; build the model with the saved "
                  "sizes, or copy the whole directory");
}

}  // namespace

namespace detail {

std::optional<std::string> tied_to(const std::vector<std::pair<std::string, at::Tensor>>& earlier,
                                   const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || !t.has_storage()) return std::nullopt;
  for (const auto& [key, other] : earlier) {
    if (other.defined() && other.has_storage() && other.numel() > 0 && other.storage().is_alias_of(t.storage()) &&
        other.storage_offset() == t.storage_offset() && other.sizes() == t.sizes() && other.strides() == t.strides() &&
        other.scalar_type() == t.scalar_type()) {
      return key;
    }
  }
  return std::nullopt;
}

// --- the index of what a directory holds --------------------------------------

namespace {

// The files a load opens, and for a directory with
// model.safetensors.index.json the file its weight_map names for each key.
struct FilesToOpen {
  std::vector<std::string> names;
  bool has_index = false;
  std::map<std::string, std::string> weight_map;
};

FilesToOpen files_to_open(const std::string& dir) {
  FilesToOpen out;
  const std::string index_path = join_path(dir, kIndexFileName);
  out.has_index = is_regular_file(index_path);
  if (!out.has_index) {
    out.names = list_files(dir, ".safetensors");
    return out;
  }
  const nlohmann::json json =
      parse_json_strict(read_text_file(index_path, int64_t{1} << 30, "index file"), "the index '" + index_path + "'");
  TORCH_CHECK(json.is_object() && json.contains("weight_map") && json["weight_map"].is_object(),
              "checkpoint: the index '", index_path, "' has no 'weight_map' object");
  std::set<std::string> files;
  for (auto it = json["weight_map"].begin(); it != json["weight_map"].end(); ++it) {
    TORCH_CHECK(it.value().is_string(), "checkpoint: the index '", index_path, "' maps key '", it.key(),
                "' to something that is not a file name");
    const std::string file = it.value().get<std::string>();
    // Refused before anything is opened: a name must not reach outside `dir`.
    TORCH_CHECK(is_plain_file_name(file), "checkpoint: the index '", index_path, "' maps key '", it.key(), "' to '",
                file, "', which is not a plain file name inside the checkpoint directory");
    out.weight_map[it.key()] = file;
    files.insert(file);
  }
  out.names.assign(files.begin(), files.end());
  return out;
}

// The JSON object a file's __metadata__ holds as text under `key`, if any.
std::optional<nlohmann::json> metadata_object(const SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) return std::nullopt;
  nlohmann::json value =
      parse_json_strict(it->second, std::string("__metadata__[\"") + key + "\"] of '" + f.path() + "'");
  TORCH_CHECK(value.is_object(), "checkpoint: '", f.path(), "': ", key, " is not a JSON object");
  return value;
}

void add_tied_keys(const nlohmann::json& tied, const std::string& path, std::map<std::string, std::string>& aliases) {
  for (auto it = tied.begin(); it != tied.end(); ++it) {
    TORCH_CHECK(it.value().is_string(), "checkpoint: '", path, "': ", kTiedMetadataKey, " maps '", it.key(),
                "' to a non-string");
    const std::string to = it.value().get<std::string>();
    auto [pos, inserted] = aliases.emplace(it.key(), to);
    TORCH_CHECK(inserted || pos->second == to, "checkpoint: '", path, "': the tied key '", it.key(), "' names '", to,
                "' here but '", pos->second, "' in another file");
  }
}

// Where tensor `t` of a file sits in its global tensor: its saved_offsets
// in the file's DCP_SHARDING_INFO, or the origin for a file without one.
std::vector<int64_t> saved_offset(const std::optional<nlohmann::json>& sharding, const TensorInfo& t,
                                  const std::string& path) {
  std::vector<int64_t> offset(t.shape.size(), 0);
  if (!sharding.has_value()) return offset;
  TORCH_CHECK(sharding->contains(t.name) && (*sharding)[t.name].is_object() &&
                  (*sharding)[t.name].contains("saved_offsets") && (*sharding)[t.name]["saved_offsets"].is_array(),
              "checkpoint: '", path, "': key '", t.name, "' has no saved_offsets in ", kShardingInfoKey);
  const auto& offs = (*sharding)[t.name]["saved_offsets"];
  TORCH_CHECK(offs.size() == t.shape.size(), "checkpoint: '", path, "': key '", t.name, "' has ", offs.size(),
              " saved_offsets for a ", t.shape.size(), "-dim tensor");
  for (size_t d = 0; d < offs.size(); ++d) {
    TORCH_CHECK(
        offs[d].is_number_integer() && offs[d].get<int64_t>() >= 0 && offs[d].get<int64_t>() <= (int64_t{1} << 62),
        "checkpoint: '", path, "': key '", t.name, "' has a bad saved offset ", offs[d].dump());
    offset[d] = offs[d].get<int64_t>();
  }
  return offset;
}

// Adds tensor `t` of file `file_index`, saved at `offset`, as a piece of its key.
void add_piece(SavedIndex& index, size_t file_index, const TensorInfo& t, std::vector<int64_t> offset) {
  const std::string& path = index.files[file_index]->path();
  auto [it, inserted] = index.tensors.try_emplace(t.name);
  SavedTensor& saved = it->second;
  if (inserted) {
    saved.dtype = t.dtype;
    saved.global_shape.assign(t.shape.size(), 0);
    index.order.push_back(t.name);
  }
  TORCH_CHECK(saved.dtype == t.dtype && saved.global_shape.size() == t.shape.size(), "checkpoint: key '", t.name,
              "' is ", c10::toString(t.dtype), " with ", t.shape.size(), " dims in '", path, "' but ",
              c10::toString(saved.dtype), " with ", saved.global_shape.size(), " dims in '",
              index.files[saved.pieces.front().file]->path(), "'");
  for (size_t d = 0; d < t.shape.size(); ++d) {
    saved.global_shape[d] = std::max(saved.global_shape[d], offset[d] + t.shape[d]);
  }
  saved.pieces.push_back(SavedPiece{file_index, std::move(offset), t.shape});
}

// Opens file `name` of the directory and adds its tensors to `index`.
void add_file(SavedIndex& index, const FilesToOpen& files, const std::string& name) {
  const std::string path = join_path(index.dir, name);
  index.files.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(path)));
  const SafetensorsFile& f = *index.files.back();
  const size_t file_index = index.files.size() - 1;
  const std::optional<nlohmann::json> sharding = metadata_object(f, kShardingInfoKey);
  if (const auto tied = metadata_object(f, kTiedMetadataKey)) add_tied_keys(*tied, path, index.aliases);
  for (const auto& t : f.tensors()) {
    std::vector<int64_t> offset = saved_offset(sharding, t, path);
    if (files.has_index) {
      auto w = files.weight_map.find(t.name);
      if (w != files.weight_map.end() && w->second != name) continue;  // the index says another file holds it
    }
    add_piece(index, file_index, t, std::move(offset));
  }
}

// Pieces of one key must not overlap: each element has one saved value.
void check_pieces_disjoint(const SavedIndex& index) {
  for (const auto& [key, saved] : index.tensors) {
    for (size_t i = 0; i < saved.pieces.size(); ++i) {
      for (size_t j = i + 1; j < saved.pieces.size(); ++j) {
        const auto& a = saved.pieces[i];
        const auto& b = saved.pieces[j];
        bool overlap = numel_of(a.shape) > 0 && numel_of(b.shape) > 0;
        for (size_t d = 0; overlap && d < a.shape.size(); ++d) {
          overlap = std::max(a.offset[d], b.offset[d]) < std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
        }
        TORCH_CHECK(!overlap, "checkpoint: key '", key, "' is saved twice over the same elements: at offset ",
                    shape_to_string(a.offset), " in '", index.files[a.file]->path(), "' and at offset ",
                    shape_to_string(b.offset), " in '", index.files[b.file]->path(), "'");
      }
    }
  }
}

}  // namespace

SavedIndex SavedIndex::build(const std::string& dir) {
  TORCH_CHECK(is_directory(dir), "checkpoint: '", dir, "' is not a directory");
  SavedIndex index;
  index.dir = dir;
  const FilesToOpen files = files_to_open(dir);
  TORCH_CHECK(!files.names.empty(), "checkpoint: '", dir,
              "' holds no *.safetensors file (nor a model.safetensors.index.json): nothing to load");
  index.manifest_files = manifest_files_for(dir, &index.manifest_path);
  for (const auto& name : files.names) add_file(index, files, name);
  for (const auto& [key, file] : files.weight_map) {
    TORCH_CHECK(index.tensors.count(key) != 0, "checkpoint: the index of '", dir, "' maps key '", key, "' to '", file,
                "', which has no such tensor");
  }
  check_pieces_disjoint(index);
  return index;
}

namespace {

// A target key, its value and the saved key that holds its values (itself,
// or the key it is tied to).
struct PlannedLoad {
  std::string key;
  StateValue* value;
  const std::string* saved_key;
};

// Resolves each target key to the saved key holding its values; lists in
// `result` the target keys nothing was saved for and the saved keys no
// target key takes.
std::vector<PlannedLoad> plan_load(StateDict& target, const SavedIndex& index, LoadResult& result) {
  std::vector<PlannedLoad> plan;
  std::set<std::string> used;
  for (auto& [key, value] : target) {
    const std::string* saved_key = nullptr;
    if (auto it = index.tensors.find(key); it != index.tensors.end()) {
      saved_key = &it->first;
    } else if (auto a = index.aliases.find(key); a != index.aliases.end()) {
      if (auto it2 = index.tensors.find(a->second); it2 != index.tensors.end()) saved_key = &it2->first;
    }
    if (saved_key == nullptr) {
      result.missing_keys.push_back(key);
      continue;
    }
    used.insert(key);
    plan.push_back(PlannedLoad{key, &value, saved_key});
  }
  for (const auto& key : index.order) {
    if (used.count(key) == 0) result.unexpected_keys.push_back(key);
  }
  for (const auto& [alias, to] : index.aliases) {
    if (used.count(alias) == 0 && index.tensors.count(to) != 0) result.unexpected_keys.push_back(alias);
  }
  return plan;
}

void check_keys_match(const LoadResult& result, const SavedIndex& index, const char* strict_option) {
  TORCH_CHECK(
      result.missing_keys.empty() && result.unexpected_keys.empty(), "checkpoint: loading '", index.dir, "' (strict): ",
      result.missing_keys.empty() ? std::string()
                                  : "missing keys (in the target, not saved): " + join_keys(result.missing_keys),
      !result.missing_keys.empty() && !result.unexpected_keys.empty() ? "; " : "",
      result.unexpected_keys.empty()
          ? std::string()
          : "unexpected keys (saved, not in the target): " + join_keys(result.unexpected_keys),
      missing_shard_file_hint(index, !result.missing_keys.empty()), ". Set ", strict_option,
      " = false to load the keys both have.");
}

// The shape, the dtype and the coverage of one planned entry: the saved
// pieces must hold every element of this rank's region.
void check_loadable(const PlannedLoad& entry, const SavedIndex& index) {
  const StateValue& value = *entry.value;
  const std::string& key = entry.key;
  const SavedTensor& saved = index.tensors.at(*entry.saved_key);
  TORCH_CHECK(value.local().defined(), "checkpoint: target key '", key, "' holds an undefined tensor");
  const std::vector<int64_t> global = value.global_shape();
  if (global != saved.global_shape) {
    bool too_small = global.size() == saved.global_shape.size();
    for (size_t d = 0; too_small && d < global.size(); ++d) too_small = saved.global_shape[d] <= global[d];
    TORCH_CHECK(false, "checkpoint: key '", key, "' has the global shape ", shape_to_string(global),
                " in the target but ", shape_to_string(saved.global_shape), " in '", index.dir, "'",
                missing_shard_file_hint(index, too_small));
  }
  TORCH_CHECK(value.dtype() == saved.dtype, "checkpoint: key '", key, "' is ", c10::toString(value.dtype()),
              " in the target but ", c10::toString(saved.dtype), " in '", index.dir,
              "'; convert the checkpoint or the model first");
  const std::vector<int64_t> offset = value.local_offset();
  const std::vector<int64_t> shape = value.local().sizes().vec();
  int64_t covered = 0;
  for (const auto& piece : saved.pieces) {
    int64_t n = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t lo = std::max(offset[d], piece.offset[d]);
      const int64_t hi = std::min(offset[d] + shape[d], piece.offset[d] + piece.shape[d]);
      n *= std::max<int64_t>(0, hi - lo);
    }
    covered += n;
  }
  TORCH_CHECK(covered == numel_of(shape), "checkpoint: key '", key, "': the saved pieces in '", index.dir,
              "' hold only ", covered, " of the ", numel_of(shape), " elements of this rank's region (offset ",
              shape_to_string(offset), ", shape ", shape_to_string(shape), "): a file of the checkpoint is missing",
              missing_shard_file_hint(index, false));
}

// Copies the overlap of `piece` with this rank's region (`local` at
// `offset`) into `local`. Returns the bytes read.
int64_t copy_piece(const SafetensorsFile& file, const std::string& saved_key, const SavedPiece& piece,
                   const at::Tensor& local, const std::vector<int64_t>& offset) {
  const std::vector<int64_t> shape = local.sizes().vec();
  std::vector<int64_t> lo(shape.size());
  std::vector<int64_t> len(shape.size());
  bool empty = false;
  bool full_rows = true;  // the overlap spans whole rows of both piece and target
  for (size_t d = 0; d < shape.size(); ++d) {
    lo[d] = std::max(offset[d], piece.offset[d]);
    len[d] = std::min(offset[d] + shape[d], piece.offset[d] + piece.shape[d]) - lo[d];
    if (len[d] <= 0) empty = true;
    if (d > 0 && (len[d] != piece.shape[d] || len[d] != shape[d])) full_rows = false;
  }
  if (empty) return 0;
  at::Tensor dst = local.narrow(0, lo[0] - offset[0], len[0]);
  if (full_rows && local.device().is_cpu() && dst.is_contiguous()) {
    // The rows land where they belong: no staging copy.
    file.read_rows_into(saved_key, lo[0] - piece.offset[0], dst);
    return static_cast<int64_t>(dst.nbytes());
  }
  at::Tensor rows = file.read_rows(saved_key, lo[0] - piece.offset[0], len[0]);
  const auto bytes = static_cast<int64_t>(rows.nbytes());
  for (size_t d = 1; d < shape.size(); ++d) {
    rows = rows.narrow(static_cast<int64_t>(d), lo[d] - piece.offset[d], len[d]);
    dst = dst.narrow(static_cast<int64_t>(d), lo[d] - offset[d], len[d]);
  }
  dst.copy_(rows);
  return bytes;
}

// Fills the target value of `entry` from its saved pieces. Returns the
// bytes read.
int64_t load_entry(const PlannedLoad& entry, const SavedIndex& index) {
  const at::Tensor& local = entry.value->local();
  const std::string& saved_key = *entry.saved_key;
  const SavedTensor& saved = index.tensors.at(saved_key);
  if (local.dim() == 0) {
    at::Tensor v = index.files[saved.pieces.front().file]->read(saved_key);
    local.copy_(v);
    return static_cast<int64_t>(v.nbytes());
  }
  const std::vector<int64_t> offset = entry.value->local_offset();
  int64_t bytes = 0;
  for (const auto& piece : saved.pieces) bytes += copy_piece(*index.files[piece.file], saved_key, piece, local, offset);
  return bytes;
}

}  // namespace

LoadResult load_into(StateDict& target, const SavedIndex& index, const LoadOptions& options,
                     const char* strict_option) {
  const auto start = Clock::now();
  LoadResult result;
  result.files = static_cast<int64_t>(index.files.size());
  const std::vector<PlannedLoad> plan = plan_load(target, index, result);
  if (options.strict) check_keys_match(result, index, strict_option);
  // Every entry is checked before anything is copied.
  for (const auto& entry : plan) check_loadable(entry, index);
  for (const auto& entry : plan) result.bytes_read += load_entry(entry, index);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace detail

std::string sharded_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "shard-%05d-model-00001-of-00001.safetensors", rank + 1);
  return buf;
}

SaveResult save_sharded(const StateDict& state_dict, const std::string& dir, int rank, const SaveOptions& options) {
  const auto start = Clock::now();
  TORCH_CHECK(rank >= 0, "checkpoint: save_sharded: rank ", rank, " is negative");
  TORCH_CHECK(detail::is_directory(dir), "checkpoint: save_sharded: '", dir, "' is not a directory (create it first)");

  std::vector<SafetensorsWriter::Entry> entries;
  std::vector<at::Tensor> tensors;
  std::vector<std::pair<std::string, at::Tensor>> written;
  nlohmann::ordered_json sharding = nlohmann::ordered_json::object();
  nlohmann::ordered_json tied = nlohmann::ordered_json::object();
  for (const auto& [key, value] : state_dict) {
    const at::Tensor& local = value.local();
    TORCH_CHECK(local.defined(), "checkpoint: save_sharded: key '", key, "' holds an undefined tensor");
    bool writes;
    if (value.is_dtensor()) {
      const DTensor& dt = value.dtensor();
      TORCH_CHECK(dt.mesh().global_rank() == rank, "checkpoint: save_sharded: rank ", rank, " was passed but key '",
                  key, "' lives on a mesh where this process is global rank ", dt.mesh().global_rank());
      const std::vector<int64_t> coord = dt.mesh().coordinate();
      bool replicate_zero = true;
      bool all_zero = true;
      for (size_t d = 0; d < dt.placements().size(); ++d) {
        const Placement& p = dt.placements()[d];
        TORCH_CHECK(!p.is_partial(), "checkpoint: save_sharded: key '", key, "' has a Partial placement on mesh dim ",
                    d, "; its values are not final (redistribute it to Replicate or Shard first)");
        if (p.is_replicate() && coord[d] != 0) replicate_zero = false;
        if (coord[d] != 0) all_zero = false;
      }
      writes = replicate_zero && (local.numel() > 0 || (numel_of(dt.shape()) == 0 && all_zero));
    } else {
      writes = rank == 0;
    }
    if (!writes) continue;
    if (auto to = detail::tied_to(written, local)) {
      tied[key] = *to;
      continue;
    }
    written.emplace_back(key, local);
    entries.push_back({key, local.scalar_type(), local.sizes().vec()});
    tensors.push_back(local);
    sharding[key] = {{"saved_offsets", value.local_offset()}};
  }

  SaveResult result;
  if (!entries.empty()) {
    std::map<std::string, std::string> metadata{{kShardingInfoKey, sharding.dump()}, {"DCP_VERSION", "1.0"}};
    if (!tied.empty()) metadata[kTiedMetadataKey] = tied.dump();
    SafetensorsWriter writer(detail::join_path(dir, sharded_file_name(rank)), entries, std::move(metadata));
    for (size_t i = 0; i < entries.size(); ++i) writer.write(entries[i].name, tensors[i]);
    result.files.push_back(writer.finish(options.fsync));
    result.bytes = result.files.back().size;
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

LoadResult load_sharded(StateDict& target, const std::string& dir, const LoadOptions& options) {
  const auto start = Clock::now();
  const detail::SavedIndex index = detail::SavedIndex::build(dir);
  LoadResult result = detail::load_into(target, index, options);
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

}  // namespace fsdp::checkpoint
