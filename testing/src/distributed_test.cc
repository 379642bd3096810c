// The multi-process GoogleTest harness: the parent side starts one copy of
// the test binary per rank and collects how each ended; the rank side runs
// the test body with a World made from a FileStore rendezvous.
#include "fsdp_testing/distributed_test.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp_common/child_process.h"
#include "fsdp_testing/test_helpers.h"

extern char** environ;

namespace fsdp::testing {

namespace {

constexpr const char* kRankVar = "FSDP2CPP_TEST_RANK";
constexpr const char* kWorldSizeVar = "FSDP2CPP_TEST_WORLD_SIZE";
constexpr const char* kStoreVar = "FSDP2CPP_TEST_STORE";
constexpr const char* kNameVar = "FSDP2CPP_TEST_NAME";
constexpr const char* kCallVar = "FSDP2CPP_TEST_CALL";
constexpr const char* kParentVar = "FSDP2CPP_TEST_PARENT_PID";
constexpr size_t kOutputTail = 8 * 1024;
constexpr size_t kOutputTailLines = 40;
constexpr size_t kStacksTail = 48 * 1024;
constexpr std::chrono::milliseconds kPollInterval{20};

// The current test and the index of this run_distributed call within it.
struct CallId {
  std::string test_name;
  int index = 0;
};

CallId next_call() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) {
    throw std::logic_error("fsdp::testing::run_distributed must be called from inside a GoogleTest test body");
  }
  CallId id;
  id.test_name = std::string(info->test_suite_name()) + "." + info->name();
  // Keyed by the start time as well, so that --gtest_repeat starts again at 0.
  const std::string key = id.test_name + "@" + std::to_string(info->result()->start_timestamp());
  static std::mutex mutex;
  static std::map<std::string, int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  id.index = counts[key]++;
  return id;
}

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

std::string signal_name(int sig) {
  std::ostringstream out;
  out << sig;
  const char* abbrev = sigabbrev_np(sig);
  const char* text = strsignal(sig);
  if (abbrev) {
    out << " (SIG" << abbrev;
    if (text) out << ": " << text;
    out << ")";
  }
  return out.str();
}

std::string seconds_string(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << seconds << "s";
  return out.str();
}

std::string marker_path(const std::string& dir, int rank, int call) {
  return dir + "/rank-" + std::to_string(rank) + "-call-" + std::to_string(call) + ".ran";
}

// std::filesystem is safe here: fsdp2cpp::torch links libstdc++ ahead of
// libtorch.so ([Note: libstdc++ before libtorch] in cmake/Fsdp2cppTorch.cmake).
bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

// Best effort: a leftover temporary directory must not fail the test.
void remove_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

std::string parent_dir(const std::string& path) { return std::filesystem::path(path).parent_path().string(); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string tail(const std::string& text, size_t bytes) {
  if (text.size() <= bytes) return text;
  return "[... " + std::to_string(text.size() - bytes) + " bytes omitted ...]\n" + text.substr(text.size() - bytes);
}

// ---- reading a rank's output -------------------------------------------------

// One GoogleTest failure that a rank printed: "<file>:<line>: Failure" and the
// message lines after it.
struct PrintedFailure {
  std::string file;  // empty for GoogleTest's "unknown file"
  int line = -1;
  std::string message;
  bool operator==(const PrintedFailure& o) const { return file == o.file && line == o.line && message == o.message; }
};

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// "[ RUN      ]", "[  FAILED  ]", "[==========]", ...
bool is_gtest_status_line(const std::string& line) { return line.size() >= 12 && line[0] == '[' && line[11] == ']'; }

// Lines that every rank prints and that say nothing about the failure.
bool is_boilerplate(const std::string& line) {
  return is_gtest_status_line(line) || line.rfind("Note: Google Test filter = ", 0) == 0 ||
         line.rfind("Running main() from ", 0) == 0 || line.rfind("fsdp2cpp: rank ", 0) == 0 || line.empty();
}

// Parses "<file>:<line>: Failure" (or "unknown file: Failure").
bool parse_failure_header(const std::string& line, PrintedFailure& out) {
  static const std::string kSuffix = ": Failure";
  if (line.size() <= kSuffix.size() || line.compare(line.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
    return false;
  }
  const std::string where = line.substr(0, line.size() - kSuffix.size());
  if (where == "unknown file") {
    out = PrintedFailure{};
    return true;
  }
  const size_t colon = where.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == where.size()) return false;
  const std::string number = where.substr(colon + 1);
  if (!std::all_of(number.begin(), number.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  out = PrintedFailure{};
  out.file = where.substr(0, colon);
  out.line = std::stoi(number);
  return true;
}

// The failures in a rank's output, in order. A message runs to the next
// GoogleTest status line or failure header.
std::vector<PrintedFailure> printed_failures(const std::string& output) {
  std::vector<PrintedFailure> failures;
  PrintedFailure* open = nullptr;
  for (const std::string& line : split_lines(output)) {
    PrintedFailure header;
    if (parse_failure_header(line, header)) {
      failures.push_back(header);
      open = &failures.back();
    } else if (is_gtest_status_line(line)) {
      open = nullptr;
    } else if (open != nullptr) {
      open->message += line + "\n";
    }
  }
  for (PrintedFailure& f : failures) {
    while (!f.message.empty() && (f.message.back() == '\n' || f.message.back() == ' ')) f.message.pop_back();
    // GoogleTest's text for ADD_FAILURE() and FAIL(), which says nothing.
    if (f.message == "Failed") f.message.clear();
    if (f.message.rfind("Failed\n", 0) == 0) f.message.erase(0, 7);
  }
  return failures;
}

// The last `max_lines` lines of a rank's output without GoogleTest's and the
// harness's boilerplate, at most `max_bytes` of them.
std::string informative_tail(const std::string& output, size_t max_lines, size_t max_bytes) {
  std::vector<std::string> kept;
  for (const std::string& line : split_lines(output)) {
    if (!is_boilerplate(line)) kept.push_back(line);
  }
  const size_t first = kept.size() > max_lines ? kept.size() - max_lines : 0;
  std::string text;
  if (first > 0) text = "[... " + std::to_string(first) + " earlier lines omitted ...]\n";
  for (size_t i = first; i < kept.size(); ++i) text += kept[i] + "\n";
  return tail(text, max_bytes);
}

// "rank 1 of 3", "ranks 0, 2 of 3", "all 3 ranks".
std::string rank_list(const std::vector<int>& ranks, int world_size) {
  if (world_size > 1 && static_cast<int>(ranks.size()) == world_size) {
    return "all " + std::to_string(world_size) + " ranks";
  }
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + " of " + std::to_string(world_size);
}

// ---- rank side --------------------------------------------------------------

constexpr std::chrono::seconds kDepartureWait{5};

// The rank's context: its device, the rendezvous, the World. Null, with the
// failure added, when that failed.
std::unique_ptr<RankContext> set_up_rank(const DistributedTestOptions& options, int rank, int world_size,
                                         const std::string& store) {
  try {
    if (options.device_type == c10::kCUDA) {
      const int count = cuda_device_count();
      if (count == 0) {
        ADD_FAILURE() << "rank " << rank << ": a CUDA run needs a GPU, but none is visible; call "
                      << "FSDP2CPP_SKIP_WITHOUT_CUDA() at the top of the test";
        return nullptr;
      }
    }
    collectives::RendezvousOptions rendezvous;
    rendezvous.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout);
    auto world = collectives::World::from_file(store, rank, world_size, rendezvous);
    auto ctx = std::make_unique<RankContext>(std::move(world), options);
    if (options.device_type == c10::kCUDA) {
      c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(ctx->device());
    }
    return ctx;
  } catch (...) {
    ADD_FAILURE() << "rank " << rank << ": setting up the rank failed: " << exception_text(std::current_exception());
    return nullptr;
  }
}

// [Note: leaving together] A rank that tears its groups down while a peer
// is still connecting to it (Gloo's full-mesh connect finishes at different
// times on different ranks) makes that peer fail with "connection closed
// by peer". So every rank waits, briefly, until all have finished their
// body. A rank that crashed or hangs never arrives; the others give up
// after kDepartureWait (at most a quarter of the run's timeout) and the
// crash or hang is reported as usual.
void wait_for_departures(RankContext& ctx, const DistributedTestOptions& options, int world_size) {
  try {
    const auto& store = ctx.world()->store();
    const std::string key = "fsdp2cpp/test/departed";
    store->add(key, 1);
    // Bounded well inside the run's deadline, so that waiting for a hung peer
    // never makes this rank time out too.
    const auto wait = std::min<std::chrono::milliseconds>(kDepartureWait, options.timeout / 4);
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (store->add(key, 0) < world_size && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (...) {
    // Best effort: the store itself may be gone with a crashed rank 0.
  }
}

void run_as_rank(const DistributedTestOptions& options, const RankBody& body, const CallId& call) {
  // Rank output goes to a file: keep it line-buffered so that a crash loses
  // as little of it as possible.
  std::fflush(stdout);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // Die with the harness (for instance when CTest kills it at its timeout).
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // Let the harness's gdb read this rank's stacks if it hangs, also where
  // Yama allows ptrace only from ancestors (gdb is the harness's child, not
  // ours). Without Yama this fails harmlessly.
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY);
  const std::string parent = env_or_empty(kParentVar);
  if (!parent.empty() && std::to_string(getppid()) != parent) std::_Exit(3);

  const int rank = std::stoi(env_or_empty(kRankVar));
  const int world_size = std::stoi(env_or_empty(kWorldSizeVar));
  const std::string store = env_or_empty(kStoreVar);
  std::cerr << "fsdp2cpp: rank " << rank << " of " << world_size << " running " << call.test_name << " (call "
            << call.index << ")" << std::endl;
  {
    // The parent only trusts a zero exit code from a rank that got here.
    std::ofstream marker(marker_path(parent_dir(store), rank, call.index));
  }
  if (world_size != options.world_size) {
    ADD_FAILURE() << "rank " << rank << ": the harness started " << world_size
                  << " ranks but this run_distributed call asks for " << options.world_size;
    return;
  }

  at::set_num_threads(1);
  try {
    at::set_num_interop_threads(1);
  } catch (const std::exception&) {
    // Already started: the default pool is then used.
  }

  std::unique_ptr<RankContext> ctx = set_up_rank(options, rank, world_size, store);
  if (!ctx) return;
  try {
    body(*ctx);
  } catch (...) {
    ADD_FAILURE() << "rank " << rank << ": the test body threw: " << exception_text(std::current_exception());
  }
  wait_for_departures(*ctx, options, world_size);
  // Communicators and the World are torn down here, before the test ends.
  try {
    ctx.reset();
  } catch (...) {
    ADD_FAILURE() << "rank " << rank << ": tearing down the rank failed: " << exception_text(std::current_exception());
  }
}

// ---- parent side ------------------------------------------------------------

struct SpawnResources {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  SpawnResources() {
    posix_spawn_file_actions_init(&actions);
    posix_spawnattr_init(&attr);
  }
  ~SpawnResources() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
  }
};

std::string self_exe() {
  std::vector<char> buffer(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buffer.data(), buffer.size() - 1);
  if (n <= 0) return "/proc/self/exe";
  return std::string(buffer.data(), static_cast<size_t>(n));
}

// Environment of a rank: ours minus harness and GoogleTest variables (a
// GTEST_OUTPUT or sharding setting of the parent must not reach the ranks),
// plus the rank's own.
std::vector<std::string> rank_environment(int rank, const DistributedTestOptions& options, const std::string& store,
                                          const CallId& call) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.rfind("FSDP2CPP_TEST_", 0) == 0 && entry.rfind("FSDP2CPP_TEST_VERBOSE=", 0) != 0) continue;
    if (entry.rfind("GTEST_", 0) == 0) continue;
    if (entry.rfind("OMP_NUM_THREADS=", 0) == 0) continue;
    env.push_back(entry);
  }
  env.push_back(std::string(kRankVar) + "=" + std::to_string(rank));
  env.push_back(std::string(kWorldSizeVar) + "=" + std::to_string(options.world_size));
  env.push_back(std::string(kStoreVar) + "=" + store);
  env.push_back(std::string(kNameVar) + "=" + call.test_name);
  env.push_back(std::string(kCallVar) + "=" + std::to_string(call.index));
  env.push_back(std::string(kParentVar) + "=" + std::to_string(getpid()));
  env.push_back("OMP_NUM_THREADS=1");
  return env;
}

pid_t spawn_rank(const std::string& exe, const std::string& log_path, const std::vector<std::string>& args,
                 const std::vector<std::string>& env) {
  SpawnResources res;
  posix_spawn_file_actions_addopen(&res.actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&res.actions, STDOUT_FILENO, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&res.actions, STDOUT_FILENO, STDERR_FILENO);
  // Own process group, so that a kill reaches everything the rank started.
  posix_spawnattr_setpgroup(&res.attr, 0);
  sigset_t mask;
  sigemptyset(&mask);
  posix_spawnattr_setsigmask(&res.attr, &mask);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGABRT, SIGSEGV}) sigaddset(&defaults, sig);
  posix_spawnattr_setsigdefault(&res.attr, &defaults);
  posix_spawnattr_setflags(&res.attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), &res.actions, &res.attr, argv.data(), envp.data());
  if (rc != 0) throw std::runtime_error("fsdp::testing: posix_spawn of " + exe + " failed: " + strerror(rc));
  return pid;
}

// A fresh directory for one run's store, logs and markers.
std::string make_run_dir() {
  const char* tmp_root = std::getenv("TMPDIR");
  std::string templ = std::string(tmp_root && *tmp_root ? tmp_root : "/tmp") + "/fsdp2cpp-test-XXXXXX";
  std::vector<char> buffer(templ.begin(), templ.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {
    throw std::runtime_error("fsdp::testing: mkdtemp(" + templ + ") failed: " + strerror(errno));
  }
  return std::string(buffer.data());
}

// Starts every rank; on a failure kills those already started, removes `dir`
// and rethrows.
std::vector<pid_t> spawn_ranks(const DistributedTestOptions& options, const CallId& call, const std::string& dir,
                               const std::string& store) {
  const std::string exe = self_exe();
  const std::vector<std::string> args = {exe, "--gtest_filter=" + call.test_name, "--gtest_also_run_disabled_tests",
                                         "--gtest_color=no"};
  const int n = options.world_size;
  std::vector<pid_t> pids;
  try {
    for (int r = 0; r < n; ++r) {
      pids.push_back(spawn_rank(exe, dir + "/rank-" + std::to_string(r) + ".log", args,
                                rank_environment(r, options, store, call)));
    }
  } catch (...) {
    for (pid_t pid : pids) {
      kill(-pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    remove_dir(dir);
    throw;
  }
  return pids;
}

// [Note: stacks of a hung rank]
// A rank killed at the deadline leaves no trace of where it waited: its
// output is usually empty, since a body prints nothing until it fails, and a
// hang seen once in CI could not be diagnosed. So before the kill the harness
// asks gdb for every thread's stack (bounded by coreutils' timeout, a few
// seconds per rank: gdb reads LibTorch's symbols). Without gdb on PATH the
// command prints no stack, and there are none to show.
std::string thread_stacks(pid_t pid) {
  if (env_or_empty("FSDP2CPP_TEST_STACKS") == "0") return "";
  ChildOptions quiet;
  quiet.separate_stderr = true;
  const ChildResult result = run_child({"timeout", "-s", "KILL", "60", "gdb", "-p", std::to_string(pid), "-batch",
                                        "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt"},
                                       quiet);
  std::string stacks;
  for (const std::string& line : split_lines(result.output)) {
    if (line.rfind("Thread ", 0) == 0 || line.rfind("#", 0) == 0) stacks += line + "\n";
  }
  return tail(stacks, kStacksTail);
}

// Waits for every rank to end, until `start` + the run's timeout, after which
// the ranks still running are killed as timed out (their stacks read first);
// fills in how each ended.
void wait_for_ranks(const std::vector<pid_t>& pids, std::chrono::steady_clock::time_point start,
                    std::chrono::seconds timeout, std::vector<RankOutcome>& outcomes) {
  const int n = static_cast<int>(pids.size());
  std::vector<bool> running(n, true);
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  const auto deadline = start + timeout;
  int remaining = n;
  while (remaining > 0) {
    for (int r = 0; r < n; ++r) {
      if (!running[r]) continue;
      int status = 0;
      const pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) continue;
      running[r] = false;
      --remaining;
      outcomes[r].seconds = elapsed();
      if (got == pids[r] && WIFEXITED(status)) {
        outcomes[r].exited = true;
        outcomes[r].exit_code = WEXITSTATUS(status);
      } else if (got == pids[r] && WIFSIGNALED(status)) {
        outcomes[r].signal = WTERMSIG(status);
      }
      // Anything the rank left behind in its group goes too.
      kill(-pids[r], SIGKILL);
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      // The time of the deadline, not of the kill after gdb read the stacks.
      const double at_deadline = elapsed();
      std::vector<std::thread> readers;
      for (int r = 0; r < n; ++r) {
        if (running[r]) readers.emplace_back([&, r] { outcomes[r].stacks = thread_stacks(pids[r]); });
      }
      for (std::thread& reader : readers) reader.join();
      for (int r = 0; r < n; ++r) {
        if (!running[r]) continue;
        kill(-pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        running[r] = false;
        outcomes[r].timed_out = true;
        outcomes[r].signal = SIGKILL;
        outcomes[r].seconds = at_deadline;
      }
      break;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

std::vector<RankOutcome> launch(const DistributedTestOptions& options, const CallId& call) {
  if (options.world_size < 1) {
    throw std::invalid_argument("fsdp::testing: world_size must be >= 1, got " + std::to_string(options.world_size));
  }
  if (options.timeout.count() <= 0) {
    throw std::invalid_argument("fsdp::testing: the timeout must be positive");
  }
  const std::string dir = make_run_dir();
  const std::string store = dir + "/store";
  const int n = options.world_size;
  std::vector<RankOutcome> outcomes(n);
  for (int r = 0; r < n; ++r) outcomes[r].rank = r;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<pid_t> pids = spawn_ranks(options, call, dir, store);
  wait_for_ranks(pids, start, options.timeout, outcomes);

  const bool verbose = env_or_empty("FSDP2CPP_TEST_VERBOSE") == "1";
  for (int r = 0; r < n; ++r) {
    outcomes[r].output = read_file(dir + "/rank-" + std::to_string(r) + ".log");
    outcomes[r].body_ran = file_exists(marker_path(dir, r, call.index));
    if (verbose) {
      std::cout << "==== " << call.test_name << ": " << outcomes[r].describe() << "; output ====\n"
                << outcomes[r].output << "==== end of rank " << r << " ====" << std::endl;
    }
  }
  remove_dir(dir);
  return outcomes;
}

// Runs the body in a rank process when this call is the one it was started
// for. Returns false in the parent.
bool maybe_run_as_rank(const DistributedTestOptions& options, const RankBody& body, const CallId& call) {
  if (!is_rank_process()) return false;
  const std::string name = env_or_empty(kNameVar);
  if (name != call.test_name) {
    ADD_FAILURE() << "fsdp::testing: this rank process was started for test " << name << " but is running "
                  << call.test_name;
    return true;
  }
  if (env_or_empty(kCallVar) == std::to_string(call.index)) run_as_rank(options, body, call);
  return true;
}

}  // namespace

// ---- RankContext --------------------------------------------------------------

DistributedTestOptions hsdp_options(int64_t replicas, int64_t shards) {
  DistributedTestOptions options;
  options.world_size = static_cast<int>(replicas * shards);
  options.mesh_shape = {replicas, shards};
  options.mesh_dim_names = {"replicate", "shard"};
  return options;
}

DistributedTestOptions cuda_options(int world_size, collectives::BackendKind backend) {
  DistributedTestOptions options;
  options.world_size = world_size;
  options.device_type = c10::kCUDA;
  options.communicator.backend = backend;
  return options;
}

RankContext::RankContext(std::shared_ptr<collectives::World> world, DistributedTestOptions options)
    : world_(std::move(world)), options_(std::move(options)) {
  TORCH_CHECK(world_ != nullptr, "RankContext: the world is null");
}

int RankContext::rank() const { return world_->rank(); }

int RankContext::world_size() const { return world_->size(); }

c10::Device RankContext::device() const {
  if (options_.device_type != c10::kCUDA) return c10::Device(options_.device_type);
  const int count = cuda_device_count();
  TORCH_CHECK(count > 0, "RankContext::device: a CUDA run, but no CUDA device is visible");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(world_->local_rank() % count));
}

const std::shared_ptr<collectives::World>& RankContext::world() const { return world_; }

const std::shared_ptr<collectives::Communicator>& RankContext::world_group() {
  if (!world_group_) world_group_ = world_->new_group(world_->all_ranks(), options_.device_type, options_.communicator);
  return world_group_;
}

const DeviceMesh& RankContext::mesh() {
  if (!mesh_) {
    std::vector<int64_t> shape = options_.mesh_shape;
    if (shape.empty()) shape = {world_->size()};
    mesh_ = std::make_unique<DeviceMesh>(
        init_device_mesh(world_, options_.device_type, shape, options_.mesh_dim_names, options_.communicator));
  }
  return *mesh_;
}

// ---- RankOutcome --------------------------------------------------------------

std::string RankOutcome::describe() const {
  std::ostringstream out;
  out << "rank " << rank << ": ";
  if (timed_out) {
    out << "timed out after " << seconds_string(seconds) << ", still running; killed with SIGKILL";
  } else if (exited && exit_code == 0 && !body_ran) {
    out << "exited with code 0 after " << seconds_string(seconds)
        << " but never ran the body of this run_distributed call (did the test return before the call in the rank "
           "process, or does the test name not match --gtest_filter?)";
  } else if (exited && exit_code == 0) {
    out << "passed in " << seconds_string(seconds);
  } else if (exited) {
    out << "exited with code " << exit_code << " after " << seconds_string(seconds);
  } else if (signal != 0) {
    out << "killed by signal " << signal_name(signal) << " after " << seconds_string(seconds);
  } else {
    out << "ended in an unknown way after " << seconds_string(seconds);
  }
  return out.str();
}

// ---- entry points ---------------------------------------------------------------

std::vector<RankOutcome> run_distributed_collect(const DistributedTestOptions& options, const RankBody& body) {
  const CallId call = next_call();
  if (maybe_run_as_rank(options, body, call)) return {};
  return launch(options, call);
}

namespace {

// [Note: failure reports] Each failure is recorded at the user's file and
// line, so that GoogleTest prints that location first: a failed EXPECT/ASSERT
// of a rank at the location the rank printed; a crash, hang, exception or a
// rank that never ran the body at the TEST itself. A failure that several
// ranks printed identically is recorded once, naming the ranks. The rank's
// full output is not repeated (FSDP2CPP_TEST_VERBOSE=1 prints it): a failure
// carries its message, a crash the last lines of the rank's own output
// without GoogleTest's banners.
void report_failures(const CallId& call, int world_size, const std::vector<RankOutcome>& outcomes) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test_file = info != nullptr && info->file() != nullptr ? info->file() : "unknown file";
  const int test_line = info != nullptr ? info->line() : -1;
  // Failures the harness recorded inside a rank (an exception from the body,
  // a failed setup) belong to the test, not to this file.
  const std::string harness_file = __FILE__;

  struct Group {
    PrintedFailure failure;
    std::vector<int> ranks;
  };
  std::vector<Group> groups;
  std::vector<const RankOutcome*> unexplained;
  for (const RankOutcome& outcome : outcomes) {
    if (outcome.ok()) continue;
    std::vector<PrintedFailure> failures = printed_failures(outcome.output);
    for (PrintedFailure& f : failures) {
      if (f.file.empty() || f.file == harness_file) {
        f.file = test_file;
        f.line = test_line;
      }
      auto same = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.failure == f; });
      if (same == groups.end()) {
        groups.push_back(Group{f, {outcome.rank}});
      } else if (same->ranks.back() != outcome.rank) {
        same->ranks.push_back(outcome.rank);
      }
    }
    // A rank whose gtest failures explain its end (exit code 1 after the
    // body ran) needs nothing more; anything else is reported as it ended.
    const bool explained = !failures.empty() && outcome.exited && outcome.exit_code == 1 && outcome.body_ran;
    if (!explained) unexplained.push_back(&outcome);
  }
  const std::string where = call.test_name + (call.index > 0 ? ", call " + std::to_string(call.index) : "");
  for (const Group& g : groups) {
    // GTEST_MESSAGE_AT_ rather than ADD_FAILURE_AT, which starts the message
    // with a line "Failed".
    GTEST_MESSAGE_AT_(g.failure.file.c_str(), g.failure.line, "", ::testing::TestPartResult::kNonFatalFailure)
        << rank_list(g.ranks, world_size) << " (" << where << "):\n"
        << g.failure.message;
  }
  for (const RankOutcome* outcome : unexplained) {
    const std::string output = informative_tail(outcome->output, kOutputTailLines, kOutputTail);
    GTEST_MESSAGE_AT_(test_file.c_str(), test_line, "", ::testing::TestPartResult::kNonFatalFailure)
        << where << " with " << world_size << " ranks: " << outcome->describe() << "\n"
        << (output.empty() ? std::string("(no output)\n")
                           : "---- last lines of rank " + std::to_string(outcome->rank) + "'s output ----\n" + output +
                                 "---- end of rank " + std::to_string(outcome->rank) + " ----\n")
        << (outcome->stacks.empty()
                ? std::string()
                : "---- rank " + std::to_string(outcome->rank) + "'s threads at the deadline ----\n" + outcome->stacks +
                      "---- end of rank " + std::to_string(outcome->rank) + "'s threads ----\n")
        << "(FSDP2CPP_TEST_VERBOSE=1 prints every rank's full output)";
  }
}

}  // namespace

void run_distributed(const DistributedTestOptions& options, const RankBody& body) {
  const CallId call = next_call();
  if (maybe_run_as_rank(options, body, call)) return;
  report_failures(call, options.world_size, launch(options, call));
}

void run_distributed(int world_size, const RankBody& body) {
  DistributedTestOptions options;
  options.world_size = world_size;
  run_distributed(options, body);
}

bool is_rank_process() { return std::getenv(kRankVar) != nullptr; }

int cuda_device_count() {
  if (!at::hasCUDA()) return 0;
  return at::detail::getCUDAHooks().deviceCount();
}

}  // namespace fsdp::testing
