// fsdp::run_child and fsdp::child_environment (fsdp_common/child_process.h),
// with /bin/sh as the child.
#include "fsdp_common/child_process.h"

#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

fsdp::ChildResult sh(const std::string& script, const fsdp::ChildOptions& options = {}) {
  return fsdp::run_child({"/bin/sh", "-c", script}, options);
}

bool has_entry(const std::vector<std::string>& env, const std::string& entry) {
  return std::find(env.begin(), env.end(), entry) != env.end();
}

TEST(ChildProcess, ExitCodeAndInterleavedOutput) {
  const fsdp::ChildResult r = sh("echo out; echo err >&2; exit 3");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.term_signal, 0);
  EXPECT_EQ(r.output, "out\nerr\n");
  EXPECT_EQ(r.error, "");
  EXPECT_GT(r.seconds, 0.0);
}

TEST(ChildProcess, SeparateStderr) {
  fsdp::ChildOptions options;
  options.separate_stderr = true;
  const fsdp::ChildResult r = sh("echo out; echo err >&2", options);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.output, "out\n");
  EXPECT_EQ(r.error, "err\n");
}

// More than a pipe holds (64 KiB) on both streams at once: a reader that
// drained stdout before stderr would wait forever.
TEST(ChildProcess, LargeOutputOnBothStreamsDoesNotBlock) {
  fsdp::ChildOptions options;
  options.separate_stderr = true;
  const fsdp::ChildResult r =
      sh("i=0; while [ $i -lt 4000 ]; do echo e$i-0123456789012345678901234567890123456789 >&2; "
         "echo o$i; i=$((i+1)); done",
         options);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_GT(r.error.size(), 160000u);
  EXPECT_NE(r.output.find("o3999\n"), std::string::npos);
  EXPECT_NE(r.error.find("e3999-"), std::string::npos);
}

TEST(ChildProcess, KilledBySignal) {
  const fsdp::ChildResult r = sh("kill -KILL $$");
  EXPECT_EQ(r.term_signal, SIGKILL);
  EXPECT_EQ(r.exit_code, 128 + SIGKILL);
}

// The signal goes out once the output shows the state asked for, and only
// then: the child prints "ready" and would otherwise sleep for a minute.
TEST(ChildProcess, SignalWhenTheOutputShowsAState) {
  fsdp::ChildOptions options;
  options.signal = SIGTERM;
  int asked = 0;
  options.signal_when = [&asked](const std::string& out) {
    ++asked;
    return out.find("ready\n") != std::string::npos;
  };
  const fsdp::ChildResult r = sh("echo starting; sleep 0.2; echo ready; exec sleep 60", options);
  EXPECT_EQ(r.term_signal, SIGTERM);
  EXPECT_EQ(r.output, "starting\nready\n");
  EXPECT_GE(asked, 1);
}

// on_start hands over the child's pid before its output is read: here a
// signal that ends a child which would otherwise sleep for a minute.
TEST(ChildProcess, OnStartGetsTheChildsPid) {
  fsdp::ChildOptions options;
  pid_t started = -1;
  options.on_start = [&started](pid_t child) {
    started = child;
    ::kill(child, SIGTERM);
  };
  const fsdp::ChildResult r = sh("exec sleep 60", options);
  EXPECT_GT(started, 0);
  EXPECT_EQ(r.term_signal, SIGTERM);
  EXPECT_LT(r.seconds, 30);
}

TEST(ChildProcess, ProgramLookedUpInPath) {
  const fsdp::ChildResult r = fsdp::run_child({"sh", "-c", "echo found"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.output, "found\n");
}

TEST(ChildProcess, MissingProgramSaysWhy) {
  const fsdp::ChildResult r = fsdp::run_child({"/nonexistent/fsdp2cpp-no-such-program"});
  EXPECT_EQ(r.exit_code, -1);
  EXPECT_NE(r.output.find("cannot start /nonexistent/fsdp2cpp-no-such-program"), std::string::npos) << r.output;
  fsdp::ChildOptions options;
  options.separate_stderr = true;
  const fsdp::ChildResult separate = fsdp::run_child({"/nonexistent/fsdp2cpp-no-such-program"}, options);
  EXPECT_EQ(separate.exit_code, -1);
  EXPECT_NE(separate.error.find("cannot start"), std::string::npos);
  EXPECT_EQ(separate.output, "");
}

TEST(ChildProcess, EmptyArgvIsRejected) { EXPECT_THROW(fsdp::run_child({}), std::invalid_argument); }

// A child never joins the caller's job; extra entries replace variables of
// the same name.
TEST(ChildEnvironment, DropsTheJobVariablesAndAddsTheExtraOnes) {
  ASSERT_EQ(::setenv("RANK", "3", 1), 0);
  ASSERT_EQ(::setenv("MASTER_PORT", "29500", 1), 0);
  ASSERT_EQ(::setenv("FSDP2CPP_NPROC", "2", 1), 0);
  ASSERT_EQ(::setenv("FSDP2CPP_CHILD_TEST", "parent", 1), 0);
  const std::vector<std::string> env = fsdp::child_environment({"FSDP2CPP_CHILD_TEST=child", "EXTRA=1"});
  for (const char* name : {"RANK=", "MASTER_PORT=", "FSDP2CPP_NPROC=", "FSDP2CPP_CHILD_TEST=parent"}) {
    EXPECT_TRUE(std::none_of(env.begin(), env.end(), [&](const std::string& e) { return e.rfind(name, 0) == 0; }))
        << name;
  }
  EXPECT_TRUE(has_entry(env, "FSDP2CPP_CHILD_TEST=child"));
  EXPECT_TRUE(has_entry(env, "EXTRA=1"));

  fsdp::ChildOptions options;
  options.extra_env = {"FSDP2CPP_CHILD_TEST=child"};
  const fsdp::ChildResult r = sh("echo \"${RANK:-unset} ${MASTER_PORT:-unset} $FSDP2CPP_CHILD_TEST\"", options);
  EXPECT_EQ(r.output, "unset unset child\n");
  ::unsetenv("RANK");
  ::unsetenv("MASTER_PORT");
  ::unsetenv("FSDP2CPP_NPROC");
  ::unsetenv("FSDP2CPP_CHILD_TEST");
}

TEST(ChildEnvironment, AnEntryWithoutEqualsIsRejected) {
  try {
    fsdp::child_environment({"NOT_AN_ENTRY"});
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'NOT_AN_ENTRY' is not a NAME=value entry"), std::string::npos) << e.what();
  }
}

}  // namespace
