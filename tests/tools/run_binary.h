// Helpers of the trainer tests: run a program and capture what it prints, a
// scratch directory, and a reader for fsdp_train's --json record.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp_common/child_process.h"
#include "fsdp_testing/test_helpers.h"

namespace fsdp_train_test {

// exit_code and output (stdout and stderr, interleaved) are what is used.
using RunResult = fsdp::ChildResult;

// Runs `program` with `args` (fsdp::run_child: no shell, the rendezvous
// variables left out) and waits for it.
inline RunResult run_program(const std::string& program, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  return fsdp::run_child(argv);
}

// The testing layer's scratch directory (fsdp_testing/test_helpers.h).
using fsdp::testing::ScratchDir;

// The trainer tests' small run: 2 blocks of dim 32, `steps` steps, a global
// batch of 6 rows (divisible by 1, 2 and 3), per-step losses to `json`.
inline std::vector<std::string> small_run_flags(const std::string& json, int steps = 20) {
  return {"--steps",        std::to_string(steps),
          "--global-batch", "6",
          "--seq-len",      "32",
          "--layers",       "2",
          "--dim",          "32",
          "--heads",        "4",
          "--seed",         "7",
          "--warmup",       "5",
          "--json",         json};
}

// The parts of fsdp_train's --json record the tests check.
struct TrainRecord {
  int world_size = -1;
  std::vector<int> steps;
  std::vector<double> losses;
  double final_loss = 0;
  bool ok = false;
};

// A reader for exactly the format fsdp_train writes (see tools/train/report.h).
inline TrainRecord read_train_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  TrainRecord record;
  std::smatch m;
  if (!std::regex_search(text, m, std::regex(R"re("world_size":\s*(\d+))re"))) return record;
  record.world_size = std::stoi(m[1]);
  const std::regex step_re(R"re(\{"step":\s*(\d+),\s*"loss":\s*([-+0-9.eE]+|nan|inf))re");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), step_re); it != std::sregex_iterator(); ++it) {
    record.steps.push_back(std::stoi((*it)[1]));
    record.losses.push_back(std::stod((*it)[2]));
  }
  if (!std::regex_search(text, m, std::regex(R"re("final_loss":\s*([-+0-9.eE]+))re"))) return record;
  record.final_loss = std::stod(m[1]);
  record.ok = !record.losses.empty();
  return record;
}

}  // namespace fsdp_train_test
