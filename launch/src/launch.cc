#include "launch/launch.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace fsdp::launch {

namespace {

// The environment of rank `rank`: this process's, with torchrun's variables
// set for the rank. Built before fork, so the child only calls execve.
std::vector<std::string> rank_environment(int rank, int nproc, int port, int attempt, int max_restarts,
                                          const std::map<std::string, std::string>& extra) {
  std::map<std::string, std::string> ours = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      {kRestartCountEnv, std::to_string(attempt)},
      {kMaxRestartsEnv, std::to_string(max_restarts)},
  };
  for (const auto& [key, value] : extra) ours[key] = value;
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    // This launcher hosts no agent store: rank 0 hosts the TCPStore. A rank
    // must not launch again because of an inherited FSDP2CPP_NPROC.
    if (ours.count(key) != 0 || key == "TORCHELASTIC_USE_AGENT_STORE" || key == kNprocEnv) continue;
    env.push_back(entry);
  }
  for (const auto& [key, value] : ours) env.push_back(key + "=" + value);
  return env;
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// The path execve gets: as given when it has a '/', else the first match in
// PATH (execvp's rule), resolved here so that a typo fails before any rank
// starts. Empty when not found.
std::string resolve_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return is_executable_file(program) ? program : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    std::string candidate = dir + "/" + program;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return "";
}

// The child side of fork: only async-signal-safe calls until execve.
[[noreturn]] void exec_rank(pid_t parent, const char* path, char* const* argv, char* const* envp, int out_fd,
                            int err_fd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // die with the launcher
  if (::getppid() != parent) ::_exit(1);
  if (out_fd >= 0 && ::dup2(out_fd, STDOUT_FILENO) < 0) ::_exit(127);
  if (err_fd >= 0 && ::dup2(err_fd, STDERR_FILENO) < 0) ::_exit(127);
  ::execve(path, argv, envp);
  static const char kMessage[] = "fsdp::launch: execve of the rank's program failed\n";
  (void)!::write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  ::_exit(127);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// One rank's stdout or stderr, read through a pipe and written to ours a
// whole line at a time behind the rank's prefix, so that the lines of
// different ranks never interleave mid-line.
struct OutputStream {
  int fd = -1;         // read end, -1 once closed
  int target = -1;     // STDOUT_FILENO or STDERR_FILENO
  std::string prefix;  // "[rank1] "
  std::string partial;

  void emit_lines(bool at_eof) {
    size_t start = 0;
    std::string out;
    for (size_t nl = partial.find('\n'); nl != std::string::npos; nl = partial.find('\n', start)) {
      out += prefix;
      out.append(partial, start, nl + 1 - start);
      start = nl + 1;
    }
    partial.erase(0, start);
    if (at_eof && !partial.empty()) {
      out += prefix + partial + "\n";
      partial.clear();
    }
    if (!out.empty()) write_all(target, out);
  }

  // Reads what is there; closes at end of file.
  void pump() {
    char buffer[4096];
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      ::close(fd);
      fd = -1;
      emit_lines(/*at_eof=*/true);
      return;
    }
    partial.append(buffer, static_cast<size_t>(n));
    emit_lines(/*at_eof=*/false);
  }
};

void poll_streams(std::vector<OutputStream>& streams, int timeout_ms) {
  std::vector<pollfd> fds;
  std::vector<OutputStream*> owners;
  for (auto& s : streams) {
    if (s.fd < 0) continue;
    fds.push_back(pollfd{s.fd, POLLIN, 0});
    owners.push_back(&s);
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0) owners[i]->pump();
  }
}

// The stop signal the launcher received (SIGINT, SIGTERM, SIGHUP), or 0.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void record_stop_signal(int sig) { g_stop_signal = sig; }

// While the ranks run, a stop signal to the launcher is passed on to them
// (as torchrun does) instead of killing the launcher, which would leave the
// ranks to PR_SET_PDEATHSIG's SIGKILL with no chance to clean up. The
// previous handlers come back when the ranks are gone.
class ForwardStopSignals {
 public:
  ForwardStopSignals() {
    g_stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = record_stop_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &action, &previous_[i]);
  }
  ~ForwardStopSignals() {
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &previous_[i], nullptr);
  }
  ForwardStopSignals(const ForwardStopSignals&) = delete;
  ForwardStopSignals& operator=(const ForwardStopSignals&) = delete;

 private:
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGHUP};
  std::array<struct sigaction, 3> previous_{};
};

// How one attempt of the group ended.
struct AttemptResult {
  // 0 when every rank exited with 0; else the first failure's exit status
  // (128 + signal when killed by one, or for a stop signal passed on).
  int status = 0;
  // The rank whose failure ended the attempt; -1 when none did (success, a
  // stop signal to the launcher, or the launcher's own failure to start a
  // rank), and then there is nothing to restart.
  int failed_rank = -1;
  // The signal that killed failed_rank, or 0 when it exited.
  int signal = 0;
};

std::string describe_failure(const AttemptResult& result) {
  if (result.signal != 0) {
    return "was killed by signal " + std::to_string(result.signal) + " (" + strsignal(result.signal) + ")";
  }
  return "failed with exit code " + std::to_string(result.status);
}

// The ranks of one attempt while they run.
struct RunningRanks {
  std::map<pid_t, int> rank_of;  // pid -> rank, of the ranks not yet reaped
  std::vector<OutputStream> streams;

  void signal_all(int sig) const {
    for (const auto& [pid, rank] : rank_of) ::kill(pid, sig);
  }
};

// Forks and execs rank `rank`, its output through pipes when
// options.prefix_output. Returns false, having said why, when it could not.
bool start_rank(int rank, const LaunchOptions& options, const std::string& path, const std::vector<char*>& argv,
                int port, int attempt, RunningRanks& ranks) {
  const char* name = options.name.c_str();
  const std::vector<std::string> env =
      rank_environment(rank, options.nproc, port, attempt, options.max_restarts, options.extra_env);
  const std::vector<char*> envp = c_strings(env);
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  if (options.prefix_output && (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)) {
    std::fprintf(stderr, "%s: pipe for rank %d failed: %s\n", name, rank, std::strerror(errno));
    return false;
  }
  const pid_t self = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) exec_rank(self, path.c_str(), argv.data(), envp.data(), out_pipe[1], err_pipe[1]);
  if (options.prefix_output) {
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
  }
  if (pid < 0) {
    std::fprintf(stderr, "%s: fork of rank %d failed: %s\n", name, rank, std::strerror(errno));
    if (options.prefix_output) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
    }
    return false;
  }
  ranks.rank_of[pid] = rank;
  if (options.prefix_output) {
    const std::string prefix = "[rank" + std::to_string(rank) + "] ";
    ranks.streams.push_back(OutputStream{out_pipe[0], STDOUT_FILENO, prefix, {}});
    ranks.streams.push_back(OutputStream{err_pipe[0], STDERR_FILENO, prefix, {}});
  }
  return true;
}

// Reaps the ranks, passing their output on, until all are gone. The first
// failure (or a stop signal to the launcher) stops the others: they would
// otherwise wait for the failed rank in a collective until their timeout.
void wait_for_ranks(RunningRanks& ranks, const LaunchOptions& options, AttemptResult& result) {
  const char* name = options.name.c_str();
  int& first_failure = result.status;
  if (first_failure != 0) ranks.signal_all(SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + options.grace_period;
  bool killed = false, stopping = false;
  while (!ranks.rank_of.empty() || (g_stop_signal != 0 && !stopping)) {
    poll_streams(ranks.streams, 20);
    if (const int sig = g_stop_signal; sig != 0 && !stopping) {
      stopping = true;
      std::fprintf(stderr, "%s: got signal %d (%s); stopping the ranks\n", name, sig, strsignal(sig));
      // The caller sees g_stop_signal and does not restart.
      if (first_failure == 0) first_failure = 128 + sig;
      ranks.signal_all(sig);
      deadline = std::chrono::steady_clock::now() + options.grace_period;
      continue;
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {
      if (first_failure != 0 && !killed && std::chrono::steady_clock::now() > deadline) {
        ranks.signal_all(SIGKILL);
        killed = true;
      }
      continue;
    }
    auto it = ranks.rank_of.find(pid);
    if (it == ranks.rank_of.end()) continue;
    const int rank = it->second;
    ranks.rank_of.erase(it);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    if (first_failure != 0) continue;  // stopped by us, or failing for the same reason
    first_failure = exit_code_of(status);
    if (first_failure == 0) first_failure = 1;
    result.failed_rank = rank;
    result.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    // The failed rank's last words come before the launcher's verdict.
    poll_streams(ranks.streams, 0);
    std::fprintf(stderr, "%s: rank %d %s; stopping the other ranks\n", name, rank,
                 result.signal != 0 ? describe_failure(result).c_str()
                                    : ("exited with code " + std::to_string(first_failure)).c_str());
    ranks.signal_all(SIGTERM);
    deadline = std::chrono::steady_clock::now() + options.grace_period;
  }
}

// What the ranks wrote last. A process the ranks started may still hold a
// pipe open: give up on it after a moment rather than wait for it.
void drain_output(std::vector<OutputStream>& streams) {
  const auto drain_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    bool open = false;
    for (const auto& s : streams) open = open || s.fd >= 0;
    if (!open) break;
    if (std::chrono::steady_clock::now() > drain_deadline) {
      for (auto& s : streams) {
        if (s.fd < 0) continue;
        ::close(s.fd);
        s.fd = -1;
        s.emit_lines(/*at_eof=*/true);
      }
      break;
    }
    poll_streams(streams, 20);
  }
}

// Starts the ranks of attempt `attempt` (0 first) and waits for all of them;
// after the first failure the others are stopped. Every attempt has its own
// MASTER_PORT: rank 0 of the new attempt hosts a new store, so no rank ever
// reads a key a rank of an earlier attempt wrote (torchrun gets the same
// from its per-attempt store prefix).
AttemptResult run_attempt(const LaunchOptions& options, const std::string& path, const std::vector<std::string>& args,
                          int attempt) {
  AttemptResult result;
  const int port = free_port();
  if (port < 0) {
    std::fprintf(stderr, "%s: cannot find a free port on 127.0.0.1: %s\n", options.name.c_str(), std::strerror(errno));
    result.status = 1;
    return result;
  }
  const std::vector<char*> argv = c_strings(args);
  std::fflush(stdout);
  std::fflush(stderr);
  RunningRanks ranks;
  for (int r = 0; r < options.nproc && g_stop_signal == 0; ++r) {
    if (!start_rank(r, options, path, argv, port, attempt, ranks)) {
      result.status = 1;
      break;
    }
  }
  wait_for_ranks(ranks, options, result);
  drain_output(ranks.streams);
  return result;
}

bool parse_positive_int(const std::string& text, int* out) {
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  *out = std::stoi(text);
  return *out > 0;
}

}  // namespace

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

bool set_single_rank_environment() {
  const int port = free_port();
  if (port < 0) return false;
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "1", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  ::setenv("LOCAL_WORLD_SIZE", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  return true;
}

int launch_local_ranks(const LaunchOptions& options) {
  const char* name = options.name.c_str();
  if (options.nproc < 1) {
    std::fprintf(stderr, "%s: the number of ranks must be >= 1 (got %d)\n", name, options.nproc);
    return 2;
  }
  if (options.max_restarts < 0) {
    std::fprintf(stderr, "%s: the number of restarts must be >= 0 (got %d)\n", name, options.max_restarts);
    return 2;
  }
  const std::string path = options.program.empty() ? "/proc/self/exe" : resolve_program(options.program);
  if (path.empty()) {
    std::fprintf(stderr, "%s: cannot run '%s': %s\n", name, options.program.c_str(),
                 options.program.find('/') != std::string::npos ? "no such executable file"
                                                                : "not found in PATH (give a path, e.g. ./prog)");
    return 127;
  }
  const std::vector<std::string> args =
      options.args.empty() ? std::vector<std::string>{options.program.empty() ? path : options.program} : options.args;

  // N ranks that each start one OpenMP thread per core oversubscribe the
  // machine N times over (intra-op parallelism in every rank), so, as
  // torchrun does, several local ranks get OMP_NUM_THREADS=1 unless the user
  // chose a value; said once, not per attempt.
  LaunchOptions effective = options;
  if (options.nproc > 1 && std::getenv(kOmpNumThreadsEnv) == nullptr &&
      options.extra_env.count(kOmpNumThreadsEnv) == 0) {
    effective.extra_env[kOmpNumThreadsEnv] = "1";
    std::fprintf(stderr,
                 "%s: OMP_NUM_THREADS is not set; setting it to 1 for each of the %d ranks so that they do not "
                 "overload this machine (set OMP_NUM_THREADS yourself to tune the threads per rank)\n",
                 name, options.nproc);
  }

  // One handler for all attempts, so that a stop signal that arrives between
  // two attempts is seen too and ends the job instead of restarting it.
  const ForwardStopSignals forward_stop_signals;
  for (int attempt = 0;; ++attempt) {
    const AttemptResult result = run_attempt(effective, path, args, attempt);
    if (result.status == 0 || result.failed_rank < 0 || g_stop_signal != 0) return result.status;
    const std::string failure = describe_failure(result);
    if (attempt == options.max_restarts) {
      if (options.max_restarts > 0) {
        std::fprintf(stderr, "%s: rank %d %s; no restarts left (%d attempts, --max-restarts %d)\n", name,
                     result.failed_rank, failure.c_str(), attempt + 1, options.max_restarts);
      }
      return result.status;
    }
    std::fprintf(stderr, "%s: rank %d %s; restarting the group (restart %d of %d)\n", name, result.failed_rank,
                 failure.c_str(), attempt + 1, options.max_restarts);
  }
}

int launch_local_ranks(int nproc, const std::vector<std::string>& args, int max_restarts) {
  LaunchOptions options;
  options.nproc = nproc;
  options.max_restarts = max_restarts;
  options.args = args;
  options.prefix_output = false;
  options.name = args.empty() ? "fsdp::launch" : args[0].substr(args[0].rfind('/') + 1);
  return launch_local_ranks(options);
}

std::optional<int> maybe_launch_local(int& argc, char** argv) {
  const std::string program = argc > 0 ? argv[0] : "program";
  const std::string name = program.substr(program.rfind('/') + 1);
  std::optional<std::string> nproc_text;
  std::string source = "--nproc";
  std::vector<std::string> rest;
  int kept = argc > 0 ? 1 : 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {  // the program's own arguments from here on
      for (; i < argc; ++i) {
        rest.push_back(argv[i]);
        argv[kept++] = argv[i];
      }
      break;
    }
    if (arg == "--nproc") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: --nproc needs a value (e.g. --nproc 2)\n", name.c_str());
        return 2;
      }
      nproc_text = argv[++i];
    } else if (arg.rfind("--nproc=", 0) == 0) {
      nproc_text = arg.substr(8);
    } else {
      rest.push_back(arg);
      argv[kept++] = argv[i];
    }
  }
  if (kept < argc) argv[kept] = nullptr;
  argc = kept;

  const bool is_rank = std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr;
  if (!nproc_text && !is_rank) {
    if (const char* env = std::getenv(kNprocEnv); env != nullptr && *env != '\0') {
      nproc_text = env;
      source = kNprocEnv;
    }
  }
  if (!nproc_text) {
    if (is_rank) return std::nullopt;
    if (!set_single_rank_environment()) {
      std::fprintf(stderr, "%s: cannot find a free port on 127.0.0.1 for a one-rank run: %s\n", name.c_str(),
                   std::strerror(errno));
      return 1;
    }
    return std::nullopt;
  }
  int nproc = 0;
  if (!parse_positive_int(*nproc_text, &nproc)) {
    std::fprintf(stderr, "%s: %s must be a positive integer (got '%s')\n", name.c_str(), source.c_str(),
                 nproc_text->c_str());
    return 2;
  }
  try {
    (void)mesh_shape_from_env(nproc);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    return 2;
  }
  LaunchOptions options;
  options.nproc = nproc;
  options.args.push_back(program);
  options.args.insert(options.args.end(), rest.begin(), rest.end());
  options.name = name;
  return launch_local_ranks(options);
}

double parse_timeout_seconds(const std::string& text, const std::string& what) {
  // strtod's whole-string rule, without its leading spaces, hex or "inf".
  const bool plain = !text.empty() && text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const double seconds = plain ? std::strtod(text.c_str(), &end) : 0.0;
  if (!plain || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(seconds) || !(seconds > 0)) {
    throw std::invalid_argument(what + " must be a number of seconds > 0, e.g. 600 or 1.5 (got '" + text + "')");
  }
  return seconds;
}

MeshShape parse_mesh(const std::string& text, const std::string& what) {
  const size_t x = text.find('x');
  int r = 0, s = 0;
  if (x == std::string::npos || !parse_positive_int(text.substr(0, x), &r) ||
      !parse_positive_int(text.substr(x + 1), &s)) {
    throw std::invalid_argument(
        what + " must be RxS with positive integers R (replicas) and S (shards), e.g. 2x2 (got '" + text + "')");
  }
  return MeshShape{r, s};
}

std::vector<int64_t> mesh_shape_from_env(int64_t world_size) {
  const char* text = std::getenv(kMeshEnv);
  if (text == nullptr || *text == '\0') return {world_size};
  const MeshShape shape = parse_mesh(text, kMeshEnv);
  if (shape.replicate * shape.shard != world_size) {
    throw std::invalid_argument(std::string(kMeshEnv) + "=" + text + " needs " +
                                std::to_string(shape.replicate * shape.shard) + " ranks, but the world has " +
                                std::to_string(world_size));
  }
  return {shape.replicate, shape.shard};
}

}  // namespace fsdp::launch
