// fsdprun: start N local ranks of any program, as torchrun would.
//
//   fsdprun --nproc 4 -- ./my_trainer --steps 10
//   fsdprun --nproc 4 --mesh 2x2 -- ./my_trainer     FSDP2CPP_MESH=2x2 for every rank
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// and MASTER_PORT (torchrun's variables; World::from_env() reads them), its
// lines are prefixed with "[rankN] ", and when a rank fails the others are
// stopped and fsdprun exits with that rank's status (128 + signal when it was
// killed by one). See launch/include/launch/launch.h and docs/porting.md.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "launch/launch.h"

namespace {

constexpr char kUsage[] =
    "usage: fsdprun --nproc N [--mesh RxS] [--no-prefix] -- PROGRAM [ARGS...]\n"
    "  --nproc N     start N ranks of PROGRAM on this machine (torchrun's environment: RANK,\n"
    "                WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)\n"
    "  --mesh RxS    R replicas x S shards (HSDP); R*S must be N; passed as FSDP2CPP_MESH=RxS\n"
    "  --no-prefix   do not prefix the ranks' output lines with [rankN]\n"
    "A failing rank stops the others; fsdprun exits with its status (128 + signal if killed).\n"
    "SIGINT, SIGTERM and SIGHUP sent to fsdprun are passed on to the ranks.\n";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "fsdprun: %s\n%s", message.c_str(), kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::launch::LaunchOptions options;
  options.name = "fsdprun";
  std::string nproc_text, mesh_text;
  bool have_nproc = false, have_mesh = false;
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
    } else if (arg == "--nproc" || arg == "--mesh") {
      if (i + 1 >= argc || std::strcmp(argv[i + 1], "--") == 0) return usage_error(arg + " needs a value");
      value = argv[++i];
    }
    if (flag == "--nproc") {
      nproc_text = value;
      have_nproc = true;
    } else if (flag == "--mesh") {
      mesh_text = value;
      have_mesh = true;
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
  int nproc = 0;
  try {
    size_t used = 0;
    nproc = std::stoi(nproc_text, &used);
    if (used != nproc_text.size()) nproc = 0;
  } catch (const std::exception&) {
    nproc = 0;
  }
  if (nproc < 1) return usage_error("--nproc must be a positive integer (got '" + nproc_text + "')");
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
