// FSDP2CPP_EXPECT_THROW_WITH: a GoogleTest expectation that a statement
// throws a c10::Error (TORCH_CHECK) whose message names what it should.
//
//   FSDP2CPP_EXPECT_THROW_WITH(fsdp::fully_shard(model, opts), "already applied", "layers.0");
//
// Fails the test when the statement does not throw, or when the message lacks
// any of the fragments (each failure prints the whole message). Other
// exception types propagate, failing the test with their own message.
#pragma once

#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

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
