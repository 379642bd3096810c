// A program that links LibTorch through fsdp2cpp and uses std::filesystem as
// a training program does (a checkpoint directory tree made, listed, renamed
// into place and removed). Without the link option of fsdp2cpp::torch
// ([Note: libstdc++ before libtorch] in cmake/Fsdp2cppTorch.cmake) these
// calls bind to the copies that the torch wheel's libtorch.so exports, and
// remove_all jumps to address 0.
//
// Prints where std::filesystem::remove_all was bound and "filesystem: ok";
// exits non-zero with the failed check otherwise. Built in the main build
// (test consumer.filesystem) and against the installed package
// (consumer.find_package_installed).
#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <system_error>

#include "collectives/reduce_op.h"

namespace fs = std::filesystem;

namespace {

int failures = 0;

#define FS_CHECK(cond)                                                              \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                                   \
    }                                                                               \
  } while (false)

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// The shared object that defines the function the program calls.
std::string defining_object(const void* fn) {
  Dl_info info{};
  if (dladdr(fn, &info) == 0 || info.dli_fname == nullptr) return "?";
  return info.dli_fname;
}

}  // namespace

int main() {
  // A call into libfsdp2cpp_collectives, so that the program needs it (and
  // LibTorch behind it) even under --as-needed.
  std::printf("reduce op: %s\n", fsdp::collectives::ReduceOp::sum().to_string().c_str());

  using RemoveAll = std::uintmax_t (*)(const fs::path&);
  const RemoveAll remove_all = &fs::remove_all;
  const std::string bound_to = defining_object(reinterpret_cast<const void*>(remove_all));
  std::printf("std::filesystem::remove_all bound to %s\n", bound_to.c_str());
  FS_CHECK(bound_to.find("libtorch") == std::string::npos);

  const fs::path tmp = fs::temp_directory_path();
  FS_CHECK(fs::is_directory(tmp));
  const fs::path root = tmp / ("fsdp2cpp-filesystem-check-" + std::to_string(::getpid()));
  fs::remove_all(root);  // a leftover from an earlier run with the same pid

  // A checkpoint-like tree: root/step-1.tmp/{model,optim}/shard-*.
  const fs::path staging = root / "step-1.tmp";
  FS_CHECK(fs::create_directories(staging / "model"));
  FS_CHECK(fs::create_directories(staging / "optim"));
  FS_CHECK(!fs::create_directories(staging / "model"));  // exists: false, no error
  write_file(staging / "model" / "shard-00001.safetensors", "0123456789");
  write_file(staging / "model" / "shard-00002.safetensors", "01234");
  write_file(staging / "optim" / "state.bin", "");
  FS_CHECK(fs::exists(staging / "model" / "shard-00001.safetensors"));
  FS_CHECK(!fs::exists(staging / "missing"));
  FS_CHECK(fs::file_size(staging / "model" / "shard-00001.safetensors") == 10);
  FS_CHECK(fs::file_size(staging / "optim" / "state.bin") == 0);
  FS_CHECK(fs::equivalent(staging / "model" / "..", staging));
  FS_CHECK(!fs::equivalent(staging / "model", staging / "optim"));

  std::set<std::string> listed;
  for (const fs::directory_entry& entry : fs::directory_iterator(staging / "model")) {
    listed.insert(entry.path().filename().string());
  }
  FS_CHECK((listed == std::set<std::string>{"shard-00001.safetensors", "shard-00002.safetensors"}));
  int recursive = 0;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(root)) {
    (void)entry;
    ++recursive;
  }
  FS_CHECK(recursive == 6);  // step-1.tmp, model, optim and three files

  // Atomic publish: rename the staging directory into place.
  const fs::path final_dir = root / "step-1";
  fs::rename(staging, final_dir);
  FS_CHECK(!fs::exists(staging));
  FS_CHECK(fs::file_size(final_dir / "model" / "shard-00002.safetensors") == 5);

  // Error-code overloads report instead of throwing.
  std::error_code ec;
  FS_CHECK(fs::file_size(root / "missing", ec) == static_cast<std::uintmax_t>(-1));
  FS_CHECK(ec);
  FS_CHECK(fs::remove_all(root / "missing", ec) == 0 && !ec);

  // Checkpoint cleanup: remove the tree, counting every entry.
  FS_CHECK(fs::remove_all(root) == 7);  // root, step-1, model, optim, three files
  FS_CHECK(!fs::exists(root));

  if (failures != 0) {
    std::fprintf(stderr, "filesystem: %d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  std::printf("filesystem: ok\n");
  return EXIT_SUCCESS;
}
