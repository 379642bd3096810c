#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <set>
#include <utility>

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "io_util.h"

namespace fsdp::checkpoint {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so must the host be");

namespace {

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;
};

constexpr std::array<DtypeName, 15> kDtypeNames{{
    {c10::ScalarType::Bool, "BOOL"},
    {c10::ScalarType::Byte, "U8"},
    {c10::ScalarType::Char, "I8"},
    {c10::ScalarType::Short, "I16"},
    {c10::ScalarType::UInt16, "U16"},
    {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::UInt32, "U32"},
    {c10::ScalarType::Float, "F32"},
    {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Long, "I64"},
    {c10::ScalarType::UInt64, "U64"},
    {c10::ScalarType::Float8_e4m3fn, "F8_E4M3"},
    {c10::ScalarType::Float8_e5m2, "F8_E5M2"},
}};

// numel * itemsize, or -1 when it overflows int64.
int64_t checked_nbytes(const std::vector<int64_t>& shape, int64_t itemsize) {
  int64_t n = itemsize;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) return -1;
  }
  return n;
}

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& d : kDtypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, "checkpoint: dtype ", c10::toString(dtype),
              " has no safetensors name (supported: bool, uint8/16/32/64, int8/16/32/64, float16, bfloat16, float32, "
              "float64, float8_e4m3fn, float8_e5m2)");
}

std::optional<c10::ScalarType> safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypeNames) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

int64_t TensorInfo::numel() const { return checked_numel(shape); }

// --- reader ------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    file_size_ = other.file_size_;
    data_start_ = other.data_start_;
    metadata_ = std::move(other.metadata_);
    tensors_ = std::move(other.tensors_);
    by_name_ = std::move(other.by_name_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// The header's length from the first 8 bytes of the file, checked against
// the limit of the format and the file's size.
uint64_t read_header_length(int fd, int64_t file_size, const std::string& path) {
  unsigned char len_bytes[8];
  detail::pread_all(fd, len_bytes, 8, 0, path, "header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  TORCH_CHECK(header_len <= static_cast<uint64_t>(kMaxSafetensorsHeaderBytes), "checkpoint: '", path,
              "' declares a header of ", header_len, " bytes, more than the ", kMaxSafetensorsHeaderBytes,
              " a safetensors header may have; refusing to read it");
  TORCH_CHECK(static_cast<int64_t>(header_len) <= file_size - 8, "checkpoint: '", path, "' declares a header of ",
              header_len, " bytes, past the end of the file (", file_size, " bytes): truncated or not safetensors");
  return header_len;
}

nlohmann::json read_header(int fd, uint64_t header_len, const std::string& path) {
  std::string header(header_len, '\0');
  detail::pread_all(fd, header.data(), static_cast<int64_t>(header_len), 8, path, "header");
  TORCH_CHECK(!header.empty() && header[0] == '{', "checkpoint: the header of '", path,
              "' does not start with '{': not a safetensors file");
  nlohmann::json json = detail::parse_json_strict(header, "the header of '" + path + "'");
  TORCH_CHECK(json.is_object(), "checkpoint: the header of '", path, "' is not a JSON object");
  return json;
}

void read_metadata(const nlohmann::json& v, const std::string& path, std::map<std::string, std::string>& metadata) {
  TORCH_CHECK(v.is_object(), "checkpoint: '", path, "': __metadata__ is not an object of strings");
  for (auto m = v.begin(); m != v.end(); ++m) {
    TORCH_CHECK(m.value().is_string(), "checkpoint: '", path, "': __metadata__ key '", m.key(),
                "' is not a string (safetensors metadata maps strings to strings)");
    metadata[m.key()] = m.value().get<std::string>();
  }
}

std::vector<int64_t> read_shape(const nlohmann::json& v, const std::string& key, const std::string& path) {
  TORCH_CHECK(v.contains("shape") && v["shape"].is_array(), "checkpoint: '", path, "': key '", key,
              "' has no 'shape' array");
  std::vector<int64_t> shape;
  for (const auto& s : v["shape"]) {
    TORCH_CHECK(s.is_number_unsigned() || (s.is_number_integer() && s.get<int64_t>() >= 0), "checkpoint: '", path,
                "': key '", key, "' has a shape entry that is not a non-negative integer: ", s.dump());
    TORCH_CHECK(!s.is_number_unsigned() || s.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), "checkpoint: '", path,
                "': key '", key, "' has a shape entry past int64: ", s.dump());
    shape.push_back(s.get<int64_t>());
  }
  return shape;
}

// The header's entry for tensor `key`, checked on its own and against the
// `data_size` bytes after the header.
TensorInfo read_tensor_entry(const std::string& key, const nlohmann::json& v, int64_t data_size,
                             const std::string& path) {
  TORCH_CHECK(v.is_object(), "checkpoint: '", path, "': key '", key,
              "' is not an object with dtype/shape/data_offsets");
  for (auto field = v.begin(); field != v.end(); ++field) {
    TORCH_CHECK(field.key() == "dtype" || field.key() == "shape" || field.key() == "data_offsets", "checkpoint: '",
                path, "': key '", key, "' has an unknown field '", field.key(), "'");
  }
  TORCH_CHECK(v.contains("dtype") && v["dtype"].is_string(), "checkpoint: '", path, "': key '", key,
              "' has no string 'dtype'");
  const std::string dtype_name = v["dtype"].get<std::string>();
  const auto dtype = safetensors_dtype(dtype_name);
  TORCH_CHECK(dtype.has_value(), "checkpoint: '", path, "': key '", key, "' has the unknown dtype '", dtype_name, "'");
  TensorInfo info;
  info.name = key;
  info.dtype = *dtype;
  info.shape = read_shape(v, key, path);
  const int64_t nbytes = checked_nbytes(info.shape, c10::elementSize(*dtype));
  TORCH_CHECK(nbytes >= 0, "checkpoint: '", path, "': key '", key, "' has the shape ",
              detail::shape_to_string(info.shape), " whose byte size overflows int64; refusing it");
  TORCH_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
              "checkpoint: '", path, "': key '", key, "' has no 'data_offsets' pair [begin, end]");
  for (const auto& o : v["data_offsets"]) {
    TORCH_CHECK(o.is_number_integer() && (o.is_number_unsigned() || o.get<int64_t>() >= 0) &&
                    (!o.is_number_unsigned() || o.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)),
                "checkpoint: '", path, "': key '", key,
                "' has a data offset that is not a non-negative int64: ", o.dump());
  }
  info.data_begin = v["data_offsets"][0].get<int64_t>();
  info.data_end = v["data_offsets"][1].get<int64_t>();
  TORCH_CHECK(info.data_begin <= info.data_end, "checkpoint: '", path, "': key '", key, "' has data_offsets [",
              info.data_begin, ", ", info.data_end, "] with begin after end");
  TORCH_CHECK(info.data_end <= data_size, "checkpoint: '", path, "': key '", key, "' has data_offsets [",
              info.data_begin, ", ", info.data_end, "] past the end of the data (", data_size,
              " bytes after the header): the file is truncated or corrupt");
  TORCH_CHECK(info.data_end - info.data_begin == nbytes, "checkpoint: '", path, "': key '", key, "' has data_offsets [",
              info.data_begin, ", ", info.data_end, "] spanning ", info.data_end - info.data_begin,
              " bytes, but dtype ", dtype_name, " and shape ", detail::shape_to_string(info.shape), " need ", nbytes);
  return info;
}

// Sorts `tensors` by their data and checks that they cover the
// `data_size` bytes of data exactly, without holes or overlap.
void sort_and_check_coverage(std::vector<TensorInfo>& tensors, int64_t data_size, const std::string& path) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::make_pair(a.data_begin, a.data_end) < std::make_pair(b.data_begin, b.data_end);
  });
  int64_t covered = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : tensors) {
    TORCH_CHECK(t.data_begin >= covered, "checkpoint: '", path, "': the data of key '", t.name, "' [", t.data_begin,
                ", ", t.data_end, ") overlaps that of key '", prev ? prev->name : "", "' (ending at ", covered, ")");
    TORCH_CHECK(t.data_begin == covered, "checkpoint: '", path, "': a hole in the data: bytes [", covered, ", ",
                t.data_begin, ") before key '", t.name, "' belong to no tensor");
    covered = t.data_end;
    prev = &t;
  }
  TORCH_CHECK(covered == data_size, "checkpoint: '", path, "': the data section is ", data_size,
              " bytes but the tensors cover only ", covered, " (trailing bytes: corrupt or not safetensors)");
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = detail::open_or_throw(path, O_RDONLY, "safetensors file");
  struct stat st {};
  TORCH_CHECK(::fstat(f.fd_, &st) == 0, "checkpoint: cannot stat '", path, "'");
  TORCH_CHECK(S_ISREG(st.st_mode), "checkpoint: '", path, "' is not a regular file");
  f.file_size_ = st.st_size;
  TORCH_CHECK(f.file_size_ >= 8, "checkpoint: '", path, "' is ", f.file_size_,
              " bytes, shorter than the 8-byte header length of a safetensors file (truncated?)");
  const uint64_t header_len = read_header_length(f.fd_, f.file_size_, path);
  f.data_start_ = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = f.file_size_ - f.data_start_;
  const nlohmann::json json = read_header(f.fd_, header_len, path);
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      read_metadata(it.value(), path, f.metadata_);
    } else {
      f.tensors_.push_back(read_tensor_entry(it.key(), it.value(), data_size, path));
    }
  }
  sort_and_check_coverage(f.tensors_, data_size, path);
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.by_name_[f.tensors_[i].name] = i;
  return f;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const TensorInfo* t = find(name);
  TORCH_CHECK(t != nullptr, "checkpoint: '", path_, "' has no tensor '", name, "'");
  return *t;
}

void SafetensorsFile::pread_exact(void* dst, int64_t nbytes, int64_t file_offset, const std::string& key) const {
  detail::pread_all(fd_, dst, nbytes, file_offset, path_, key);
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const TensorInfo& t = info(name);
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  pread_exact(out.data_ptr(), t.nbytes(), data_start_ + t.data_begin, name);
  return out;
}

at::Tensor SafetensorsFile::read_rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const TensorInfo& t = info(name);
  TORCH_CHECK(!t.shape.empty(), "checkpoint: read_rows of '", name, "' in '", path_, "': a 0-dim tensor has no rows");
  std::vector<int64_t> shape = t.shape;
  shape[0] = row_count;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(t.dtype));
  read_rows_into(name, row_begin, out);
  return out;
}

void SafetensorsFile::read_rows_into(const std::string& name, int64_t row_begin, const at::Tensor& out) const {
  const TensorInfo& t = info(name);
  TORCH_CHECK(!t.shape.empty(), "checkpoint: reading rows of '", name, "' in '", path_,
              "': a 0-dim tensor has no rows");
  TORCH_CHECK(out.defined() && out.device().is_cpu() && out.is_contiguous() && out.scalar_type() == t.dtype,
              "checkpoint: reading rows of '", name, "' in '", path_, "' needs a contiguous CPU ",
              c10::toString(t.dtype), " tensor to read into");
  const int64_t rows = out.dim() == 0 ? -1 : out.size(0);
  std::vector<int64_t> expected = t.shape;
  expected[0] = rows;
  TORCH_CHECK(out.sizes().vec() == expected, "checkpoint: reading rows of '", name, "' in '", path_,
              "': the destination has shape ", out.sizes(), ", expected ", detail::shape_to_string(expected));
  TORCH_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= t.shape[0], "checkpoint: rows [", row_begin, ", ",
              row_begin + rows, ") of '", name, "' in '", path_, "' are outside its ", t.shape[0], " rows");
  const int64_t row_bytes = t.shape[0] == 0 ? 0 : t.nbytes() / t.shape[0];
  pread_exact(out.data_ptr(), rows * row_bytes, data_start_ + t.data_begin + row_begin * row_bytes, name);
}

// --- writer ------------------------------------------------------------------

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Entry> entries,
                                     std::map<std::string, std::string> metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  metadata["format"] = "pt";
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = std::move(meta);
  std::set<std::string> names;
  int64_t offset = 0;
  for (const auto& e : entries_) {
    TORCH_CHECK(!e.name.empty() && e.name != "__metadata__", "checkpoint: '", path_, "': the tensor name '", e.name,
                "' is reserved or empty");
    TORCH_CHECK(names.insert(e.name).second, "checkpoint: '", path_, "': the tensor '", e.name, "' is declared twice");
    for (int64_t s : e.shape) {
      TORCH_CHECK(s >= 0, "checkpoint: '", path_, "': tensor '", e.name, "' has a negative size in ",
                  detail::shape_to_string(e.shape));
    }
    const int64_t nbytes = checked_nbytes(e.shape, c10::elementSize(e.dtype));
    TORCH_CHECK(nbytes >= 0, "checkpoint: '", path_, "': tensor '", e.name, "' is too large");
    nlohmann::ordered_json t;
    t["dtype"] = safetensors_dtype_name(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + nbytes};
    header[e.name] = std::move(t);
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  fd_ = detail::open_or_throw(path_, O_WRONLY | O_CREAT | O_TRUNC, "safetensors file for writing");
  unsigned char len_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((len >> (8 * i)) & 0xff);
  try {
    write_bytes(len_bytes, 8);
    write_bytes(text.data(), text.size());
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(path_.c_str());
}

void SafetensorsWriter::write_bytes(const void* data, size_t nbytes) {
  detail::write_all(fd_, data, nbytes, path_);
  crc_ = detail::crc32_update(crc_, data, nbytes);
  written_ += static_cast<int64_t>(nbytes);
}

std::string SafetensorsWriter::next_name() const { return next_ < entries_.size() ? entries_[next_].name : ""; }

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  TORCH_CHECK(!finished_ && fd_ >= 0, "checkpoint: '", path_, "': write('", name, "') after finish()");
  TORCH_CHECK(next_ < entries_.size(), "checkpoint: '", path_, "': write('", name,
              "') but every declared tensor is already written");
  const Entry& e = entries_[next_];
  TORCH_CHECK(name == e.name, "checkpoint: '", path_, "': write('", name,
              "') out of order: the next declared tensor is '", e.name, "'");
  TORCH_CHECK(tensor.defined() && tensor.scalar_type() == e.dtype && tensor.sizes().vec() == e.shape, "checkpoint: '",
              path_, "': tensor '", name, "' was declared ", c10::toString(e.dtype), " ",
              detail::shape_to_string(e.shape), " but is ",
              tensor.defined() ? std::string(c10::toString(tensor.scalar_type())) : std::string("undefined"), " ",
              tensor.defined() ? detail::shape_to_string(tensor.sizes().vec()) : std::string());
  at::Tensor cpu = tensor.device().is_cpu() ? tensor.contiguous() : tensor.to(at::kCPU).contiguous();
  write_bytes(cpu.data_ptr(), cpu.nbytes());
  ++next_;
}

WrittenFile SafetensorsWriter::finish(bool fsync) {
  TORCH_CHECK(!finished_, "checkpoint: '", path_, "': finish() called twice");
  TORCH_CHECK(next_ == entries_.size(), "checkpoint: '", path_, "': finish() before tensor '", entries_[next_].name,
              "' (and ", entries_.size() - next_ - 1, " more) was written");
  if (fsync) detail::fsync_or_throw(fd_, path_);
  const int rc = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(rc == 0, "checkpoint: closing '", path_, "' failed: ", std::strerror(errno));
  finished_ = true;
  return WrittenFile{path_, written_, crc_};
}

WrittenFile save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata, bool fsync) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t.defined(), "checkpoint: save_safetensors('", path, "'): tensor '", name, "' is undefined");
    entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(entries), metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  return writer.finish(fsync);
}

}  // namespace fsdp::checkpoint
