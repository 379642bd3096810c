// The command line of the trainer and the benchmarks: one parse, and one
// choice between running a rank and starting local ranks.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace fsdp_train {

// normalize_flag_names (config.h), then Abseil's ParseCommandLine, so that
// flags may be written with dashes or underscores. Returns the normalized
// arguments, argv[0] included, which a launcher passes on to the ranks it
// starts. The positional arguments (argv[0] first) are stored in
// `positional` when it is given. Exits on a bad flag, as Abseil does.
std::vector<std::string> parse_command_line(int argc, char** argv, std::vector<std::string>* positional = nullptr);

// What main() does in a program whose ranks run `run_rank`: a rank started
// by an external launcher (RANK is set) runs it and returns its exit code;
// otherwise `nproc` local ranks are started with `args` less --nproc and the
// launcher's exit code is returned. nproc < 1 prints an error naming
// `program` and returns 2.
int run_rank_or_launch(const char* program, int nproc, const std::vector<std::string>& args,
                       const std::function<int()>& run_rank);

}  // namespace fsdp_train
