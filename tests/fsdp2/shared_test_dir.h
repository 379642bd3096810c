// A scratch directory for a multi-process test: the parent (the test
// process) makes it and puts its path in an environment variable, which the
// rank processes it starts inherit; the parent removes it, with everything
// in it, at the end of the test.
#pragma once

#include <stdlib.h>

#include <optional>
#include <string>

#include "fsdp_testing/distributed_test.h"
#include "fsdp_testing/test_helpers.h"

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
    owned_.emplace("fsdp2cpp-shared-dir");
    path_ = owned_->path();
    ::setenv(variable, path_.c_str(), 1);
  }

  const std::string& path() const { return path_; }

 private:
  std::optional<testing::ScratchDir> owned_;  // the parent's: removed with the object
  std::string path_;
};

}  // namespace fsdp::test
