// Safetensors files: a validating reader and a streaming writer.
//
// The format (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data: each tensor row-major, little-endian, at [begin, end)
// relative to the end of the header. The data is covered exactly (no holes,
// no overlap, no trailing bytes); shape [] (a scalar) and empty tensors are
// allowed.
//
//   auto f = fsdp::checkpoint::SafetensorsFile::open("/ckpt/model.safetensors");
//   at::Tensor w = f.read("layers.0.weight");
//   at::Tensor rows = f.read_rows("embed.weight", 100, 20);   // rows [100, 120)
//
//   fsdp::checkpoint::SafetensorsWriter out("/tmp/x.safetensors",
//       {{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {}}});
//   out.write("a", a);
//   out.write("b", b);
//   fsdp::checkpoint::WrittenFile rec = out.finish();   // fsynced; size + crc32
//
// Files come from other people, so the reader validates the whole header
// before it allocates anything for the data: every violation throws
// c10::Error naming the file and, where there is one, the key.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace fsdp::checkpoint {

// The largest header a reader accepts (as the safetensors library does).
inline constexpr int64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// The safetensors name of `dtype` ("F32", "BF16", ...). Supported: BOOL U8 I8
// I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64 F8_E4M3 F8_E5M2. Throws for any
// other dtype (complex, quantized, ...).
std::string safetensors_dtype_name(c10::ScalarType dtype);
// The dtype of a safetensors name, or nullopt when unknown.
std::optional<c10::ScalarType> safetensors_dtype(const std::string& name);

// One tensor of a file, as its header describes it.
struct TensorInfo {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  // [begin, end) relative to the start of the data section.
  int64_t data_begin = 0;
  int64_t data_end = 0;
  int64_t numel() const;
  int64_t nbytes() const { return data_end - data_begin; }
};

// A file that the size, CRC32 and path of which a writer reports, for the
// manifest of a checkpoint directory. The CRC is zlib's crc32 (the
// polynomial of zip, PNG and Python's zlib.crc32) of the whole file.
struct WrittenFile {
  std::string path;
  int64_t size = 0;
  uint32_t crc32 = 0;
};

// An open safetensors file. Move-only; closes its descriptor on destruction.
// Reads use pread, so one SafetensorsFile may be read from several threads.
class SafetensorsFile {
 public:
  // Opens `path` and validates the header: the file holds at least 8 bytes;
  // the header length is at most kMaxSafetensorsHeaderBytes and within the
  // file; the header is a JSON object without duplicate keys; __metadata__
  // maps strings to strings; each tensor has a known dtype, a shape of
  // non-negative sizes whose byte size fits int64, and data_offsets whose
  // length equals that byte size; the tensors cover the data section exactly.
  // Throws c10::Error naming the file (and the key) otherwise.
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // The __metadata__ strings (empty when the header has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensors in the order of their data.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The tensor named `name`, or nullptr.
  const TensorInfo* find(const std::string& name) const;
  // The tensor named `name`; throws naming the file and the key when absent.
  const TensorInfo& info(const std::string& name) const;
  // Byte offset of the data section in the file (8 + header length).
  int64_t data_start() const { return data_start_; }
  int64_t file_size() const { return file_size_; }

  // Reads tensor `name` into a new CPU tensor.
  at::Tensor read(const std::string& name) const;
  // Reads rows [row_begin, row_begin + row_count) of tensor `name` (dim 0),
  // reading only those bytes. REQUIRES: the tensor has at least one dim and
  // the rows are within it.
  at::Tensor read_rows(const std::string& name, int64_t row_begin, int64_t row_count) const;
  // Reads rows [row_begin, row_begin + out.size(0)) of `name` into `out`.
  // REQUIRES: `out` is a contiguous CPU tensor of the file's dtype whose
  // shape is [rows, file shape[1:]...].
  void read_rows_into(const std::string& name, int64_t row_begin, const at::Tensor& out) const;

 private:
  SafetensorsFile() = default;
  void pread_exact(void* dst, int64_t nbytes, int64_t file_offset, const std::string& key) const;

  std::string path_;
  int fd_ = -1;
  int64_t file_size_ = 0;
  int64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
};

// Streams one safetensors file, one tensor at a time: the header is written
// from the declared entries at construction, then each tensor's bytes in
// declaration order, so only one tensor needs to be in memory at a time.
// `"format": "pt"` is always added to the metadata (transformers refuses
// files without it). The header is space-padded so the data starts at a
// multiple of 8.
//
// Not thread-safe. A writer destroyed before finish() deletes its partial
// file, so a half-written file never looks like a complete one.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
  };

  // Creates (truncates) `path` and writes the header. Throws on a duplicate
  // or empty name, the name "__metadata__", an unsupported dtype, a negative
  // size, or an I/O error (naming the file).
  SafetensorsWriter(std::string path, std::vector<Entry> entries, std::map<std::string, std::string> metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // Writes the next declared tensor. REQUIRES: `name` is the next entry and
  // `tensor` has its dtype and shape (any device, any strides: it is copied
  // to contiguous CPU memory when it is not already).
  void write(const std::string& name, const at::Tensor& tensor);
  // Name of the next entry to write; empty when all are written.
  std::string next_name() const;
  // Checks every entry was written, fsyncs (when `fsync`) and closes the
  // file. Returns its path, size and CRC32.
  WrittenFile finish(bool fsync = true);

 private:
  void write_bytes(const void* data, size_t nbytes);

  std::string path_;
  std::vector<Entry> entries_;
  size_t next_ = 0;
  int fd_ = -1;
  int64_t written_ = 0;
  uint32_t crc_ = 0;
  bool finished_ = false;
};

// Writes `tensors` (name, tensor) to `path` as one safetensors file.
WrittenFile save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                             const std::map<std::string, std::string>& metadata = {}, bool fsync = true);

}  // namespace fsdp::checkpoint
