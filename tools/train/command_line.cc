#include "command_line.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/parse.h"
#include "config.h"
#include "launch/launch.h"

namespace fsdp_train {

std::vector<std::string> parse_command_line(int argc, char** argv, std::vector<std::string>* positional) {
  std::vector<std::string> args = normalize_flag_names(argc, argv);
  // Abseil takes char**; it reorders pointers, never the strings, so the
  // normalized arguments stay intact for the launcher.
  std::vector<std::string> scratch = args;
  std::vector<char*> cargs;
  cargs.reserve(scratch.size());
  for (auto& a : scratch) cargs.push_back(a.data());
  const std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(cargs.size()), cargs.data());
  if (positional) positional->assign(rest.begin(), rest.end());
  return args;
}

int run_rank_or_launch(const char* program, int nproc, const std::vector<std::string>& args,
                       const std::function<int()>& run_rank) {
  if (std::getenv("RANK") != nullptr) return run_rank();
  if (nproc < 1) {
    std::fprintf(stderr, "%s: --nproc must be at least 1 (got %d)\n", program, nproc);
    return 2;
  }
  return fsdp::launch::launch_local_ranks(nproc, remove_flag(args, "nproc"));
}

}  // namespace fsdp_train
