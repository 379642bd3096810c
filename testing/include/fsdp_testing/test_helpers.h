// Small helpers every test layer uses: a scratch directory that is removed
// with everything in it, and the text of the error a call throws.
//
//   fsdp::testing::ScratchDir dir("fsdp_train_test");
//   ASSERT_FALSE(dir.path().empty());
//   run_trainer({"--json", dir / "run.json"});
//
//   EXPECT_THAT(fsdp::testing::error_of([&] { mesh.slice({}); }), HasSubstr("no dim names given"));
//
// Header-only, for test binaries (they link fsdp2cpp::testing, which brings
// collectives/errors.h); no GoogleTest dependency of its own.
#pragma once

#include <stdlib.h>

#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include <c10/util/Exception.h>

#include "collectives/errors.h"

namespace fsdp::testing {

// exception_text
//
// The message of an error: what_without_backtrace() for a c10::Error (the
// message without LibTorch's C++ backtrace), what() for another
// std::exception, and "an exception of unknown type" otherwise
// (collectives/errors.h).
using fsdp::collectives::exception_text;

// error_of
//
// Runs `f` and returns the message of the c10::Error (TORCH_CHECK) it
// throws, without the backtrace, or "<no error>" when it returns normally.
// Other exception types propagate (and fail the test that called it).
template <typename F>
std::string error_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// ScratchDir
//
// A fresh directory for one test, made with mkdtemp under $TMPDIR (or /tmp)
// as <prefix>.XXXXXX, and removed with everything in it when the object
// goes. path() is empty when it could not be made (assert on that before
// use). Not copyable. A multi-process test that wants one directory for all
// of its ranks makes it in the parent process and hands the path down (an
// environment variable, as tests/fsdp2/shared_test_dir.h does).
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix = "fsdp2cpp_test") {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + prefix + ".XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = std::move(pattern);
  }
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ignored;  // a test's cleanup never fails the test
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  // A path inside the directory (nothing is created).
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace fsdp::testing
