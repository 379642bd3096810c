#include "io_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>

#include <c10/util/Exception.h>

namespace fsdp::checkpoint::detail {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

int open_or_throw(const std::string& path, int flags, const char* what) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open ", what, " '", path, "': ", errno_text());
  return fd;
}

void write_all(int fd, const void* data, size_t nbytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    // Linux writes at most ~2 GiB per call.
    const size_t chunk = std::min<size_t>(nbytes, size_t{1} << 30);
    const ssize_t n = ::write(fd, p, chunk);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "checkpoint: writing '", path, "' failed: ", n < 0 ? errno_text() : "no progress",
                " (is the disk full?)");
    p += n;
    nbytes -= static_cast<size_t>(n);
  }
}

void pread_all(int fd, void* dst, int64_t nbytes, int64_t offset, const std::string& path, const std::string& key) {
  char* p = static_cast<char*>(dst);
  while (nbytes > 0) {
    const size_t chunk = std::min<int64_t>(nbytes, int64_t{1} << 30);
    const ssize_t n = ::pread(fd, p, chunk, offset);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "checkpoint: reading '", path, "' (key '", key, "') at byte ", offset,
                " failed: ", errno_text());
    TORCH_CHECK(n > 0, "checkpoint: '", path, "' ended at byte ", offset, " while reading key '", key,
                "': the file was truncated after it was opened");
    p += n;
    nbytes -= n;
    offset += n;
  }
}

void fsync_or_throw(int fd, const std::string& path) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  TORCH_CHECK(rc == 0, "checkpoint: fsync of '", path, "' failed: ", errno_text());
}

void fsync_dir(const std::string& dir) {
  const int fd = open_or_throw(dir, O_RDONLY | O_DIRECTORY, "directory");
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  // Some file systems refuse fsync on directories; the rename is then as
  // durable as that file system makes it.
  TORCH_CHECK(rc == 0 || err == EINVAL || err == EROFS, "checkpoint: fsync of directory '", dir,
              "' failed: ", std::strerror(err));
}

uint32_t crc32_update(uint32_t crc, const void* data, size_t nbytes) {
  // zlib returns the initial value for a null buffer (an empty tensor's data).
  if (nbytes == 0) return crc;
  return static_cast<uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), nbytes));
}

void write_text_file(const std::string& path, const std::string& content, bool fsync, int64_t* size, uint32_t* crc) {
  const int fd = open_or_throw(path, O_WRONLY | O_CREAT | O_TRUNC, "file for writing");
  try {
    write_all(fd, content.data(), content.size(), path);
    if (fsync) fsync_or_throw(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  TORCH_CHECK(::close(fd) == 0, "checkpoint: closing '", path, "' failed: ", errno_text());
  if (size != nullptr) *size = static_cast<int64_t>(content.size());
  if (crc != nullptr) *crc = crc32_update(0, content.data(), content.size());
}

std::string read_text_file(const std::string& path, int64_t max_bytes, const std::string& what) {
  const int fd = open_or_throw(path, O_RDONLY, what.c_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    TORCH_CHECK(false, "checkpoint: cannot stat ", what, " '", path, "': ", errno_text());
  }
  if (st.st_size > max_bytes) {
    ::close(fd);
    TORCH_CHECK(false, "checkpoint: ", what, " '", path, "' is ", st.st_size, " bytes, more than the ", max_bytes,
                " accepted; it is not a file this library wrote");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  try {
    pread_all(fd, text.data(), st.st_size, 0, path, what);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

uint32_t crc32_of_file(const std::string& path, int64_t* size) {
  const int fd = open_or_throw(path, O_RDONLY, "file");
  std::vector<char> buf(size_t{4} << 20);
  uint32_t crc = 0;
  int64_t total = 0;
  while (true) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string err = errno_text();
      ::close(fd);
      TORCH_CHECK(false, "checkpoint: reading '", path, "' failed: ", err);
    }
    if (n == 0) break;
    crc = crc32_update(crc, buf.data(), static_cast<size_t>(n));
    total += n;
  }
  ::close(fd);
  if (size != nullptr) *size = total;
  return crc;
}

nlohmann::json parse_json_strict(const std::string& text, const std::string& source) {
  // nlohmann keeps the last of duplicate keys silently; a callback sees every
  // key, so track the keys of each open object.
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    switch (event) {
      case nlohmann::json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case nlohmann::json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case nlohmann::json::parse_event_t::key:
        if (!open_objects.empty() && duplicate.empty() && parsed.is_string() &&
            !open_objects.back().insert(parsed.get<std::string>()).second) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default: break;
    }
    return true;
  };
  nlohmann::json result;
  try {
    result = nlohmann::json::parse(text, callback);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "checkpoint: ", source, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK(duplicate.empty(), "checkpoint: ", source, " has the key '", duplicate,
              "' twice; refusing it (which one is meant is ambiguous)");
  return result;
}

bool is_plain_file_name(const std::string& name) {
  if (name.empty() || name == "." || name == "..") return false;
  return name.find_first_of(std::string("/\\\0", 3)) == std::string::npos;
}

bool is_plain_relative_path(const std::string& rel) {
  if (rel.empty()) return false;
  size_t begin = 0;
  while (true) {
    const size_t slash = rel.find('/', begin);
    const std::string part = rel.substr(begin, slash == std::string::npos ? std::string::npos : slash - begin);
    if (!is_plain_file_name(part)) return false;
    if (slash == std::string::npos) return true;
    begin = slash + 1;
  }
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::vector<std::string> list_files(const std::string& dir, const std::string& suffix) {
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d != nullptr, "checkpoint: cannot list directory '", dir, "': ", errno_text());
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    if (is_regular_file(join_path(dir, name))) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void make_dirs(const std::string& path) {
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    prefix = path.substr(0, pos);
    if (prefix.empty() || is_directory(prefix)) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "checkpoint: cannot create directory '", prefix, "': ", errno_text());
    }
  }
  TORCH_CHECK(is_directory(path), "checkpoint: '", path, "' exists and is not a directory");
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      std::vector<std::string> children;
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") children.push_back(name);
      }
      ::closedir(d);
      for (const auto& c : children) remove_tree(join_path(path, c));
    }
    TORCH_CHECK(::rmdir(path.c_str()) == 0 || errno == ENOENT, "checkpoint: cannot remove directory '", path,
                "': ", errno_text());
  } else {
    TORCH_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, "checkpoint: cannot remove '", path,
                "': ", errno_text());
  }
}

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

}  // namespace fsdp::checkpoint::detail
