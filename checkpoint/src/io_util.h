// Internals of the checkpoint layer: file I/O with errors that name the
// file, JSON parsing that refuses duplicate keys, and name checks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::checkpoint::detail {

// open(2) with O_CLOEXEC; throws naming `what` and the path.
int open_or_throw(const std::string& path, int flags, const char* what);
// Writes all of `nbytes` at the current position; throws naming the path.
void write_all(int fd, const void* data, size_t nbytes, const std::string& path);
// Reads exactly `nbytes` at `offset`; throws naming the path and `key`.
void pread_all(int fd, void* dst, int64_t nbytes, int64_t offset, const std::string& path, const std::string& key);
void fsync_or_throw(int fd, const std::string& path);
// fsyncs a directory (so a rename or a new entry in it is durable).
void fsync_dir(const std::string& dir);
// Writes `content` to `path` (truncating) and fsyncs it; returns its record
// parts through `size` and `crc`.
void write_text_file(const std::string& path, const std::string& content, bool fsync, int64_t* size = nullptr,
                     uint32_t* crc = nullptr);
std::string read_text_file(const std::string& path, int64_t max_bytes, const std::string& what);
// zlib crc32 of a whole file (streamed).
uint32_t crc32_of_file(const std::string& path, int64_t* size);
uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes);

// Parses `text` as JSON, throwing c10::Error naming `source` on a syntax
// error or on any object (at any depth) with a duplicate key.
nlohmann::json parse_json_strict(const std::string& text, const std::string& source);

// True when `name` is one plain file name: not empty, not "." or "..", no
// '/', '\\' or NUL.
bool is_plain_file_name(const std::string& name);
// True when `rel` is a relative path of plain names joined by '/'.
bool is_plain_relative_path(const std::string& rel);

std::string join_path(const std::string& dir, const std::string& name);
// Sorted names of the regular files in `dir` ending with `suffix`.
std::vector<std::string> list_files(const std::string& dir, const std::string& suffix);
bool is_directory(const std::string& path);
bool is_regular_file(const std::string& path);
// mkdir -p; throws naming the path.
void make_dirs(const std::string& path);
// rm -rf of a directory tree we created (no symlink following).
void remove_tree(const std::string& path);

std::string shape_to_string(const std::vector<int64_t>& shape);

}  // namespace fsdp::checkpoint::detail
