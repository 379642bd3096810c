// Launching the ranks of a job on this machine: the part of torchrun that a
// C++ program needs, as a library (fsdp2cpp::launch) and as the installed
// command `fsdprun`.
//
// A program that wants `--nproc N` calls maybe_launch_local() first thing in
// main; the same binary then works alone, under `--nproc`, under fsdprun,
// under torchrun and under srun (examples/fully_shard_basic.cc):
//
//   int main(int argc, char** argv) {
//     if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;  // --nproc N starts N ranks
//     auto world = fsdp::collectives::World::from_env();  // torchrun / srun / fsdprun / --nproc
//     ...
//   }
//
//   ./prog --nproc 4                      4 local ranks of ./prog
//   FSDP2CPP_NPROC=4 ./prog               the same, without touching argv
//   fsdprun --nproc 4 --mesh 2x2 -- ./prog --steps 10
//   torchrun --nproc-per-node 4 --no-python ./prog
//
// Every rank gets torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT=<a free port>, so
// World::from_env() (collectives/world.h) makes the process group, and, with
// several ranks, OMP_NUM_THREADS=1 when the user left it unset (saying so
// once, see kOmpNumThreadsEnv). Lines the
// ranks print come out prefixed with the rank ("[rank1] ..."), each line
// whole. When a rank fails, the others get SIGTERM (SIGKILL after a grace
// period) and the launcher returns the failed rank's exit status (128 +
// signal for a rank killed by a signal), so a crash never leaves peers
// waiting in a collective. SIGINT, SIGTERM or SIGHUP sent to the launcher
// is passed on to the ranks (as torchrun does), and the launcher then
// returns 128 + that signal. Ranks die with the launcher (PR_SET_PDEATHSIG).
//
// Restarts (torchrun's --max-restarts): with LaunchOptions::max_restarts = N,
// a failed attempt (any rank exiting non-zero or killed) stops the whole
// group as above and then starts all ranks again, up to N times, each with a
// fresh rendezvous (a new MASTER_PORT, so rank 0 hosts a new store and no key
// of the failed attempt is ever seen) and TORCHELASTIC_RESTART_COUNT set to
// the attempt (0 first) and TORCHELASTIC_MAX_RESTARTS to N, as torchrun sets
// them. A program that saves checkpoints resumes from its newest one on a
// restart: the launcher only restarts, the program decides what to load. A
// stop signal to the launcher never triggers a restart. The launcher prints
//   fsdprun: rank 2 failed with exit code 1; restarting the group (restart 1 of 3)
// before each restart, and returns the last attempt's failure status when
// none is left.
//
// Linux only (fork/exec, /proc/self/exe). Not thread-safe: launch from the
// main thread before other threads exist.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::launch {

// The variable through which fsdprun's `--mesh RxS` reaches the ranks.
inline constexpr const char kMeshEnv[] = "FSDP2CPP_MESH";
// The variable maybe_launch_local() reads when argv has no --nproc.
inline constexpr const char kNprocEnv[] = "FSDP2CPP_NPROC";
// The variable through which fsdprun's `--collective-timeout SECONDS` reaches
// the ranks: the default timeout of every collective (CommunicatorOptions::
// timeout) in seconds, as torchrun users set it in init_process_group.
inline constexpr const char kCollectiveTimeoutEnv[] = "FSDP2CPP_COLLECTIVE_TIMEOUT_S";
// What torchrun sets for every rank: the restart attempt (0, 1, ...) and
// --max-restarts.
inline constexpr const char kRestartCountEnv[] = "TORCHELASTIC_RESTART_COUNT";
inline constexpr const char kMaxRestartsEnv[] = "TORCHELASTIC_MAX_RESTARTS";
// OpenMP's thread count. With more than one rank and the variable unset in
// the launcher's environment (and not in LaunchOptions::extra_env), every
// rank gets OMP_NUM_THREADS=1 and the launcher says so once on stderr, as
// torchrun does: N ranks with one intra-op thread per core each would
// overload the machine N times over. A value the user set is passed on as it
// is; a single rank keeps OpenMP's default.
inline constexpr const char kOmpNumThreadsEnv[] = "OMP_NUM_THREADS";

struct LaunchOptions {
  // Ranks to start, >= 1.
  int nproc = 1;
  // The executable; empty: this program (/proc/self/exe). A name without a
  // '/' is looked up in PATH, before any rank starts.
  std::string program;
  // The ranks' argv; args[0] is the program name they see. Empty: {program}.
  std::vector<std::string> args;
  // Variables set for every rank in addition to torchrun's (e.g. kMeshEnv).
  std::map<std::string, std::string> extra_env;
  // Prefix each line a rank writes to stdout or stderr with "[rankN] ".
  bool prefix_output = true;
  // How the launcher names itself in its own messages ("fsdprun: ...").
  std::string name = "fsdp::launch";
  // Between SIGTERM and SIGKILL for the ranks still running after a failure.
  std::chrono::milliseconds grace_period{5000};
  // Times the whole group is started again after a rank fails (torchrun's
  // --max-restarts), >= 0. See "Restarts" above.
  int max_restarts = 0;
};

// Starts `options.nproc` ranks and waits for all of them. Returns 0 when all
// exited with 0, else the first failure's exit status (128 + signal for a
// rank killed by a signal, or for a stop signal the launcher passed on);
// 127 when the program cannot be found or run, 2 for bad options
// (nproc < 1, max_restarts < 0), each with a message on stderr naming the
// cause. With max_restarts > 0 the status is that of the last attempt.
// Replaces the handlers of SIGINT, SIGTERM and SIGHUP while the ranks run.
int launch_local_ranks(const LaunchOptions& options);

// The trainer's form: `nproc` ranks of this program with `args`, their output
// not prefixed (they share this process's stdout and stderr), restarted up to
// `max_restarts` times.
int launch_local_ranks(int nproc, const std::vector<std::string>& args, int max_restarts = 0);

// Parses a collective timeout in seconds (`--collective-timeout`,
// FSDP2CPP_COLLECTIVE_TIMEOUT_S): a finite number > 0, e.g. "600" or "0.5".
// Throws std::invalid_argument naming `what` and the text otherwise.
double parse_timeout_seconds(const std::string& text, const std::string& what = "--collective-timeout");

// For a program's main, before anything else. Returns the exit code to
// return from main when this process was the launcher, or nullopt when it
// is to go on as a rank:
//   * argv has `--nproc N` or `--nproc=N` (removed from argv, so the program's
//     own flag parser never sees it), or else FSDP2CPP_NPROC=N is set and
//     RANK is not: starts N ranks of this program with the remaining
//     arguments (output prefixed) and returns their result. A bad N, or an
//     FSDP2CPP_MESH whose R*S is not N, returns 2 with a message.
//   * RANK and WORLD_SIZE are set (torchrun, srun with the variables
//     exported, fsdprun, or this launcher): nullopt.
//   * Neither: sets the environment of a one-rank job (RANK=0, WORLD_SIZE=1,
//     MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and returns nullopt, so
//     World::from_env() works in a plain `./prog` run.
// `argc` and `argv` are updated in place when --nproc is removed.
std::optional<int> maybe_launch_local(int& argc, char** argv);

// A TCP port free on 127.0.0.1 now (the kernel picks it), or -1. Rank 0
// binds it again moments later, as torchrun's standalone mode does.
int free_port();

// Sets the environment of a one-rank job (RANK=0, WORLD_SIZE=1,
// LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free
// MASTER_PORT), so that World::from_env() works in a process no launcher
// started. Returns false, changing nothing, when no port is free.
bool set_single_rank_environment();

// `--mesh RxS` / FSDP2CPP_MESH: R replicas of S shards (HSDP when R > 1).
struct MeshShape {
  int64_t replicate = 1;
  int64_t shard = 1;
};

// Parses "RxS" (positive integers). Throws std::invalid_argument naming
// `what` (the flag or variable) and the text when it is not of that form.
MeshShape parse_mesh(const std::string& text, const std::string& what = "--mesh");

// The mesh shape for init_device_mesh from FSDP2CPP_MESH: {R, S} when it is
// set, {world_size} when not. Throws std::invalid_argument when the variable
// is malformed or R*S != world_size.
std::vector<int64_t> mesh_shape_from_env(int64_t world_size);

}  // namespace fsdp::launch
