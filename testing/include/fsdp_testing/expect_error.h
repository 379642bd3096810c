// GoogleTest expectations that a call throws a c10::Error (TORCH_CHECK)
// whose message names what it should.
//
// FSDP2CPP_EXPECT_THROW_WITH: the statement throws, and the message holds
// every fragment:
//
//   FSDP2CPP_EXPECT_THROW_WITH(fsdp::fully_shard(model, opts), "already applied", "layers.0");
//
// Fails the test when the statement does not throw, or when the message lacks
// any of the fragments (each failure prints the whole message). Other
// exception types propagate, failing the test with their own message.
//
// fsdp::testing::thrown_error: the message, for matchers of its own:
//
//   EXPECT_THAT(fsdp::testing::thrown_error([&] { mesh.slice({}); }), HasSubstr("no dim names given"));
#pragma once

#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::testing {

// thrown_error
//
// Runs `f` and returns the message of the c10::Error it throws, without the
// backtrace; fails the test (ADD_FAILURE) and returns "" when it throws
// nothing. Other exception types propagate. (test_helpers.h's error_of is the
// same without the failure, for tests that also expect no error.)
template <typename F>
std::string thrown_error(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error, nothing was thrown";
  return "";
}

}  // namespace fsdp::testing

#define FSDP2CPP_EXPECT_THROW_WITH(statement, ...)                                   \
  do {                                                                               \
    try {                                                                            \
      statement;                                                                     \
      ADD_FAILURE() << "expected an error from: " #statement;                        \
    } catch (const c10::Error& e) {                                                  \
      for (const char* fragment : {__VA_ARGS__}) {                                   \
        EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)           \
            << "message lacks '" << fragment << "': " << e.what_without_backtrace(); \
      }                                                                              \
    }                                                                                \
  } while (false)
