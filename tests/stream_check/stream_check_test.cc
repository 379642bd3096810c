// The stream-order checker's model on hand-written stream programs: a correct
// one reports nothing, and each missing edge (event, wait, record_stream, a
// block freed too early) is reported with both accesses named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "stream_check/stream_check.h"

namespace fsdp::stream_check {
namespace {

using ::testing::HasSubstr;

// Makes `waiter` wait for everything enqueued on `stream` so far.
void wait_stream(const c10::Stream& waiter, const c10::Stream& stream) {
  c10::Event e(c10::kCPU);
  e.record(stream);
  e.block(waiter);
}

c10::Stream current_stream() {
  const c10::impl::VirtualGuardImpl impl(c10::kCPU);
  return impl.getStream(impl.getDevice());
}

// The example of stream_check.h, as it is there.
TEST(StreamCheck, HeaderExample) {
  fsdp::stream_check::Checker checker;
  c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({4});  // written on the default stream
  {
    c10::StreamGuard guard(side);
    t.add_(1);  // not ordered after the write
  }
  ASSERT_EQ(checker.reports().size(), 1u);
}

// `stream` waits for the default stream, then reads `t`.
void read_after_default_stream(const c10::Stream& stream, const at::Tensor& t) {
  wait_stream(stream, current_stream());
  c10::StreamGuard guard(stream);
  at::Tensor sum = t.sum();
}

TEST(StreamCheck, CorrectProgramReportsNothing) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  const c10::Stream main = current_stream();
  at::Tensor t = at::ones({8});
  at::Tensor out;
  wait_stream(side, main);
  {
    c10::StreamGuard guard(side);
    t.mul_(3);
    out = t + 1;  // allocated on side, read later on main
  }
  wait_stream(main, side);
  EXPECT_EQ(out.sum().item<float>(), 32.0f);
  t = at::Tensor();
  out = at::Tensor();
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
}

TEST(StreamCheck, MissingEventIsAReadAfterWrite) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({8});
  name_buffer(t, "the test buffer");
  {
    PhaseLabel phase("FSDP::test_phase");
    c10::StreamGuard guard(side);
    at::Tensor u = t * 2;
  }
  const std::vector<Report> reports = checker.reports();
  ASSERT_EQ(reports.size(), 1u);
  const Report& r = reports.front();
  EXPECT_EQ(r.kind, Report::Kind::kReadAfterWrite);
  EXPECT_EQ(r.buffer, "the test buffer");
  EXPECT_EQ(r.first_stream, "default (compute)");
  EXPECT_EQ(r.second_stream, "side");
  EXPECT_EQ(r.second_phase, "FSDP::test_phase");
  EXPECT_EQ(r.first_op, "aten::ones");
  EXPECT_EQ(r.second_op, "aten::mul");
  EXPECT_THAT(r.message, HasSubstr("Missing edge: default (compute) -> side"));
}

TEST(StreamCheck, WriteAfterAnUnorderedReadIsReported) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({4});
  wait_stream(side, current_stream());
  {
    c10::StreamGuard guard(side);
    at::Tensor u = t + 1;  // reads t on side
  }
  t.zero_();  // overwrites it on the default stream without waiting for side
  const std::vector<Report> reports = checker.reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.front().kind, Report::Kind::kWriteAfterRead);
  EXPECT_EQ(reports.front().first_stream, "side");
  EXPECT_EQ(reports.front().second_op, "aten::zero_");
}

TEST(StreamCheck, BlockFreedTooEarlyIsReported) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({16});  // allocated on the default stream
  read_after_default_stream(side, t);
  t = at::Tensor();  // freed while side may still read it
  const std::vector<Report> reports = checker.reports();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.front().kind, Report::Kind::kFreedInUse);
  EXPECT_EQ(reports.front().first_stream, "side");
  EXPECT_EQ(reports.front().second_stream, "default (compute)");
  EXPECT_THAT(reports.front().message, HasSubstr("record_stream(side)"));
}

TEST(StreamCheck, RecordStreamCoversTheFree) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({16});
  read_after_default_stream(side, t);
  c10::impl::VirtualGuardImpl(c10::kCPU).recordDataPtrOnStream(t.storage().data_ptr(), side);
  t = at::Tensor();
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
}

// The allocator records an event on the recorded stream at the free: what
// that stream waited for before the free is covered too (an access by a
// collective's stream that the recorded stream waited for), what it did not
// wait for is not.
TEST(StreamCheck, RecordStreamCoversWhatThatStreamWaitedFor) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  const c10::Stream other = checker.new_stream("other");
  for (bool side_waits : {true, false}) {
    checker.clear_reports();
    at::Tensor t = at::ones({16});
    read_after_default_stream(other, t);
    if (side_waits) wait_stream(side, other);
    c10::impl::VirtualGuardImpl(c10::kCPU).recordDataPtrOnStream(t.storage().data_ptr(), side);
    t = at::Tensor();
    EXPECT_EQ(checker.reports().size(), side_waits ? 0u : 1u) << "side waits: " << side_waits;
  }
}

TEST(StreamCheck, WaitingBeforeTheFreeCoversIt) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({16});
  read_after_default_stream(side, t);
  wait_stream(current_stream(), side);
  t = at::Tensor();
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
}

TEST(StreamCheck, HostSynchronizeOrdersEveryStream) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::empty({4});
  wait_stream(side, current_stream());  // ordered after the allocation
  c10::Event done(c10::kCPU);
  {
    c10::StreamGuard guard(side);
    t.fill_(2);
    done.record(side);
  }
  done.synchronize();
  EXPECT_EQ(t.sum().item<float>(), 8.0f);
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
}

TEST(StreamCheck, DisjointSlicesOfOneBufferMayBeWrittenConcurrently) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::empty({8});
  wait_stream(side, current_stream());
  t.narrow(0, 0, 4).fill_(1);
  {
    c10::StreamGuard guard(side);
    t.narrow(0, 4, 4).fill_(2);
  }
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
  {
    c10::StreamGuard guard(side);
    t.narrow(0, 2, 4).fill_(3);  // overlaps the default stream's half
  }
  ASSERT_EQ(checker.reports().size(), 1u);
  EXPECT_EQ(checker.reports().front().kind, Report::Kind::kWriteAfterWrite);
}

TEST(StreamCheck, TheSameRaceIsReportedOnce) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({4});
  for (int step = 0; step < 3; ++step) {
    c10::StreamGuard guard(side);
    at::Tensor u = t * 2;  // the same unordered read of the same write
  }
  ASSERT_EQ(checker.reports().size(), 1u);
  // A write on the default stream now races with those reads: a new report.
  t.add_(1);
  ASSERT_EQ(checker.reports().size(), 2u);
  EXPECT_EQ(checker.reports().back().kind, Report::Kind::kWriteAfterRead);
}

TEST(StreamCheck, ThrowModeFailsTheRacingOp) {
  Checker checker(Options{OnRace::kThrow});
  const c10::Stream side = checker.new_stream("side");
  at::Tensor t = at::ones({4});
  c10::StreamGuard guard(side);
  try {
    at::Tensor u = t * 2;
    FAIL() << "the racing op did not throw";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("read after write"));
  }
}

// The allocator's other half: a block allocated on the default stream may
// still be in use by work queued there for its previous occupant, so a side
// stream that fills it must first wait for the default stream's position at
// the allocation.
TEST(StreamCheck, AnotherStreamMustBeOrderedAfterTheAllocation) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  for (bool ordered : {false, true}) {
    checker.clear_reports();
    at::Tensor t;
    {
      PhaseLabel phase("FSDP::test_allocation");
      t = at::empty({8});
    }
    name_buffer(t, "the test buffer");
    if (ordered) wait_stream(side, current_stream());
    {
      PhaseLabel phase("FSDP::test_fill");
      c10::StreamGuard guard(side);
      t.fill_(1);
    }
    wait_stream(current_stream(), side);
    const std::vector<Report> reports = checker.reports();
    if (ordered) {
      EXPECT_TRUE(reports.empty()) << reports.front().message;
      continue;
    }
    ASSERT_EQ(reports.size(), 1u);
    const Report& r = reports.front();
    EXPECT_EQ(r.kind, Report::Kind::kUsedBeforeAllocationOrdered);
    EXPECT_EQ(r.buffer, "the test buffer");
    EXPECT_EQ(r.first_stream, "default (compute)");
    EXPECT_EQ(r.first_phase, "FSDP::test_allocation");
    EXPECT_EQ(r.second_stream, "side");
    EXPECT_EQ(r.second_phase, "FSDP::test_fill");
    EXPECT_EQ(r.second_op, "aten::fill_");
    EXPECT_THAT(r.message, HasSubstr("allocated on the default (compute) stream"));
    EXPECT_THAT(r.message, HasSubstr("Missing edge: default (compute) -> side"));
  }
}

// Every way the host waits for a stream is counted, with the phase it was
// made in, as torch.cuda.set_sync_debug_mode reports them on a GPU; an
// engine's blocking wait (host_wait) also orders every stream after it.
TEST(StreamCheck, HostSynchronizationsAreCountedWithTheirPhase) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  EXPECT_TRUE(host_syncs().empty());
  at::Tensor t = at::ones({4});
  {
    PhaseLabel phase("FSDP::test_read");
    EXPECT_EQ(t.sum().item<float>(), 4.0f);
  }
  c10::Event recorded(c10::kCPU);
  recorded.record(current_stream());
  recorded.synchronize();
  wait_stream(side, current_stream());
  c10::Event filled(c10::kCPU);
  {
    c10::StreamGuard guard(side);
    t.fill_(2);
    filled.record(side);
  }
  host_wait(filled, "a test engine's blocking wait");
  EXPECT_EQ(t.sum().item<float>(), 8.0f);  // ordered after side's fill by the host wait
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
  const std::vector<HostSync> syncs = host_syncs();
  ASSERT_EQ(syncs.size(), 4u);
  EXPECT_THAT(syncs[0].what, HasSubstr("aten::_local_scalar_dense"));
  EXPECT_EQ(syncs[0].phase, "FSDP::test_read");
  EXPECT_EQ(syncs[1].what, "event synchronize");
  EXPECT_EQ(syncs[1].phase, "outside the FSDP phases");
  EXPECT_EQ(syncs[2].what, "a test engine's blocking wait");
  EXPECT_THAT(syncs[3].what, HasSubstr("aten::_local_scalar_dense"));
  clear_host_syncs();
  EXPECT_TRUE(host_syncs().empty());
}

TEST(StreamCheck, TheCollectiveModelComesFromTheEnvironment) {
  ::unsetenv("FSDP2CPP_STREAM_CHECK_MODEL");
  EXPECT_EQ(collective_model_from_env(), CollectiveModel::kGloo);
  ::setenv("FSDP2CPP_STREAM_CHECK_MODEL", "nccl", 1);
  EXPECT_EQ(collective_model_from_env(), CollectiveModel::kNccl);
  {
    Checker checker;
    EXPECT_TRUE(models_nccl());
  }
  EXPECT_FALSE(models_nccl());
  ::setenv("FSDP2CPP_STREAM_CHECK_MODEL", "mpi", 1);
  try {
    collective_model_from_env();
    ADD_FAILURE() << "an unknown model was accepted";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("FSDP2CPP_STREAM_CHECK_MODEL='mpi' is neither gloo nor nccl"));
  }
  ::unsetenv("FSDP2CPP_STREAM_CHECK_MODEL");
}

TEST(StreamCheck, OneCheckerAtATimeAndCpuWorksAfterIt) {
  {
    Checker checker;
    EXPECT_TRUE(active());
    try {
      Checker second;
      FAIL() << "a second Checker was made";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("already alive"));
    }
  }
  EXPECT_FALSE(active());
  at::Tensor t = at::ones({4});
  EXPECT_EQ((t * 2).sum().item<float>(), 8.0f);
}

}  // namespace
}  // namespace fsdp::stream_check
