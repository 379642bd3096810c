// The launcher (fsdp2cpp::launch) and the fsdprun command, at 1 to 3 ranks:
// the environment each rank gets, the [rankN] prefix on whole lines, the
// exit status of a failing or killed rank with the others stopped, the flag
// errors of fsdprun, and maybe_launch_local driven by --nproc and by
// FSDP2CPP_NPROC.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>

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

// SIGTERM to fsdprun reaches the ranks (they stop at once instead of
// sleeping 60 s) and fsdprun exits with 128 + SIGTERM.
TEST(LaunchLocalRanks, StopSignalToTheLauncherIsPassedOnToTheRanks) {
  int out_fds[2], err_fds[2];
  ASSERT_EQ(::pipe2(out_fds, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(err_fds, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_fds[1], STDERR_FILENO);
  std::vector<std::string> args = {kFsdprun, "--nproc", "2", "--", kProbe, "exit", "99", "0"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  ASSERT_EQ(::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out_fds[1]);
  ::close(err_fds[1]);
  const auto start = std::chrono::steady_clock::now();
  // Both ranks are up once both said so.
  std::string out;
  char buffer[256];
  while (out.find("[rank0] waiting") == std::string::npos || out.find("[rank1] waiting") == std::string::npos) {
    const ssize_t n = ::read(out_fds[0], buffer, sizeof(buffer));
    ASSERT_GT(n, 0) << out;
    out.append(buffer, static_cast<size_t>(n));
  }
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  out += fsdp_launch_test::read_all(out_fds[0]);
  const std::string err = fsdp_launch_test::read_all(err_fds[0]);
  ::close(out_fds[0]);
  ::close(err_fds[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(WIFEXITED(status)) << "fsdprun itself was killed\n" << out << err;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << out << err;
  EXPECT_LT(seconds, 30.0) << out << err;
  EXPECT_NE(err.find("fsdprun: got signal 15 (Terminated); stopping the ranks"), std::string::npos) << err;
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
