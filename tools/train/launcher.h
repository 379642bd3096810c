// A local launcher, the part of torchrun the trainer needs for `--nproc N`:
// start N copies of this program as ranks 0..N-1 of one job on this machine,
// wait for them, and stop the rest when one fails.
//
//   std::vector<std::string> args = {"fsdp_train", "--steps", "20"};
//   int rc = fsdp_train::launch_local_ranks(2, args);
//
// Each rank is /proc/self/exe run with `args` and the environment torchrun
// would give it: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1 and MASTER_PORT=<a free port>. The ranks share this
// process's stdout and stderr. A rank dies with the launcher (PR_SET_PDEATHSIG).
#pragma once

#include <string>
#include <vector>

namespace fsdp_train {

// A TCP port free on 127.0.0.1 now (the kernel picks it), or -1. Rank 0
// binds it again moments later, as torchrun's standalone mode does.
int free_port();

// Starts `nproc` ranks running /proc/self/exe with `args` (args[0] is the
// program name they see) and waits for all of them. When a rank fails, the
// others get SIGTERM (and SIGKILL after a grace period). Returns 0 when all
// exited with 0, else the first failure's exit code (128 + signal for a rank
// killed by a signal).
int launch_local_ranks(int nproc, const std::vector<std::string>& args);

}  // namespace fsdp_train
