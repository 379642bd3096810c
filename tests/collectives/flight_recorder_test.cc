// The flight recorder, the divergence diagnosis over hand-written logs, and
// the environment variables of divergence.h and communicator.h: no peers.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "collectives/communicator.h"
#include "collectives/divergence.h"
#include "collectives/flight_recorder.h"
#include "divergence_monitor.h"  // collectives/src
#include "fsdp_testing/expect_error.h"

namespace fsdp::collectives {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(FlightRecorder, RecordsFingerprintLabelsAndStates) {
  FlightRecorder recorder(/*rank=*/1, /*capacity=*/8);
  const int comm = recorder.register_communicator("gloo[0,1]#0", {0, 1});
  int64_t first = 0, second = 0;
  {
    CollectiveLabel outer("FSDP::pre_forward (layers.3)");
    CollectiveLabel inner("FSDP::all_gather (layers.3)");
    EXPECT_STREQ(CollectiveLabel::current(), "FSDP::all_gather (layers.3)");
    EXPECT_STREQ(CollectiveLabel::enclosing(), "FSDP::pre_forward (layers.3)");
    first = recorder.record_issue(comm, 1, "all_gather_into_tensor", "", at::kFloat, true, 2048, 1);
  }
  EXPECT_EQ(CollectiveLabel::current(), nullptr);
  second = recorder.record_issue(comm, 2, "reduce_scatter_tensor", "AVG", at::kBFloat16, true, 10, 1);
  recorder.mark(first, CollectiveState::kWaiting);
  recorder.mark(first, CollectiveState::kCompleted);
  recorder.mark(second, CollectiveState::kWaiting);

  const FlightLog log = recorder.snapshot();
  EXPECT_EQ(log.rank, 1);
  EXPECT_EQ(log.dropped, 0);
  ASSERT_EQ(log.communicators.size(), 1u);
  EXPECT_EQ(log.communicators[0].global_ranks, (std::vector<int>{0, 1}));
  ASSERT_EQ(log.records.size(), 2u);
  const CollectiveRecord& a = log.records[0];
  EXPECT_EQ(a.communicator, "gloo[0,1]#0");
  EXPECT_EQ(a.seq, 1);
  EXPECT_EQ(a.fingerprint.describe(), "all_gather_into_tensor(Float, 2048 elements) for FSDP::all_gather (layers.3)");
  EXPECT_EQ(a.context, "FSDP::pre_forward (layers.3)");
  EXPECT_EQ(a.state, CollectiveState::kCompleted);
  EXPECT_GE(a.wait_started_ago_s, a.ended_ago_s);
  const CollectiveRecord& b = log.records[1];
  EXPECT_EQ(b.fingerprint.describe(), "reduce_scatter_tensor(AVG, BFloat16, 10 elements)");
  EXPECT_EQ(b.context, "");
  EXPECT_EQ(b.state, CollectiveState::kWaiting);
  EXPECT_LT(b.ended_ago_s, 0);
}

TEST(FlightRecorder, RingKeepsTheLastRecordsAndCountsTheDropped) {
  FlightRecorder recorder(0, 3);
  const int comm = recorder.register_communicator("gloo[0]#0", {0});
  for (int64_t seq = 1; seq <= 5; ++seq) recorder.record_issue(comm, seq, "barrier", "", at::kFloat, false, 0, 0);
  // A mark of an overwritten record changes nothing.
  recorder.mark(1, CollectiveState::kFailed);
  const FlightLog log = recorder.snapshot();
  EXPECT_EQ(log.dropped, 2);
  ASSERT_EQ(log.records.size(), 3u);
  EXPECT_EQ(log.records.front().seq, 3);
  EXPECT_EQ(log.records.back().seq, 5);
  for (const auto& r : log.records) EXPECT_EQ(r.state, CollectiveState::kIssued);
}

TEST(FlightRecorder, LongLabelsAreCutNotOverrun) {
  FlightRecorder recorder(0, 2);
  const int comm = recorder.register_communicator("gloo[0]#0", {0});
  const std::string long_label = "FSDP::all_gather (" + std::string(300, 'x') + ")";
  CollectiveLabel label(long_label);
  recorder.record_issue(comm, 1, "all_reduce", "SUM", at::kFloat, true, 1, 1);
  const std::string kept = recorder.snapshot().records.at(0).fingerprint.label;
  EXPECT_EQ(kept, long_label.substr(0, kept.size()));
  EXPECT_GT(kept.size(), 64u);
  EXPECT_LT(kept.size(), long_label.size());
}

TEST(FlightRecorder, JsonRoundTrip) {
  FlightRecorder recorder(2, 4);
  const int comm = recorder.register_communicator("gloo[0,1,2]#1", {0, 1, 2});
  CollectiveLabel label("FSDP::reduce_scatter (layers.0)");
  const int64_t id = recorder.record_issue(comm, 7, "reduce_scatter_tensor", "SUM", at::kFloat, true, 12, 1);
  recorder.mark(id, CollectiveState::kFailed);
  FlightLog log = recorder.snapshot();
  log.diagnosing = true;
  const FlightLog back = flight_log_from_json(to_json(log));
  EXPECT_EQ(back.rank, 2);
  EXPECT_TRUE(back.diagnosing);
  ASSERT_EQ(back.communicators.size(), 1u);
  EXPECT_EQ(back.communicators[0].id, "gloo[0,1,2]#1");
  ASSERT_EQ(back.records.size(), 1u);
  EXPECT_EQ(back.records[0].fingerprint, log.records[0].fingerprint);
  EXPECT_EQ(back.records[0].seq, 7);
  EXPECT_EQ(back.records[0].state, CollectiveState::kFailed);
  FSDP2CPP_EXPECT_THROW_WITH(flight_log_from_json("{\"rank\": 1}"), "not valid JSON of the dump format");
}

// Logs written as ranks would publish them, for diagnose_divergence.
struct LogBuilder {
  FlightLog log;
  explicit LogBuilder(int rank, std::vector<int> members = {0, 1, 2}) {
    log.rank = rank;
    log.communicators.push_back({"gloo[0,1,2]#0", std::move(members)});
  }
  LogBuilder& add(int64_t seq, const std::string& op, const std::string& label, const std::string& context,
                  CollectiveState state = CollectiveState::kCompleted, const std::string& comm = "gloo[0,1,2]#0",
                  int64_t numel = 78) {
    CollectiveRecord r;
    r.communicator = comm;
    r.seq = seq;
    r.fingerprint.op = op;
    r.fingerprint.dtype = "Float";
    r.fingerprint.numel = numel;
    r.fingerprint.tensors = 1;
    r.fingerprint.label = label;
    r.context = context;
    r.state = state;
    r.issued_ago_s = 40.0 - static_cast<double>(seq);
    r.wait_started_ago_s = state == CollectiveState::kWaiting ? 3.0 : -1;
    log.records.push_back(r);
    return *this;
  }
};

TEST(DiagnoseDivergence, NamesTheFirstCollectiveThatDiffersAndEachSide) {
  auto common = [](LogBuilder& b) {
    b.add(1, "all_gather_into_tensor", "FSDP::all_gather (layers.0)", "FSDP::pre_forward (layers.0)");
  };
  LogBuilder r0(0), r1(1), r2(2);
  common(r0), common(r1), common(r2);
  r0.add(2, "all_gather_into_tensor", "FSDP::all_gather (layers.3)", "FSDP::pre_forward (layers.3)",
         CollectiveState::kWaiting);
  r1.add(2, "all_gather_into_tensor", "FSDP::all_gather (layers.3)", "FSDP::pre_forward (layers.3)",
         CollectiveState::kWaiting);
  r2.add(2, "reduce_scatter_tensor", "FSDP::reduce_scatter (layers.2)", "FSDP::post_backward (layers.2)",
         CollectiveState::kWaiting);
  const std::string text = diagnose_divergence({r0.log, r1.log, r2.log}, 0, 3.0);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #2 of gloo[0,1,2]#0:")) << text;
  EXPECT_THAT(text, HasSubstr("ranks 0,1 issued all_gather_into_tensor(Float, 78 elements) for FSDP::all_gather "
                              "(layers.3) [in FSDP::pre_forward (layers.3)]"))
      << text;
  EXPECT_THAT(text, HasSubstr("rank 2 issued reduce_scatter_tensor(Float, 78 elements) for FSDP::reduce_scatter "
                              "(layers.2)"))
      << text;
  EXPECT_THAT(text, HasSubstr("rank 2: waiting 3 s for #2 of gloo[0,1,2]#0")) << text;
}

// Ranks that issue the same collective of the same group with different
// sizes (an expert that got no token on one rank, and so no gradient to
// reduce) diverge, and the diagnosis names both sizes and the likely cause.
TEST(DiagnoseDivergence, ReduceScattersThatDifferOnlyInSizeAreNamedWithTheUnusedParameterHint) {
  LogBuilder r0(0, {0, 1}), r1(1, {0, 1});
  r0.add(1, "reduce_scatter_tensor", "FSDP::reduce_scatter (blocks.0)", "FSDP::post_backward (blocks.0)",
         CollectiveState::kFailed, "gloo[0,1,2]#0", 99456);
  r1.add(1, "reduce_scatter_tensor", "FSDP::reduce_scatter (blocks.0)", "FSDP::post_backward (blocks.0)",
         CollectiveState::kFailed, "gloo[0,1,2]#0", 66304);
  const std::string text = diagnose_divergence({r0.log, r1.log}, 1, 0.2);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #1 of gloo[0,1,2]#0:")) << text;
  EXPECT_THAT(text, HasSubstr("rank 0 issued reduce_scatter_tensor(Float, 99456 elements) for FSDP::reduce_scatter "
                              "(blocks.0)"))
      << text;
  EXPECT_THAT(text, HasSubstr("rank 1 issued reduce_scatter_tensor(Float, 66304 elements)")) << text;
  EXPECT_THAT(text, HasSubstr("set_reduce_scatter_unused_params(true)")) << text;
  // All-gathers of different sizes are not that case: no hint.
  LogBuilder a0(0, {0, 1}), a1(1, {0, 1});
  a0.add(1, "all_gather_into_tensor", "FSDP::all_gather (blocks.0)", "", CollectiveState::kFailed, "gloo[0,1,2]#0", 8);
  a1.add(1, "all_gather_into_tensor", "FSDP::all_gather (blocks.0)", "", CollectiveState::kFailed, "gloo[0,1,2]#0", 6);
  const std::string gathers = diagnose_divergence({a0.log, a1.log}, 0, 0.2);
  EXPECT_THAT(gathers, HasSubstr("8 elements")) << gathers;
  EXPECT_THAT(gathers, Not(HasSubstr("set_reduce_scatter_unused_params"))) << gathers;
}

// The same collective of the same group, once from the forward and once from
// the backward, is a divergence: the pass is part of what must agree.
TEST(DiagnoseDivergence, ForwardAndBackwardAllGathersOfOneGroupDiffer) {
  LogBuilder r0(0, {0, 1}), r1(1, {0, 1});
  r0.add(1, "all_gather_into_tensor", "FSDP::all_gather (layers.1)", "FSDP::pre_forward (layers.1)",
         CollectiveState::kWaiting);
  r1.add(1, "all_gather_into_tensor", "FSDP::all_gather (layers.1)", "FSDP::pre_backward (layers.1)",
         CollectiveState::kWaiting);
  const std::string text = diagnose_divergence({r0.log, r1.log}, 1, 3.0);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #1")) << text;
  EXPECT_THAT(text, HasSubstr("rank 1 issued all_gather_into_tensor(Float, 78 elements) for FSDP::all_gather "
                              "(layers.1) [in FSDP::pre_backward (layers.1)]"))
      << text;
}

TEST(DiagnoseDivergence, NamesARankThatStoppedIssuingAndOneThatDidNotAnswer) {
  LogBuilder r0(0), r1(1);
  r0.add(1, "all_reduce", "", "").add(2, "all_reduce", "", "", CollectiveState::kWaiting);
  r1.add(1, "all_reduce", "", "");
  const std::string text = diagnose_divergence({r0.log, r1.log, std::nullopt}, 0, 3.0);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #2")) << text;
  EXPECT_THAT(text, HasSubstr("rank 1 has issued nothing on it since #1, 39 s ago (stalled in user code")) << text;
  EXPECT_THAT(text, HasSubstr("rank 1: in no collective; last issued #1")) << text;
  EXPECT_THAT(text, HasSubstr("rank 2: did not answer")) << text;
}

TEST(DiagnoseDivergence, RanksThatAgreeAreSaidToAgree) {
  LogBuilder r0(0, {0, 1}), r1(1, {0, 1});
  r0.add(1, "all_reduce", "", "", CollectiveState::kWaiting);
  r1.add(1, "all_reduce", "", "", CollectiveState::kWaiting);
  const std::string text = diagnose_divergence({r0.log, r1.log}, 0, 3.0);
  EXPECT_THAT(text, Not(HasSubstr("ranks diverged"))) << text;
  EXPECT_THAT(text, HasSubstr("every rank that answered issued the same collectives in the same order")) << text;
}

// Records the ring dropped prove nothing: a rank whose ring starts later is
// compared from its first record on.
TEST(DiagnoseDivergence, IgnoresWhatARingDropped) {
  LogBuilder r0(0, {0, 1}), r1(1, {0, 1});
  r0.add(1, "all_reduce", "a", "")
      .add(2, "all_reduce", "b", "")
      .add(3, "all_reduce", "c", "", CollectiveState::kWaiting);
  r1.add(2, "all_reduce", "b", "").add(3, "barrier", "", "", CollectiveState::kWaiting);
  r1.log.dropped = 1;
  const std::string text = diagnose_divergence({r0.log, r1.log}, 0, 3.0);
  EXPECT_THAT(text, HasSubstr("ranks diverged at collective #3")) << text;
}

class DivergenceEnv : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* name :
         {"FSDP2CPP_DIVERGENCE_TIMEOUT_S", "FSDP2CPP_FLIGHT_RECORDER_SIZE", "FSDP2CPP_FLIGHT_RECORDER_DIR",
          "FSDP2CPP_STRICT_COLLECTIVES", "FSDP2CPP_COLLECTIVE_TIMEOUT_S"}) {
      ::unsetenv(name);
    }
  }
};

TEST_F(DivergenceEnv, OptionsComeFromTheEnvironment) {
  const DivergenceOptions defaults = DivergenceOptions::from_env();
  EXPECT_EQ(defaults.timeout, std::chrono::seconds(30));
  EXPECT_FALSE(defaults.strict);
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "2.5", 1);
  ::setenv("FSDP2CPP_FLIGHT_RECORDER_SIZE", "16", 1);
  ::setenv("FSDP2CPP_FLIGHT_RECORDER_DIR", "/tmp/fr", 1);
  ::setenv("FSDP2CPP_STRICT_COLLECTIVES", "1", 1);
  const DivergenceOptions o = DivergenceOptions::from_env();
  EXPECT_EQ(o.timeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(o.recorder_capacity, 16u);
  EXPECT_EQ(o.dump_dir, "/tmp/fr");
  EXPECT_TRUE(o.strict);
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "0", 1);
  EXPECT_EQ(DivergenceOptions::from_env().timeout.count(), 0);
}

TEST_F(DivergenceEnv, MalformedVariablesAreNamed) {
  ::setenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S", "soon", 1);
  FSDP2CPP_EXPECT_THROW_WITH(DivergenceOptions::from_env(), "FSDP2CPP_DIVERGENCE_TIMEOUT_S='soon'", "non-negative");
  ::unsetenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S");
  ::setenv("FSDP2CPP_FLIGHT_RECORDER_SIZE", "0", 1);
  FSDP2CPP_EXPECT_THROW_WITH(DivergenceOptions::from_env(), "FSDP2CPP_FLIGHT_RECORDER_SIZE='0'");
  ::unsetenv("FSDP2CPP_FLIGHT_RECORDER_SIZE");
  ::setenv("FSDP2CPP_STRICT_COLLECTIVES", "yes", 1);
  FSDP2CPP_EXPECT_THROW_WITH(DivergenceOptions::from_env(), "FSDP2CPP_STRICT_COLLECTIVES='yes'", "neither 0 nor 1");
}

// A collective whose engine never completes it, waited for as NCCL waits
// (the wait orders a stream and returns): the host is not blocked, and the
// monitor's watchdog makes the divergence diagnosis after the timeout,
// prints it and ends the process, as it does for a blocked Gloo wait.
class NeverCompletes : public c10d::Work {
 public:
  NeverCompletes() : c10d::Work(/*rank=*/0, c10d::OpType::ALLGATHER) {}
  bool isCompleted() override { return false; }
  bool wait(std::chrono::milliseconds timeout) override {
    // ProcessGroupNCCL: a timeout blocks the host until it expires, then
    // fails; without one, only a stream waits.
    if (timeout != ::kNoTimeout) {
      std::this_thread::sleep_for(timeout);
      TORCH_CHECK(false, "timed out (NeverCompletes)");
    }
    return true;
  }
};

void wait_for_a_collective_that_never_completes() {
  DivergenceOptions options;
  options.timeout = std::chrono::milliseconds(300);
  auto monitor = std::make_shared<detail::DivergenceMonitor>(c10::make_intrusive<c10d::HashStore>(), /*rank=*/0,
                                                             /*world_size=*/2, options);
  const int comm = monitor->recorder().register_communicator("nccl[0,1]#0", {0, 1});
  const int64_t record =
      monitor->recorder().record_issue(comm, 1, "all_gather_into_tensor", "", c10::kFloat, true, 64, 1);
  Work work(c10::make_intrusive<NeverCompletes>(), "all_gather_into_tensor on nccl[0,1]");
  work.set_record(monitor, record);
  work.set_stream_ordered(true);
  work.wait();
  std::fprintf(stderr, "the wait returned\n");
  std::this_thread::sleep_for(std::chrono::seconds(60));
  std::fprintf(stderr, "the watchdog did not end the process\n");
  std::exit(0);
}

TEST(DivergenceWatchdog, AStreamOrderedWaitReturnsAndTheWatchdogDiagnosesTheStall) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(wait_for_a_collective_that_never_completes(), ::testing::ExitedWithCode(1),
              "the wait returned(.|\n)*a collective that a stream waits for has not completed after(.|\n)*"
              "rank 0: waiting .* for #1 of nccl\\[0,1\\]#0(.|\n)*rank 1: did not answer(.|\n)*rank 0 exits");
}

TEST_F(DivergenceEnv, CollectiveTimeoutComesFromTheEnvironment) {
  EXPECT_EQ(default_collective_timeout(), std::chrono::minutes(5));
  EXPECT_EQ(CommunicatorOptions{}.timeout, std::chrono::minutes(5));
  ::setenv("FSDP2CPP_COLLECTIVE_TIMEOUT_S", "90.5", 1);
  EXPECT_EQ(default_collective_timeout(), std::chrono::milliseconds(90500));
  EXPECT_EQ(CommunicatorOptions{}.timeout, std::chrono::milliseconds(90500));
  for (const char* bad : {"0", "-3", "ten", "0.0001"}) {
    ::setenv("FSDP2CPP_COLLECTIVE_TIMEOUT_S", bad, 1);
    const std::string named = "FSDP2CPP_COLLECTIVE_TIMEOUT_S='" + std::string(bad) + "'";
    FSDP2CPP_EXPECT_THROW_WITH(default_collective_timeout(), named.c_str());
  }
}

}  // namespace
}  // namespace fsdp::collectives
