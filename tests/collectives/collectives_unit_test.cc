// Single-process tests of the collectives layer: argument checks, reduce-op
// names, Work handles, env:// parsing and rendezvous errors. Where a check
// needs peers, the ranks are threads of this process sharing a HashStore
// (the rendezvous and Gloo work the same between threads as between
// processes); the multi-process tests are in collectives_distributed_test.cc.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "collectives/communicator.h"
#include "collectives/errors.h"
#include "collectives/reduce_op.h"
#include "collectives/work.h"
#include "collectives/world.h"
#include "env_test_util.h"
#include "fsdp_testing/distributed_test.h"
#include "fsdp_testing/expect_error.h"

namespace fsdp::collectives {
namespace {

using ::fsdp::testing::thrown_error;
using test::free_port;
using ::testing::HasSubstr;

// Runs `body(rank)` on `size` threads and rethrows the first failure.
void run_threads(int size, const std::function<void(int)>& body) {
  std::vector<std::future<void>> done;
  for (int r = 0; r < size; ++r) done.push_back(std::async(std::launch::async, body, r));
  for (auto& f : done) f.get();
}

// A world of `size` in-process ranks over one HashStore.
std::vector<std::shared_ptr<World>> thread_worlds(int size) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<World>> worlds(size);
  run_threads(size, [&](int r) { worlds[r] = World::from_store(store, r, size, "test://threads"); });
  return worlds;
}

// A CPU communicator of size 1, in this process.
class SingleRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = World::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, "test://single");
    comm_ = world_->new_group({0}, c10::kCPU);
  }
  std::shared_ptr<World> world_;
  std::shared_ptr<Communicator> comm_;
};

TEST(ReduceOpTest, NamesEveryKind) {
  EXPECT_EQ(ReduceOp::sum().to_string(), "SUM");
  EXPECT_EQ(ReduceOp::avg().to_string(), "AVG");
  EXPECT_EQ(ReduceOp::max().to_string(), "MAX");
  EXPECT_EQ(ReduceOp::min().to_string(), "MIN");
  EXPECT_EQ(ReduceOp::premul_sum(0.5).to_string(), "PREMUL_SUM(0.5)");
  EXPECT_EQ(ReduceOp::premul_sum(0.5).factor(), 0.5);
  EXPECT_EQ(ReduceOp::avg().factor(), 1.0);
  EXPECT_TRUE(ReduceOp::premul_sum(0.5) == ReduceOp::premul_sum(0.5));
  EXPECT_FALSE(ReduceOp::premul_sum(0.5) == ReduceOp::premul_sum(0.25));
  EXPECT_EQ(to_string(BackendKind::kGloo), "gloo");
  EXPECT_EQ(to_string(BackendKind::kNccl), "nccl");
}

TEST(WorkTest, ThenStepsRunOnceAtWaitInOrder) {
  std::vector<int> ran;
  Work work;
  work.then([&] { ran.push_back(1); });
  work.then([&] { ran.push_back(2); });
  EXPECT_TRUE(ran.empty());  // not before wait()
  work.wait();
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
  work.wait();
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));  // once
  // Added after a wait (as the stream-order checker's collectives, already
  // waited for at issue): run at the next wait.
  work.then([&] { ran.push_back(3); });
  EXPECT_EQ(ran.size(), 2u);
  work.wait();
  EXPECT_EQ(ran, (std::vector<int>{1, 2, 3}));
}

TEST(WorkTest, DefaultWorkIsCompleted) {
  Work work;
  EXPECT_TRUE(work.is_completed());
  EXPECT_EQ(work.exception(), nullptr);
  EXPECT_EQ(work.c10d_work(), nullptr);
  work.wait();
  work.wait(std::chrono::milliseconds(1));
}

TEST_F(SingleRankTest, DescribesItself) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  EXPECT_EQ(comm_->name(), "gloo[0]");
  EXPECT_EQ(comm_->backend_kind(), BackendKind::kGloo);
  EXPECT_EQ(comm_->device_type(), c10::kCPU);
  EXPECT_EQ(comm_->global_ranks(), std::vector<int>{0});
  EXPECT_NE(comm_->backend(), nullptr);
}

TEST_F(SingleRankTest, SizeOneGroupComputesEveryOp) {
  auto t = at::arange(4, at::kFloat);
  comm_->all_reduce(t, ReduceOp::avg()).wait();
  EXPECT_TRUE(t.equal(at::arange(4, at::kFloat)));
  comm_->all_reduce(t, ReduceOp::premul_sum(0.5)).wait();
  EXPECT_TRUE(t.equal(at::arange(4, at::kFloat) * 0.5));
  auto out = at::empty({4});
  comm_->reduce_scatter_tensor(out, at::arange(4, at::kFloat), ReduceOp::sum()).wait();
  EXPECT_TRUE(out.equal(at::arange(4, at::kFloat)));
  comm_->all_gather_into_tensor(out, at::ones({4})).wait();
  EXPECT_TRUE(out.equal(at::ones({4})));
  comm_->broadcast(out, 0).wait();
  comm_->barrier().wait();
}

// The Rejects tests: each refused call throws at issue, before there is a
// Work to wait for, so its result is dropped with (void).
TEST_F(SingleRankTest, RejectsAllGatherOutputOfWrongSize) {
  const std::string message =
      thrown_error([&] { (void)comm_->all_gather_into_tensor(at::empty({4}), at::empty({5})); });
  EXPECT_THAT(message, HasSubstr("all_gather_into_tensor on gloo[0]"));
  EXPECT_THAT(message, HasSubstr("`output` has 4 elements, expected size() * input.numel() = 1 * 5 = 5"));
}

TEST_F(SingleRankTest, RejectsReduceScatterInputOfWrongSize) {
  const std::string message =
      thrown_error([&] { (void)comm_->reduce_scatter_tensor(at::empty({5}), at::empty({6}), ReduceOp::sum()); });
  EXPECT_THAT(message, HasSubstr("reduce_scatter_tensor on gloo[0]"));
  EXPECT_THAT(message, HasSubstr("`input` has 6 elements, expected size() * output.numel() = 1 * 5 = 5"));
}

TEST_F(SingleRankTest, RejectsMismatchedDtypes) {
  const std::string message = thrown_error(
      [&] { (void)comm_->all_gather_into_tensor(at::empty({4}, at::kFloat), at::empty({4}, at::kBFloat16)); });
  EXPECT_THAT(message, HasSubstr("`output` has dtype Float but `input` has dtype BFloat16"));
  EXPECT_THAT(thrown_error([&] {
                (void)comm_->reduce_scatter_tensor(at::empty({4}, at::kLong), at::empty({4}, at::kFloat),
                                                   ReduceOp::sum());
              }),
              HasSubstr("`output` has dtype Long but `input` has dtype Float"));
}

TEST_F(SingleRankTest, RejectsNonContiguousTensors) {
  at::Tensor transposed = at::zeros({4, 3}).t();
  const std::string message = thrown_error([&] { (void)comm_->all_reduce(transposed, ReduceOp::sum()); });
  EXPECT_THAT(message, HasSubstr("all_reduce on gloo[0]: `tensor` is not contiguous"));
  EXPECT_THAT(message, HasSubstr(".contiguous()"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->all_gather_into_tensor(at::empty({12}), transposed); }),
              HasSubstr("`input` is not contiguous"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->broadcast(transposed, 0); }), HasSubstr("`tensor` is not contiguous"));
}

TEST_F(SingleRankTest, RejectsTensorsOnAnotherDevice) {
  // A meta tensor has a device type other than the communicator's without a
  // GPU being present; CUDA tensors take the same check.
  at::Tensor meta = at::empty({4}, at::TensorOptions().device(c10::kMeta));
  const std::string message = thrown_error([&] { (void)comm_->all_reduce(meta, ReduceOp::sum()); });
  EXPECT_THAT(message, HasSubstr("`tensor` is on device meta, expected a cpu tensor"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->all_gather_into_tensor(meta, at::empty({4})); }),
              HasSubstr("`output` is on device meta"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->reduce_scatter_tensor(at::empty({4}), meta, ReduceOp::sum()); }),
              HasSubstr("`input` is on device meta"));
}

TEST_F(SingleRankTest, RejectsUndefinedTensors) {
  EXPECT_THAT(thrown_error([&] { (void)comm_->all_reduce(at::Tensor(), ReduceOp::sum()); }),
              HasSubstr("`tensor` is an undefined tensor"));
}

TEST_F(SingleRankTest, RejectsBroadcastRootOutsideTheGroup) {
  at::Tensor t = at::zeros({2});
  EXPECT_THAT(thrown_error([&] { (void)comm_->broadcast(t, 1); }), HasSubstr("root 1 is not a group rank"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->broadcast(t, -1); }), HasSubstr("root -1 is not a group rank"));
}

TEST_F(SingleRankTest, RejectsScaledReductionsOfIntegers) {
  at::Tensor t = at::zeros({2}, at::kLong);
  EXPECT_THAT(thrown_error([&] { (void)comm_->all_reduce(t, ReduceOp::avg()); }),
              HasSubstr("AVG needs a floating-point tensor, got dtype Long"));
  EXPECT_THAT(thrown_error([&] { (void)comm_->reduce_scatter_tensor(t, t, ReduceOp::premul_sum(0.5)); }),
              HasSubstr("PREMUL_SUM(0.5) needs a floating-point tensor"));
}

TEST_F(SingleRankTest, RejectsCoalescedListsThatDoNotPair) {
  EXPECT_THAT(thrown_error([&] { (void)comm_->all_gather_into_tensor_coalesced({at::empty({2})}, {}); }),
              HasSubstr("1 outputs but 0 inputs"));
  EXPECT_THAT(thrown_error([&] {
                (void)comm_->reduce_scatter_tensor_coalesced({at::empty({2}), at::empty({3})},
                                                             {at::empty({2}), at::empty({2})}, ReduceOp::sum());
              }),
              HasSubstr("`inputs[1]` has 2 elements, expected size() * outputs[1].numel() = 1 * 3 = 3"));
}

TEST(CommunicatorTest, SizeChecksUseTheGroupSize) {
  auto worlds = thread_worlds(2);
  std::vector<std::string> messages(2);
  run_threads(2, [&](int r) {
    auto comm = worlds[r]->new_group({0, 1}, c10::kCPU);
    // Right for one rank, wrong for two: refused at issue, no Work to wait for.
    messages[r] = thrown_error([&] { (void)comm->all_gather_into_tensor(at::empty({3}), at::empty({3})); });
  });
  EXPECT_THAT(messages[0], HasSubstr("on gloo[0,1]: `output` has 3 elements, expected size() * input.numel() = 2 * 3"));
}

TEST(WorldTest, GroupsDroppedRightAfterCreationDoNotBreakTheirPeers) {
  // Gloo's connect may return on one side of a pair before the other side has
  // finished its handshake; without new_group's barrier a member that drops
  // the group at once closed the socket under its peer now and then.
  auto worlds = thread_worlds(2);
  run_threads(2, [&](int r) {
    for (int i = 0; i < 40; ++i) {
      EXPECT_NO_THROW(worlds[r]->new_group({0, 1}, c10::kCPU)) << "creation " << i << " on rank " << r;
    }
  });
}

TEST(CommunicatorTest, WaitWithTimeoutThrowsACollectiveTimeoutAndCanBeRetried) {
  auto worlds = thread_worlds(2);
  std::promise<void> rank0_timed_out;
  run_threads(2, [&](int r) {
    auto comm = worlds[r]->new_group({0, 1}, c10::kCPU);
    at::Tensor t = at::full({3}, r + 1.0);
    if (r == 1) rank0_timed_out.get_future().wait();  // rank 1 comes late
    Work work = comm->all_reduce(t, ReduceOp::avg());
    if (r == 0) {
      try {
        work.wait(std::chrono::milliseconds(200));
        ADD_FAILURE() << "the wait returned before rank 1 issued the all_reduce";
      } catch (const CollectiveTimeout& e) {
        EXPECT_THAT(e.what_without_backtrace(),
                    HasSubstr("all_reduce(AVG) on gloo[0,1] did not complete within 200 ms"));
        EXPECT_THAT(e.what_without_backtrace(), HasSubstr("wait() may be called again"));
      }
      EXPECT_FALSE(work.is_completed());
      EXPECT_EQ(work.exception(), nullptr);
      rank0_timed_out.set_value();
    }
    work.wait();
    EXPECT_TRUE(t.equal(at::full({3}, 1.5))) << t;
  });
}

TEST(WorldTest, NewGroupRejectsANonMemberCaller) {
  auto worlds = thread_worlds(2);
  const std::string message = thrown_error([&] { worlds[0]->new_group({1}, c10::kCPU); });
  EXPECT_THAT(message, HasSubstr("new_group([1]) on test://threads: this rank (0) is not a member"));
}

TEST(WorldTest, NewGroupRejectsDuplicateMembers) {
  auto worlds = thread_worlds(2);
  EXPECT_THAT(thrown_error([&] {
                worlds[0]->new_group({0, 1, 0}, c10::kCPU);
              }),
              HasSubstr("new_group([0,1,0]) on test://threads: rank 0 is listed twice"));
}

TEST(WorldTest, NewGroupRejectsRanksOutsideTheWorld) {
  auto worlds = thread_worlds(2);
  EXPECT_THAT(thrown_error([&] {
                worlds[0]->new_group({0, 2}, c10::kCPU);
              }),
              HasSubstr("rank 2 is out of range for world size 2"));
  EXPECT_THAT(thrown_error([&] { worlds[0]->new_group({}, c10::kCPU); }), HasSubstr("the member list is empty"));
}

TEST(WorldTest, NewGroupRejectsDevicesWithoutAnEngine) {
  auto world = World::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, "test://single");
  EXPECT_THAT(thrown_error([&] { world->new_group({0}, c10::kMeta); }), HasSubstr("has no collective engine"));
  CommunicatorOptions nccl;
  nccl.backend = BackendKind::kNccl;
  EXPECT_THAT(thrown_error([&] { world->new_group({0}, c10::kCPU, nccl); }), HasSubstr("NCCL moves CUDA tensors only"));
}

TEST(WorldTest, CudaGroupWithoutAGpuFailsClearly) {
  if (fsdp::testing::cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  auto world = World::from_store(c10::make_intrusive<c10d::HashStore>(), 0, 1, "test://single");
  // CUDA builds: no device; CPU-only builds: no NCCL. Both name NCCL.
  EXPECT_THAT(thrown_error([&] { world->new_group({0}, c10::kCUDA); }), HasSubstr("NCCL"));
}

TEST(WorldTest, GroupsOverTheSameRanksAreIndependent) {
  auto worlds = thread_worlds(2);
  run_threads(2, [&](int r) {
    auto first = worlds[r]->new_group({0, 1}, c10::kCPU);
    auto second = worlds[r]->new_group({0, 1}, c10::kCPU);
    auto reversed = worlds[r]->new_group({1, 0}, c10::kCPU);
    EXPECT_EQ(reversed->rank(), 1 - r);
    at::Tensor a = at::full({2}, r + 1.0);
    at::Tensor b = at::full({2}, 10.0 * (r + 1));
    // The ranks issue the two groups' collectives in opposite orders, which
    // only works when the groups share no connections or tags.
    Work wa = r == 0 ? first->all_reduce(a, ReduceOp::sum()) : second->all_reduce(b, ReduceOp::sum());
    Work wb = r == 0 ? second->all_reduce(b, ReduceOp::sum()) : first->all_reduce(a, ReduceOp::sum());
    wa.wait();
    wb.wait();
    EXPECT_TRUE(a.equal(at::full({2}, 3.0)));
    EXPECT_TRUE(b.equal(at::full({2}, 30.0)));
    at::Tensor gathered = at::empty({2});
    reversed->all_gather_into_tensor(gathered, at::full({1}, static_cast<double>(r))).wait();
    EXPECT_TRUE(gathered.equal(at::tensor({1.0f, 0.0f})));  // group-rank order
  });
}

TEST(RendezvousTest, NamesTheMissingRanks) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RendezvousOptions options;
  options.timeout = std::chrono::milliseconds(300);
  std::vector<std::string> messages(4);
  // Ranks 1 and 3 of 4 never come.
  run_threads(2, [&](int i) {
    const int rank = i * 2;
    messages[rank] = thrown_error([&] { World::from_store(store, rank, 4, "test://missing", options); });
  });
  for (int rank : {0, 2}) {
    EXPECT_THAT(messages[rank], HasSubstr("rendezvous test://missing timed out after 300 ms"));
    EXPECT_THAT(messages[rank], HasSubstr("missing rank(s) [1,3] never joined"));
  }
}

TEST(RendezvousTest, RejectsRanksOutsideTheWorld) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(thrown_error([&] { World::from_store(store, 2, 2, "test://x"); }),
              HasSubstr("rank 2 is out of range for world size 2"));
}

TEST(RendezvousTest, FileRendezvousAtWorldSizeOne) {
  char path[] = "/tmp/fsdp2cpp-collectives-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::remove(path);
  auto world = World::from_file(path, 0, 1);
  EXPECT_EQ(world->description(), std::string("file://") + path);
  EXPECT_EQ(world->local_rank(), 0);
  EXPECT_EQ(world->local_size(), 1);
  EXPECT_EQ(world->all_ranks(), std::vector<int>{0});
  auto comm = world->new_group({0}, c10::kCPU);
  at::Tensor t = at::ones({2});
  comm->all_reduce(t, ReduceOp::sum()).wait();
  EXPECT_TRUE(t.equal(at::ones({2})));
  std::remove(path);
}

// ---- env:// -------------------------------------------------------------------

// Sets the torchrun variables for the test and restores them after.
class EnvRendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override { env_.save_and_unset(); }
  void TearDown() override { env_.restore(); }
  void set_single_rank(int port) {
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
  }
  test::SavedEnv env_{{"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"}};
};

TEST_F(EnvRendezvousTest, WorldSizeOne) {
  const int port = free_port();
  set_single_rank(port);
  setenv("LOCAL_RANK", "0", 1);
  setenv("LOCAL_WORLD_SIZE", "1", 1);
  auto world = World::from_env();
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->local_rank(), 0);
  EXPECT_EQ(world->local_size(), 1);
  EXPECT_EQ(world->description(), "env://127.0.0.1:" + std::to_string(port));
  auto comm = world->new_group(world->all_ranks(), c10::kCPU);
  at::Tensor t = at::full({3}, 2.0);
  comm->all_reduce(t, ReduceOp::sum()).wait();
  EXPECT_TRUE(t.equal(at::full({3}, 2.0)));
}

// torchrun's agent hosts the store; rank 0 must join it as a client, under
// the restart attempt's prefix, as torch.distributed does.
TEST_F(EnvRendezvousTest, JoinsTheStoreOfTheTorchrunAgent) {
  const int port = free_port();
  c10d::TCPStoreOptions agent_options;
  agent_options.port = static_cast<std::uint16_t>(port);
  agent_options.isServer = true;
  agent_options.waitWorkers = false;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", agent_options);
  set_single_rank(port);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  auto world = World::from_env();
  EXPECT_TRUE(agent->check({"/worker/attempt_2/fsdp2cpp/rdzv/rank/0"}));
  auto comm = world->new_group({0}, c10::kCPU);
  comm->barrier().wait();
}

TEST_F(EnvRendezvousTest, NamesEachMissingVariable) {
  for (const char* missing : {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"}) {
    set_single_rank(free_port());
    unsetenv(missing);
    EXPECT_THAT(thrown_error([] { World::from_env(); }),
                HasSubstr(std::string("environment variable ") + missing + " is not set"))
        << missing;
  }
}

TEST_F(EnvRendezvousTest, NamesEachMalformedVariable) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"MASTER_PORT", "http"}, {"MASTER_PORT", "0"},     {"MASTER_PORT", "70000"}, {"RANK", "one"},
      {"RANK", "1"},           {"RANK", "-1"},           {"WORLD_SIZE", "0"},      {"WORLD_SIZE", "2x"},
      {"LOCAL_RANK", "1"},     {"LOCAL_WORLD_SIZE", "2"}};
  for (const auto& [var, value] : cases) {
    set_single_rank(free_port());
    setenv(var, value, 1);
    EXPECT_THAT(thrown_error([] { World::from_env(); }),
                HasSubstr(std::string("environment variable ") + var + "='" + value + "' is not an integer in"))
        << var << "=" << value;
    unsetenv("LOCAL_RANK");
    unsetenv("LOCAL_WORLD_SIZE");
  }
}

TEST_F(EnvRendezvousTest, RankWhoseRankZeroNeverCameTimesOutNamingTheAddress) {
  const int port = free_port();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  RendezvousOptions options;
  options.timeout = std::chrono::milliseconds(1000);
  const auto start = std::chrono::steady_clock::now();
  const std::string message = thrown_error([&] { World::from_env(options); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_THAT(message, HasSubstr("rendezvous env://127.0.0.1:" + std::to_string(port) + " timed out"));
  EXPECT_THAT(message, HasSubstr("could not reach the store of rank 0 at 127.0.0.1:" + std::to_string(port)));
}

}  // namespace
}  // namespace fsdp::collectives
