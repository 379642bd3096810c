// fsdp_train --no-shard: the same model, initial values, batches and loop
// without fully_shard, on one rank. Its losses equal the sharded run's at
// world sizes 1 and 3 (so the benchmarks' unsharded baseline trains the same
// model), and the flags that need fully_shard or several ranks are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "config.h"
#include "run_binary.h"

namespace fsdp_train_test {
namespace {

constexpr int kSteps = 6;

std::vector<std::string> run_flags(const std::string& json) {
  return {"--steps",        std::to_string(kSteps),
          "--global-batch", "6",
          "--seq-len",      "16",
          "--layers",       "2",
          "--dim",          "24",
          "--heads",        "2",
          "--seed",         "3",
          "--warmup",       "2",
          "--json",         json};
}

TEST(NoShard, ValidateRejectsWhatNeedsFullyShard) {
  fsdp_train::TrainConfig c;
  c.no_shard = true;
  EXPECT_TRUE(fsdp_train::validate(c, 1).ok());
  EXPECT_NE(fsdp_train::validate(c, 2).message().find("--no-shard"), std::string::npos);
  c.mesh = "1x1";
  EXPECT_NE(fsdp_train::validate(c, 1).message().find("--mesh"), std::string::npos);
  c.mesh.clear();
  c.param_dtype = "bf16";
  EXPECT_NE(fsdp_train::validate(c, 1).message().find("--param-dtype"), std::string::npos);
}

TEST(NoShard, BinaryFailsBeforeStartingWithSeveralRanks) {
  const RunResult run = run_program(FSDP_TRAIN_BINARY, {"--no-shard", "--nproc", "2", "--steps", "1"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("--no-shard trains the unsharded model on one rank (got 2 ranks)"), std::string::npos)
      << run.output;
}

TEST(NoShard, TrainsTheSameModelAsTheShardedRuns) {
  ScratchDir dir;
  auto train = [&](const std::string& name, std::vector<std::string> extra) {
    const std::string json = dir / (name + ".json");
    std::vector<std::string> args = run_flags(json);
    args.insert(args.end(), extra.begin(), extra.end());
    const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
    EXPECT_EQ(run.exit_code, 0) << name << ":\n" << run.output;
    if (name == "unsharded") {
      EXPECT_NE(run.output.find("--no-shard"), std::string::npos) << "the header says it is unsharded:\n" << run.output;
    }
    return read_train_json(json);
  };
  const TrainRecord unsharded = train("unsharded", {"--no-shard"});
  const TrainRecord one = train("one", {});
  const TrainRecord three = train("three", {"--nproc", "3"});
  ASSERT_TRUE(unsharded.ok && one.ok && three.ok);
  ASSERT_EQ(unsharded.losses.size(), static_cast<size_t>(kSteps));
  for (const TrainRecord* sharded : {&one, &three}) {
    ASSERT_EQ(sharded->losses.size(), unsharded.losses.size());
    for (size_t i = 0; i < unsharded.losses.size(); ++i) {
      EXPECT_NEAR(sharded->losses[i], unsharded.losses[i], 1e-4 * std::abs(unsharded.losses[i]))
          << "step " << i + 1 << ", world size " << sharded->world_size;
    }
  }
  EXPECT_LT(unsharded.losses.back(), unsharded.losses.front());
}

}  // namespace
}  // namespace fsdp_train_test
