// A scratch directory for a multi-process test: the parent (the test
// process) makes it and puts its path in an environment variable, which the
// rank processes it starts inherit; the parent removes it, with everything
// in it, at the end of the test.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "fsdp_testing/distributed_test.h"

namespace fsdp::test {

class SharedTestDir {
 public:
  // `variable` names the environment variable that carries the path. path()
  // is empty when the directory could not be made.
  explicit SharedTestDir(const char* variable) {
    if (testing::is_rank_process()) {
      const char* p = std::getenv(variable);
      path_ = p != nullptr ? p : "";
      return;
    }
    std::string pattern = (std::filesystem::temp_directory_path() / "fsdp2cpp-shared-dir-XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
    ::setenv(variable, path_.c_str(), 1);
    owner_ = true;
  }
  ~SharedTestDir() {
    if (!owner_ || path_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  SharedTestDir(const SharedTestDir&) = delete;
  SharedTestDir& operator=(const SharedTestDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool owner_ = false;
};

}  // namespace fsdp::test
