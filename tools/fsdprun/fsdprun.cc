// fsdprun: start N local ranks of any program, as torchrun would.
//
//   fsdprun --nproc 4 -- ./my_trainer --steps 10
//   fsdprun --nproc 4 --mesh 2x2 -- ./my_trainer     FSDP2CPP_MESH=2x2 for every rank
//   fsdprun --nproc 4 --max-restarts 3 -- ./my_trainer --resume
//                                  a failed rank restarts the whole group, up to 3 times
//   fsdprun --nproc 4 --collective-timeout 120 -- ./my_trainer
//                                  FSDP2CPP_COLLECTIVE_TIMEOUT_S=120 for every rank
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT (torchrun's variables; World::from_env() reads them), and,
// with N > 1 and OMP_NUM_THREADS unset, OMP_NUM_THREADS=1 (said once), its
// lines are prefixed with "[rankN] ", and when a rank fails the others are
// stopped and fsdprun exits with that rank's status (128 + signal when it was
// killed by one), or, with --max-restarts N, the whole group starts again
// (TORCHELASTIC_RESTART_COUNT=1, 2, ...) up to N times. See
// launch/include/launch/launch.h and docs/porting.md.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "launch/launch.h"

namespace {

constexpr char kUsage[] =
    "usage: fsdprun --nproc N [--mesh RxS] [--max-restarts K] [--collective-timeout SECONDS] [--no-prefix]\n"
    "               -- PROGRAM [ARGS...]\n"
    "  --nproc N                     start N ranks of PROGRAM on this machine (torchrun's environment:\n"
    "                                RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,\n"
    "                                MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS)\n"
    "  --mesh RxS                    R replicas x S shards (HSDP); R*S must be N; passed as FSDP2CPP_MESH=RxS\n"
    "  --max-restarts K              when a rank fails, stop all ranks and start the whole group again,\n"
    "                                up to K times (default 0), with a fresh rendezvous and\n"
    "                                TORCHELASTIC_RESTART_COUNT=1..K; a program that checkpoints resumes\n"
    "                                from its newest checkpoint\n"
    "  --collective-timeout SECONDS  the ranks' default collective timeout (> 0), passed as\n"
    "                                FSDP2CPP_COLLECTIVE_TIMEOUT_S=SECONDS\n"
    "  --no-prefix                   do not prefix the ranks' output lines with [rankN]\n"
    "With N > 1 and OMP_NUM_THREADS unset, every rank gets OMP_NUM_THREADS=1 (as torchrun sets it).\n"
    "A failing rank stops the others; when no restart is left, fsdprun exits with its status\n"
    "(128 + signal if killed). SIGINT, SIGTERM and SIGHUP sent to fsdprun are passed on to the\n"
    "ranks and never restart them.\n";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "fsdprun: %s\n%s", message.c_str(), kUsage);
  return 2;
}

// The whole of `text` as a decimal integer, or -1.
int parse_int(const std::string& text) {
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(text);
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::launch::LaunchOptions options;
  options.name = "fsdprun";
  std::string nproc_text, mesh_text, restarts_text, timeout_text;
  bool have_nproc = false, have_mesh = false, have_restarts = false, have_timeout = false;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::string value;
    std::string flag = arg;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else if (arg == "--nproc" || arg == "--mesh" || arg == "--max-restarts" || arg == "--collective-timeout") {
      if (i + 1 >= argc || std::strcmp(argv[i + 1], "--") == 0) return usage_error(arg + " needs a value");
      value = argv[++i];
    }
    if (flag == "--nproc") {
      nproc_text = value;
      have_nproc = true;
    } else if (flag == "--mesh") {
      mesh_text = value;
      have_mesh = true;
    } else if (flag == "--max-restarts") {
      restarts_text = value;
      have_restarts = true;
    } else if (flag == "--collective-timeout") {
      timeout_text = value;
      have_timeout = true;
    } else if (flag == "--no-prefix") {
      options.prefix_output = false;
    } else if (arg.rfind('-', 0) == 0) {
      return usage_error("unknown flag '" + arg + "'");
    } else {
      return usage_error("expected '--' before the program to run (got '" + arg + "'): fsdprun --nproc N -- " + arg);
    }
  }
  if (i >= argc) return usage_error("missing '--' and the program to run after it");
  if (i + 1 >= argc) return usage_error("no program after '--'");
  if (!have_nproc) return usage_error("--nproc N is required");
  const int nproc = parse_int(nproc_text);
  if (nproc < 1) return usage_error("--nproc must be a positive integer (got '" + nproc_text + "')");
  if (have_restarts) {
    options.max_restarts = parse_int(restarts_text);
    if (options.max_restarts < 0) {
      return usage_error("--max-restarts must be an integer >= 0 (got '" + restarts_text + "')");
    }
  }
  if (have_timeout) {
    try {
      (void)fsdp::launch::parse_timeout_seconds(timeout_text, "--collective-timeout");
    } catch (const std::invalid_argument& e) {
      return usage_error(e.what());
    }
    options.extra_env[fsdp::launch::kCollectiveTimeoutEnv] = timeout_text;
  }
  if (have_mesh) {
    try {
      const fsdp::launch::MeshShape mesh = fsdp::launch::parse_mesh(mesh_text, "--mesh");
      if (mesh.replicate * mesh.shard != nproc) {
        return usage_error("--mesh " + mesh_text + " needs " + std::to_string(mesh.replicate * mesh.shard) +
                           " ranks, but --nproc is " + std::to_string(nproc));
      }
    } catch (const std::invalid_argument& e) {
      return usage_error(e.what());
    }
    options.extra_env[fsdp::launch::kMeshEnv] = mesh_text;
  }
  options.nproc = nproc;
  options.program = argv[i + 1];
  for (int k = i + 1; k < argc; ++k) options.args.emplace_back(argv[k]);
  return fsdp::launch::launch_local_ranks(options);
}
