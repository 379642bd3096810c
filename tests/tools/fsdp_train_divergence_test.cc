// The trainer when its ranks go different ways (issue 20): ranks started with
// different flags, as a config read differently on one machine would, under
// fsdprun. A different layer count fails every rank at the first forward,
// naming the group only one side has; one more step on one rank stops both
// within seconds, each printing the diagnosis that names the collective where
// they parted and what the other rank waits for instead.
#include <cstdlib>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "run_binary.h"

namespace fsdp_train_test {
namespace {

using ::testing::HasSubstr;

// fsdprun --nproc 2 running fsdp_train with `flags`, where "$RANK" in a flag
// is this rank's number (through sh), so that ranks can be given different
// values.
RunResult run_two_ranks(const std::string& flags) {
  // A short wait before diagnosing; the communicators' own timeout stays long,
  // so that only the diagnosis can end the run early.
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "3", 1);
  ::setenv("FSDP2CPP_COLLECTIVE_TIMEOUT_S", "600", 1);
  const std::string script =
      "exec \"$0\" --layers 2 --dim 32 --heads 2 --seq-len 16 --global-batch 4 --log-every 1 " + flags;
  return run_program(FSDPRUN_BINARY, {"--nproc", "2", "--", "/bin/sh", "-c", script, FSDP_TRAIN_BINARY});
}

TEST(Divergence, TrainerRanksWithDifferentLayerCountsFailAtTheFirstForward) {
  const RunResult r = run_two_ranks("--steps 3 --layers $((2 + RANK))");
  EXPECT_NE(r.exit_code, 0) << r.output;
  for (const char* rank : {"[rank0] fsdp_train: [rank 0] error: ", "[rank1] fsdp_train: [rank 1] error: "}) {
    EXPECT_THAT(r.output, HasSubstr(std::string(rank) + "fsdp2: the sharded model differs between ranks")) << rank;
  }
  EXPECT_THAT(r.output, HasSubstr("rank 1 has fully_shard group 'layers.2' of 1 module(s) with 7 parameter(s)"));
  EXPECT_THAT(r.output, HasSubstr("rank 0 has nothing more"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("step 1/3"))) << "a step ran on models that differ";
}

TEST(Divergence, TrainerRankThatRunsOneMoreStepIsDiagnosed) {
  const RunResult r = run_two_ranks("--steps $((3 + RANK))");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("[rank0] step 3/3")) << r.output;
  // Rank 1's fourth step gathers the root's parameters; rank 0, done
  // training, waits in the run's summary on the metrics group.
  EXPECT_THAT(r.output, HasSubstr("ranks diverged at collective #")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 1 issued all_gather_into_tensor(Float, 8208 elements) for FSDP::all_gather "
                                  "(root) [in FSDP::pre_forward (root)]"))
      << r.output;
  EXPECT_THAT(r.output, HasSubstr("rank 0 has issued nothing on it since #")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("for fsdp_train: run summary")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("error: fsdp2cpp: all_gather_into_tensor on gloo[0,1] did not complete")) << r.output;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("timed out"))) << "the communicator's timeout ended it:\n" << r.output;
}

}  // namespace
}  // namespace fsdp_train_test
