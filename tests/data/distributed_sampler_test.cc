// fsdp::data::DistributedSampler and split_global_batch: the same indices as
// PyTorch's DistributedSampler (the venv's torch prints them, for sizes that
// divide and do not, fewer samples than ranks, shuffle on and off, several
// seeds and epochs, drop_last on and off), what the ranks read together, and
// the errors.
#include "fsdp_data/distributed_sampler.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "fsdp_testing/test_helpers.h"

namespace {

using fsdp::data::BatchSlice;
using fsdp::data::DistributedSampler;
using fsdp::data::DistributedSamplerOptions;
using fsdp::data::split_global_batch;
using fsdp::testing::error_of;

struct Config {
  int64_t size, replicas, rank;
  bool shuffle;
  int64_t seed, epoch;
  bool drop_last;

  std::string line() const {
    std::ostringstream s;
    s << size << ' ' << replicas << ' ' << rank << ' ' << shuffle << ' ' << seed << ' ' << epoch << ' ' << drop_last;
    return s.str();
  }
  std::vector<int64_t> ours() const {
    DistributedSamplerOptions options;
    options.shuffle = shuffle;
    options.seed = seed;
    options.drop_last = drop_last;
    DistributedSampler sampler(size, replicas, rank, options);
    sampler.set_epoch(epoch);
    return sampler.indices();
  }
};

std::string indices_text(const std::vector<int64_t>& indices) {
  std::string out;
  for (int64_t i : indices) out += " " + std::to_string(i);
  return out;
}

// Runs the venv's Python on the configurations; returns its output lines.
std::vector<std::string> torch_indices(const std::vector<Config>& configs, std::string* error) {
  const std::string input = ::testing::TempDir() + "sampler_configs_" + std::to_string(::getpid()) + ".txt";
  {
    std::ofstream f(input);
    for (const Config& c : configs) f << c.line() << '\n';
  }
  const std::string cmd =
      std::string("'") + FSDP2CPP_TEST_PYTHON + "' '" + FSDP_DATA_TORCH_SAMPLER_PY + "' < '" + input + "' 2>&1";
  std::string output;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    *error = "popen failed: " + cmd;
    return {};
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  const int status = ::pclose(pipe);
  std::remove(input.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    *error = cmd + " failed:\n" + output;
    return {};
  }
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(DistributedSampler, IndicesEqualPyTorchsForEveryConfiguration) {
  if (std::string(FSDP2CPP_TEST_PYTHON).empty()) GTEST_SKIP() << "no Python with torch configured";
  std::vector<Config> configs;
  for (int64_t size : {1, 2, 5, 7, 8, 12, 13, 100, 1001}) {
    for (int64_t replicas : {1, 2, 3, 4, 8, 16}) {
      for (bool drop_last : {false, true}) {
        if (drop_last && size < replicas) continue;  // an error here (checked below), [] in PyTorch
        for (bool shuffle : {false, true}) {
          for (auto [seed, epoch] : {std::pair<int64_t, int64_t>{0, 0}, {0, 1}, {42, 3}, {-5, 2}}) {
            if (!shuffle && (seed != 0 || epoch != 0)) continue;  // the order ignores them
            for (int64_t rank = 0; rank < replicas; ++rank) {
              configs.push_back({size, replicas, rank, shuffle, seed, epoch, drop_last});
            }
          }
        }
      }
    }
  }
  // A dataset large enough for randperm's other algorithm, a large seed.
  configs.push_back({70000, 3, 2, true, 1234567, 9, false});
  configs.push_back({70000, 4, 1, true, int64_t{1} << 40, 0, true});
  // seed + epoch past INT64_MAX (PyTorch's Python ints take it modulo 2^64)
  // and a negative sum.
  configs.push_back({13, 2, 1, true, std::numeric_limits<int64_t>::max(), 3, false});
  configs.push_back({13, 2, 1, true, -9, 2, true});

  std::string error;
  const std::vector<std::string> lines = torch_indices(configs, &error);
  ASSERT_TRUE(error.empty()) << error;
  ASSERT_EQ(lines.size(), configs.size());
  int mismatches = 0;
  for (size_t i = 0; i < configs.size(); ++i) {
    const std::string ours = configs[i].line() + ":" + indices_text(configs[i].ours());
    if (ours != lines[i] && ++mismatches <= 5) {
      ADD_FAILURE() << "configuration (size replicas rank shuffle seed epoch drop_last) " << configs[i].line()
                    << "\n  PyTorch: " << lines[i].substr(0, 300) << "\n  ours:    " << ours.substr(0, 300);
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << configs.size() << " configurations";
}

// Together the ranks read every sample once per epoch; padding adds the
// first samples of the shuffled order again; every rank has the same count.
TEST(DistributedSampler, RanksCoverTheDatasetWithEqualCounts) {
  for (bool drop_last : {false, true}) {
    const int64_t size = 10, replicas = 4;
    std::vector<int64_t> all;
    for (int64_t rank = 0; rank < replicas; ++rank) {
      DistributedSamplerOptions options;
      options.drop_last = drop_last;
      options.seed = 3;
      DistributedSampler sampler(size, replicas, rank, options);
      sampler.set_epoch(5);
      const std::vector<int64_t> mine = sampler.indices();
      EXPECT_EQ(static_cast<int64_t>(mine.size()), sampler.num_samples());
      EXPECT_EQ(sampler.num_samples(), drop_last ? 2 : 3);
      EXPECT_EQ(sampler.total_size(), drop_last ? 8 : 12);
      all.insert(all.end(), mine.begin(), mine.end());
    }
    const std::set<int64_t> distinct(all.begin(), all.end());
    EXPECT_EQ(distinct.size(), drop_last ? 8u : 10u) << "drop_last " << drop_last;
    EXPECT_TRUE(std::all_of(all.begin(), all.end(), [](int64_t i) { return i >= 0 && i < 10; }));
  }
}

TEST(DistributedSampler, EpochAndSeedChangeTheOrderAndNothingElseDoes) {
  DistributedSamplerOptions options;
  options.seed = 1;
  DistributedSampler a(50, 2, 0, options), b(50, 2, 0, options);
  EXPECT_EQ(a.indices(), b.indices());
  EXPECT_EQ(a.indices(), a.indices());
  b.set_epoch(1);
  EXPECT_EQ(b.epoch(), 1);
  EXPECT_NE(a.indices(), b.indices());
  options.seed = 2;
  EXPECT_NE(DistributedSampler(50, 2, 0, options).indices(), a.indices());
  options.shuffle = false;
  DistributedSampler ordered(7, 3, 1, options);
  ordered.set_epoch(4);
  EXPECT_EQ(ordered.indices(), (std::vector<int64_t>{1, 4, 0}));  // 1, 4, then padding: position 7 is index 0
}

// Without drop_last, fewer samples than ranks is PyTorch's padding: every
// rank gets one (repeated) sample, never nothing.
TEST(DistributedSampler, FewerSamplesThanRanksIsPaddedWithoutDropLast) {
  DistributedSamplerOptions options;
  options.shuffle = false;
  for (int64_t rank = 0; rank < 8; ++rank) {
    EXPECT_EQ(DistributedSampler(3, 8, rank, options).indices(), (std::vector<int64_t>{rank % 3}));
  }
}

TEST(DistributedSampler, ARankThatWouldGetNothingIsAClearError) {
  DistributedSamplerOptions options;
  options.drop_last = true;
  const std::string message = error_of([&] { DistributedSampler(3, 4, 0, options); });
  EXPECT_NE(message.find("a dataset of 3 samples over 4 ranks with drop_last = true gives every rank 0 samples"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("use at least 4 samples, at most 3 ranks, or drop_last = false"), std::string::npos)
      << message;
  const std::string empty = error_of([] { DistributedSampler(0, 2, 1); });
  EXPECT_NE(empty.find("the dataset is empty, so none of the 2 ranks would get a sample"), std::string::npos) << empty;
}

TEST(DistributedSampler, BadRanksAreErrors) {
  std::string m = error_of([] { DistributedSampler(10, 0, 0); });
  EXPECT_NE(m.find("num_replicas must be >= 1 (got 0)"), std::string::npos) << m;
  m = error_of([] { DistributedSampler(10, 4, 4); });
  EXPECT_NE(m.find("invalid rank 4, rank should be in the interval [0, 3]"), std::string::npos) << m;
  m = error_of([] { DistributedSampler(10, 4, -1); });
  EXPECT_NE(m.find("invalid rank -1"), std::string::npos) << m;
  m = error_of([] { DistributedSampler(-1, 4, 0); });
  EXPECT_NE(m.find("dataset_size must be >= 0 (got -1)"), std::string::npos) << m;
}

TEST(SplitGlobalBatch, RanksTakeConsecutiveEqualSlices) {
  for (int64_t replicas : {1, 2, 3, 6}) {
    int64_t next = 0;
    for (int64_t rank = 0; rank < replicas; ++rank) {
      const BatchSlice s = split_global_batch(12, replicas, rank);
      EXPECT_EQ(s.begin, next);
      EXPECT_EQ(s.rows, 12 / replicas);
      next += s.rows;
    }
    EXPECT_EQ(next, 12);
  }
}

TEST(SplitGlobalBatch, MoreRanksThanRowsIsAClearError) {
  const std::string m = error_of([] { split_global_batch(2, 4, 0); });
  EXPECT_NE(m.find("a global batch of 2 rows over 4 data-parallel ranks leaves ranks 2..3 without a row"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("use a global batch of at least 4 rows (a multiple of 4) or fewer ranks"), std::string::npos) << m;
}

TEST(SplitGlobalBatch, UnevenSplitsAndBadRanksAreErrors) {
  std::string m = error_of([] { split_global_batch(10, 4, 0); });
  EXPECT_NE(m.find("a global batch of 10 rows does not split evenly over 4 data-parallel ranks"), std::string::npos)
      << m;
  EXPECT_NE(m.find("use a multiple of 4 rows (8 or 12)"), std::string::npos) << m;
  m = error_of([] { split_global_batch(8, 0, 0); });
  EXPECT_NE(m.find("num_replicas must be >= 1"), std::string::npos) << m;
  m = error_of([] { split_global_batch(8, 2, 2); });
  EXPECT_NE(m.find("invalid rank 2"), std::string::npos) << m;
}

}  // namespace
