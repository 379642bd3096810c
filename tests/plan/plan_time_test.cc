// The time model's simulation (fsdp_plan/timeline.h) on op sequences small
// enough to add up by hand: overlap and exposure, FSDP's two event edges,
// the report's figures, the Chrome trace, and the profiles' errors.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "fsdp_plan/timeline.h"
#include "kernel_call.h"
#include "trainer_plan.h"

namespace fsdp_plan::test {
namespace {

using ::testing::HasSubstr;

// Round figures: 1 TFLOP/s, 1 GB/s of memory and of link, nothing else
// costs anything.
DeviceProfile round_profile() {
  DeviceProfile p;
  p.name = "round";
  for (double* flops : {&p.peak_flops_bf16, &p.peak_flops_fp32}) *flops = 1e12;
  for (double* bandwidth : {&p.memory_bandwidth, &p.intra_node_bandwidth, &p.inter_node_bandwidth}) *bandwidth = 1e9;
  return p;
}

OpRecord kernel(StepPhase phase, int64_t flops, int64_t bytes, std::vector<int64_t> reads, std::vector<int64_t> writes,
                std::string fsdp_phase = "") {
  OpRecord op;
  op.name = "aten::mm";
  op.flops = flops;
  op.matmul = flops > 0;
  op.bytes = bytes;
  op.dtype = c10::kBFloat16;
  op.step = 1;
  op.step_phase = phase;
  op.reads = std::move(reads);
  op.writes = std::move(writes);
  op.fsdp_phase = std::move(fsdp_phase);
  return op;
}

OpRecord collective(const char* name, int stream, StepPhase phase, int64_t bytes, std::vector<int64_t> reads,
                    std::vector<int64_t> writes) {
  OpRecord op;
  op.kind = OpRecord::Kind::kCollective;
  op.name = name;
  op.stream = stream;
  op.bytes = bytes;
  op.group = std::make_shared<const std::vector<int>>(std::vector<int>{0, 1});
  op.step = 1;
  op.step_phase = phase;
  op.reads = std::move(reads);
  op.writes = std::move(writes);
  return op;
}

// In ms, from the issue order and the data edges:
//   k0  compute, forward: 2 GFLOP                       [0, 2]
//   c1  all-gather of 2 MB over 2 ranks (1 MB moved)    [0, 1]   overlaps k0
//   k2  compute, backward: 1 GFLOP, reads c1's output   [2, 3]
//   c3  reduce-scatter of 4 MB, reads k2's output       [3, 5]   exposed
//   k4  optimizer: 1 MB of memory, reads c3's output    [5, 6]
std::vector<OpRecord> five_ops() {
  return {kernel(StepPhase::kForward, 2'000'000'000, 0, {}, {0}),
          collective("all_gather_into_tensor", 2, StepPhase::kForward, 2'000'000, {}, {1}),
          kernel(StepPhase::kBackward, 1'000'000'000, 0, {1}, {2}),
          collective("reduce_scatter_tensor", 3, StepPhase::kBackward, 4'000'000, {2}, {3}),
          kernel(StepPhase::kOptimizer, 0, 1'000'000, {3}, {4})};
}

TEST(PlanTime, SimulatesOverlapAndExposureByHand) {
  TimelineOptions options;
  options.device = round_profile();
  options.tokens = 1000;
  options.model_flops = 3e9;
  const StepTime t = simulate(five_ops(), 1, options);
  EXPECT_NEAR(t.step_s, 6e-3, 1e-12);
  EXPECT_NEAR(t.compute_s, 4e-3, 1e-12);
  EXPECT_NEAR(t.communication_s, 3e-3, 1e-12);
  EXPECT_NEAR(t.exposed_communication_s, 2e-3, 1e-12);  // the reduce-scatter; the all-gather hides under k0
  EXPECT_NEAR(t.tokens_per_s, 1000 / 6e-3, 1e-6);
  EXPECT_NEAR(t.mfu, 0.5, 1e-12);
  EXPECT_EQ(t.flops, 3'000'000'000);
  ASSERT_EQ(t.ops.size(), 5u);
  EXPECT_NEAR(t.ops[1].start_s, 0, 1e-12);
  EXPECT_NEAR(t.ops[2].start_s, 2e-3, 1e-12);
  EXPECT_NEAR(t.ops[4].start_s, 5e-3, 1e-12);
  ASSERT_EQ(t.phases.size(), 3u);
  EXPECT_NEAR(t.phases[0].wall_s, 2e-3, 1e-12);  // forward until k2 computes
  EXPECT_NEAR(t.phases[0].exposed_s, 0, 1e-12);
  EXPECT_NEAR(t.phases[1].wall_s, 3e-3, 1e-12);
  EXPECT_NEAR(t.phases[1].communication_s, 2e-3, 1e-12);
  EXPECT_NEAR(t.phases[1].exposed_s, 2e-3, 1e-12);
  EXPECT_NEAR(t.phases[2].compute_s, 1e-3, 1e-12);
  EXPECT_THAT(format_time(t), HasSubstr("6.0 ms"));
}

TEST(PlanTime, AStepStartsWhereThePreviousLeftTheStreams) {
  std::vector<OpRecord> ops = five_ops();
  for (OpRecord op : five_ops()) {
    op.step = 2;
    for (int64_t& a : op.reads) a += 10;
    for (int64_t& a : op.writes) a += 10;
    ops.push_back(op);
  }
  TimelineOptions options;
  options.device = round_profile();
  const StepTime t = simulate(ops, 2, options);
  // Step 2's all-gather starts at 1 ms (after step 1's, on its stream) and
  // hides under step 1's tail, so step 2 is its compute and its exposed
  // reduce-scatter: 6 ms from the end of step 1.
  EXPECT_NEAR(t.step_s, 6e-3, 1e-12);
  EXPECT_NEAR(t.ops[6].start_s, 1e-3, 1e-12);
  EXPECT_NEAR(t.ops[5].start_s, 6e-3, 1e-12);
}

// The two event edges beyond data ([Note: FSDP's event edges in the
// simulation]): without them the all-gather would start at 0 and the
// reduce-scatter copy-in at 3 ms.
TEST(PlanTime, AllGathersWaitForTheLastCopyOutAndCopyInsForTheLastReduceScatter) {
  std::vector<OpRecord> ops = {
      kernel(StepPhase::kForward, 3'000'000'000, 0, {}, {0}),                                    // [0, 3]
      kernel(StepPhase::kForward, 0, 1'000'000, {0}, {1}, "FSDP::all_gather_copy_out (b0)"),     // [3, 4]
      collective("all_gather_into_tensor", 2, StepPhase::kForward, 2'000'000, {}, {2}),          // [4, 5]
      collective("reduce_scatter_tensor", 3, StepPhase::kBackward, 8'000'000, {1}, {3}),         // [4, 8]
      kernel(StepPhase::kBackward, 0, 1'000'000, {}, {4}, "FSDP::reduce_scatter_copy_in (b1)"),  // [8, 9]
  };
  TimelineOptions options;
  options.device = round_profile();
  const StepTime t = simulate(ops, 1, options);
  EXPECT_NEAR(t.ops[2].start_s, 4e-3, 1e-12);
  EXPECT_NEAR(t.ops[4].start_s, 8e-3, 1e-12);
  EXPECT_NEAR(t.step_s, 9e-3, 1e-12);
}

// A CUDA job's dry run records the runtime's events (OpRecord::after and
// host_after), and then they, not the two inferred edges above, order the
// streams. The ops above with recorded waits: the all-gather waits for k0
// only and starts at 3 ms (inferred: 4); the reduce-scatter copy-in waits for
// nothing on its stream and starts at 4 ms (inferred: 8), unless the host
// waited for the reduce-scatter before issuing it (a synchronize): 8 ms.
TEST(PlanTime, RecordedEventsOrderTheStreamsInsteadOfTheInferredEdges) {
  std::vector<OpRecord> ops = {
      kernel(StepPhase::kForward, 3'000'000'000, 0, {}, {0}),
      kernel(StepPhase::kForward, 0, 1'000'000, {0}, {1}, "FSDP::all_gather_copy_out (b0)"),
      collective("all_gather_into_tensor", 2, StepPhase::kForward, 2'000'000, {}, {2}),
      collective("reduce_scatter_tensor", 3, StepPhase::kBackward, 8'000'000, {1}, {3}),
      kernel(StepPhase::kBackward, 0, 1'000'000, {}, {4}, "FSDP::reduce_scatter_copy_in (b1)"),
  };
  ops[2].after = {0};
  TimelineOptions options;
  options.device = round_profile();
  StepTime t = simulate(ops, 1, options);
  EXPECT_NEAR(t.ops[2].start_s, 3e-3, 1e-12);
  EXPECT_NEAR(t.ops[3].start_s, 4e-3, 1e-12);
  EXPECT_NEAR(t.ops[4].start_s, 4e-3, 1e-12);
  ops[4].host_after = {3};
  t = simulate(ops, 1, options);
  EXPECT_NEAR(t.ops[4].issue_s, 8e-3, 1e-12);
  EXPECT_NEAR(t.ops[4].start_s, 8e-3, 1e-12);
}

// NCCL runs one communicator's collectives in issue order on its own
// stream: an all-gather and a reduce-scatter of the same communicator issued
// together run one after the other, though FSDP issues them from different
// streams; another communicator's (of the same ranks) runs beside them.
TEST(PlanTime, OneCommunicatorsCollectivesRunInIssueOrder) {
  std::vector<OpRecord> ops = {
      collective("all_gather_into_tensor", 2, StepPhase::kBackward, 2'000'000, {}, {0}),  // 1 ms
      collective("reduce_scatter_tensor", 3, StepPhase::kBackward, 4'000'000, {}, {1}),   // 2 ms
  };
  ops[1].group = ops[0].group;
  TimelineOptions options;
  options.device = round_profile();
  StepTime t = simulate(ops, 1, options);
  EXPECT_NEAR(t.ops[1].start_s, 1e-3, 1e-12);
  EXPECT_NEAR(t.step_s, 3e-3, 1e-12);
  ops[1].group = std::make_shared<const std::vector<int>>(std::vector<int>{0, 1});
  t = simulate(ops, 1, options);
  EXPECT_NEAR(t.ops[1].start_s, 0, 1e-12);
  EXPECT_NEAR(t.step_s, 2e-3, 1e-12);
}

TEST(PlanTime, CollectivesAcrossNodesTakeTheNetworksBandwidth) {
  TimelineOptions options;
  options.device = round_profile();
  options.device.inter_node_bandwidth = 0.25e9;
  options.device.gpus_per_node = 1;  // ranks 0 and 1 on two nodes
  const StepTime t = simulate(five_ops(), 1, options);
  EXPECT_NEAR(t.ops[1].end_s - t.ops[1].start_s, 4e-3, 1e-12);  // 1 MB at 0.25 GB/s
  EXPECT_NEAR(t.ops[3].end_s - t.ops[3].start_s, 8e-3, 1e-12);
}

TEST(PlanTime, ChromeTraceHasOneRowPerStreamAndEveryOpOfTheStep) {
  TimelineOptions options;
  options.device = round_profile();
  const StepTime t = simulate(five_ops(), 1, options);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace(t));
  std::vector<std::string> rows;
  std::vector<double> starts;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") rows.push_back(e["args"]["name"]);
    if (e["ph"] == "X") starts.push_back(e["ts"].get<double>());
  }
  EXPECT_THAT(rows, ::testing::IsSupersetOf({"compute", "all-gather", "reduce-scatter"}));
  ASSERT_EQ(starts.size(), 5u);
  EXPECT_NEAR(starts[2], 2000, 1e-6);  // microseconds
  EXPECT_NEAR(starts[3], 3000, 1e-6);
}

TEST(PlanTime, RejectsAMissingStepAndABadProfileNamingThem) {
  TimelineOptions options;
  options.device = round_profile();
  EXPECT_THAT([&] { simulate(five_ops(), 3, options); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("no op of step 3")));
  options.device.memory_bandwidth = 0;
  EXPECT_THAT([&] { simulate(five_ops(), 1, options); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("memory_bandwidth")));
  EXPECT_FALSE(device_profile("tpu").has_value());
  for (const std::string& name : device_profile_names()) {
    const std::optional<DeviceProfile> p = device_profile(name);
    ASSERT_TRUE(p.has_value()) << name;
    EXPECT_GT(p->peak_flops_bf16, p->peak_flops_fp32) << name;
    EXPECT_FALSE(p->sources.empty()) << name;
  }
}

// CPU offload, in ms: the copy of a 1 MB shard in from the host takes the
// host link (0.25 GB/s: 4 ms), not the device's memory (1 ms); the
// optimizer's kernel on host tensors runs on the host thread once its input
// is ready, at the host's memory bandwidth (3 MB at 1 GB/s), and the host
// issues nothing meanwhile, so the next device kernel starts after it:
//   c0  copy-in, host -> device, 1 MB             [0, 4]
//   k1  forward, 1 GFLOP, reads c0's output       [4, 5]
//   k2  optimizer on the host, 3 MB, reads k1's   [5, 8]
//   k3  optimizer on the device, 1 GFLOP          [8, 9]
TEST(PlanTime, OffloadsCopiesTakeTheHostLinkAndItsOptimizerTheHost) {
  OpRecord copy_in = kernel(StepPhase::kForward, 0, 1'000'000, {}, {0}, "FSDP::all_gather_copy_in (b0)");
  copy_in.name = "aten::copy_";
  copy_in.stream = 1;
  copy_in.host_link_bytes = 1'000'000;
  OpRecord on_host = kernel(StepPhase::kOptimizer, 0, 3'000'000, {1}, {2});
  on_host.name = "aten::addcdiv_";
  on_host.on_host = true;
  const std::vector<OpRecord> ops = {copy_in, kernel(StepPhase::kForward, 1'000'000'000, 0, {0}, {1}), on_host,
                                     kernel(StepPhase::kOptimizer, 1'000'000'000, 0, {}, {3})};
  TimelineOptions options;
  options.device = round_profile();
  options.device.host_link_bandwidth = 0.25e9;
  options.device.host_memory_bandwidth = 1e9;
  const StepTime t = simulate(ops, 1, options);
  ASSERT_EQ(t.ops.size(), 4u);
  EXPECT_NEAR(t.ops[0].end_s, 4e-3, 1e-12);
  EXPECT_NEAR(t.ops[2].start_s, 5e-3, 1e-12);
  EXPECT_NEAR(t.ops[2].end_s, 8e-3, 1e-12);
  EXPECT_EQ(stream_name(t.ops[2].stream), "host (CPU offload's compute)");
  EXPECT_NEAR(t.ops[3].start_s, 8e-3, 1e-12);
  EXPECT_NEAR(t.step_s, 9e-3, 1e-12);
  ASSERT_EQ(t.phases.size(), 3u);
  EXPECT_NEAR(t.phases[2].wall_s, 4e-3, 1e-12);  // the optimizer, from the host's kernel on

  options.device.host_memory_bandwidth = 0;
  EXPECT_THAT([&] { simulate(ops, 1, options); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("host_memory_bandwidth")));
  options.device.host_memory_bandwidth = 1e9;
  options.device.host_link_bandwidth = 0;
  EXPECT_THAT([&] { simulate(ops, 1, options); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("host_link_bandwidth")));
  for (const std::string& name : device_profile_names()) {
    EXPECT_GT(device_profile(name)->host_link_bandwidth, 0) << name;
    EXPECT_GT(device_profile(name)->host_memory_bandwidth, 0) << name;
  }
}

// On a CPU the host's work around each kernel (host_launch_s) and its time
// to issue a collective (host_collective_s) take the host's time. The five
// ops of five_ops(), in ms, with 0.5 around each kernel and 0.25 to issue:
//   k0  [0, 2.5]
//   c1  issued at 2.75, [2.75, 3.75]
//   k2  reads c1's output: [3.75, 5.25]
//   c3  issued at 5.5, reads k2's: [5.5, 7.5]
//   k4  reads c3's: [7.5, 9]
TEST(PlanTime, OnACpuTheHostsWorkAroundKernelsAndCollectivesTakesTime) {
  TimelineOptions options;
  options.device = round_profile();
  options.device.host_computes = true;
  options.device.host_launch_s = 0.5e-3;
  options.device.host_collective_s = 0.25e-3;
  const StepTime t = simulate(five_ops(), 1, options);
  ASSERT_EQ(t.ops.size(), 5u);
  const double expected[5][2] = {{0, 2.5}, {2.75, 3.75}, {3.75, 5.25}, {5.5, 7.5}, {7.5, 9}};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_NEAR(t.ops[i].start_s, expected[i][0] * 1e-3, 1e-12) << i;
    EXPECT_NEAR(t.ops[i].end_s, expected[i][1] * 1e-3, 1e-12) << i;
  }
  EXPECT_NEAR(t.step_s, 9e-3, 1e-12);
  // A GPU's host issues kernels host_launch_s apart and runs none;
  // host_collective_s is a CPU's figure only.
  options.device.host_computes = false;
  options.device.host_launch_s = 0;
  EXPECT_NEAR(simulate(five_ops(), 1, options).step_s, 6e-3, 1e-12);
}

// A CPU's collective waits for its peers: its latency, and
// collective_wait_per_compute for each second the host computed since its
// previous collective. The engine moves the next collective's bytes during
// that wait, so the waits of collectives issued back to back overlap. In
// ms, latency 1, 0.5 per ms computed, each collective moving 1 MB in 1 ms:
//   k0  2 GFLOP                              [0, 2]
//   c1  after 2 ms of computing: 1 + 1 + 1   [2, 5], the engine busy [2, 3]
//   c2  issued right after, nothing computed [3, 5]: waits 1, moves 1
//   k3  reads c2's output                    [5, 6]
TEST(PlanTime, OnACpuCollectivesWaitForLatePeersAndTheirWaitsOverlap) {
  const std::vector<OpRecord> ops = {kernel(StepPhase::kForward, 2'000'000'000, 0, {}, {0}),
                                     collective("all_gather_into_tensor", 2, StepPhase::kForward, 2'000'000, {0}, {1}),
                                     collective("all_gather_into_tensor", 2, StepPhase::kForward, 2'000'000, {}, {2}),
                                     kernel(StepPhase::kForward, 1'000'000'000, 0, {2}, {3})};
  TimelineOptions options;
  options.device = round_profile();
  options.device.host_computes = true;
  options.device.collective_latency_s = 1e-3;
  options.device.collective_wait_per_compute = 0.5;
  const StepTime t = simulate(ops, 1, options);
  ASSERT_EQ(t.ops.size(), 4u);
  const double expected[4][2] = {{0, 2}, {2, 5}, {3, 5}, {5, 6}};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(t.ops[i].start_s, expected[i][0] * 1e-3, 1e-12) << i;
    EXPECT_NEAR(t.ops[i].end_s, expected[i][1] * 1e-3, 1e-12) << i;
  }
  EXPECT_NEAR(t.step_s, 6e-3, 1e-12);
  // On a GPU a collective holds its stream for all of its time, and the
  // wait per second computed is a CPU's figure only: c1 [2, 4], c2 [4, 6].
  options.device.host_computes = false;
  const StepTime gpu = simulate(ops, 1, options);
  EXPECT_NEAR(gpu.ops[1].end_s, 4e-3, 1e-12);
  EXPECT_NEAR(gpu.ops[2].start_s, 4e-3, 1e-12);
  EXPECT_NEAR(gpu.ops[2].end_s, 6e-3, 1e-12);
}

TEST(PlanTime, MeasuresThisMachinesCpu) {
  const DeviceProfile cpu = measure_cpu_profile(/*ranks=*/1, /*threads=*/1);
  EXPECT_TRUE(cpu.host_computes);
  EXPECT_GT(cpu.peak_flops_fp32, 1e8);  // any CPU of this century does 0.1 GFLOP/s on one thread
  EXPECT_GT(cpu.memory_bandwidth, 1e8);
  EXPECT_GT(cpu.kernel_overhead_s, 0);
  // Autograd's and the allocator's work around a kernel: a microsecond or
  // more on any CPU, far less than a millisecond.
  EXPECT_GT(cpu.host_launch_s, 1e-8);
  EXPECT_LT(cpu.host_launch_s, 1e-3);
  EXPECT_EQ(cpu.host_collective_s, 0);  // one rank issues no collective
  EXPECT_EQ(cpu.threads_per_core, 1.0);
  // Two ranks, each with as many threads as there are cores: two threads
  // per core, each rank with half the rate (not compared: two measured
  // rates under a loaded machine's noise); and Gloo's costs measured
  // between the two.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const DeviceProfile shared = measure_cpu_profile(/*ranks=*/2, /*threads=*/cores);
  EXPECT_EQ(shared.threads_per_core, 2.0);
  EXPECT_GT(shared.host_collective_s, 0);
  EXPECT_GE(shared.collective_latency_s, shared.host_collective_s);     // issuing is part of a collective's time
  EXPECT_GT(shared.intra_node_bandwidth, 1e6);                          // loopback moves more than 1 MB/s
  EXPECT_LE(shared.intra_node_bandwidth, shared.memory_bandwidth / 2);  // and copies each byte twice
  EXPECT_LT(shared.collective_latency_s, 1.0);
  EXPECT_GE(shared.collective_wait_per_compute, 0);
  EXPECT_LT(shared.collective_wait_per_compute, 100);
  EXPECT_THAT([] { measure_cpu_profile(/*ranks=*/65, /*threads=*/1); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("at most 64 ranks")));
}

// The CPU profile replays a kernel from its description: every run gets
// fresh inputs, and the hook before each timed run (the cache eviction by
// default) runs once per run, the warm-up included; an op that does not
// exist gives no time.
TEST(PlanTime, AKernelCallRunsAgainWithTheHookBeforeEachRun) {
  detail::KernelCall call;
  call.op = c10::OperatorName("aten::sqrt", "");
  call.arguments.emplace_back(detail::TensorSpec{{64, 64}, {64, 1}, c10::kFloat});
  int hooks = 0;
  const std::optional<double> seconds = detail::time_call(call, /*reps=*/3, [&] { ++hooks; });
  ASSERT_TRUE(seconds.has_value());
  EXPECT_GT(*seconds, 0);
  EXPECT_EQ(hooks, 4);
  EXPECT_TRUE(detail::time_call(call, /*reps=*/1).has_value());  // with the eviction
  call.op = c10::OperatorName("aten::no_such_op", "");
  EXPECT_FALSE(detail::time_call(call, /*reps=*/1, [&] { ++hooks; }).has_value());
  EXPECT_EQ(hooks, 4);
}

// The CPU profile times the plan's own kernels (each distinct call run again
// on CPU tensors), and the simulation uses those times: every kernel with a
// measured call lasts exactly what the profile measured for it.
TEST(PlanTime, CpuProfileTimesThePlansKernelsAndTheSimulationUsesThem) {
  fsdp_train::TrainConfig c;
  c.layers = 1;
  c.dim = 32;
  c.heads = 2;
  c.seq_len = 16;
  DryRunOptions options;
  options.world_size = 2;
  options.engine = fsdp::collectives::BackendKind::kGloo;
  const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(c, options, /*local_batch=*/2, /*steps=*/2);
  std::set<std::string> distinct;
  for (const OpRecord& op : plan.ops) {
    if (op.kind == OpRecord::Kind::kKernel && op.call) distinct.insert(measured_kernel_key(op));
  }
  const DeviceProfile cpu = measure_cpu_profile(/*ranks=*/1, /*threads=*/1, plan.ops);
  ASSERT_TRUE(cpu.measured_kernels != nullptr);
  EXPECT_GE(cpu.measured_kernels->size() * 10, distinct.size() * 9) << "most of the plan's kernels run again";
  TimelineOptions t;
  t.device = cpu;
  const StepTime time = simulate(plan.ops, 2, t);
  ASSERT_EQ(time.ops.size(), plan.ops.size());
  int checked = 0;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const OpRecord& op = plan.ops[i];
    if (op.step != 2 || op.kind != OpRecord::Kind::kKernel || !op.call) continue;
    const auto it = cpu.measured_kernels->find(measured_kernel_key(op));
    if (it == cpu.measured_kernels->end()) continue;
    EXPECT_GT(it->second, 0) << op.name;
    EXPECT_NEAR(time.ops[i].end_s - time.ops[i].start_s, it->second + cpu.host_launch_s, 1e-12) << op.name;
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

}  // namespace
}  // namespace fsdp_plan::test
