#include "launcher.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace fsdp_train {

namespace {

constexpr auto kGracePeriod = std::chrono::seconds(5);

// The environment of rank `rank`: this process's, with torchrun's variables
// set for the rank. Built before fork, so the child only calls execve.
std::vector<std::string> rank_environment(int rank, int nproc, int port) {
  const std::map<std::string, std::string> ours = {
      {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", std::to_string(port)},
  };
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    // This launcher hosts no agent store: rank 0 hosts the TCPStore.
    if (ours.count(key) != 0 || key == "TORCHELASTIC_USE_AGENT_STORE") continue;
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

// The child side of fork: only async-signal-safe calls until execve.
[[noreturn]] void exec_rank(pid_t parent, char* const* argv, char* const* envp) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // die with the launcher
  if (::getppid() != parent) ::_exit(1);
  ::execve("/proc/self/exe", argv, envp);
  static const char kMessage[] = "fsdp_train: exec of /proc/self/exe failed\n";
  (void)!::write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  ::_exit(127);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
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

int launch_local_ranks(int nproc, const std::vector<std::string>& args) {
  const int port = free_port();
  if (port < 0) {
    std::fprintf(stderr, "fsdp_train: cannot find a free port on 127.0.0.1: %s\n", std::strerror(errno));
    return 1;
  }
  const std::vector<char*> argv = c_strings(args);
  const pid_t self = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);

  std::map<pid_t, int> running;  // pid -> rank
  int first_failure = 0;
  for (int r = 0; r < nproc; ++r) {
    const std::vector<std::string> env = rank_environment(r, nproc, port);
    const std::vector<char*> envp = c_strings(env);
    const pid_t pid = ::fork();
    if (pid == 0) exec_rank(self, argv.data(), envp.data());
    if (pid < 0) {
      std::fprintf(stderr, "fsdp_train: fork of rank %d failed: %s\n", r, std::strerror(errno));
      first_failure = 1;
      break;
    }
    running[pid] = r;
  }

  // After the first failure the others are stopped: they would otherwise wait
  // for the failed rank in a collective until their timeout.
  auto kill_all = [&running](int sig) {
    for (const auto& [pid, rank] : running) ::kill(pid, sig);
  };
  if (first_failure != 0) kill_all(SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + kGracePeriod;
  bool killed = false;
  while (!running.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, first_failure != 0 ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // failure mode: poll, escalate after the grace period
      if (!killed && std::chrono::steady_clock::now() > deadline) {
        kill_all(SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    auto it = running.find(pid);
    if (it == running.end()) continue;
    const int rank = it->second;
    running.erase(it);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    if (first_failure != 0) continue;  // stopped by us, or failing for the same reason
    first_failure = exit_code_of(status);
    if (first_failure == 0) first_failure = 1;
    if (WIFSIGNALED(status)) {
      std::fprintf(stderr, "fsdp_train: rank %d was killed by signal %d (%s); stopping the other ranks\n", rank,
                   WTERMSIG(status), strsignal(WTERMSIG(status)));
    } else {
      std::fprintf(stderr, "fsdp_train: rank %d exited with code %d; stopping the other ranks\n", rank, first_failure);
    }
    kill_all(SIGTERM);
    deadline = std::chrono::steady_clock::now() + kGracePeriod;
  }
  return first_failure;
}

}  // namespace fsdp_train
