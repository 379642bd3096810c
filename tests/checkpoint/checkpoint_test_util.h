// Shared helpers of the checkpoint tests: values computed from a formula
// (interop.py computes the same ones independently), a scratch directory
// the rank processes share, and error expectations.
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "device_mesh/dtensor.h"
#include "device_mesh/state_dict.h"
#include "fsdp_testing/distributed_test.h"
#include "fsdp_testing/expect_error.h"
#include "fsdp_testing/test_helpers.h"

// FSDP2CPP_EXPECT_THROW_WITH (fsdp_testing/expect_error.h), under the name
// these tests have always used.
#define CKPT_EXPECT_THROW_WITH(...) FSDP2CPP_EXPECT_THROW_WITH(__VA_ARGS__)

namespace ckpt_test {

// v[i] = ((7 i + 13 seed) mod 251 - 125) / 4 for floating dtypes (exact in
// f16/bf16/f32/f64), without the /4 for integers, (i + seed) mod 3 == 0 for
// bool. interop.py's `formula` is the same.
inline at::Tensor formula(const std::vector<int64_t>& shape, at::ScalarType dtype, int64_t seed) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  at::Tensor base = at::arange(numel, at::kLong);
  at::Tensor out;
  if (dtype == at::kBool) {
    out = base.add(seed).remainder(3).eq(0);
  } else {
    at::Tensor v = base.mul(7).add(13 * seed).remainder(251).sub(125);
    if (at::isFloatingType(dtype)) {
      out = v.to(at::kDouble).mul(0.25).to(dtype);
    } else {
      out = v.to(dtype);
    }
  }
  return out.reshape(shape);
}

struct Spec {
  std::string key;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  int64_t seed;
  bool dtensor;  // else a plain (replicated) tensor
};

// The state dict the distributed and interop tests save: uneven rows, fewer
// rows than ranks, a 0-dim and an empty tensor, a plain tensor, several
// dtypes. interop.py has the same table.
inline std::vector<Spec> specs() {
  return {
      {"embed.weight", {10, 3}, at::kFloat, 1, true}, {"layers.0.bias", {7}, at::kBFloat16, 2, true},
      {"layers.0.idx", {2, 5}, at::kLong, 3, true},   {"layers.1.weight", {9, 2, 2}, at::kHalf, 4, true},
      {"norm.weight", {5}, at::kFloat, 5, false},     {"scale", {}, at::kDouble, 6, false},
      {"empty", {0, 4}, at::kFloat, 7, true},
  };
}

inline fsdp::StateDict make_state(const fsdp::DeviceMesh& mesh, const std::vector<fsdp::Placement>& placements,
                                  int64_t seed_offset = 0, bool zeros = false) {
  fsdp::StateDict sd;
  for (const auto& s : specs()) {
    at::Tensor full = formula(s.shape, s.dtype, s.seed + seed_offset);
    if (zeros) full = at::zeros_like(full);
    if (s.dtensor) {
      // Clone so that no two keys share memory unless a test ties them.
      auto dt = fsdp::distribute_tensor(full, mesh, placements);
      sd.insert(s.key, fsdp::DTensor::from_local(dt.to_local().clone(), mesh, placements, s.shape));
    } else {
      sd.insert(s.key, full);
    }
  }
  return sd;
}

// Plain full tensors of zeros, for a single-process load.
inline fsdp::StateDict make_full_zeros() {
  fsdp::StateDict sd;
  for (const auto& s : specs()) sd.insert(s.key, at::zeros(s.shape, at::TensorOptions().dtype(s.dtype)));
  return sd;
}

// Checks every value of `sd` against the formula: a DTensor's local piece
// against the matching slice of the full reference.
inline void expect_state_equals_formula(const fsdp::StateDict& sd, int64_t seed_offset = 0) {
  for (const auto& s : specs()) {
    const fsdp::StateValue* v = sd.find(s.key);
    ASSERT_NE(v, nullptr) << s.key;
    at::Tensor expected = formula(s.shape, s.dtype, s.seed + seed_offset);
    const auto offset = v->local_offset();
    const at::Tensor& local = v->local();
    for (int64_t d = 0; d < local.dim(); ++d) expected = expected.narrow(d, offset[d], local.size(d));
    EXPECT_TRUE(local.equal(expected)) << "key " << s.key << "\nexpected " << expected << "\ngot " << local;
  }
}

// No std::filesystem in these tests: the torch wheel's libtorch.so exports its
// own copy and calls bind to it and crash (see testing/src/distributed_test.cc).
inline bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

inline void remove_tree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        ::remove(p);  // best effort: keep walking
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

// A directory the parent creates and the rank processes find through the
// environment (they inherit it), removed by the parent at the end.
class SharedDir {
 public:
  SharedDir() {
    if (fsdp::testing::is_rank_process()) {
      const char* p = std::getenv("FSDP2CPP_CKPT_TEST_DIR");
      path_ = p != nullptr ? p : "";
      return;
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdp2cpp-ckpt-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
    ::setenv("FSDP2CPP_CKPT_TEST_DIR", path_.c_str(), 1);
    owner_ = true;
  }
  ~SharedDir() {
    if (owner_ && !path_.empty() && std::getenv("FSDP2CPP_KEEP_TEST_DIR") == nullptr) remove_tree(path_);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  bool owner_ = false;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The message of the c10::Error `f` throws, without the backtrace, or
// "<no error>" (the testing layer's, for tests that pin an error's text).
using fsdp::testing::error_of;

}  // namespace ckpt_test
