// A training loop written as a user writes one to survive restarts under
// `fsdprun --max-restarts` or `torchrun --max-restarts`: it saves its progress
// after every step and, when started again, continues from the newest save.
// The launcher tests run it with a crash and without one, and compare.
//
//   restartable_loop --steps 8 --checkpoint DIR/progress.txt [--crash-rank R --crash-at K]
//                    [--stall-rank R --stall-at K]
//
// Each step every rank adds its contribution to a vector, the ranks sum the
// vector with an all-reduce (a real Gloo process group made by
// World::from_env), and the state becomes state / 2 + sum: a step that is
// skipped or done twice changes the result. Rank 0 then writes "step s0 s1 s2
// s3" to the checkpoint (a temporary file renamed into place, so a crash never
// leaves half a file) and all ranks pass a barrier, so every rank knows the
// step is saved before the next one starts. On attempt 0
// (TORCHELASTIC_RESTART_COUNT unset or 0), rank R exits with 1 when step K
// starts, as a rank that hits a fault would. With --stall-rank, rank R
// sleeps for 10 minutes when step K starts instead, as a rank stuck in user
// code would (the others then stop with the divergence diagnosis,
// docs/debugging.md). Rank 0 prints
//   attempt A resumes at step S
//   final step=N state=s0,s1,s2,s3
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "collectives/world.h"
#include "launch/launch.h"

namespace {

struct Flags {
  int64_t steps = 8;
  std::string checkpoint;
  int crash_rank = -1;
  int64_t crash_at = 0;
  int stall_rank = -1;
  int64_t stall_at = 0;
};

bool parse_flags(int argc, char** argv, Flags* flags) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--steps") {
      flags->steps = std::atoll(value.c_str());
    } else if (flag == "--checkpoint") {
      flags->checkpoint = value;
    } else if (flag == "--crash-rank") {
      flags->crash_rank = std::atoi(value.c_str());
    } else if (flag == "--crash-at") {
      flags->crash_at = std::atoll(value.c_str());
    } else if (flag == "--stall-rank") {
      flags->stall_rank = std::atoi(value.c_str());
    } else if (flag == "--stall-at") {
      flags->stall_at = std::atoll(value.c_str());
    } else {
      return false;
    }
  }
  return argc % 2 == 1 && !flags->checkpoint.empty();
}

constexpr int64_t kWidth = 4;

// The newest saved step and state, or step 0 and zeros when nothing was saved.
int64_t load(const std::string& path, at::Tensor& state) {
  std::ifstream in(path);
  int64_t step = 0;
  if (!(in >> step)) return 0;
  auto values = state.accessor<double, 1>();
  for (int64_t i = 0; i < kWidth; ++i) in >> values[i];
  return step;
}

void save(const std::string& path, int64_t step, const at::Tensor& state) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s: %s\n", tmp.c_str(), std::strerror(errno));
    std::exit(2);
  }
  std::fprintf(f, "%lld", static_cast<long long>(step));
  auto values = state.accessor<double, 1>();
  for (int64_t i = 0; i < kWidth; ++i) std::fprintf(f, " %.17g", values[i]);
  std::fprintf(f, "\n");
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;
  Flags flags;
  if (!parse_flags(argc, argv, &flags)) {
    std::fprintf(stderr,
                 "usage: restartable_loop --steps N --checkpoint FILE [--crash-rank R --crash-at K] "
                 "[--stall-rank R --stall-at K]\n");
    return 2;
  }
  const char* restart_count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int attempt = restart_count != nullptr ? std::atoi(restart_count) : 0;

  auto world = fsdp::collectives::World::from_env();
  auto group = world->new_group(world->all_ranks(), c10::kCPU);
  const int rank = world->rank();

  at::Tensor state = at::zeros({kWidth}, at::kDouble);
  const int64_t saved = load(flags.checkpoint, state);
  if (rank == 0) std::printf("attempt %d resumes at step %lld\n", attempt, static_cast<long long>(saved + 1));
  std::fflush(stdout);

  for (int64_t step = saved + 1; step <= flags.steps; ++step) {
    if (attempt == 0 && rank == flags.crash_rank && step == flags.crash_at) {
      std::printf("crashing at step %lld\n", static_cast<long long>(step));
      std::fflush(stdout);
      return 1;
    }
    if (rank == flags.stall_rank && step == flags.stall_at) std::this_thread::sleep_for(std::chrono::minutes(10));
    at::Tensor update = at::arange(kWidth, at::kDouble) + static_cast<double>((rank + 1) * step);
    group->all_reduce(update, fsdp::collectives::ReduceOp::sum()).wait();
    state = state / 2 + update;
    if (rank == 0) save(flags.checkpoint, step, state);
    group->barrier().wait();
  }
  if (rank == 0) {
    std::printf("final step=%lld state=", static_cast<long long>(flags.steps));
    auto values = state.accessor<double, 1>();
    for (int64_t i = 0; i < kWidth; ++i) std::printf("%s%.17g", i > 0 ? "," : "", values[i]);
    std::printf("\n");
  }
  return 0;
}
