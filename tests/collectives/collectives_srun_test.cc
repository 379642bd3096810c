// env:// under srun: when RANK is unset, World::from_env takes the rank, the
// world size and the local rank from Slurm's variables, which these tests set
// by hand (no Slurm here). One real rendezvous at world size 1; the values of
// larger worlds are checked through env_rendezvous_spec(), which from_env
// reads.
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "collectives/communicator.h"
#include "collectives/reduce_op.h"
#include "collectives/world.h"
#include "env_test_util.h"
#include "fsdp_testing/expect_error.h"

namespace fsdp::collectives {
namespace {

using ::fsdp::testing::thrown_error;
using test::free_port;
using ::testing::HasSubstr;

// Clears every launcher variable for the test and restores them after.
class SrunEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.save_and_unset();
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29555", 1);
  }
  void TearDown() override { env_.restore(); }
  static void set(const std::vector<std::pair<const char*, const char*>>& vars) {
    for (const auto& [name, value] : vars) setenv(name, value, 1);
  }
  test::SavedEnv env_{{"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                       "SLURM_NODEID", "TORCHELASTIC_USE_AGENT_STORE"}};
};

TEST_F(SrunEnvTest, WorldSizeOneRendezvousAndCommunicates) {
  setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
  set({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "1"}});
  auto world = World::from_env();
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->local_rank(), 0);
  EXPECT_EQ(world->local_size(), 1);
  auto comm = world->new_group(world->all_ranks(), c10::kCPU);
  at::Tensor t = at::full({3}, 4.0);
  comm->all_reduce(t, ReduceOp::sum()).wait();
  EXPECT_TRUE(t.equal(at::full({3}, 4.0)));
}

TEST_F(SrunEnvTest, TakesRankSizeAndLocalValuesFromSlurm) {
  set({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NTASKS_PER_NODE", "4"}});
  const EnvRendezvousSpec spec = env_rendezvous_spec();
  EXPECT_EQ(spec.launcher, "srun");
  EXPECT_EQ(spec.master_addr, "127.0.0.1");
  EXPECT_EQ(spec.master_port, 29555);
  EXPECT_EQ(spec.rank, 5);
  EXPECT_EQ(spec.world_size, 8);
  EXPECT_EQ(spec.local_rank, 1);
  EXPECT_EQ(spec.local_world_size, 4);
}

// Without --ntasks-per-node, srun only sets SLURM_TASKS_PER_NODE, one entry
// per node run ("N(xM)": N tasks on each of M nodes).
TEST_F(SrunEnvTest, DerivesTheLocalWorldSizeFromTasksPerNode) {
  set({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"}});
  const std::vector<std::pair<const char*, int>> expected = {{"0", 2}, {"1", 2}, {"2", 2}, {"3", 1}};
  for (const auto& [node, tasks] : expected) {
    setenv("SLURM_NODEID", node, 1);
    EXPECT_EQ(env_rendezvous_spec().local_world_size, tasks) << "node " << node;
  }
  // SLURM_NTASKS_PER_NODE, when given, is the answer.
  setenv("SLURM_NTASKS_PER_NODE", "3", 1);
  EXPECT_EQ(env_rendezvous_spec().local_world_size, 3);
  // Neither: unknown (World then uses the world size).
  unsetenv("SLURM_NTASKS_PER_NODE");
  unsetenv("SLURM_TASKS_PER_NODE");
  EXPECT_EQ(env_rendezvous_spec().local_world_size, -1);
  EXPECT_EQ(env_rendezvous_spec().local_rank, 0);
}

// torchrun started inside a Slurm allocation: its variables win.
TEST_F(SrunEnvTest, TorchrunVariablesWinOverSlurms) {
  set({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}});
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}});
  const EnvRendezvousSpec spec = env_rendezvous_spec();
  EXPECT_EQ(spec.launcher, "torchrun");
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
  EXPECT_EQ(spec.local_rank, 1);
  EXPECT_EQ(spec.local_world_size, 2);
}

TEST_F(SrunEnvTest, NamesTheMissingVariable) {
  EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }),
              HasSubstr("environment variable RANK is not set (nor SLURM_PROCID, which srun sets)"));
  setenv("SLURM_PROCID", "0", 1);
  EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }), HasSubstr("environment variable SLURM_NTASKS is not set"));
  setenv("SLURM_NTASKS", "1", 1);
  unsetenv("MASTER_PORT");
  EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }), HasSubstr("environment variable MASTER_PORT is not set"));
  unsetenv("MASTER_ADDR");
  const std::string message = thrown_error([] { World::from_env(); });
  EXPECT_THAT(message, HasSubstr("environment variable MASTER_ADDR is not set"));
  EXPECT_THAT(message, HasSubstr("srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID but not MASTER_ADDR"));
}

TEST_F(SrunEnvTest, NamesTheMalformedVariable) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"SLURM_PROCID", "4"},  {"SLURM_PROCID", "x"},          {"SLURM_NTASKS", "0"},
      {"SLURM_LOCALID", "2"}, {"SLURM_NTASKS_PER_NODE", "9"}, {"SLURM_NODEID", "-1"}};
  for (const auto& [var, value] : cases) {
    set({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}});
    setenv(var, value, 1);
    EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }),
                HasSubstr(std::string("environment variable ") + var + "='" + value + "' is not an integer in"))
        << var << "=" << value;
    unsetenv("SLURM_NTASKS_PER_NODE");
    unsetenv("SLURM_NODEID");
  }
  set({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}});
  for (const char* bad : {"2(x2", "2(y2)", "two", "0(x4)"}) {
    setenv("SLURM_TASKS_PER_NODE", bad, 1);
    EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }),
                HasSubstr(std::string("environment variable SLURM_TASKS_PER_NODE='") + bad + "'"))
        << bad;
  }
  setenv("SLURM_TASKS_PER_NODE", "2(x2)", 1);
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_THAT(thrown_error([] { env_rendezvous_spec(); }), HasSubstr("has no entry for node 2 (SLURM_NODEID)"));
}

}  // namespace
}  // namespace fsdp::collectives
