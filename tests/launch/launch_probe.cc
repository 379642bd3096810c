// The program the launcher tests start as ranks. No LibTorch: it only reports
// what a rank sees and fails in the ways a rank can fail.
//
//   launch_probe print                 one line with the rank's variables on stdout,
//                                      one on stderr, then a line without '\n'
//   launch_probe exit RANK CODE        rank RANK exits with CODE, the others wait
//   launch_probe signal RANK SIGNAL    rank RANK kills itself with SIGNAL, the others wait
//   launch_probe self [--nproc N] ...  fsdp::launch::maybe_launch_local, then print
//   launch_probe omp [--nproc N]       maybe_launch_local, then one line OMP_NUM_THREADS=<value>
//   launch_probe attempt RANK CODE K   every rank prints its restart attempt, MASTER_PORT and
//                                      collective timeout; on attempts 0..K-1 rank RANK then
//                                      exits with CODE (kills itself with signal -CODE when
//                                      CODE < 0) while the others wait; attempt K on succeeds
//
// A waiting rank gives up after 60 s, so a launcher that does not stop it
// shows up as a slow test, not a hung one.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "launch/launch.h"

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "<unset>";
}

void print_rank_line() {
  std::printf("RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s LOCAL_WORLD_SIZE=%s MASTER_ADDR=%s MASTER_PORT=%s MESH=%s\n",
              env("RANK").c_str(), env("WORLD_SIZE").c_str(), env("LOCAL_RANK").c_str(),
              env("LOCAL_WORLD_SIZE").c_str(), env("MASTER_ADDR").c_str(), env("MASTER_PORT").c_str(),
              env(fsdp::launch::kMeshEnv).c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "to stderr from %s\n", env("RANK").c_str());
  std::printf("no newline at the end");
  std::fflush(stdout);
}

int wait_to_be_stopped() {
  std::printf("waiting\n");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const int rank = std::atoi(env("RANK").c_str());
  if (mode == "print") {
    print_rank_line();
    return 0;
  }
  if ((mode == "exit" || mode == "signal") && argc == 4) {
    if (rank != std::atoi(argv[2])) return wait_to_be_stopped();
    // Let the others start waiting first.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::printf("failing now\n");
    std::fflush(stdout);
    if (mode == "exit") return std::atoi(argv[3]);
    ::raise(std::atoi(argv[3]));
    return 4;
  }
  if (mode == "attempt" && argc == 5) {
    const int attempt = std::atoi(env(fsdp::launch::kRestartCountEnv).c_str());
    std::printf("attempt=%s max=%s port=%s timeout=%s\n", env(fsdp::launch::kRestartCountEnv).c_str(),
                env(fsdp::launch::kMaxRestartsEnv).c_str(), env("MASTER_PORT").c_str(),
                env(fsdp::launch::kCollectiveTimeoutEnv).c_str());
    std::fflush(stdout);
    if (attempt >= std::atoi(argv[4])) return 0;
    if (rank != std::atoi(argv[2])) return wait_to_be_stopped();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::printf("failing now\n");
    std::fflush(stdout);
    const int code = std::atoi(argv[3]);
    if (code >= 0) return code;
    ::raise(-code);
    return 4;
  }
  if (mode == "self") {
    if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;
    std::string args;
    for (int i = 2; i < argc; ++i) args += std::string(" ") + argv[i];
    std::printf("args:%s\n", args.c_str());
    print_rank_line();
    std::printf("\n");
    return 0;
  }
  if (mode == "omp") {
    if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;
    std::printf("OMP_NUM_THREADS=%s\n", env(fsdp::launch::kOmpNumThreadsEnv).c_str());
    return 0;
  }
  std::fprintf(stderr, "launch_probe: unknown mode '%s'\n", mode.c_str());
  return 2;
}
