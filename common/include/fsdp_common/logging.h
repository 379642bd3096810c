// Logging for every layer of fsdp2cpp.
//
// A deliberately small interface: callers format their own message (with
// c10::str, std::ostringstream, ...) and hand a string to the logger. The
// implementation uses spdlog and includes no LibTorch header, because torch
// ships its own fmt and a translation unit that saw both could mix two fmt
// versions.
//
// The level comes from the environment variable FSDP2CPP_LOG_LEVEL (trace,
// debug, info, warn, error, off; default warn) and can be changed with
// set_log_level(). Messages go to stderr, prefixed with the rank when
// set_log_rank() was called (collectives/src/world.cc):
//
//   FSDP2CPP_LOG_INFO(c10::str("rendezvous ", description, ": all ", world_size, " ranks joined"));
#pragma once

#include <string_view>

namespace fsdp {

enum class LogLevel { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Returns true when messages at `level` are written. Cheap: one atomic load.
bool log_enabled(LogLevel level) noexcept;

// Writes one message at `level` (no-op when the level is disabled).
// Thread-safe.
void log_message(LogLevel level, std::string_view message) noexcept;

// Sets the process-wide level, overriding FSDP2CPP_LOG_LEVEL.
void set_log_level(LogLevel level) noexcept;

// Tags every later message with "[rank N]". Called by the rendezvous.
void set_log_rank(int rank) noexcept;

}  // namespace fsdp

// The message expression is evaluated only when the level is enabled.
#define FSDP2CPP_LOG(level, message_expr)           \
  do {                                              \
    if (::fsdp::log_enabled(level)) {               \
      ::fsdp::log_message((level), (message_expr)); \
    }                                               \
  } while (false)
#define FSDP2CPP_LOG_DEBUG(message_expr) FSDP2CPP_LOG(::fsdp::LogLevel::kDebug, message_expr)
#define FSDP2CPP_LOG_INFO(message_expr) FSDP2CPP_LOG(::fsdp::LogLevel::kInfo, message_expr)
#define FSDP2CPP_LOG_WARN(message_expr) FSDP2CPP_LOG(::fsdp::LogLevel::kWarn, message_expr)
