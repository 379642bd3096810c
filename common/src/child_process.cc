#include "fsdp_common/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

extern char** environ;

namespace fsdp {

namespace {

std::string name_of(const std::string& entry) { return entry.substr(0, entry.find('=')); }

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Both ends of a pipe, closed when it goes out of scope.
struct Pipe {
  int fds[2] = {-1, -1};
  bool open() { return ::pipe2(fds, O_CLOEXEC) == 0; }
  void close_end(int i) {
    if (fds[i] >= 0) ::close(fds[i]);
    fds[i] = -1;
  }
  ~Pipe() {
    close_end(0);
    close_end(1);
  }
};

}  // namespace

std::vector<std::string> child_environment(const std::vector<std::string>& extra) {
  static const char* const kJobVariables[] = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",     "LOCAL_WORLD_SIZE",
                                              "MASTER_ADDR", "MASTER_PORT", "FSDP2CPP_NPROC", "FSDP2CPP_MESH"};
  for (const auto& entry : extra) {
    if (entry.find('=') == std::string::npos) {
      throw std::invalid_argument("child_environment: '" + entry + "' is not a NAME=value entry");
    }
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = name_of(entry);
    if (std::any_of(std::begin(kJobVariables), std::end(kJobVariables), [&](const char* v) { return name == v; })) {
      continue;
    }
    if (std::any_of(extra.begin(), extra.end(), [&](const std::string& x) { return name_of(x) == name; })) continue;
    env.push_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

ChildResult run_child(const std::vector<std::string>& argv, const ChildOptions& options) {
  if (argv.empty()) throw std::invalid_argument("run_child: argv is empty (argv[0] names the program)");
  std::vector<std::string> args = argv, env = child_environment(options.extra_env);
  std::vector<char*> c_argv = c_strings(args), c_env = c_strings(env);

  ChildResult result;
  std::string& stderr_text = options.separate_stderr ? result.error : result.output;
  Pipe out, err;
  if (!out.open() || (options.separate_stderr && !err.open())) {
    stderr_text = "run_child: pipe2 failed: " + std::string(std::strerror(errno));
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out.fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, options.separate_stderr ? err.fds[1] : out.fds[1], STDERR_FILENO);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, c_argv.data(), c_env.data());
  posix_spawn_file_actions_destroy(&actions);
  // Only the child holds the write ends now, so the reads end when it does.
  out.close_end(1);
  err.close_end(1);
  if (rc != 0) {
    stderr_text = "run_child: cannot start " + argv[0] + ": " + std::strerror(rc);
    return result;
  }
  if (options.on_start) options.on_start(pid);
  // Both pipes are read as they fill; `signal_when` sees the output after
  // every read of it.
  std::vector<std::pair<int, std::string*>> reads = {{out.fds[0], &result.output}};
  if (options.separate_stderr) reads.emplace_back(err.fds[0], &result.error);
  bool signalled = false;
  char buffer[4096];
  while (!reads.empty()) {
    std::vector<pollfd> polled;
    for (const auto& read : reads) polled.push_back(pollfd{read.first, POLLIN, 0});
    if (::poll(polled.data(), polled.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (size_t i = polled.size(); i-- > 0;) {
      if (polled[i].revents == 0) continue;
      const ssize_t n = ::read(polled[i].fd, buffer, sizeof(buffer));
      if (n > 0) {
        reads[i].second->append(buffer, static_cast<size_t>(n));
        if (!signalled && options.signal_when && reads[i].second == &result.output &&
            options.signal_when(result.output)) {
          ::kill(pid, options.signal);
          signalled = true;
        }
      } else if (n == 0 || errno != EINTR) {
        reads.erase(reads.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
  }
  // Closed before the wait, so that a child still writing (poll failed) gets
  // SIGPIPE instead of blocking on a full pipe.
  out.close_end(0);
  err.close_end(0);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.term_signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + result.term_signal;
  return result;
}

}  // namespace fsdp
