// fsdp_plan, the program: its report, its JSON, and its errors on bad flags
// (each names the flag and exits with status 2).
#include <fstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fsdp_common/child_process.h"

namespace {

using ::testing::HasSubstr;

fsdp::ChildResult run_plan(std::vector<std::string> args) {
  args.insert(args.begin(), FSDP_PLAN_BINARY);
  return fsdp::run_child(args);
}

const std::vector<std::string> kSmall = {"--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32"};

std::vector<std::string> small(std::vector<std::string> more) {
  std::vector<std::string> args = kSmall;
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST(PlanTool, PrintsTheReportAndItsJson) {
  const fsdp::ChildResult run =
      run_plan(small({"--world-size", "4", "--global-batch", "8", "--memory-per-gpu", "128MiB", "--json=-"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("rank 0 of 4"));
  EXPECT_THAT(run.output, HasSubstr("peak allocated"));
  EXPECT_THAT(run.output, HasSubstr("local batch up to"));
  const std::string json = run.output.substr(run.output.find("\n{") + 1);
  const nlohmann::json j = nlohmann::json::parse(json);
  EXPECT_EQ(j["world_size"], 4);
  EXPECT_EQ(j["local_batch"], 2);
  EXPECT_GT(j["memory"]["peak_allocated_bytes"].get<int64_t>(), 0);
  EXPECT_GE(j["memory"]["peak_reserved_bytes"].get<int64_t>(), j["memory"]["peak_allocated_bytes"].get<int64_t>());
  EXPECT_GT(j["largest_local_batch"].get<int64_t>(), 0);
  EXPECT_TRUE(j["collectives_per_step"].contains("reduce_scatter_tensor"));
}

TEST(PlanTool, PrintsTheSimulatedTimeItsTraceAndTheSettingsCompared) {
  const std::string trace_path = ::testing::TempDir() + "/fsdp_plan_trace.json";
  const fsdp::ChildResult run = run_plan(small({"--world-size", "8", "--global-batch", "16", "--device", "h200",
                                                "--trace", trace_path, "--compare", "--json=-"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("time of step 2 on h200"));
  EXPECT_THAT(run.output, HasSubstr("settings compared"));
  EXPECT_THAT(run.output, HasSubstr("ac full"));
  EXPECT_THAT(run.output, HasSubstr("reshard after forward no"));
  EXPECT_THAT(run.output, HasSubstr("prefetch 2"));
  EXPECT_THAT(run.output, HasSubstr("cpu offload"));
  const nlohmann::json j = nlohmann::json::parse(run.output.substr(run.output.find("\n{") + 1));
  EXPECT_EQ(j["time"]["device"], "h200");
  EXPECT_GT(j["time"]["step_s"].get<double>(), 0);
  EXPECT_GT(j["time"]["flops"].get<int64_t>(), 0);
  std::ifstream trace(trace_path);
  const nlohmann::json t = nlohmann::json::parse(trace);
  int complete = 0;
  for (const auto& e : t["traceEvents"]) complete += e["ph"] == "X";
  EXPECT_GT(complete, 10);
}

TEST(PlanTool, PlansCpuOffloadWithTheShardedStateInHostMemory) {
  const fsdp::ChildResult run =
      run_plan(small({"--world-size", "4", "--global-batch", "8", "--cpu-offload", "--json=-"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("host memory"));
  const nlohmann::json j = nlohmann::json::parse(run.output.substr(run.output.find("\n{") + 1));
  const nlohmann::json& host = j["memory"]["host_peak_by_holder_bytes"];
  // AdamW's two moments take twice what the parameters take, on the host.
  EXPECT_GT(host["sharded parameters"].get<int64_t>(), 0);
  EXPECT_EQ(host["optimizer state"].get<int64_t>(), 2 * host["sharded parameters"].get<int64_t>());
  EXPECT_EQ(j["memory"]["peak_by_holder_bytes"]["optimizer state"].get<int64_t>(), 0);
}

TEST(PlanTool, RejectsBadFlagsNamingThem) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--world-size", "0"}, "--world-size must be at least 1"},
      {{"--world-size", "4", "--rank", "4"}, "--rank 4 is not a rank of --world-size 4"},
      {{"--world-size", "4", "--engine", "mpi"}, "--engine must be nccl or gloo"},
      {{"--world-size", "4", "--global-batch", "8", "--memory-per-gpu", "80XB"}, "--memory-per-gpu '80XB'"},
      {{"--world-size", "4", "--global-batch", "7"}, "global"},
      {{"--world-size", "4", "--global-batch", "8", "--device", "tpu"}, "--device 'tpu' is not a device profile"},
      {{"--world-size", "4", "--global-batch", "8", "--prefetch", "-2"}, "--prefetch must be >= 0 (got -2)"},
      {{"--world-size", "4", "--global-batch", "8", "--cpu-offload", "--engine", "gloo"},
       "--cpu-offload plans a CUDA job, but --engine gloo plans a CPU job"},
  };
  for (const Case& c : cases) {
    const fsdp::ChildResult run = run_plan(small(c.args));
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_THAT(run.output, HasSubstr(c.message));
  }
}

}  // namespace
