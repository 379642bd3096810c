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

// What a test expects of a Report: its kind, and each field given (an empty
// one is not checked).
struct ExpectedReport {
  Report::Kind kind;
  std::string buffer;
  std::string first_stream, first_phase, first_op;
  std::string second_stream, second_phase, second_op;
};

void expect_report(const Report& r, const ExpectedReport& expected) {
  EXPECT_EQ(r.kind, expected.kind);
  auto expect_field = [](const char* name, const std::string& actual, const std::string& wanted) {
    if (!wanted.empty()) {
      EXPECT_EQ(actual, wanted) << name;
    }
  };
  expect_field("buffer", r.buffer, expected.buffer);
  expect_field("first_stream", r.first_stream, expected.first_stream);
  expect_field("first_phase", r.first_phase, expected.first_phase);
  expect_field("first_op", r.first_op, expected.first_op);
  expect_field("second_stream", r.second_stream, expected.second_stream);
  expect_field("second_phase", r.second_phase, expected.second_phase);
  expect_field("second_op", r.second_op, expected.second_op);
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
  expect_report(r, {.kind = Report::Kind::kReadAfterWrite,
                    .buffer = "the test buffer",
                    .first_stream = "default (compute)",
                    .first_op = "aten::ones",
                    .second_stream = "side",
                    .second_phase = "FSDP::test_phase",
                    .second_op = "aten::mul"});
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
    expect_report(r, {.kind = Report::Kind::kUsedBeforeAllocationOrdered,
                      .buffer = "the test buffer",
                      .first_stream = "default (compute)",
                      .first_phase = "FSDP::test_allocation",
                      .second_stream = "side",
                      .second_phase = "FSDP::test_fill",
                      .second_op = "aten::fill_"});
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

// --- The host as an agent (docs/gpu.md, "The host as an agent") ---------------

// Pinned host memory, as offload's gradient on the host: the reduce-scatter
// stream copies a device gradient into it without blocking, and the host's
// optimizer reads it. Only a host synchronization (the event recorded after
// the copy) orders the host after the copy; waiting for it on a stream does
// not.
TEST(StreamCheckHost, HostReadOfANonBlockingCopyNeedsAHostSynchronization) {
  Checker checker;
  const c10::Stream side = checker.new_stream("reduce-scatter");
  enum class Order { kNone, kStreamWait, kEventSynchronize };
  for (Order order : {Order::kNone, Order::kStreamWait, Order::kEventSynchronize}) {
    checker.clear_reports();
    clear_host_syncs();
    at::Tensor host;
    {
      HostScope on_host(/*pinned=*/true);
      host = at::empty({6});
    }
    EXPECT_EQ(memory_of(host), Memory::kPinnedHost);
    name_buffer(host, "the host gradient");
    const at::Tensor device = at::full({6}, 3.0f);
    EXPECT_EQ(memory_of(device), Memory::kDevice);
    wait_stream(side, current_stream());
    c10::Event copied(c10::kCPU);
    {
      PhaseLabel phase("FSDP::post_backward_reduce");
      c10::StreamGuard guard(side);
      host.copy_(device, /*non_blocking=*/true);
      copied.record(side);
    }
    EXPECT_TRUE(host_syncs().empty()) << host_syncs().front().what;  // cudaMemcpyAsync from pinned memory
    if (order == Order::kStreamWait) copied.block(current_stream());
    if (order == Order::kEventSynchronize) copied.synchronize();
    at::Tensor param;
    {
      HostScope on_host(/*pinned=*/false);
      param = at::zeros({6});
    }
    {
      PhaseLabel phase("optimizer step");
      param.add_(host, -0.5);  // all host memory: the host's op
    }
    EXPECT_TRUE(param.equal(at::full({6}, -1.5f)));
    const std::vector<Report> reports = checker.reports();
    if (order == Order::kEventSynchronize) {
      EXPECT_TRUE(reports.empty()) << reports.front().message;
      continue;
    }
    ASSERT_EQ(reports.size(), 1u) << "order " << static_cast<int>(order);
    const Report& r = reports.front();
    expect_report(r, {.kind = Report::Kind::kReadAfterWrite,
                      .buffer = "the host gradient",
                      .first_stream = "reduce-scatter",
                      .first_op = "aten::copy_",
                      .second_stream = "host",
                      .second_phase = "optimizer step",
                      .second_op = "aten::add_"});
    EXPECT_THAT(r.message, HasSubstr("Missing edge: reduce-scatter -> host"));
    EXPECT_THAT(r.message, HasSubstr("synchronized by the host"));
  }
}

// The other direction: a non-blocking copy from pinned memory to the device
// reads the host buffer on its stream later; the host must not overwrite it
// before a host synchronization says the copy ran (a write after read).
TEST(StreamCheckHost, HostWriteBeforeAnAsynchronousUploadRanIsAWriteAfterRead) {
  Checker checker;
  const c10::Stream copy_in = checker.new_stream("all-gather copy-in");
  for (bool synchronized : {false, true}) {
    checker.clear_reports();
    at::Tensor shard;
    {
      HostScope on_host(/*pinned=*/true);
      shard = at::ones({4});  // the host fills it: its own work, ordered before any later stream work
    }
    name_buffer(shard, "the shard");
    at::Tensor device = at::empty({4});
    wait_stream(copy_in, current_stream());
    c10::Event uploaded(c10::kCPU);
    {
      c10::StreamGuard guard(copy_in);
      device.copy_(shard, /*non_blocking=*/true);
      uploaded.record(copy_in);
    }
    if (synchronized) uploaded.synchronize();
    shard.mul_(2);  // the host optimizer's write
    const std::vector<Report> reports = checker.reports();
    if (synchronized) {
      EXPECT_TRUE(reports.empty()) << reports.front().message;
      continue;
    }
    // Once for mul_ and once for the mul it runs as.
    ASSERT_FALSE(reports.empty());
    EXPECT_EQ(reports.front().second_op, "aten::mul_");
    EXPECT_EQ(reports.front().kind, Report::Kind::kWriteAfterRead);
    EXPECT_EQ(reports.front().first_stream, "all-gather copy-in");
    EXPECT_EQ(reports.front().second_stream, "host");
  }
}

// A copy between host and device that is not non-blocking to or from pinned
// memory makes the host wait for it: counted as a host synchronization
// (copy_ synchronizes its stream), and the host is ordered after it. The
// host's own ops and scalar reads of host memory are no synchronization.
TEST(StreamCheckHost, BlockingCopiesAreHostSynchronizationsAndHostOpsAreNot) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor pageable;
  {
    HostScope on_host(/*pinned=*/false);
    pageable = at::empty({3});
  }
  EXPECT_EQ(memory_of(pageable), Memory::kPageableHost);
  const at::Tensor device = at::full({3}, 2.0f);
  wait_stream(side, current_stream());
  {
    c10::StreamGuard guard(side);
    pageable.copy_(device, /*non_blocking=*/true);  // to pageable memory: synchronous all the same
  }
  at::Tensor doubled = pageable * 2;                     // the host's op: ordered after the copy by its host sync
  EXPECT_EQ(memory_of(doubled), Memory::kPageableHost);  // made by the host
  EXPECT_EQ(doubled.sum().item<float>(), 12.0f);         // a scalar read of host memory
  at::Tensor back = at::empty({3});
  back.copy_(doubled);  // blocking upload
  // A non-blocking upload from pageable memory is staged by the host, which
  // reads the source then and goes on: no synchronization, and the host may
  // write the source at once.
  at::Tensor staged_back = at::empty({3});
  wait_stream(side, current_stream());
  {
    c10::StreamGuard guard(side);
    staged_back.copy_(doubled, /*non_blocking=*/true);
  }
  doubled.zero_();
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
  const std::vector<HostSync> syncs = host_syncs();
  ASSERT_EQ(syncs.size(), 2u);
  EXPECT_THAT(syncs[0].what, HasSubstr("device to pageable host memory"));
  EXPECT_THAT(syncs[1].what, HasSubstr("host to device (blocking)"));
  EXPECT_TRUE(back.equal(at::full({3}, 4.0f)));
  EXPECT_TRUE(staged_back.equal(at::full({3}, 4.0f)));
}

// Host memory is not the caching allocator's: freeing it while a stream's
// non-blocking copy may still read it is left to the pinned allocator, which
// records the copy's stream itself.
TEST(StreamCheckHost, HostMemoryIsExemptFromTheCachingAllocatorsRules) {
  Checker checker;
  const c10::Stream side = checker.new_stream("side");
  at::Tensor device = at::empty({4});
  wait_stream(side, current_stream());
  {
    at::Tensor staged;
    {
      HostScope on_host(/*pinned=*/true);
      staged = at::ones({4});
    }
    c10::StreamGuard guard(side);
    device.copy_(staged, /*non_blocking=*/true);
  }  // `staged` freed by the host while the copy may still read it
  wait_stream(current_stream(), side);
  EXPECT_TRUE(checker.reports().empty()) << checker.reports().front().message;
  EXPECT_TRUE(device.equal(at::ones({4})));
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
