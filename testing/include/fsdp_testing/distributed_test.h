// Multi-process tests with GoogleTest: run one test body on N real processes.
//
// The counterpart of PyTorch's MultiProcessTestCase / FSDPTest for C++. A test
// calls run_distributed() with a world size; the harness starts that many
// copies of the test binary, each running only the current test as one rank
// (rank, world size and a fresh file:// rendezvous come through the
// environment), and reports every rank's failures with the rank and its
// output. A rank that crashes fails the test with its exit status; a run that
// does not finish within the timeout is killed and fails, naming the ranks
// still running, so a hang never stalls CI
// (examples/distributed_test_example.cc):
//
//   TEST(AllReduce, SumsAcrossRanks) {
//     fsdp::testing::run_distributed(3, [](fsdp::testing::RankContext& ctx) {
//       auto t = at::full({4}, ctx.rank() + 1.0);
//       ctx.world_group()->all_reduce(t, fsdp::collectives::ReduceOp::sum()).wait();
//       EXPECT_TRUE(t.equal(at::full({4}, 6.0)));
//     });
//   }
//
// Inside the body, use EXPECT_*/ASSERT_* as usual. Label such tests
// `distributed` in CTest. Each rank runs with one intra-op thread so that
// several ranks share the cores of one machine fairly.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "collectives/communicator.h"
#include "collectives/world.h"
#include "device_mesh/device_mesh.h"

namespace fsdp::testing {

struct DistributedTestOptions {
  int world_size = 2;
  // Optional mesh for RankContext::mesh(); default: 1-D over all ranks.
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> mesh_dim_names;
  // Device of the ranks. CUDA ranks use GPU (local_rank % device_count).
  c10::DeviceType device_type = c10::kCPU;
  collectives::CommunicatorOptions communicator;
  // Whole-run deadline, after which every rank still running is killed.
  std::chrono::seconds timeout{180};
};

// hsdp_options
//
// The options of an HSDP test: `replicas * shards` ranks, and a mesh of shape
// {replicas, shards} named {"replicate", "shard"}, as fully_shard wants a 2-D
// mesh; the other fields default. hsdp_options(2, 2) is the usual 2x2.
DistributedTestOptions hsdp_options(int64_t replicas, int64_t shards);

// cuda_options
//
// The options of a test on `world_size` CUDA ranks: with kAuto, NCCL (one
// GPU per rank); with kGloo, Gloo moving CUDA tensors (ranks may share a GPU).
DistributedTestOptions cuda_options(int world_size, collectives::BackendKind backend = collectives::BackendKind::kAuto);

// What one rank sees inside the test body.
class RankContext {
 public:
  int rank() const;
  int world_size() const;
  // This rank's device (cuda:<local_rank % device_count> for CUDA runs).
  c10::Device device() const;
  const std::shared_ptr<collectives::World>& world() const;
  // The group of all ranks on the run's device type (created on first use).
  const std::shared_ptr<collectives::Communicator>& world_group();
  // The mesh of the options (created on first use; collective on first use).
  const DeviceMesh& mesh();

  RankContext(std::shared_ptr<collectives::World> world, DistributedTestOptions options);

 private:
  std::shared_ptr<collectives::World> world_;
  DistributedTestOptions options_;
  std::shared_ptr<collectives::Communicator> world_group_;
  std::unique_ptr<DeviceMesh> mesh_;
};

using RankBody = std::function<void(RankContext&)>;

// How one rank process ended.
struct RankOutcome {
  int rank = -1;
  bool exited = false;     // exited normally (else killed by a signal or timed out)
  int exit_code = -1;      // when exited
  int signal = 0;          // when killed by a signal
  bool timed_out = false;  // killed by the harness at the deadline
  // The rank process reached the body of this run_distributed call. False
  // when it died first, or when the test returned before making the call in
  // the rank process (a rank that exits 0 without running the body is not
  // ok: that would be a silent pass).
  bool body_ran = false;
  double seconds = 0;  // wall time from start to exit (or to the kill)
  std::string output;  // stdout and stderr, interleaved
  // When timed out: every thread's stack at the deadline, as gdb printed
  // them before the kill ("Thread ..." and "#N ..." lines); empty when gdb is
  // not on PATH or FSDP2CPP_TEST_STACKS=0.
  std::string stacks;
  bool ok() const { return exited && exit_code == 0 && body_ran; }
  // One line: the rank and how it ended ("rank 1: killed by signal 6
  // (SIGABRT: Aborted) after 0.4s", "rank 0: timed out after 5.0s, still
  // running; killed with SIGKILL", "rank 2: exited with code 1 after 1.2s").
  std::string describe() const;
};

// Runs `body` on options.world_size processes and records a GoogleTest
// failure for every rank that failed, crashed or timed out, with its output.
// In a rank process it runs the body as that rank instead.
//
// A test may call run_distributed several times (e.g. over world sizes); the
// rank processes of the k-th call run only the k-th body and skip the others.
// Code after the call also runs in the rank processes: guard parent-only
// checks with `if (is_rank_process()) return;`.
//
// Environment: FSDP2CPP_TEST_VERBOSE=1 prints every rank's output, also when
// it passed; FSDP2CPP_TEST_STACKS=0 skips the thread stacks of ranks that
// timed out (RankOutcome::stacks), which otherwise cost gdb a few seconds per
// rank. The rank processes see FSDP2CPP_TEST_RANK,
// FSDP2CPP_TEST_WORLD_SIZE, FSDP2CPP_TEST_STORE and FSDP2CPP_TEST_NAME.
void run_distributed(const DistributedTestOptions& options, const RankBody& body);
void run_distributed(int world_size, const RankBody& body);

// Like run_distributed, but returns each rank's outcome instead of failing:
// for tests that expect a rank to crash or hang. In a rank process it runs
// the body and returns an empty vector.
std::vector<RankOutcome> run_distributed_collect(const DistributedTestOptions& options, const RankBody& body);

// True inside a rank process started by the harness.
bool is_rank_process();

// Number of CUDA devices usable by this process (0 in a build without CUDA).
int cuda_device_count();

}  // namespace fsdp::testing

// Skips the current test (from the test body, before run_distributed) when no
// GPU is present.
#define FSDP2CPP_SKIP_WITHOUT_CUDA()                                                 \
  do {                                                                               \
    if (::fsdp::testing::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (false)
