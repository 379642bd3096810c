// fsdp_demo: the smallest end-to-end run (`make demo` runs the trainer,
// tools/train). It proves that the stack works on real processes:
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

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
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
#include "launch/launch.h"

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

// Starts `nproc` copies of this program as ranks 0..nproc-1 with the
// trainer's launcher (env:// on 127.0.0.1 and a free port) and waits for
// them; when one fails, the others are stopped.
int launch(int nproc, const char* argv0) {
  if (nproc < 1) {
    std::fprintf(stderr, "fsdp_demo: --nproc must be >= 1 (got %d)\n", nproc);
    return 2;
  }
  std::printf("fsdp_demo: starting %d rank%s on 127.0.0.1\n", nproc, nproc == 1 ? "" : "s");
  const int rc = fsdp::launch::launch_local_ranks(nproc, {argv0});
  if (rc == 0) {
    std::printf("fsdp_demo: %d of %d ranks OK\n", nproc, nproc);
  } else {
    std::fprintf(stderr, "fsdp_demo: a rank failed (exit code %d)\n", rc);
  }
  return rc == 0 ? 0 : 1;
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
