// Uses each package of the offline prefix once, with a checked result.
#include <string>

#include <absl/strings/str_cat.h>
#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

TEST(OfflineProbe, EveryPackageWorks) {
  EXPECT_EQ(absl::StrCat("rank", 3), "rank3");
  EXPECT_EQ(fmt::format("{}:{}", "node", 29500), "node:29500");
  EXPECT_EQ(nlohmann::json::parse(R"({"world_size": 4})").at("world_size").get<int>(), 4);
  EXPECT_THAT(std::string(gloo::IoException("socket closed").what()), ::testing::HasSubstr("socket closed"));
  spdlog::info("offline probe: spdlog {}.{}", SPDLOG_VER_MAJOR, SPDLOG_VER_MINOR);
}
