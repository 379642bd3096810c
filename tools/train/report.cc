#include "report.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fsdp_train {

absl::Status write_json(const std::string& path, int64_t world_size, const std::string& mesh,
                        const std::vector<StepRecord>& steps) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::UnavailableError(absl::StrCat("--json: cannot write '", path, "': ", std::strerror(errno)));
  }
  std::string quoted_mesh;
  for (char c : mesh) {
    if (c == '"' || c == '\\') quoted_mesh += '\\';
    quoted_mesh += c;
  }
  std::fprintf(f, "{\"world_size\": %lld, \"mesh\": \"%s\", \"steps\": [", static_cast<long long>(world_size),
               quoted_mesh.c_str());
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepRecord& s = steps[i];
    std::fprintf(f, "%s\n  {\"step\": %lld, \"loss\": %.17g, \"tokens_per_s\": %.6g, \"peak_mem_bytes\": %lld}",
                 i == 0 ? "" : ",", static_cast<long long>(s.step), s.loss, s.tokens_per_s,
                 static_cast<long long>(s.peak_mem_bytes));
  }
  std::fprintf(f, "\n], \"final_loss\": %.17g}\n", steps.empty() ? std::nan("") : steps.back().loss);
  const bool ok = std::fclose(f) == 0;
  if (!ok) return absl::UnavailableError(absl::StrCat("--json: cannot write '", path, "': ", std::strerror(errno)));
  return absl::OkStatus();
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return absl::StrFormat("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return absl::StrFormat("%.1f MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return absl::StrFormat("%.1f KiB", b / 1024.0);
  return absl::StrCat(bytes, " B");
}

std::string format_count(double value) {
  std::string digits = absl::StrFormat("%.0f", value);
  std::string out;
  const size_t start = digits[0] == '-' ? 1 : 0;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > start && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

Progress::Progress(int64_t steps, int64_t log_every)
    : steps_(steps), log_every_(log_every), tty_(::isatty(STDOUT_FILENO) == 1) {}

void Progress::update(const StepRecord& r) {
  const std::string stats = absl::StrFormat("loss %.4f | %s tokens/s | %.0f ms/step", r.loss,
                                            format_count(r.tokens_per_s), r.seconds * 1000.0);
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * r.step / steps_);
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::printf("\r[%s] step %lld/%lld | %s\x1b[K", bar.c_str(), static_cast<long long>(r.step),
                static_cast<long long>(steps_), stats.c_str());
    open_line_ = true;
  } else if (r.step == 1 || r.step % log_every_ == 0 || r.step == steps_) {
    std::printf("step %*lld/%lld | %s\n", static_cast<int>(std::to_string(steps_).size()),
                static_cast<long long>(r.step), static_cast<long long>(steps_), stats.c_str());
  }
  std::fflush(stdout);
}

void Progress::finish() {
  if (open_line_) std::printf("\n");
  open_line_ = false;
  std::fflush(stdout);
}

}  // namespace fsdp_train
