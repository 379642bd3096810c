// No LibTorch header may be included here (see logging.h).
#include "fsdp_common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

namespace fsdp {
namespace {

LogLevel level_from_env() {
  const char* value = std::getenv("FSDP2CPP_LOG_LEVEL");
  if (value == nullptr) return LogLevel::kWarn;
  struct Name {
    const char* name;
    LogLevel level;
  };
  static constexpr Name kNames[] = {{"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
                                    {"warn", LogLevel::kWarn},   {"error", LogLevel::kError}, {"off", LogLevel::kOff}};
  for (const auto& n : kNames) {
    if (std::strcmp(value, n.name) == 0) return n.level;
  }
  std::fprintf(stderr,
               "fsdp2cpp: unknown FSDP2CPP_LOG_LEVEL '%s' (use trace, debug, info, warn, error or off); using warn\n",
               value);
  return LogLevel::kWarn;
}

// The logger and its level are process-wide by nature (like spdlog's default
// logger); they are created once and never replaced.
std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(level_from_env())};
  return level;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("fsdp2cpp");
    l->set_pattern("[%H:%M:%S.%e] [fsdp2cpp] [%^%l%$] %v");
    l->set_level(spdlog::level::trace);  // filtering happens in log_enabled()
    return l;
  }();
  return *instance;
}

std::atomic<int>& rank_storage() {
  static std::atomic<int> rank{-1};
  return rank;
}

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::off;
}

}  // namespace

bool log_enabled(LogLevel level) noexcept {
  return static_cast<int>(level) >= level_storage().load(std::memory_order_relaxed) && level != LogLevel::kOff;
}

void log_message(LogLevel level, std::string_view message) noexcept {
  if (!log_enabled(level)) return;
  try {
    const int rank = rank_storage().load(std::memory_order_relaxed);
    if (rank >= 0) {
      logger().log(to_spdlog(level), "[rank {}] {}", rank, message);
    } else {
      logger().log(to_spdlog(level), "{}", message);
    }
  } catch (...) {
    // Logging must never take the program down.
  }
}

void set_log_level(LogLevel level) noexcept { level_storage().store(static_cast<int>(level)); }

void set_log_rank(int rank) noexcept { rank_storage().store(rank); }

}  // namespace fsdp
