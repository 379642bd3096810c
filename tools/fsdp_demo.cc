// fsdp_demo: the smoke program that `make demo` runs (until the trainer
// replaces it). It proves that the stack works end to end on real processes:
// env:// rendezvous, a 1-D DeviceMesh, and an all-gather on its group.
//
//   fsdp_demo                 starts 2 local ranks of itself and waits for them
//   fsdp_demo --nproc 4       starts 4
//   torchrun --nproc-per-node 2 --no-python fsdp_demo
//                             (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
//                             runs as the rank the environment names
//
// Rank r contributes arange(3) + 10 * r; every rank prints what it gathered,
// checks it, and exits non-zero when it is wrong. Lines come out in rank
// order. The launcher exits non-zero when any rank fails.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "collectives/world.h"
#include "device_mesh/device_mesh.h"

// Optional so that "not given" is visible: a process started by torchrun (RANK
// and WORLD_SIZE set) then runs as its rank instead of launching more.
ABSL_FLAG(std::optional<int>, nproc, std::nullopt,
          "Number of local ranks to start (default 2). Without this flag, a process whose environment has RANK and "
          "WORLD_SIZE (as torchrun sets them) runs as that rank instead.");

namespace {

constexpr int kElements = 3;
constexpr int kDefaultRanks = 2;
constexpr auto kTimeout = std::chrono::seconds(60);

// c10::Error's what() carries a C++ backtrace; one line is enough here.
const char* message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

std::string format_values(const at::Tensor& t) {
  std::string s = "[";
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(static_cast<int64_t>(p[i]));
  }
  return s + "]";
}

// One rank: rendezvous, mesh, all-gather, print (in rank order), check.
int run_rank() {
  fsdp::collectives::RendezvousOptions rendezvous;
  rendezvous.timeout = kTimeout;
  auto world = fsdp::collectives::World::from_env(rendezvous);
  const int rank = world->rank();
  const int n = world->size();
  try {
    fsdp::collectives::CommunicatorOptions comm_options;
    comm_options.timeout = kTimeout;
    fsdp::DeviceMesh mesh = fsdp::init_device_mesh(world, c10::kCPU, {n}, {"dp"}, comm_options);
    const auto& group = mesh.group(0);

    at::Tensor input = at::arange(kElements, at::kFloat).add_(10.0 * rank);
    at::Tensor output = at::empty({n * kElements}, at::kFloat);
    group->all_gather_into_tensor(output, input).wait();

    at::Tensor expected = at::empty({n * kElements}, at::kFloat);
    for (int r = 0; r < n; ++r) {
      expected.narrow(0, r * kElements, kElements).copy_(at::arange(kElements, at::kFloat).add_(10.0 * r));
    }
    const bool ok = output.equal(expected);

    // Take turns: rank i prints while the others wait at a barrier.
    for (int i = 0; i < n; ++i) {
      if (i == rank) {
        std::printf("[rank %d/%d] %s all_gather_into_tensor on %s: %s %s\n", rank, n, mesh.to_string().c_str(),
                    group->name().c_str(), format_values(output).c_str(),
                    ok ? "OK" : ("WRONG, expected " + format_values(expected)).c_str());
        std::fflush(stdout);
      }
      group->barrier().wait();
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d/%d] error: %s\n", rank, n, message_of(e));
    return 1;
  }
}

// A TCP port that is free now on 127.0.0.1 (the kernel picks it). Rank 0
// binds it again moments later; torchrun's standalone mode does the same.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
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

// Starts `nproc` copies of this program as ranks 0..nproc-1 and waits for
// them. When one fails, the others are stopped (they would otherwise wait for
// it until the timeout).
int launch(int nproc, const char* argv0) {
  if (nproc < 1) {
    std::fprintf(stderr, "fsdp_demo: --nproc must be >= 1 (got %d)\n", nproc);
    return 2;
  }
  const int port = free_port();
  if (port < 0) {
    std::fprintf(stderr, "fsdp_demo: cannot find a free port: %s\n", std::strerror(errno));
    return 1;
  }
  std::printf("fsdp_demo: starting %d rank%s (MASTER_ADDR=127.0.0.1 MASTER_PORT=%d)\n", nproc, nproc == 1 ? "" : "s",
              port);
  std::fflush(stdout);

  std::map<pid_t, int> rank_of;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::fprintf(stderr, "fsdp_demo: fork failed: %s\n", std::strerror(errno));
      for (const auto& [child, _] : rank_of) ::kill(child, SIGTERM);
      break;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      char* child_argv[] = {const_cast<char*>(argv0), nullptr};
      ::execv("/proc/self/exe", child_argv);
      std::fprintf(stderr, "fsdp_demo: exec of /proc/self/exe failed: %s\n", std::strerror(errno));
      ::_exit(127);
    }
    rank_of[pid] = r;
  }

  int failed = rank_of.size() == static_cast<size_t>(nproc) ? 0 : 1;
  while (!rank_of.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = rank_of.find(pid);
    if (it == rank_of.end()) continue;
    const int rank = it->second;
    rank_of.erase(it);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    if (WIFEXITED(status)) {
      std::fprintf(stderr, "fsdp_demo: rank %d exited with status %d\n", rank, WEXITSTATUS(status));
    } else {
      std::fprintf(stderr, "fsdp_demo: rank %d killed by signal %d\n", rank, WTERMSIG(status));
    }
    if (failed++ == 0) {
      for (const auto& [child, _] : rank_of) ::kill(child, SIGTERM);
    }
  }
  if (failed == 0) std::printf("fsdp_demo: %d of %d ranks OK\n", nproc, nproc);
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::optional<int> nproc = absl::GetFlag(FLAGS_nproc);
  const bool launched_as_rank = std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr;
  if (launched_as_rank && !nproc) {
    try {
      return run_rank();
    } catch (const std::exception& e) {  // rendezvous failures
      std::fprintf(stderr, "[rank %s] error: %s\n", std::getenv("RANK"), message_of(e));
      return 1;
    }
  }
  return launch(nproc.value_or(kDefaultRanks), argv[0]);
}
