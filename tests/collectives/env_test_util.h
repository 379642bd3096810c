// Helpers of the collectives tests that rendezvous through the launcher's
// environment variables (env://): a port to rendezvous on, and the variables
// saved, unset and restored around a test.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace fsdp::collectives::test {

// A port nobody listens on right now.
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Environment variables a test sets as it likes: save_and_unset() in the
// fixture's SetUp, restore() in its TearDown.
class SavedEnv {
 public:
  explicit SavedEnv(std::vector<const char*> vars) : vars_(std::move(vars)) {}

  // Remembers each variable's value and unsets it.
  void save_and_unset() {
    for (const char* var : vars_) {
      if (const char* value = std::getenv(var)) saved_[var] = value;
      unsetenv(var);
    }
  }
  // Unsets each variable, and sets back the value it had.
  void restore() {
    for (const char* var : vars_) {
      unsetenv(var);
      if (auto it = saved_.find(var); it != saved_.end()) setenv(var, it->second.c_str(), 1);
    }
  }

 private:
  std::vector<const char*> vars_;
  std::map<std::string, std::string> saved_;
};

}  // namespace fsdp::collectives::test
