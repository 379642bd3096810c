// Single-process tests of the safetensors reader and writer: every dtype
// round trips bit-exactly, row reads, and every malformed file is refused
// with an error naming the file and the key.
#include "checkpoint/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/hf.h"
#include "checkpoint/sharded.h"
#include "checkpoint_test_util.h"

namespace {

using fsdp::checkpoint::SafetensorsFile;
using fsdp::checkpoint::SafetensorsWriter;

// A file made by hand: the 8-byte length, the header text, then `data`.
std::string raw_file(const std::string& header, const std::string& data, int64_t declared_len = -1) {
  const uint64_t len = declared_len >= 0 ? static_cast<uint64_t>(declared_len) : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + header + data;
}

bool bytes_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0);
}

TEST(CheckpointSafetensors, EveryDtypeRoundTripsBitExactIncludingScalarAndEmpty) {
  ckpt_test::SharedDir dir;
  const std::vector<at::ScalarType> dtypes = {
      at::kBool,   at::kByte,  at::kChar,   at::kShort, at::kUInt16, at::kHalf,          at::kBFloat16,   at::kInt,
      at::kUInt32, at::kFloat, at::kDouble, at::kLong,  at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    // Random bits (not values): NaN payloads and negative zeros must survive too.
    at::Tensor bits = at::randint(0, 256, {3, 5, static_cast<int64_t>(c10::elementSize(dtypes[i]))}, at::kByte);
    at::Tensor t = bits.view(dtypes[i]).reshape({3, 5});
    if (dtypes[i] == at::kBool) t = bits.select(2, 0).remainder(2).to(at::kBool);
    tensors.emplace_back("t." + std::string(c10::toString(dtypes[i])), t);
  }
  tensors.emplace_back("scalar", at::scalar_tensor(3.5, at::kDouble));
  tensors.emplace_back("empty", at::zeros({0, 7}, at::kFloat));
  tensors.emplace_back("noncontiguous", at::arange(12, at::kInt).reshape({3, 4}).t());
  const std::string path = dir / "all.safetensors";
  const auto rec = fsdp::checkpoint::save_safetensors(path, tensors, {{"hello", "world"}});

  auto f = SafetensorsFile::open(path);
  EXPECT_EQ(rec.size, f.file_size());
  EXPECT_EQ(f.data_start() % 8, 0);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("hello"), "world");
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    at::Tensor back = f.read(name);
    EXPECT_TRUE(bytes_equal(back, t.contiguous())) << name;
  }
  EXPECT_EQ(f.info("scalar").shape.size(), 0u);
  EXPECT_EQ(f.info("empty").nbytes(), 0);
}

TEST(CheckpointSafetensors, ReadRowsReadsThoseRows) {
  ckpt_test::SharedDir dir;
  at::Tensor t = ckpt_test::formula({9, 4}, at::kFloat, 3);
  fsdp::checkpoint::save_safetensors(dir / "r.safetensors", {{"w", t}});
  auto f = SafetensorsFile::open(dir / "r.safetensors");
  EXPECT_TRUE(f.read_rows("w", 2, 5).equal(t.narrow(0, 2, 5)));
  EXPECT_TRUE(f.read_rows("w", 9, 0).equal(t.narrow(0, 9, 0)));
  CKPT_EXPECT_THROW_WITH(f.read_rows("w", 7, 3), "rows [7, 10)", "'w'", "r.safetensors");
  CKPT_EXPECT_THROW_WITH(f.read("nope"), "no tensor 'nope'", "r.safetensors");
}

TEST(CheckpointSafetensors, WriterChecksOrderShapesAndRemovesAnUnfinishedFile) {
  ckpt_test::SharedDir dir;
  const std::string path = dir / "w.safetensors";
  {
    SafetensorsWriter w(path, {{"a", at::kFloat, {2}}, {"b", at::kLong, {3}}});
    CKPT_EXPECT_THROW_WITH(w.write("b", at::zeros({3}, at::kLong)), "out of order", "'a'");
    CKPT_EXPECT_THROW_WITH(w.write("a", at::zeros({3}, at::kFloat)), "'a'", "declared", "[2]", "[3]");
    w.write("a", at::zeros({2}, at::kFloat));
    CKPT_EXPECT_THROW_WITH(w.finish(), "before tensor 'b'");
  }
  EXPECT_FALSE(ckpt_test::path_exists(path)) << "a writer destroyed before finish() must remove its file";
  CKPT_EXPECT_THROW_WITH(SafetensorsWriter(path, {{"a", at::kFloat, {2}}, {"a", at::kFloat, {2}}}), "'a'", "twice");
  CKPT_EXPECT_THROW_WITH(SafetensorsWriter(path, {{"c", at::kComplexFloat, {2}}}), "ComplexFloat");
}

// --- malformed files ---------------------------------------------------------

class CheckpointBadFile : public ::testing::Test {
 protected:
  // Writes `bytes` to a file and expects open() to fail naming the file and
  // each fragment.
  template <typename... Fragments>
  void expect_refused(const std::string& bytes, Fragments... fragments) {
    const std::string path = dir_ / "bad.safetensors";
    ckpt_test::write_bytes(path, bytes);
    CKPT_EXPECT_THROW_WITH(SafetensorsFile::open(path), "bad.safetensors", fragments...);
  }
  ckpt_test::SharedDir dir_;
};

const std::string kGood = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

// A file of one tensor 'a' with 8 bytes of data, as its header declares it.
std::string file_of_a(const std::string& dtype, const std::string& shape) {
  return raw_file(R"({"a":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":[0,8]}})",
                  std::string(8, '\0'));
}

TEST_F(CheckpointBadFile, TheHandMadeGoodFileOpens) {
  // The baseline of the cases below: the same bytes, unbroken, are accepted.
  const std::string path = dir_ / "good.safetensors";
  float v[2] = {1.5f, -2.0f};
  ckpt_test::write_bytes(path, raw_file(kGood, std::string(reinterpret_cast<char*>(v), 8)));
  auto f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.read("a").equal(at::tensor({1.5f, -2.0f})));
}

TEST_F(CheckpointBadFile, ShorterThanTheLength) { expect_refused(std::string(5, '\0'), "5 bytes", "8-byte"); }

TEST_F(CheckpointBadFile, HeaderLengthPastTheEnd) {
  expect_refused(raw_file(kGood, std::string(8, '\0'), 500), "past the end");
}

TEST_F(CheckpointBadFile, HeaderOver100MBIsRefusedBeforeReading) {
  expect_refused(raw_file(kGood, std::string(8, '\0'), 200'000'000), "200000000", "100000000");
}

TEST_F(CheckpointBadFile, InvalidJson) { expect_refused(raw_file(R"({"a": {"dtype": )", ""), "not valid JSON"); }

TEST_F(CheckpointBadFile, NotAnObject) { expect_refused(raw_file("[1, 2, 3]", ""), "does not start with '{'"); }

TEST_F(CheckpointBadFile, DuplicateTensorKey) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_refused(raw_file(header, std::string(8, '\0')), "key 'a' twice");
}

TEST_F(CheckpointBadFile, DuplicateMetadataKey) {
  const std::string header =
      R"({"__metadata__":{"format":"pt","format":"np"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_refused(raw_file(header, std::string(8, '\0')), "key 'format' twice");
}

TEST_F(CheckpointBadFile, TruncatedData) {
  expect_refused(raw_file(kGood, std::string(6, '\0')), "key 'a'", "past the end of the data");
}

TEST_F(CheckpointBadFile, OverlappingOffsets) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  expect_refused(raw_file(header, std::string(12, '\0')), "key 'b'", "overlaps", "key 'a'");
}

TEST_F(CheckpointBadFile, HoleInTheData) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  expect_refused(raw_file(header, std::string(12, '\0')), "hole", "key 'b'");
}

TEST_F(CheckpointBadFile, TrailingBytes) { expect_refused(raw_file(kGood, std::string(12, '\0')), "trailing"); }

TEST_F(CheckpointBadFile, OffsetsDisagreeWithShape) { expect_refused(file_of_a("F32", "[3]"), "key 'a'", "need 12"); }

TEST_F(CheckpointBadFile, UnknownDtype) { expect_refused(file_of_a("F12", "[2]"), "key 'a'", "unknown dtype 'F12'"); }

TEST_F(CheckpointBadFile, ShapeWhoseByteSizeOverflows) {
  expect_refused(file_of_a("F64", "[4294967296,4294967296]"), "key 'a'", "overflows");
}

TEST_F(CheckpointBadFile, NegativeShape) { expect_refused(file_of_a("F32", "[-2]"), "key 'a'", "non-negative"); }

TEST_F(CheckpointBadFile, MetadataValueNotAString) {
  const std::string header = R"({"__metadata__":{"n":3},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_refused(raw_file(header, std::string(8, '\0')), "__metadata__ key 'n'");
}

TEST_F(CheckpointBadFile, IndexNamingAFileOutsideTheDirectoryIsRefusedBeforeOpening) {
  for (const std::string bad : {"../model.safetensors", "/etc/passwd", "sub/model.safetensors", ".."}) {
    const std::string index = R"({"metadata":{"total_size":8},"weight_map":{"a":")" + bad + R"("}})";
    ckpt_test::write_bytes(dir_ / "model.safetensors.index.json", index);
    fsdp::StateDict target;
    target.insert("a", at::zeros({2}));
    CKPT_EXPECT_THROW_WITH(fsdp::checkpoint::import_hf(target, dir_.path()), "key 'a'", bad.c_str(),
                           "not a plain file name");
  }
}

TEST_F(CheckpointBadFile, DuplicateKeyInTheIndex) {
  ckpt_test::write_bytes(dir_ / "model.safetensors.index.json",
                         R"({"weight_map":{"a":"x.safetensors","a":"y.safetensors"}})");
  fsdp::StateDict target;
  target.insert("a", at::zeros({2}));
  CKPT_EXPECT_THROW_WITH(fsdp::checkpoint::import_hf(target, dir_.path()), "model.safetensors.index.json",
                         "key 'a' twice");
}

// --- loading plain tensors from hand-made directories -------------------------

TEST(CheckpointLoad, StrictListsMissingAndUnexpectedKeysAndChecksShapeAndDtype) {
  ckpt_test::SharedDir dir;
  fsdp::checkpoint::save_safetensors(dir / "model.safetensors", {{"a", ckpt_test::formula({4, 2}, at::kFloat, 1)},
                                                                 {"b", ckpt_test::formula({3}, at::kLong, 2)}});
  {
    fsdp::StateDict t;
    t.insert("a", at::zeros({4, 2}));
    t.insert("c", at::zeros({1}));
    CKPT_EXPECT_THROW_WITH(fsdp::checkpoint::load_sharded(t, dir.path()), "missing keys", "'c'", "unexpected keys",
                           "'b'");
    EXPECT_TRUE(t.at("a").local().equal(at::zeros({4, 2}))) << "nothing may be loaded when the keys do not match";
    auto r = fsdp::checkpoint::load_sharded(t, dir.path(), {/*strict=*/false});
    EXPECT_EQ(r.missing_keys, std::vector<std::string>{"c"});
    EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"b"});
    EXPECT_TRUE(t.at("a").local().equal(ckpt_test::formula({4, 2}, at::kFloat, 1)));
  }
  {
    fsdp::StateDict t;
    t.insert("a", at::zeros({4, 3}));
    t.insert("b", at::zeros({3}, at::kLong));
    CKPT_EXPECT_THROW_WITH(fsdp::checkpoint::load_sharded(t, dir.path()), "key 'a'", "[4, 3]", "[4, 2]");
  }
  {
    fsdp::StateDict t;
    t.insert("a", at::zeros({4, 2}, at::kDouble));
    t.insert("b", at::zeros({3}, at::kLong));
    CKPT_EXPECT_THROW_WITH(fsdp::checkpoint::load_sharded(t, dir.path()), "key 'a'", "Double", "Float");
  }
}

TEST(CheckpointLoad, LoadsInPlaceKeepingTheTargetStorage) {
  ckpt_test::SharedDir dir;
  at::Tensor saved = ckpt_test::formula({6, 4}, at::kFloat, 9);
  fsdp::checkpoint::save_safetensors(dir / "model.safetensors", {{"w", saved}});
  // A target that is a non-contiguous view into a larger buffer (as a
  // parameter's shard may be): its memory is written, never replaced.
  at::Tensor buffer = at::zeros({4, 6});
  at::Tensor view = buffer.t();
  fsdp::StateDict t;
  t.insert("w", view);
  fsdp::checkpoint::import_hf(t, dir.path());
  EXPECT_TRUE(buffer.t().equal(saved));
  EXPECT_EQ(t.at("w").local().data_ptr(), buffer.data_ptr());
}

}  // namespace
