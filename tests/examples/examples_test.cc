// The examples (examples/) run as a user runs them: fully_shard_basic and
// tiny_lm_train at 2 ranks through their own --nproc, tiny_lm_train as HSDP
// 2x2 through fsdprun. Each is checked on what it computes: the loss goes
// down; the sharded run matches unsharded training; tiny_lm_train --profile
// writes each rank's trace with its steps and FSDP phases.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "run_program.h"

namespace {

using fsdp_launch_test::describe;
using fsdp_launch_test::lines_of_rank;
using fsdp_launch_test::run;
using fsdp_launch_test::RunResult;

// The losses rank `rank` printed ("step K loss X"), in order.
std::vector<double> losses_of(const RunResult& r, int rank) {
  std::vector<double> losses;
  const std::regex step("step ([0-9]+) loss ([-0-9.naif]+)( unsharded ([-0-9.]+))?");
  for (const auto& line : lines_of_rank(r.out, rank)) {
    std::smatch m;
    if (!std::regex_match(line, m, step)) continue;
    EXPECT_EQ(std::stoul(m[1]), losses.size()) << line;
    losses.push_back(std::strtod(m[2].str().c_str(), nullptr));
  }
  return losses;
}

TEST(Examples, FullyShardBasicTrainsAtTwoRanks) {
  const RunResult r = run({FULLY_SHARD_BASIC_BINARY, "--nproc", "2"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::vector<double> rank0 = losses_of(r, 0), rank1 = losses_of(r, 1);
  ASSERT_EQ(rank0.size(), 5u) << describe(r);
  ASSERT_EQ(rank1.size(), 5u) << describe(r);
  // Each rank fits its own batch: its loss falls, and the ranks' batches
  // (so their losses) differ.
  EXPECT_LT(rank0.back(), rank0.front() * 0.99) << describe(r);
  EXPECT_LT(rank1.back(), rank1.front() * 0.99) << describe(r);
  EXPECT_NE(rank0.front(), rank1.front()) << describe(r);
}

// One run of tiny_lm_train: the sharded global loss against the unsharded
// model's on rank 0 at every step, and the verdict line. The steps: 2 epochs
// of ceil(12 / world_size) samples per rank (DistributedSampler), 3 a step.
void expect_matches_unsharded(const RunResult& r, int world_size, const std::string& mesh) {
  const int per_rank = (12 + world_size - 1) / world_size;
  const int expected_steps = 2 * ((per_rank + 2) / 3);
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  std::vector<std::string> lines = lines_of_rank(r.out, 0);
  const std::regex step("step ([0-9]) loss ([0-9.]+) unsharded ([0-9.]+)");
  int steps = 0;
  for (const auto& line : lines) {
    std::smatch m;
    if (!std::regex_match(line, m, step)) continue;
    ++steps;
    EXPECT_NEAR(std::stod(m[2]), std::stod(m[3]), 1e-5) << line;
  }
  EXPECT_EQ(steps, expected_steps) << describe(r);
  ASSERT_FALSE(lines.empty()) << describe(r);
  EXPECT_TRUE(std::regex_match(lines.back(), std::regex("OK: " + std::to_string(world_size) + " ranks, " + mesh +
                                                        ", max \\|loss - unsharded\\| = .*")))
      << describe(r);
}

TEST(Examples, TinyLmMatchesUnshardedTrainingAtTwoRanks) {
  expect_matches_unsharded(run({TINY_LM_TRAIN_BINARY, "--nproc", "2"}), 2,
                           "DeviceMesh\\(cpu, \\[0, 1\\], dim_names=\\[\"shard\"\\]\\)");
}

// 12 samples over 5 ranks: DistributedSampler pads to 15 (3 per rank), as
// PyTorch's does, and the unsharded reference trains on the same 15.
TEST(Examples, TinyLmMatchesUnshardedTrainingWhenTheDatasetDoesNotDivide) {
  const RunResult r = run({TINY_LM_TRAIN_BINARY, "--nproc", "5"});
  expect_matches_unsharded(r, 5, "DeviceMesh\\(cpu, \\[0, 1, 2, 3, 4\\], dim_names=\\[\"shard\"\\]\\)");
  const std::vector<std::string> lines = lines_of_rank(r.out, 0);
  ASSERT_FALSE(lines.empty()) << describe(r);
  EXPECT_EQ(lines.front(), "12 samples over 5 ranks: 3 per rank, up to 3 per step") << describe(r);
}

// How many complete ("X") events of each name the Chrome trace at `path` holds.
std::map<std::string, int> trace_events(const std::string& path) {
  std::map<std::string, int> out;
  std::ifstream in(path);
  if (!in.good()) return out;
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!trace.is_object() || !trace.contains("traceEvents")) return out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.contains("name") && e.value("ph", "") == "X") ++out[e.at("name").get<std::string>()];
  }
  return out;
}

// A user's program profiled with fsdp::Profiler (examples/downstream/main.cc):
// each rank's trace holds steps 1 and 2 with the phases of every group, the
// root's named "root"; and profiling changes no number.
TEST(Examples, TinyLmProfileWritesEachRanksTraceOfStepsOneAndTwo) {
  char dir_template[] = "/tmp/tiny_lm_profile.XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = std::string(dir_template) + "/prof";  // created by the profiler
  const RunResult r = run({TINY_LM_TRAIN_BINARY, "--nproc", "2", "--profile", dir});
  expect_matches_unsharded(r, 2, "DeviceMesh\\(cpu, \\[0, 1\\], dim_names=\\[\"shard\"\\]\\)");
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const std::string path = dir + "/trace_rank" + std::to_string(rank) + ".json";
    const std::vector<std::string> lines = lines_of_rank(r.out, rank);
    EXPECT_NE(std::find(lines.begin(), lines.end(), "profile: " + path), lines.end()) << describe(r);
    std::map<std::string, int> events = trace_events(path);
    ASSERT_FALSE(events.empty()) << "no Chrome trace at " << path;
    EXPECT_EQ(events.count("ProfilerStep#0"), 0u);
    EXPECT_EQ(events["ProfilerStep#1"], 1);
    EXPECT_EQ(events["ProfilerStep#2"], 1);
    EXPECT_EQ(events.count("ProfilerStep#3"), 0u);
    // Two steps: the blocks reshard after forward and are gathered again in
    // backward; the root keeps its parameters until backward.
    for (const auto& [name, count] : std::map<std::string, int>{{"FSDP::all_gather (root)", 2},
                                                                {"FSDP::all_gather (stem)", 4},
                                                                {"FSDP::all_gather (blocks.1)", 4},
                                                                {"FSDP::reduce_scatter (root)", 2},
                                                                {"FSDP::reduce_scatter (blocks.0)", 2},
                                                                {"FSDP::root_pre_forward", 2}}) {
      EXPECT_EQ(events[name], count) << name << " in " << path;
    }
  }
  std::filesystem::remove_all(dir_template);
}

TEST(Examples, TinyLmMatchesUnshardedTrainingAsHsdpTwoByTwo) {
  expect_matches_unsharded(
      run({FSDPRUN_BINARY, "--nproc", "4", "--mesh", "2x2", "--", TINY_LM_TRAIN_BINARY}), 4,
      "DeviceMesh\\(cpu, \\[\\[0, 1\\], \\[2, 3\\]\\], dim_names=\\[\"replicate\", \"shard\"\\]\\)");
}

}  // namespace
