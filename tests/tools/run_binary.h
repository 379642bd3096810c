// Helpers of the trainer tests: run a program and capture what it prints, a
// scratch directory, and a reader for fsdp_train's --json record.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp_common/child_process.h"

namespace fsdp_train_test {

// exit_code and output (stdout and stderr, interleaved) are what is used.
using RunResult = fsdp::ChildResult;

// Starts `program` with `args` (no shell, fsdp::child_environment()), its
// stdout and stderr on `output_fd`. Returns its pid, or -1.
inline pid_t start_program(const std::string& program, const std::vector<std::string>& args, int output_fd) {
  std::vector<std::string> env = fsdp::child_environment();
  std::vector<std::string> argv_strings = {program};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  auto c_strings = [](std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (auto& s : strings) out.push_back(s.data());
    out.push_back(nullptr);
    return out;
  };
  std::vector<char*> argv = c_strings(argv_strings), envp = c_strings(env);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, output_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, output_fd, STDERR_FILENO);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

// The exit code of child `pid` once it ends; 128 + signal when killed.
inline int wait_for_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs `program` with `args` (fsdp::run_child: no shell, the rendezvous
// variables left out) and waits for it.
inline RunResult run_program(const std::string& program, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  return fsdp::run_child(argv);
}

// A fresh directory under $TMPDIR (or /tmp), removed with its files.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdp_train_test.XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    for (const auto& f : files_) ::unlink(f.c_str());
    if (!path_.empty()) ::rmdir(path_.c_str());
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  // A path in the directory, removed with it.
  std::string file(const std::string& name) {
    files_.push_back(path_ + "/" + name);
    return files_.back();
  }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

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
