// Runs a program (no shell) and captures its stdout and stderr apart: the
// helper of the launcher and example tests.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fsdp_launch_test {

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string out;
  std::string err;
  double seconds = 0;
};

// Reads both pipes to their end (poll-free: stderr is small, and is read
// after stdout closes; the programs here write little).
inline std::string read_all(int fd) {
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof(buffer))) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  return text;
}

// Runs `argv` (no shell) with this process's environment minus the
// rendezvous variables, plus `extra_env`.
inline RunResult run(const std::vector<std::string>& args, const std::map<std::string, std::string>& extra_env = {}) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    static const std::set<std::string> kDropped = {"RANK",        "WORLD_SIZE",  "LOCAL_RANK",     "LOCAL_WORLD_SIZE",
                                                   "MASTER_ADDR", "MASTER_PORT", "FSDP2CPP_NPROC", "FSDP2CPP_MESH"};
    if (kDropped.count(key) == 0) env.push_back(entry);
  }
  for (const auto& [key, value] : extra_env) env.push_back(key + "=" + value);
  std::vector<std::string> argv_strings = args;
  auto c_strings = [](std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (auto& s : strings) out.push_back(s.data());
    out.push_back(nullptr);
    return out;
  };
  std::vector<char*> argv = c_strings(argv_strings), envp = c_strings(env);

  RunResult result;
  int out_fds[2], err_fds[2];
  if (::pipe2(out_fds, O_CLOEXEC) != 0 || ::pipe2(err_fds, O_CLOEXEC) != 0) return result;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_fds[1], STDERR_FILENO);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(out_fds[1]);
  ::close(err_fds[1]);
  if (rc != 0) {
    result.err = "posix_spawn of " + args[0] + " failed";
    return result;
  }
  result.out = read_all(out_fds[0]);
  result.err = read_all(err_fds[0]);
  ::close(out_fds[0]);
  ::close(err_fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

inline std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout\n" + r.out + "--- stderr\n" + r.err;
}

// The lines of `text` that start with "[rankR] ", without the prefix.
inline std::vector<std::string> lines_of_rank(const std::string& text, int rank) {
  const std::string prefix = "[rank" + std::to_string(rank) + "] ";
  std::vector<std::string> out;
  for (const auto& line : lines_of(text)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line.substr(prefix.size()));
  }
  return out;
}

}  // namespace fsdp_launch_test
