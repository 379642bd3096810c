// An NVTX injection library that records range pushes and pops, for the NVTX
// test. NVTX3 (header-only) loads the library named by NVTX_INJECTION64_PATH
// on a process's first NVTX call and calls its InitializeInjectionNvtx2,
// which fills NVTX's callback table: this is how Nsight Systems attaches.
// Each process appends "<thread> push <name>" / "<thread> pop" lines to
// $FSDP2CPP_NVTX_LOG.<pid>.
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <nvtx3/nvToolsExt.h>

namespace {

int log_fd = -1;

// One write(2) per line with O_APPEND: lines from several threads never mix.
void record(const std::string& line) {
  if (log_fd < 0) return;
  const std::string text = std::to_string(::syscall(SYS_gettid)) + " " + line + "\n";
  [[maybe_unused]] const ssize_t n = ::write(log_fd, text.data(), text.size());
}

int NVTX_API push_a(const char* message) {
  record(std::string("push ") + (message != nullptr ? message : ""));
  return 0;
}

int NVTX_API pop() {
  record("pop");
  return 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const char* prefix = std::getenv("FSDP2CPP_NVTX_LOG");
  if (prefix == nullptr || *prefix == '\0') return 0;
  const std::string path = std::string(prefix) + "." + std::to_string(::getpid());
  log_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return 0;
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr || callbacks->GetModuleFunctionTable == nullptr) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) == 0 || table == nullptr) return 0;
  if (size <= NVTX_CBID_CORE_RangePop) return 0;
  *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(&push_a);
  *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(&pop);
  record("init");
  return 1;
}
