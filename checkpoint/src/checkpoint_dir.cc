#include "checkpoint/checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <utility>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "collectives/flight_recorder.h"
#include "io_util.h"

namespace fsdp::checkpoint {

namespace {

constexpr const char* kRecordsPrefix = ".records-rank-";
constexpr const char* kManifestFormat = "fsdp2cpp-checkpoint";

std::string crc_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%08x", crc);
  return buf;
}

// Files under `dir`, as '/'-separated paths relative to it, sorted.
void walk_files(const std::string& dir, const std::string& rel, std::vector<std::string>* out,
                std::vector<std::string>* dirs) {
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d != nullptr, "checkpoint: cannot list '", dir, "': ", std::strerror(errno));
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const std::string path = detail::join_path(dir, name);
    const std::string child_rel = rel.empty() ? name : rel + "/" + name;
    struct stat st {};
    TORCH_CHECK(::lstat(path.c_str(), &st) == 0, "checkpoint: cannot stat '", path, "'");
    if (S_ISDIR(st.st_mode)) {
      dirs->push_back(path);
      walk_files(path, child_rel, out, dirs);
    } else {
      TORCH_CHECK(S_ISREG(st.st_mode), "checkpoint: '", path,
                  "' is neither a file nor a directory; a checkpoint holds only files");
      out->push_back(child_rel);
    }
  }
}

bool parse_step(const std::string& name, const std::string& prefix, int64_t* step) {
  if (name.compare(0, prefix.size(), prefix) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) {
    return false;
  }
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    v = v * 10 + (name[i] - '0');
  }
  *step = v;
  return true;
}

std::vector<std::string> list_dir_names(const std::string& root) {
  std::vector<std::string> names;
  DIR* d = ::opendir(root.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  return names;
}

void wait_barrier(collectives::Communicator& group, std::chrono::milliseconds timeout, const char* what) {
  const std::string label = std::string("checkpoint: ") + what;
  const collectives::CollectiveLabel labelled(label);
  try {
    group.barrier().wait(timeout);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "checkpoint: ", what, ": a rank of ", group.name(),
                " did not arrive (it died or is stuck): ", e.what());
  }
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return "step-" + std::to_string(step); }
std::string checkpoint_temp_dir_name(int64_t step) { return ".tmp-step-" + std::to_string(step); }

CheckpointWriter::CheckpointWriter(std::string root, int64_t step, std::shared_ptr<collectives::Communicator> group,
                                   CheckpointWriterOptions options)
    : root_(std::move(root)), step_(step), group_(std::move(group)), options_(std::move(options)) {
  TORCH_CHECK(group_ != nullptr, "checkpoint: CheckpointWriter needs a communicator");
  TORCH_CHECK(step_ >= 0, "checkpoint: CheckpointWriter: step ", step_, " is negative");
  TORCH_CHECK(!root_.empty(), "checkpoint: CheckpointWriter: the root directory is empty");
  temp_dir_ = detail::join_path(root_, checkpoint_temp_dir_name(step_));
  final_dir_ = detail::join_path(root_, checkpoint_dir_name(step_));
  std::exception_ptr failure;
  if (group_->rank() == 0) {
    try {
      detail::make_dirs(root_);
      detail::remove_tree(temp_dir_);
      detail::make_dirs(temp_dir_);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  wait_barrier(*group_, options_.timeout, "starting a checkpoint");
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(detail::is_directory(temp_dir_), "checkpoint: rank 0 could not create '", temp_dir_,
              "' (see rank 0's error), or this rank does not see the same file system");
}

std::string CheckpointWriter::subdir(const std::string& name) const {
  TORCH_CHECK(detail::is_plain_relative_path(name), "checkpoint: subdir('", name,
              "'): not a relative path of plain names");
  std::string path = detail::join_path(temp_dir_, name);
  detail::make_dirs(path);
  return path;
}

void CheckpointWriter::record(const std::vector<WrittenFile>& files) {
  for (const auto& f : files) {
    TORCH_CHECK(f.path.compare(0, temp_dir_.size() + 1, temp_dir_ + "/") == 0, "checkpoint: record('", f.path,
                "'): the file is not inside the checkpoint being written (", temp_dir_, ")");
    records_.push_back(f);
  }
}

namespace {

bool is_records_file(const std::string& rel) {
  return rel.compare(0, std::strlen(kRecordsPrefix), kRecordsPrefix) == 0;
}

// This rank's records, as the small file in `temp_dir` that commit() hands
// to rank 0.
void write_records_file(const std::string& temp_dir, int rank, const std::vector<WrittenFile>& records, bool fsync) {
  nlohmann::json json = nlohmann::json::array();
  for (const auto& f : records) {
    json.push_back({{"path", f.path.substr(temp_dir.size() + 1)}, {"size", f.size}, {"crc32", f.crc32}});
  }
  char name[64];
  std::snprintf(name, sizeof(name), "%s%05d.json", kRecordsPrefix, rank);
  detail::write_text_file(detail::join_path(temp_dir, name), json.dump(), fsync);
}

// Every rank's records, by path relative to `temp_dir`; the records files
// among `files` are read and removed.
std::map<std::string, WrittenFile> take_records(const std::string& temp_dir, const std::vector<std::string>& files) {
  std::map<std::string, WrittenFile> known;
  for (const auto& rel : files) {
    if (!is_records_file(rel)) continue;
    const std::string path = detail::join_path(temp_dir, rel);
    const nlohmann::json recs =
        detail::parse_json_strict(detail::read_text_file(path, int64_t{1} << 30, "records"), "'" + path + "'");
    for (const auto& r : recs) {
      known[r.at("path").get<std::string>()] =
          WrittenFile{r.at("path").get<std::string>(), r.at("size").get<int64_t>(), r.at("crc32").get<uint32_t>()};
    }
    detail::remove_tree(path);
  }
  return known;
}

void fsync_file(const std::string& path) {
  const int fd = detail::open_or_throw(path, O_RDONLY, "file");
  try {
    detail::fsync_or_throw(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

// The manifest's "files": each file of `files` with its size and CRC32,
// from its writer's record, or read here (and fsynced) when none recorded it.
nlohmann::ordered_json manifest_file_entries(const std::string& temp_dir, const std::vector<std::string>& files,
                                             const std::map<std::string, WrittenFile>& known, bool fsync) {
  nlohmann::ordered_json listed = nlohmann::ordered_json::array();
  for (const auto& rel : files) {
    if (is_records_file(rel) || rel == kManifestFileName) continue;
    const std::string path = detail::join_path(temp_dir, rel);
    WrittenFile f;
    auto it = known.find(rel);
    struct stat st {};
    TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint: cannot stat '", path, "'");
    if (it != known.end()) {
      f = it->second;
      TORCH_CHECK(st.st_size == f.size, "checkpoint: '", path, "' is ", st.st_size, " bytes but its writer recorded ",
                  f.size);
    } else {
      f.crc32 = detail::crc32_of_file(path, &f.size);
      if (fsync) fsync_file(path);
    }
    listed.push_back({{"path", rel}, {"size", f.size}, {"crc32", crc_hex(f.crc32)}});
  }
  return listed;
}

// Renames `temp_dir` to `final_dir`. An older ROOT/step-N (a re-run of the
// same step) is moved aside first, as rename() does not replace a
// non-empty directory, and removed after.
void rename_into_place(const std::string& root, int64_t step, const std::string& temp_dir, const std::string& final_dir,
                       bool fsync) {
  const std::string old_dir = detail::join_path(root, ".old-" + checkpoint_dir_name(step));
  const bool had_old = detail::is_directory(final_dir);
  if (had_old) {
    detail::remove_tree(old_dir);
    TORCH_CHECK(::rename(final_dir.c_str(), old_dir.c_str()) == 0, "checkpoint: cannot move the older '", final_dir,
                "' aside: ", std::strerror(errno));
  }
  TORCH_CHECK(::rename(temp_dir.c_str(), final_dir.c_str()) == 0, "checkpoint: renaming '", temp_dir, "' to '",
              final_dir, "' failed: ", std::strerror(errno));
  if (fsync) detail::fsync_dir(root);
  if (had_old) detail::remove_tree(old_dir);
}

// Rank 0's part of commit(), once every rank's records are in `temp_dir`:
// lists the files, writes the manifest, renames the directory into place.
void publish(const std::string& root, int64_t step, int world_size, const CheckpointWriterOptions& options,
             const std::string& temp_dir, const std::string& final_dir, const std::string& extra_json) {
  std::vector<std::string> files;
  std::vector<std::string> dirs{temp_dir};
  walk_files(temp_dir, "", &files, &dirs);
  const std::map<std::string, WrittenFile> known = take_records(temp_dir, files);
  nlohmann::ordered_json manifest;
  manifest["format"] = kManifestFormat;
  manifest["version"] = 1;
  manifest["step"] = step;
  manifest["world_size"] = world_size;
  manifest["mesh"] = options.mesh;
  manifest["checksum"] = "crc32-zlib";
  manifest["files"] = manifest_file_entries(temp_dir, files, known, options.fsync);
  manifest["extra"] = nlohmann::ordered_json::parse(extra_json);
  detail::write_text_file(detail::join_path(temp_dir, kManifestFileName), manifest.dump(2) + "\n", options.fsync);
  if (options.fsync) {
    for (auto d = dirs.rbegin(); d != dirs.rend(); ++d) detail::fsync_dir(*d);
  }
  rename_into_place(root, step, temp_dir, final_dir, options.fsync);
}

}  // namespace

std::string CheckpointWriter::commit(const std::string& extra_json) {
  TORCH_CHECK(!committed_, "checkpoint: commit() of '", final_dir_, "' called twice");
  const nlohmann::json extra = detail::parse_json_strict(extra_json, "the extra JSON of the checkpoint manifest");
  TORCH_CHECK(extra.is_object(), "checkpoint: commit(): the extra JSON must be an object, got ", extra.type_name());

  const int rank = group_->rank();
  write_records_file(temp_dir_, rank, records_, options_.fsync);
  wait_barrier(*group_, options_.timeout, "committing a checkpoint");

  std::exception_ptr failure;
  if (rank == 0) {
    try {
      publish(root_, step_, group_->size(), options_, temp_dir_, final_dir_, extra.dump());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  wait_barrier(*group_, options_.timeout, "finishing a checkpoint");
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(
      !detail::is_directory(temp_dir_) && detail::is_regular_file(detail::join_path(final_dir_, kManifestFileName)),
      "checkpoint: rank 0 failed to commit '", final_dir_, "' (see rank 0's error)");
  committed_ = true;
  return final_dir_;
}

CheckpointManifest read_manifest(const std::string& dir) {
  const std::string path = detail::join_path(dir, kManifestFileName);
  TORCH_CHECK(detail::is_regular_file(path), "checkpoint: '", dir, "' has no ", kManifestFileName,
              ": it is not a complete checkpoint (a save that did not finish?)");
  const nlohmann::json m = detail::parse_json_strict(detail::read_text_file(path, int64_t{1} << 30, "manifest"),
                                                     "the manifest '" + path + "'");
  auto field = [&](const char* name) -> const nlohmann::json& {
    TORCH_CHECK(m.is_object() && m.contains(name), "checkpoint: the manifest '", path, "' has no '", name, "'");
    return m.at(name);
  };
  TORCH_CHECK(field("format").is_string() && field("format").get<std::string>() == kManifestFormat, "checkpoint: '",
              path, "' is not an fsdp2cpp checkpoint manifest (format ", field("format").dump(), ")");
  TORCH_CHECK(field("version").is_number_integer() && field("version").get<int64_t>() == 1, "checkpoint: '", path,
              "' has manifest version ", field("version").dump(), "; this build reads version 1");
  CheckpointManifest out;
  out.dir = dir;
  TORCH_CHECK(field("step").is_number_integer(), "checkpoint: '", path, "': 'step' is not an integer");
  out.step = field("step").get<int64_t>();
  TORCH_CHECK(field("world_size").is_number_integer(), "checkpoint: '", path, "': 'world_size' is not an integer");
  out.world_size = field("world_size").get<int64_t>();
  if (m.contains("mesh") && m.at("mesh").is_string()) out.mesh = m.at("mesh").get<std::string>();
  TORCH_CHECK(field("files").is_array(), "checkpoint: '", path, "': 'files' is not an array");
  for (const auto& f : field("files")) {
    TORCH_CHECK(f.is_object() && f.contains("path") && f.at("path").is_string() && f.contains("size") &&
                    f.at("size").is_number_integer() && f.contains("crc32") && f.at("crc32").is_string(),
                "checkpoint: '", path, "': a 'files' entry lacks path/size/crc32: ", f.dump());
    const std::string rel = f.at("path").get<std::string>();
    // Refused before anything is opened: a name must stay inside `dir`.
    TORCH_CHECK(detail::is_plain_relative_path(rel), "checkpoint: '", path, "' lists the file '", rel,
                "', which is not a relative path of plain names inside the checkpoint directory");
    const std::string hex = f.at("crc32").get<std::string>();
    TORCH_CHECK(hex.size() == 8 && hex.find_first_not_of("0123456789abcdef") == std::string::npos, "checkpoint: '",
                path, "': file '", rel, "' has a malformed crc32 '", hex, "'");
    out.files.push_back(
        WrittenFile{rel, f.at("size").get<int64_t>(), static_cast<uint32_t>(std::stoul(hex, nullptr, 16))});
  }
  out.extra_json = m.contains("extra") ? m.at("extra").dump() : "{}";
  return out;
}

CheckpointManifest verify_checkpoint(const std::string& dir) {
  CheckpointManifest manifest = read_manifest(dir);
  for (const auto& f : manifest.files) {
    const std::string path = detail::join_path(dir, f.path);
    TORCH_CHECK(detail::is_regular_file(path), "checkpoint: '", path, "' is listed in the manifest of '", dir,
                "' but missing");
    int64_t size = 0;
    const uint32_t crc = detail::crc32_of_file(path, &size);
    TORCH_CHECK(size == f.size, "checkpoint: '", path, "' is ", size, " bytes but the manifest says ", f.size,
                " (truncated or replaced)");
    TORCH_CHECK(crc == f.crc32, "checkpoint: checksum mismatch for '", path, "': crc32 ", crc_hex(crc),
                ", the manifest says ", crc_hex(f.crc32), " (the file is corrupt)");
  }
  return manifest;
}

std::vector<CheckpointRef> list_checkpoints(const std::string& root) {
  std::vector<CheckpointRef> out;
  for (const auto& name : list_dir_names(root)) {
    int64_t step = 0;
    if (!parse_step(name, "step-", &step)) continue;
    const std::string path = detail::join_path(root, name);
    if (!detail::is_directory(path) || !detail::is_regular_file(detail::join_path(path, kManifestFileName))) continue;
    out.push_back({path, step});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointRef> find_latest_checkpoint(const std::string& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::vector<std::string> prune_checkpoints(const std::string& root, int64_t keep) {
  TORCH_CHECK(keep >= 1, "checkpoint: prune_checkpoints(keep = ", keep, "): keep at least one checkpoint");
  std::vector<std::string> removed;
  const auto all = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
    detail::remove_tree(all[i].path);
    removed.push_back(all[i].path);
  }
  for (const auto& name : list_dir_names(root)) {
    int64_t step = 0;
    if (parse_step(name, ".tmp-step-", &step) || parse_step(name, ".old-step-", &step)) {
      const std::string path = detail::join_path(root, name);
      detail::remove_tree(path);
      removed.push_back(path);
    }
  }
  return removed;
}

}  // namespace fsdp::checkpoint
