// Runs a program (no shell) and captures its stdout and stderr apart: the
// helper of the launcher and example tests.
#pragma once

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp_common/child_process.h"

namespace fsdp_launch_test {

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string out;
  std::string err;
  double seconds = 0;
};

// Runs `args` (no shell; fsdp::run_child) with this process's environment
// minus the rendezvous variables, plus `extra_env`.
inline RunResult run(const std::vector<std::string>& args, const std::map<std::string, std::string>& extra_env = {}) {
  fsdp::ChildOptions options;
  for (const auto& [key, value] : extra_env) options.extra_env.push_back(key + "=" + value);
  options.separate_stderr = true;
  fsdp::ChildResult r = fsdp::run_child(args, options);
  return RunResult{r.exit_code, std::move(r.output), std::move(r.error), r.seconds};
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

inline std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout\n" + r.out + "--- stderr\n" + r.err;
}

// The lines of `text` that start with "[rankR] ", without the prefix.
inline std::vector<std::string> lines_of_rank(const std::string& text, int rank) {
  const std::string prefix = "[rank" + std::to_string(rank) + "] ";
  std::vector<std::string> out;
  for (const auto& line : lines_of(text)) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line.substr(prefix.size()));
  }
  return out;
}

}  // namespace fsdp_launch_test
