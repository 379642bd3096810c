// Multi-process tests of the collectives layer over real Gloo process groups:
// every collective at world sizes 1 to 4, groups over subsets of ranks, the
// env:// and file:// rendezvous across processes, a rank that never joins and
// a rank that dies in the middle of a collective.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "collective_checks.h"
#include "collectives/communicator.h"
#include "collectives/errors.h"
#include "collectives/world.h"
#include "env_test_util.h"
#include "fsdp_testing/distributed_test.h"

namespace fsdp::collectives {
namespace {

using ::fsdp::testing::RankContext;
using test::free_port;
using ::testing::HasSubstr;
using ::testing::Not;

std::string store_get(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  const std::vector<uint8_t> value = store->get(key);
  return std::string(value.begin(), value.end());
}

void store_set(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, AllGatherIntoTensorPlacesEachRankAtItsOffset) {
  fsdp::testing::run_distributed(GetParam(),
                                 [](RankContext& ctx) { testing::check_all_gather(*ctx.world_group(), ctx.device()); });
}

TEST_P(CollectivesTest, ReduceScatterTensorReducesEachRanksSlice) {
  fsdp::testing::run_distributed(
      GetParam(), [](RankContext& ctx) { testing::check_reduce_scatter(*ctx.world_group(), ctx.device()); });
}

TEST_P(CollectivesTest, ReduceScattersInFlightAtOnceEachReduceOnce) {
  fsdp::testing::run_distributed(
      GetParam(), [](RankContext& ctx) { testing::check_reduce_scatters_in_flight(*ctx.world_group(), ctx.device()); });
}

TEST_P(CollectivesTest, AllReduceReducesEveryElement) {
  fsdp::testing::run_distributed(GetParam(),
                                 [](RankContext& ctx) { testing::check_all_reduce(*ctx.world_group(), ctx.device()); });
}

TEST_P(CollectivesTest, CoalescedFormsMatchTheSingleTensorCollectives) {
  fsdp::testing::run_distributed(GetParam(),
                                 [](RankContext& ctx) { testing::check_coalesced(*ctx.world_group(), ctx.device()); });
}

TEST_P(CollectivesTest, BroadcastFromEveryRootAndBarrier) {
  fsdp::testing::run_distributed(GetParam(), [](RankContext& ctx) {
    auto& comm = *ctx.world_group();
    testing::check_broadcast(comm, ctx.device());

    // Each rank arrives late by a different amount; after the barrier every
    // rank's arrival mark must be visible.
    const auto& store = ctx.world()->store();
    for (int round = 0; round < 3; ++round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30 * ((ctx.rank() + round) % ctx.world_size())));
      store_set(store, "barrier/" + std::to_string(round) + "/" + std::to_string(ctx.rank()), "arrived");
      comm.barrier().wait();
      for (int r = 0; r < ctx.world_size(); ++r) {
        EXPECT_TRUE(store->check({"barrier/" + std::to_string(round) + "/" + std::to_string(r)}))
            << "round " << round << ": rank " << r << " had not arrived when the barrier released rank " << ctx.rank();
      }
    }
  });
}

// Groups over subsets: even and odd ranks, a reversed order (group rank is the
// index in the member list, not the global rank), and a group per rank.
TEST_P(CollectivesTest, GroupsCommunicateAmongTheirMembersInListOrder) {
  fsdp::testing::run_distributed(GetParam(), [](RankContext& ctx) {
    const int rank = ctx.rank();
    const int size = ctx.world_size();
    std::vector<int> parity;
    for (int r = rank % 2; r < size; r += 2) parity.push_back(r);
    auto parity_group = ctx.world()->new_group(parity, c10::kCPU);
    at::Tensor t = at::full({3}, static_cast<double>(rank));
    parity_group->all_reduce(t, ReduceOp::sum()).wait();
    double expected = 0;
    for (int r : parity) expected += r;
    EXPECT_TRUE(t.equal(at::full({3}, expected))) << parity_group->name() << ": " << t;

    std::vector<int> reversed;
    for (int r = size - 1; r >= 0; --r) reversed.push_back(r);
    auto reversed_group = ctx.world()->new_group(reversed, c10::kCPU);
    EXPECT_EQ(reversed_group->rank(), size - 1 - rank);
    EXPECT_EQ(reversed_group->global_ranks(), reversed);
    at::Tensor gathered = at::empty({size}, at::kLong);
    reversed_group->all_gather_into_tensor(gathered, at::full({1}, rank, at::kLong)).wait();
    EXPECT_TRUE(gathered.equal(at::tensor(std::vector<int64_t>(reversed.begin(), reversed.end()))))
        << "gathered in group-rank order: " << gathered;
    testing::check_reduce_scatter(*reversed_group, ctx.device());

    auto self_group = ctx.world()->new_group({rank}, c10::kCPU);
    EXPECT_EQ(self_group->size(), 1);
    at::Tensor mine = at::full({2}, 7.0);
    self_group->all_reduce(mine, ReduceOp::avg()).wait();
    EXPECT_TRUE(mine.equal(at::full({2}, 7.0)));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "WorldSize" + std::to_string(info.param);
                         });

// ---- rendezvous across processes ------------------------------------------------

// Sets torchrun's variables for this rank, with a free port that rank 0 picks
// and shares through the harness's store under `port_key`; returns the port.
std::string set_torchrun_env(RankContext& ctx, const std::string& port_key) {
  const auto& store = ctx.world()->store();
  if (ctx.rank() == 0) store_set(store, port_key, std::to_string(free_port()));
  const std::string port = store_get(store, port_key);
  const std::string rank = std::to_string(ctx.rank()), size = std::to_string(ctx.world_size());
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port.c_str(), 1);
  setenv("RANK", rank.c_str(), 1);
  setenv("WORLD_SIZE", size.c_str(), 1);
  setenv("LOCAL_RANK", rank.c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", size.c_str(), 1);
  return port;
}

TEST(RendezvousTest, EnvRendezvousAcrossProcesses) {
  fsdp::testing::run_distributed(3, [](RankContext& ctx) {
    const std::string port = set_torchrun_env(ctx, "env_test/port");
    auto world = World::from_env();
    EXPECT_EQ(world->rank(), ctx.rank());
    EXPECT_EQ(world->size(), 3);
    EXPECT_EQ(world->local_rank(), ctx.rank());
    EXPECT_EQ(world->description(), "env://127.0.0.1:" + port);
    auto comm = world->new_group(world->all_ranks(), c10::kCPU);
    at::Tensor t = at::full({4}, ctx.rank() + 1.0);
    comm->all_reduce(t, ReduceOp::sum()).wait();
    EXPECT_TRUE(t.equal(at::full({4}, 6.0))) << t;
    // Rank 0 hosts the store: it leaves last.
    comm->barrier().wait();
  });
}

// Every rank ran to its end ("LEFT"), and none printed c10d's failed
// receive from a store that was gone.
void expect_every_rank_left_quietly(const std::vector<fsdp::testing::RankOutcome>& outcomes, size_t ranks) {
  ASSERT_EQ(outcomes.size(), ranks);
  for (const auto& o : outcomes) {
    EXPECT_TRUE(o.ok()) << o.describe() << "\n" << o.output;
    EXPECT_THAT(o.output, HasSubstr("LEFT")) << o.output;
    EXPECT_THAT(o.output, Not(HasSubstr("recvValue failed"))) << o.output;
    EXPECT_THAT(o.output, Not(HasSubstr("Connection was likely closed"))) << o.output;
  }
}

// [Note: the divergence watchdog at exit] (divergence_monitor.cc): rank 0
// hosts the env:// store and leaves first, while the other ranks keep their
// worlds, and so their divergence watchdogs polling the store, a second and
// a half longer. No rank may print c10d's failed receive from a store that
// is gone: rank 0 keeps it up until every watchdog has stopped.
TEST(RendezvousTest, RanksThatOutliveTheStoresHostExitQuietly) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 4;
  const auto outcomes = fsdp::testing::run_distributed_collect(options, [](RankContext& ctx) {
    const auto& store = ctx.world()->store();
    set_torchrun_env(ctx, "exit_test/port");
    auto world = World::from_env();
    world->new_group(world->all_ranks(), c10::kCPU)->barrier().wait();
    if (ctx.rank() == 0) {
      store_set(store, "exit_test/host_leaves", "1");
    } else {
      // Ordered by the harness's store, not by timing: rank 0 has begun to
      // leave, and these watchdogs poll its store for several rounds more.
      store_get(store, "exit_test/host_leaves");
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    }
    world.reset();
    std::cout << "LEFT" << std::endl;
  });
  if (fsdp::testing::is_rank_process()) return;
  expect_every_rank_left_quietly(outcomes, 4);
}

// The same, for worlds the program never destroys, as when the FSDP states
// of its modules keep their mesh's World until the process ends (fsdp_train
// printed c10d's failed receive in 6 runs of 10 at 4 ranks under load):
// every rank exits with its world alive, and the other ranks take a second
// longer than rank 0 to exit (five of the watchdog's polls; rank 0 waits up
// to five seconds for them). The watchdogs are stopped, and counted out, at
// exit.
TEST(RendezvousTest, RanksWhoseWorldsLiveUntilExitExitQuietly) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 4;
  const auto outcomes = fsdp::testing::run_distributed_collect(options, [](RankContext& ctx) {
    set_torchrun_env(ctx, "exit_test/port");
    // Kept by the process, never destroyed.
    static auto* const kept = new std::shared_ptr<World>(World::from_env());
    (*kept)->new_group((*kept)->all_ranks(), c10::kCPU)->barrier().wait();
    // Registered after the world was made, so it runs first at exit, while
    // the watchdog still polls rank 0's store (the harness's own departure
    // wait is over by then).
    if (ctx.rank() != 0) std::atexit([] { std::this_thread::sleep_for(std::chrono::milliseconds(1000)); });
    std::cout << "LEFT" << std::endl;
  });
  if (fsdp::testing::is_rank_process()) return;
  expect_every_rank_left_quietly(outcomes, 4);
}

// A child forked by a rank whose world is alive (a data loader's worker,
// say) inherits the exit handler that stops the watchdogs, but not their
// threads: at its own exit it must leave them alone. Without the handler's
// check of the process, each child counted itself out in the store as if
// its rank's watchdog had stopped.
TEST(RendezvousTest, AChildForkedFromARankExitsWithoutTouchingItsWatchdog) {
  fsdp::testing::run_distributed(2, [](RankContext& ctx) {
    set_torchrun_env(ctx, "fork_test/port");
    static auto* const kept = new std::shared_ptr<World>(World::from_env());
    (*kept)->new_group((*kept)->all_ranks(), c10::kCPU)->barrier().wait();
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t child = ::fork();
    if (child == 0) std::exit(7);
    ASSERT_GT(child, 0);
    int status = 0;
    pid_t done = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((done = ::waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (done == 0) ::kill(child, SIGKILL);
    ASSERT_EQ(done, child) << "the forked child did not exit within 20 s";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 7) << "status " << status;
    // No watchdog has stopped yet: a child that counted itself out would let
    // rank 0 leave (and take the store) before the ranks still running.
    (*kept)->new_group((*kept)->all_ranks(), c10::kCPU)->barrier().wait();
    EXPECT_EQ((*kept)->store()->add("fsdp2cpp/divergence/stopped", 0), 0);
  });
}

TEST(RendezvousTest, RanksThatJoinedNameTheRankThatNeverCame) {
  fsdp::testing::run_distributed(3, [](RankContext& ctx) {
    const auto& store = ctx.world()->store();
    if (ctx.rank() == 0) {
      char dir[] = "/tmp/fsdp2cpp-rdzv-XXXXXX";
      ASSERT_NE(mkdtemp(dir), nullptr);
      store_set(store, "missing_test/path", std::string(dir) + "/store");
    }
    const std::string path = store_get(store, "missing_test/path");
    if (ctx.rank() != 2) {  // rank 2 never joins
      RendezvousOptions options;
      options.timeout = std::chrono::milliseconds(1500);
      try {
        World::from_file(path, ctx.rank(), 3, options);
        ADD_FAILURE() << "the rendezvous succeeded without rank 2";
      } catch (const c10::Error& e) {
        const std::string message = e.what_without_backtrace();
        EXPECT_THAT(message, HasSubstr("rendezvous file://" + path + " timed out after 1500 ms"));
        EXPECT_THAT(message, HasSubstr("missing rank(s) [2] never joined"));
      }
    }
    ctx.world_group()->barrier().wait();
    if (ctx.rank() == 0) {
      std::remove(path.c_str());
      rmdir(path.substr(0, path.rfind('/')).c_str());
    }
  });
}

// ---- strict mode ---------------------------------------------------------------

// Strict mode on a subgroup whose group ranks are not its global ranks (the
// members listed as {2, 0}), with collectives that differ only in size: both
// members fail at once, each naming itself first and the other second, by
// global rank, with both sizes.
TEST(StrictTest, ASubgroupNamesGlobalRanksAndBothSizes) {
  ::setenv("FSDP2CPP_STRICT_COLLECTIVES", "1", 1);
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 3;
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    if (ctx.rank() == 1) return;
    const auto group = ctx.world()->new_group({2, 0}, c10::kCPU);
    const int64_t mine = ctx.rank() == 0 ? 4 : 6;
    const int64_t theirs = ctx.rank() == 0 ? 6 : 4;
    at::Tensor t = at::ones({mine});
    try {
      group->all_reduce(t, ReduceOp::sum()).wait();
      ADD_FAILURE() << "all_reduce of different sizes passed strict mode";
    } catch (const c10::Error& e) {
      const std::string expected =
          c10::str("strict collectives: the members of gloo[2,0]#0 issue different collectives as #1: rank ",
                   ctx.rank(), " issues all_reduce(SUM, Float, ", mine, " elements); rank ", 2 - ctx.rank(),
                   " issues all_reduce(SUM, Float, ", theirs, " elements)");
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr(expected));
    }
  });
  ::unsetenv("FSDP2CPP_STRICT_COLLECTIVES");
}

// ---- failures ------------------------------------------------------------------

TEST(FailureTest, SurvivorsOfARankThatDiesMidCollectiveFailNamingIt) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 3;
  options.communicator.timeout = std::chrono::seconds(10);
  options.timeout = std::chrono::seconds(60);
  const auto outcomes = fsdp::testing::run_distributed_collect(options, [](RankContext& ctx) {
    auto& comm = *ctx.world_group();
    comm.barrier().wait();  // every connection is up
    if (ctx.rank() == 1) std::_Exit(3);
    at::Tensor t = at::ones({1024});
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(t, ReduceOp::sum()).wait();
      ADD_FAILURE() << "all_reduce succeeded although rank 1 died";
    } catch (const CollectiveFailed& e) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::cout << "SURVIVOR ERROR after " << seconds << "s: " << e.what_without_backtrace() << std::endl;
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("all_reduce(SUM) on gloo[0,1,2] failed"));
      EXPECT_LT(seconds, 15.0);
    }
  });
  if (fsdp::testing::is_rank_process()) return;
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_TRUE(outcomes[1].exited && outcomes[1].exit_code == 3) << outcomes[1].describe();
  for (int r : {0, 2}) {
    EXPECT_TRUE(outcomes[r].ok()) << outcomes[r].describe() << "\n" << outcomes[r].output;
    EXPECT_THAT(outcomes[r].output, HasSubstr("SURVIVOR ERROR")) << outcomes[r].output;
  }
}

TEST(FailureTest, SurvivorsOfARankThatStopsIssuingCollectivesFailAfterTheTimeout) {
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 3;
  options.communicator.timeout = std::chrono::seconds(2);
  options.timeout = std::chrono::seconds(60);
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    auto& comm = *ctx.world_group();
    comm.barrier().wait();
    const auto& store = ctx.world()->store();
    if (ctx.rank() == 1) {
      // Alive but silent until the others have given up.
      store->wait({"hang_test/failed/0", "hang_test/failed/2"}, std::chrono::seconds(30));
      return;
    }
    at::Tensor t = at::ones({16});
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.all_reduce(t, ReduceOp::avg()).wait();
      ADD_FAILURE() << "all_reduce succeeded although rank 1 never issued it";
    } catch (const CollectiveFailed& e) {  // the engine's timeout came first
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("all_reduce(AVG) on gloo[0,1,2] failed"));
      // After the 2 s timeout, and before rank 1 gives up its 30 s wait
      // (the bound is 10x what an idle machine needs, so load does not
      // trip it).
      EXPECT_GE(seconds, 1.5);
      EXPECT_LT(seconds, 25.0);
    }
    store_set(store, "hang_test/failed/" + std::to_string(ctx.rank()), "1");
  });
}

// A rank that stops issuing collectives, found by the divergence monitor
// before the engine's own timeout: the waiting ranks get the diagnosis as a
// CollectiveDiverged, which a caller can tell from an engine failure by type.
TEST(FailureTest, AStallTheMonitorDiagnosesIsACollectiveDiverged) {
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "2", 1);
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 2;
  options.communicator.timeout = std::chrono::minutes(5);
  options.timeout = std::chrono::seconds(120);
  fsdp::testing::run_distributed(options, [](RankContext& ctx) {
    auto& comm = *ctx.world_group();
    comm.barrier().wait();
    const auto& store = ctx.world()->store();
    if (ctx.rank() == 1) {
      // Alive (its monitor answers the diagnosis) but silent.
      store->wait({"stall_test/diagnosed"}, std::chrono::seconds(90));
      return;
    }
    at::Tensor t = at::ones({16});
    try {
      comm.all_reduce(t, ReduceOp::sum()).wait();
      ADD_FAILURE() << "all_reduce succeeded although rank 1 never issued it";
    } catch (const CollectiveDiverged& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("all_reduce(SUM) on gloo[0,1] did not complete"));
    }
    store_set(store, "stall_test/diagnosed", "1");
  });
  ::unsetenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S");
}

}  // namespace
}  // namespace fsdp::collectives
