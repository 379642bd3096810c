// The launcher (fsdp2cpp::launch) and the fsdprun command, at 1 to 3 ranks:
// the environment each rank gets, the [rankN] prefix on whole lines, the
// exit status of a failing or killed rank with the others stopped, the flag
// errors of fsdprun, and maybe_launch_local driven by --nproc and by
// FSDP2CPP_NPROC.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "launch/launch.h"
#include "run_program.h"

namespace {

using fsdp_launch_test::describe;
using fsdp_launch_test::lines_of;
using fsdp_launch_test::lines_of_rank;
using fsdp_launch_test::run;
using fsdp_launch_test::RunResult;

// Every rank of an `n`-rank job printed its torchrun variables, prefixed.
void expect_rank_lines(const RunResult& r, int n, const std::string& mesh) {
  std::set<std::string> ports;
  for (int rank = 0; rank < n; ++rank) {
    const std::vector<std::string> lines = lines_of_rank(r.out, rank);
    ASSERT_EQ(lines.size(), 2u) << "rank " << rank << "\n" << describe(r);
    std::smatch m;
    const std::regex expected("RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(n) +
                              " LOCAL_RANK=" + std::to_string(rank) + " LOCAL_WORLD_SIZE=" + std::to_string(n) +
                              " MASTER_ADDR=127\\.0\\.0\\.1 MASTER_PORT=([0-9]+) MESH=" + mesh);
    ASSERT_TRUE(std::regex_match(lines[0], m, expected)) << lines[0] << "\n" << describe(r);
    ports.insert(m[1]);
    // A last line without '\n' still comes out whole, with its prefix.
    EXPECT_EQ(lines[1], "no newline at the end");
    EXPECT_EQ(lines_of_rank(r.err, rank), std::vector<std::string>{"to stderr from " + std::to_string(rank)})
        << describe(r);
  }
  EXPECT_EQ(ports.size(), 1u) << "all ranks must rendezvous at one port";
  EXPECT_EQ(lines_of(r.out).size(), static_cast<size_t>(2 * n)) << "unprefixed lines?\n" << describe(r);
}

const std::string kFsdprun = FSDPRUN_BINARY;
const std::string kProbe = LAUNCH_PROBE_BINARY;
const std::string kLoop = RESTARTABLE_LOOP_BINARY;

class FsdprunRanks : public ::testing::TestWithParam<int> {};

TEST_P(FsdprunRanks, EveryRankGetsTorchrunsEnvironmentAndItsPrefix) {
  const int n = GetParam();
  const RunResult r = run({kFsdprun, "--nproc", std::to_string(n), "--", kProbe, "print"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  expect_rank_lines(r, n, "<unset>");
}

TEST_P(FsdprunRanks, RankThatExitsNonZeroStopsTheOthersWithItsCode) {
  const int n = GetParam();
  const int failing = n - 1;
  const RunResult r = run({kFsdprun, "--nproc", std::to_string(n), "--", kProbe, "exit", std::to_string(failing), "7"});
  EXPECT_EQ(r.exit_code, 7) << describe(r);
  // The waiting ranks sleep 60 s unless stopped; SIGTERM stops them at once.
  EXPECT_LT(r.seconds, 30.0) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank " + std::to_string(failing) + " exited with code 7; stopping the other ranks"),
            std::string::npos)
      << describe(r);
  EXPECT_EQ(lines_of_rank(r.out, failing), std::vector<std::string>{"failing now"}) << describe(r);
}

TEST_P(FsdprunRanks, RankKilledBySignalGives128PlusTheSignal) {
  const int n = GetParam();
  const RunResult r =
      run({kFsdprun, "--nproc", std::to_string(n), "--", kProbe, "signal", "0", std::to_string(SIGKILL)});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << describe(r);
  EXPECT_LT(r.seconds, 30.0) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank 0 was killed by signal 9 (Killed); stopping the other ranks"), std::string::npos)
      << describe(r);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FsdprunRanks, ::testing::Values(1, 2, 3));

TEST(Fsdprun, MeshIsPassedToEveryRank) {
  const RunResult r = run({kFsdprun, "--nproc=2", "--mesh=1x2", "--", kProbe, "print"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  expect_rank_lines(r, 2, "1x2");
}

TEST(Fsdprun, NoPrefixLeavesTheLinesAlone) {
  const RunResult r = run({kFsdprun, "--nproc", "1", "--no-prefix", "--", kProbe, "print"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out.rfind("RANK=0 WORLD_SIZE=1 ", 0), 0u) << describe(r);
}

// Each flag error exits 2 before any rank starts, with a message naming it.
TEST(Fsdprun, FlagErrorsNameTheProblem) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--nproc", "2", kProbe, "print"}, "fsdprun: expected '--' before the program to run (got '" + kProbe + "')"},
      {{"--nproc", "2"}, "fsdprun: missing '--' and the program to run after it"},
      {{"--nproc", "2", "--"}, "fsdprun: no program after '--'"},
      {{"--", kProbe, "print"}, "fsdprun: --nproc N is required"},
      {{"--nproc", "0", "--", kProbe}, "fsdprun: --nproc must be a positive integer (got '0')"},
      {{"--nproc", "two", "--", kProbe}, "fsdprun: --nproc must be a positive integer (got 'two')"},
      {{"--nproc=3x", "--", kProbe}, "fsdprun: --nproc must be a positive integer (got '3x')"},
      {{"--nproc", "--", kProbe}, "fsdprun: --nproc needs a value"},
      {{"--nproc", "4", "--mesh", "2by2", "--", kProbe},
       "fsdprun: --mesh must be RxS with positive integers R (replicas) and S (shards), e.g. 2x2 (got '2by2')"},
      {{"--nproc", "4", "--mesh", "0x4", "--", kProbe}, "(got '0x4')"},
      {{"--nproc", "4", "--mesh", "2x3", "--", kProbe}, "fsdprun: --mesh 2x3 needs 6 ranks, but --nproc is 4"},
      {{"--nprocs", "4", "--", kProbe}, "fsdprun: unknown flag '--nprocs'"},
      {{"--nproc", "2", "--max-restarts", "-1", "--", kProbe},
       "fsdprun: --max-restarts must be an integer >= 0 (got '-1')"},
      {{"--nproc", "2", "--max-restarts=x", "--", kProbe}, "fsdprun: --max-restarts must be an integer >= 0 (got 'x')"},
      {{"--nproc", "2", "--max-restarts", "--", kProbe}, "fsdprun: --max-restarts needs a value"},
      {{"--nproc", "2", "--collective-timeout", "0", "--", kProbe},
       "fsdprun: --collective-timeout must be a number of seconds > 0, e.g. 600 or 1.5 (got '0')"},
      {{"--nproc", "2", "--collective-timeout=-5", "--", kProbe}, "(got '-5')"},
      {{"--nproc", "2", "--collective-timeout", "ten", "--", kProbe}, "(got 'ten')"},
      {{"--nproc", "2", "--collective-timeout", "nan", "--", kProbe}, "(got 'nan')"},
      {{"--nproc", "2", "--collective-timeout", "1e999", "--", kProbe}, "(got '1e999')"},
      {{"--nproc", "2", "--collective-timeout", "--", kProbe}, "fsdprun: --collective-timeout needs a value"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {kFsdprun};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const RunResult r = run(args);
    EXPECT_EQ(r.exit_code, 2) << c.message << "\n" << describe(r);
    EXPECT_NE(r.err.find(c.message), std::string::npos) << describe(r);
    EXPECT_NE(r.err.find("usage: fsdprun --nproc N"), std::string::npos) << describe(r);
    EXPECT_EQ(r.out, "") << "no rank may start: " << describe(r);
  }
}

TEST(Fsdprun, ProgramThatCannotBeFoundFailsWith127) {
  RunResult r = run({kFsdprun, "--nproc", "2", "--", "no_such_program_fsdp2cpp"});
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: cannot run 'no_such_program_fsdp2cpp': not found in PATH"), std::string::npos)
      << describe(r);
  r = run({kFsdprun, "--nproc", "2", "--", "./no/such/file"});
  EXPECT_EQ(r.exit_code, 127) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: cannot run './no/such/file': no such executable file"), std::string::npos)
      << describe(r);
}

TEST(Fsdprun, HelpPrintsUsage) {
  const RunResult r = run({kFsdprun, "--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("--mesh RxS"), std::string::npos) << describe(r);
}

// torchrun's rule for OMP_NUM_THREADS: 1 for several local ranks when the
// user left it unset, said once; a user's value kept; one rank untouched.
constexpr char kOmpMessage[] =
    "OMP_NUM_THREADS is not set; setting it to 1 for each of the 2 ranks so that they do not overload this machine "
    "(set OMP_NUM_THREADS yourself to tune the threads per rank)";

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

void expect_omp_lines(const RunResult& r, int n, const std::string& value) {
  for (int rank = 0; rank < n; ++rank) {
    EXPECT_EQ(lines_of_rank(r.out, rank), std::vector<std::string>{"OMP_NUM_THREADS=" + value})
        << "rank " << rank << "\n"
        << describe(r);
  }
}

TEST(OmpNumThreads, FsdprunSetsOneForSeveralRanksWhenUnsetAndSaysSoOnce) {
  ::unsetenv("OMP_NUM_THREADS");
  const RunResult r = run({kFsdprun, "--nproc", "2", "--", kProbe, "omp"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  expect_omp_lines(r, 2, "1");
  EXPECT_EQ(count_of(r.err, std::string("fsdprun: ") + kOmpMessage), 1u) << describe(r);

  // Once per job, not per attempt: rank 1 fails the first attempt.
  const RunResult restarted =
      run({kFsdprun, "--nproc", "2", "--max-restarts", "1", "--", kProbe, "attempt", "1", "1", "1"});
  ASSERT_EQ(restarted.exit_code, 0) << describe(restarted);
  EXPECT_EQ(count_of(restarted.err, "restarting the group"), 1u) << describe(restarted);
  EXPECT_EQ(count_of(restarted.err, kOmpMessage), 1u) << describe(restarted);
}

TEST(OmpNumThreads, FsdprunKeepsTheUsersValue) {
  ::unsetenv("OMP_NUM_THREADS");
  const RunResult r = run({kFsdprun, "--nproc", "2", "--", kProbe, "omp"}, {{"OMP_NUM_THREADS", "3"}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  expect_omp_lines(r, 2, "3");
  EXPECT_EQ(r.err.find("OMP_NUM_THREADS"), std::string::npos) << describe(r);
}

TEST(OmpNumThreads, FsdprunLeavesASingleRankAlone) {
  ::unsetenv("OMP_NUM_THREADS");
  const RunResult r = run({kFsdprun, "--nproc", "1", "--", kProbe, "omp"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  expect_omp_lines(r, 1, "<unset>");
  EXPECT_EQ(r.err.find("OMP_NUM_THREADS"), std::string::npos) << describe(r);
}

TEST(OmpNumThreads, NprocFlagSetsOneWhenUnsetAndKeepsTheUsersValue) {
  ::unsetenv("OMP_NUM_THREADS");
  const RunResult unset = run({kProbe, "omp", "--nproc", "2"});
  ASSERT_EQ(unset.exit_code, 0) << describe(unset);
  expect_omp_lines(unset, 2, "1");
  EXPECT_EQ(count_of(unset.err, std::string("launch_probe: ") + kOmpMessage), 1u) << describe(unset);

  const RunResult set = run({kProbe, "omp", "--nproc", "2"}, {{"OMP_NUM_THREADS", "5"}});
  ASSERT_EQ(set.exit_code, 0) << describe(set);
  expect_omp_lines(set, 2, "5");
  EXPECT_EQ(set.err.find("OMP_NUM_THREADS"), std::string::npos) << describe(set);
}

// A rank that ignores SIGTERM is killed after the grace period.
TEST(LaunchLocalRanks, RankThatIgnoresSigtermIsKilledAfterTheGracePeriod) {
  const RunResult r = run({"/bin/sh", "-c",
                           "exec " + kFsdprun + " --nproc 2 -- /bin/sh -c " +
                               "'if [ $RANK = 1 ]; then sleep 0.3; exit 5; fi; trap \"\" TERM; exec sleep 120'"});
  EXPECT_EQ(r.exit_code, 5) << describe(r);
  // 5 s of grace, then SIGKILL: long before the 120 s sleep ends. The upper
  // bound only separates killed from waited for (an idle machine needs
  // about 5.5 s; load may stretch that several times over).
  EXPECT_GT(r.seconds, 4.5) << describe(r);
  EXPECT_LT(r.seconds, 60.0) << describe(r);
}

// Starts fsdprun with `args`, sends it `sig` once every rank printed
// "waiting", and returns how it ended.
RunResult stop_fsdprun_when_ranks_wait(std::vector<std::string> args, int nproc, int sig) {
  fsdp::ChildOptions options;
  options.separate_stderr = true;
  options.signal = sig;
  // All ranks are up once all said so.
  options.signal_when = [nproc](const std::string& out) {
    for (int r = 0; r < nproc; ++r) {
      if (out.find("[rank" + std::to_string(r) + "] waiting") == std::string::npos) return false;
    }
    return true;
  };
  fsdp::ChildResult r = fsdp::run_child(args, options);
  // -1: fsdprun itself was killed, which it must never be by these signals.
  return RunResult{r.term_signal != 0 ? -1 : r.exit_code, std::move(r.output), std::move(r.error), r.seconds};
}

// SIGTERM to fsdprun reaches the ranks (they stop at once instead of
// sleeping 60 s) and fsdprun exits with 128 + SIGTERM.
TEST(LaunchLocalRanks, StopSignalToTheLauncherIsPassedOnToTheRanks) {
  const RunResult r =
      stop_fsdprun_when_ranks_wait({kFsdprun, "--nproc", "2", "--", kProbe, "exit", "99", "0"}, 2, SIGTERM);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << describe(r);
  EXPECT_LT(r.seconds, 30.0) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: got signal 15 (Terminated); stopping the ranks"), std::string::npos) << describe(r);
}

// Restarts are for ranks that fail, never for a job its user stops.
TEST(Restarts, StopSignalToTheLauncherNeverRestarts) {
  for (const int sig : {SIGTERM, SIGINT}) {
    const RunResult r = stop_fsdprun_when_ranks_wait(
        {kFsdprun, "--nproc", "2", "--max-restarts", "3", "--", kProbe, "attempt", "99", "1", "1000"}, 2, sig);
    EXPECT_EQ(r.exit_code, 128 + sig) << describe(r);
    EXPECT_LT(r.seconds, 30.0) << describe(r);
    EXPECT_EQ(r.err.find("restarting"), std::string::npos) << describe(r);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_EQ(lines_of_rank(r.out, rank).size(), 2u) << "one attempt: its line and 'waiting'\n" << describe(r);
    }
  }
}

// The "attempt=A max=M port=P timeout=T" lines rank `rank` printed, as
// {A, M, P, T} each.
std::vector<std::vector<std::string>> attempt_lines(const RunResult& r, int rank) {
  std::vector<std::vector<std::string>> out;
  const std::regex line("attempt=(\\S+) max=(\\S+) port=(\\S+) timeout=(\\S+)");
  for (const auto& text : lines_of_rank(r.out, rank)) {
    std::smatch m;
    if (std::regex_match(text, m, line)) out.push_back({m[1], m[2], m[3], m[4]});
  }
  return out;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class RestartsAtWorldSize : public ::testing::TestWithParam<int> {};

// torchrun's behaviour: rank 1 fails on the first attempt, every rank is
// stopped, and the whole group starts again with TORCHELASTIC_RESTART_COUNT=1
// and a new MASTER_PORT (a fresh store), and this time all succeed.
TEST_P(RestartsAtWorldSize, GroupThatFailsOnceSucceedsOnTheSecondAttempt) {
  const int n = GetParam();
  const int failing = n - 1;
  const RunResult r = run({kFsdprun, "--nproc", std::to_string(n), "--max-restarts", "1", "--", kProbe, "attempt",
                           std::to_string(failing), "1", "1"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank " + std::to_string(failing) +
                       " failed with exit code 1; restarting the group (restart 1 of 1)"),
            std::string::npos)
      << describe(r);
  EXPECT_EQ(count(r.err, "restarting the group"), 1u) << describe(r);
  const auto failed = attempt_lines(r, failing);
  ASSERT_EQ(failed.size(), 2u) << describe(r);
  EXPECT_EQ(failed[0][0], "0");
  EXPECT_EQ(failed[1][0], "1");
  EXPECT_NE(failed[0][2], failed[1][2]) << "each attempt must rendezvous at its own port\n" << describe(r);
  for (int rank = 0; rank < n; ++rank) {
    const auto lines = attempt_lines(r, rank);
    ASSERT_FALSE(lines.empty()) << describe(r);
    // The last attempt ran every rank, with the same port for all of them.
    EXPECT_EQ(lines.back(), (std::vector<std::string>{"1", "1", failed[1][2], "<unset>"})) << describe(r);
  }
  EXPECT_EQ(count(r.out, "failing now"), 1u) << describe(r);
}

// The same failure without restarts ends the job, as before restarts existed.
TEST_P(RestartsAtWorldSize, WithoutRestartsTheFirstFailureEndsTheJob) {
  const int n = GetParam();
  for (const bool flag : {true, false}) {
    std::vector<std::string> args = {kFsdprun, "--nproc", std::to_string(n)};
    if (flag) args.insert(args.end(), {"--max-restarts", "0"});
    args.insert(args.end(), {"--", kProbe, "attempt", "0", "1", "1"});
    const RunResult r = run(args);
    EXPECT_EQ(r.exit_code, 1) << describe(r);
    EXPECT_EQ(r.err.find("restart"), std::string::npos) << describe(r);
    const auto lines = attempt_lines(r, 0);
    ASSERT_EQ(lines.size(), 1u) << describe(r);
    EXPECT_EQ(lines[0][0], "0") << "TORCHELASTIC_RESTART_COUNT is set even without restarts, as torchrun does";
    EXPECT_EQ(lines[0][1], "0") << describe(r);
  }
}

// --max-restarts 2: three attempts, then the failing rank's status.
TEST_P(RestartsAtWorldSize, GroupThatAlwaysFailsRunsOneAttemptPerRestartAndExitsWithItsStatus) {
  const int n = GetParam();
  const RunResult r =
      run({kFsdprun, "--nproc", std::to_string(n), "--max-restarts", "2", "--", kProbe, "attempt", "0", "7", "1000"});
  EXPECT_EQ(r.exit_code, 7) << describe(r);
  const auto lines = attempt_lines(r, 0);
  ASSERT_EQ(lines.size(), 3u) << describe(r);
  for (int a = 0; a < 3; ++a) {
    EXPECT_EQ(lines[a][0], std::to_string(a)) << describe(r);
    EXPECT_EQ(lines[a][1], "2") << describe(r);
  }
  EXPECT_EQ(count(r.out, "[rank0] failing now"), 3u) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank 0 failed with exit code 7; restarting the group (restart 1 of 2)"),
            std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank 0 failed with exit code 7; restarting the group (restart 2 of 2)"),
            std::string::npos)
      << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank 0 failed with exit code 7; no restarts left (3 attempts, --max-restarts 2)"),
            std::string::npos)
      << describe(r);
  EXPECT_EQ(count(r.err, "restarting the group"), 2u) << describe(r);
  // Each attempt's waiting ranks were stopped, not waited for (60 s each).
  EXPECT_LT(r.seconds, 60.0) << describe(r);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, RestartsAtWorldSize, ::testing::Values(1, 2, 3));

// A rank killed by a signal (a segfault, the OOM killer) is a failure too.
TEST(Restarts, RankKilledBySignalRestartsTheGroup) {
  const RunResult r = run(
      {kFsdprun, "--nproc", "2", "--max-restarts", "1", "--", kProbe, "attempt", "1", std::to_string(-SIGKILL), "1"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.err.find("fsdprun: rank 1 was killed by signal 9 (Killed); restarting the group (restart 1 of 1)"),
            std::string::npos)
      << describe(r);
}

// The library's form, as the trainer's --nproc uses it.
TEST(Restarts, LaunchLocalRanksRestartsUpToMaxRestarts) {
  fsdp::launch::LaunchOptions options;
  options.nproc = 2;
  options.program = "/bin/sh";
  options.args = {"sh", "-c", "[ \"$TORCHELASTIC_RESTART_COUNT\" = 2 ] || [ \"$RANK\" = 0 ] || exit 9"};
  options.prefix_output = false;
  options.max_restarts = 2;
  EXPECT_EQ(fsdp::launch::launch_local_ranks(options), 0);
  options.max_restarts = 1;
  EXPECT_EQ(fsdp::launch::launch_local_ranks(options), 9);
  options.max_restarts = -1;
  EXPECT_EQ(fsdp::launch::launch_local_ranks(options), 2);
}

TEST(CollectiveTimeout, FlagReachesEveryRanksEnvironment) {
  RunResult r = run({kFsdprun, "--nproc", "2", "--collective-timeout", "90", "--", kProbe, "attempt", "0", "0", "0"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (int rank = 0; rank < 2; ++rank) {
    const auto lines = attempt_lines(r, rank);
    ASSERT_EQ(lines.size(), 1u) << describe(r);
    EXPECT_EQ(lines[0][3], "90") << describe(r);
  }
  r = run({kFsdprun, "--nproc=1", "--collective-timeout=2.5", "--", kProbe, "attempt", "0", "0", "0"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_EQ(attempt_lines(r, 0).size(), 1u) << describe(r);
  EXPECT_EQ(attempt_lines(r, 0)[0][3], "2.5") << describe(r);
  // Without the flag, the variable the user exported reaches the ranks as it is.
  r = run({kFsdprun, "--nproc", "1", "--", kProbe, "attempt", "0", "0", "0"},
          {{"FSDP2CPP_COLLECTIVE_TIMEOUT_S", "45"}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  ASSERT_EQ(attempt_lines(r, 0).size(), 1u) << describe(r);
  EXPECT_EQ(attempt_lines(r, 0)[0][3], "45") << describe(r);
}

TEST(CollectiveTimeout, ParseTimeoutSecondsAcceptsPositiveNumbersOnly) {
  EXPECT_EQ(fsdp::launch::parse_timeout_seconds("600"), 600.0);
  EXPECT_EQ(fsdp::launch::parse_timeout_seconds("0.25"), 0.25);
  EXPECT_EQ(fsdp::launch::parse_timeout_seconds("1e3"), 1000.0);
  for (const std::string bad : {"", "0", "-1", "+", "1s", " 5", "inf", "nan", "0x10", "1e999", "1..2"}) {
    EXPECT_THROW(fsdp::launch::parse_timeout_seconds(bad), std::invalid_argument) << bad;
  }
  try {
    fsdp::launch::parse_timeout_seconds("soon", "FSDP2CPP_COLLECTIVE_TIMEOUT_S");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "FSDP2CPP_COLLECTIVE_TIMEOUT_S must be a number of seconds > 0, e.g. 600 or 1.5 (got 'soon')");
  }
}

// A user's loop that saves its progress every step (restartable_loop.cc):
// rank 1 dies at step 5 of 8 on the first attempt, fsdprun restarts the
// group, the loop resumes from its checkpoint, and the result is that of a
// run that never failed. Real Gloo collectives, so the restarted group's
// rendezvous (a fresh store) is exercised too.
class ResumeAtWorldSize : public ::testing::TestWithParam<int> {};

TEST_P(ResumeAtWorldSize, RestartedLoopResumesFromItsCheckpointAndEndsAsAnUninterruptedRun) {
  const int n = GetParam();
  char tmpl[] = "/tmp/fsdp2cpp_restart_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string steps = "8";
  const RunResult clean =
      run({kFsdprun, "--nproc", std::to_string(n), "--", kLoop, "--steps", steps, "--checkpoint", dir + "/clean.txt"});
  ASSERT_EQ(clean.exit_code, 0) << describe(clean);
  const RunResult restarted = run({kFsdprun, "--nproc", std::to_string(n), "--max-restarts", "2",
                                   "--collective-timeout", "60", "--", kLoop, "--steps", steps, "--checkpoint",
                                   dir + "/restarted.txt", "--crash-rank", std::to_string(n - 1), "--crash-at", "5"});
  ASSERT_EQ(restarted.exit_code, 0) << describe(restarted);
  EXPECT_NE(restarted.err.find("; restarting the group (restart 1 of 2)"), std::string::npos) << describe(restarted);
  EXPECT_EQ(count(restarted.err, "restarting the group"), 1u) << describe(restarted);
  EXPECT_EQ(lines_of_rank(restarted.out, n - 1).front(), n == 1 ? "attempt 0 resumes at step 1" : "crashing at step 5")
      << describe(restarted);
  const std::vector<std::string> rank0 = lines_of_rank(restarted.out, 0);
  // Steps 1-4 were saved (each save precedes a barrier), so attempt 1 starts at 5.
  EXPECT_NE(std::find(rank0.begin(), rank0.end(), "attempt 1 resumes at step 5"), rank0.end()) << describe(restarted);
  const std::vector<std::string> clean0 = lines_of_rank(clean.out, 0);
  ASSERT_EQ(clean0.size(), 2u) << describe(clean);
  EXPECT_EQ(clean0[0], "attempt 0 resumes at step 1");
  ASSERT_EQ(clean0[1].rfind("final step=8 state=", 0), 0u) << describe(clean);
  EXPECT_EQ(rank0.back(), clean0[1]) << describe(restarted);
  std::remove((dir + "/clean.txt").c_str());
  std::remove((dir + "/restarted.txt").c_str());
  ::rmdir(dir.c_str());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ResumeAtWorldSize, ::testing::Values(1, 2, 3));

// A rank stuck in the user's own code under fsdprun: the other ranks stop
// after the divergence timeout (3 s here, the collective timeout 10 minutes)
// with the diagnosis naming the stalled rank, and fsdprun prints it and
// fails, long before the collective timeout.
TEST(Divergence, FsdprunPrintsTheDiagnosisOfAStalledRank) {
  char tmpl[] = "/tmp/fsdp2cpp_stall_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const RunResult r = run({kFsdprun, "--nproc", "3", "--collective-timeout", "600", "--", kLoop, "--steps", "6",
                           "--checkpoint", dir + "/progress.txt", "--stall-rank", "1", "--stall-at", "3"},
                          {{"FSDP2CPP_DIVERGENCE_TIMEOUT_S", "3"}});
  EXPECT_NE(r.exit_code, 0) << describe(r);
  const std::string all = r.out + r.err;
  EXPECT_NE(all.find("ranks diverged at collective #"), std::string::npos) << describe(r);
  EXPECT_NE(all.find("rank 1 has issued nothing on it since #"), std::string::npos) << describe(r);
  EXPECT_NE(all.find("stalled in user code"), std::string::npos) << describe(r);
  EXPECT_LT(r.seconds, 120.0) << describe(r);
  std::remove((dir + "/progress.txt").c_str());
  ::rmdir(dir.c_str());
}

TEST(MaybeLaunchLocal, NprocFlagStartsRanksOfThisProgramWithoutTheFlag) {
  for (const std::string& flag : {std::string("--nproc=3"), std::string("--nproc")}) {
    std::vector<std::string> args = {kProbe, "self", "a", flag};
    if (flag == "--nproc") args.push_back("3");
    args.push_back("b");
    const RunResult r = run(args);
    ASSERT_EQ(r.exit_code, 0) << describe(r);
    for (int rank = 0; rank < 3; ++rank) {
      const std::vector<std::string> lines = lines_of_rank(r.out, rank);
      ASSERT_GE(lines.size(), 2u) << describe(r);
      EXPECT_EQ(lines[0], "args: a b") << describe(r);
      EXPECT_EQ(lines[1].rfind("RANK=" + std::to_string(rank) + " WORLD_SIZE=3 LOCAL_RANK=" + std::to_string(rank), 0),
                0u)
          << describe(r);
    }
  }
}

TEST(MaybeLaunchLocal, EnvironmentVariableStartsRanksAndIsNotInherited) {
  const RunResult r = run({kProbe, "self", "x"}, {{"FSDP2CPP_NPROC", "2"}, {"FSDP2CPP_MESH", "2x1"}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<std::string> lines = lines_of_rank(r.out, rank);
    ASSERT_GE(lines.size(), 2u) << describe(r);
    EXPECT_EQ(lines[0], "args: x");
    EXPECT_NE(lines[1].find("WORLD_SIZE=2 "), std::string::npos) << describe(r);
    EXPECT_NE(lines[1].find("MESH=2x1"), std::string::npos) << describe(r);
  }
  // Two ranks, two lines each with args: no rank launched ranks of its own.
  int args_lines = 0;
  for (const auto& line : lines_of(r.out)) args_lines += line.find("] args:") != std::string::npos ? 1 : 0;
  EXPECT_EQ(args_lines, 2) << describe(r);
}

TEST(MaybeLaunchLocal, WithoutLauncherRunsAsOneRank) {
  const RunResult r = run({kProbe, "self", "solo"});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  const std::vector<std::string> lines = lines_of(r.out);
  ASSERT_GE(lines.size(), 2u) << describe(r);
  EXPECT_EQ(lines[0], "args: solo");
  EXPECT_TRUE(std::regex_search(
      lines[1],
      std::regex("^RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=[0-9]+")))
      << describe(r);
}

TEST(MaybeLaunchLocal, UnderALauncherRunsAsTheRankItIsGiven) {
  const RunResult r = run({kProbe, "self"}, {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_NE(r.out.find("RANK=1 WORLD_SIZE=2 "), std::string::npos) << describe(r);
}

TEST(MaybeLaunchLocal, BadValuesFailBeforeAnyRankStarts) {
  RunResult r = run({kProbe, "self", "--nproc", "0"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("launch_probe: --nproc must be a positive integer (got '0')"), std::string::npos) << describe(r);
  r = run({kProbe, "self", "--nproc"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("launch_probe: --nproc needs a value"), std::string::npos) << describe(r);
  r = run({kProbe, "self"}, {{"FSDP2CPP_NPROC", "many"}});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("launch_probe: FSDP2CPP_NPROC must be a positive integer (got 'many')"), std::string::npos)
      << describe(r);
  r = run({kProbe, "self", "--nproc", "3"}, {{"FSDP2CPP_MESH", "2x2"}});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_NE(r.err.find("launch_probe: FSDP2CPP_MESH=2x2 needs 4 ranks, but the world has 3"), std::string::npos)
      << describe(r);
  EXPECT_EQ(r.out, "") << describe(r);
}

TEST(MeshShapeFromEnv, ParsesAndChecksTheProduct) {
  ::unsetenv("FSDP2CPP_MESH");
  EXPECT_EQ(fsdp::launch::mesh_shape_from_env(3), (std::vector<int64_t>{3}));
  ::setenv("FSDP2CPP_MESH", "2x2", 1);
  EXPECT_EQ(fsdp::launch::mesh_shape_from_env(4), (std::vector<int64_t>{2, 2}));
  EXPECT_THROW(fsdp::launch::mesh_shape_from_env(2), std::invalid_argument);
  ::setenv("FSDP2CPP_MESH", "2*2", 1);
  try {
    fsdp::launch::mesh_shape_from_env(4);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP2CPP_MESH must be RxS"), std::string::npos) << e.what();
  }
  ::unsetenv("FSDP2CPP_MESH");
}

}  // namespace
