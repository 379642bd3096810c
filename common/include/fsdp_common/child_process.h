// Running another program to its end and keeping what it printed: how the
// benchmarks start the trainer and PyTorch's script, and how the tests of
// the launcher, the examples and the tools start their programs.
//
// No shell is involved, and a child never joins the caller's job: it gets the
// caller's environment without the variables that place a process in a
// torchrun-style job (child_environment()).
//
//   fsdp::ChildResult r = fsdp::run_child({"python3", script, "--nproc", "2"});
//   if (r.exit_code != 0) std::cerr << r.output;
#pragma once

#include <sys/types.h>

#include <csignal>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

// This process's environment without RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and fsdprun's FSDP2CPP_NPROC and
// FSDP2CPP_MESH, plus `extra` ("NAME=value" entries; each replaces the
// variable of that name). Entries without '=' in `extra` are rejected with
// std::invalid_argument.
std::vector<std::string> child_environment(const std::vector<std::string>& extra = {});

struct ChildOptions {
  std::vector<std::string> extra_env;  // passed to child_environment()
  bool separate_stderr = false;        // false: stderr is interleaved into `output`
  // When set, `signal` is sent to the child the first time this returns true
  // for the output so far (asked after every read of it): how a test stops a
  // program once it has reached some state.
  std::function<bool(const std::string& output)> signal_when;
  int signal = SIGTERM;
  // When set, called once with the child's pid right after it started, on
  // the calling thread, before any of its output is read: how a test reaches
  // what the child starts in turn (a launcher's ranks, from a thread of its
  // own). It must return promptly: the child's output waits meanwhile.
  std::function<void(pid_t child)> on_start;
};

struct ChildResult {
  int exit_code = -1;   // 128 + signal when killed by one; -1 when it never started
  int term_signal = 0;  // the signal that killed it; 0 when it exited
  std::string output;   // stdout, and stderr too unless separate_stderr
  std::string error;    // stderr with separate_stderr
  double seconds = 0;   // from the start to the exit
};

// Runs argv[0] (a path, or a name looked up in PATH) with the arguments
// argv[1..] and waits for it. Both pipes are read as they fill, so a child
// that writes much to both never blocks. When the program cannot be started,
// exit_code is -1 and the reason is where its stderr would have gone.
// `argv` must not be empty (std::invalid_argument). Thread-safe; the caller
// must not reap children with waitpid(-1) meanwhile.
ChildResult run_child(const std::vector<std::string>& argv, const ChildOptions& options = {});

}  // namespace fsdp
