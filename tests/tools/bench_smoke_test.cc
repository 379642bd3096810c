// The benchmark programs (tools/bench) in their --quick mode: each runs to
// the end and prints its table with the expected columns and rows, and the
// figures in it are finite positive numbers. They measure nothing here (a
// tiny model); this keeps them from rotting.
#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "run_binary.h"

namespace fsdp_train_test {
namespace {

// The lines of `output` that start with `prefix`.
std::vector<std::string> lines_starting_with(const std::string& output, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  }
  return out;
}

// The whitespace-separated fields of `line` from index `first` on, as numbers
// (NaN for a field that does not parse completely).
std::vector<double> numbers_from(const std::string& line, size_t first) {
  std::istringstream in(line);
  std::vector<double> out;
  size_t i = 0;
  for (std::string f; in >> f; ++i) {
    if (i < first) continue;
    char* end = nullptr;
    const double v = std::strtod(f.c_str(), &end);
    out.push_back(end != f.c_str() && *end == '\0' ? v : std::nan(""));
  }
  return out;
}

// The fields of `line` from `first` on, each a finite number > 0.
void expect_positive_numbers(const std::string& line, size_t first) {
  const std::vector<double> values = numbers_from(line, first);
  ASSERT_FALSE(values.empty()) << line;
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_TRUE(std::isfinite(values[i]) && values[i] > 0) << "field " << first + i << " of: " << line;
  }
}

TEST(BenchSmoke, MemoryBenchPrintsBothSystemsWithRatios) {
  const RunResult run = run_program(FSDP_MEMORY_BENCH, {"--quick", "--cpu-only"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* column : {"measure", "growth/block", "state/block", "growth/state", "vs PyTorch"}) {
    EXPECT_NE(run.output.find(column), std::string::npos) << column << " missing:\n" << run.output;
  }
  for (const std::string system : {"fsdp2cpp      ", "PyTorch FSDP2 "}) {
    const std::string prefix = "cpu    " + system + " ";
    const auto rows = lines_starting_with(run.output, prefix);
    ASSERT_EQ(rows.size(), 2u) << "a live and an rss row for " << system << ":\n" << run.output;
    // measure, peak small, peak large. Peaks and the state per block are
    // positive; the growth of a tiny model may be 0 or negative (page reuse),
    // so only the columns before it.
    double peaks[2][2] = {};
    for (size_t i = 0; i < 2; ++i) {
      std::istringstream fields(rows[i].substr(prefix.size()));
      std::string measure, peak_small, peak_large;
      fields >> measure >> peak_small >> peak_large;
      EXPECT_EQ(measure, i == 0 ? "live" : "rss") << rows[i];
      peaks[i][0] = std::strtod(peak_small.c_str(), nullptr);
      peaks[i][1] = std::strtod(peak_large.c_str(), nullptr);
      EXPECT_GT(peaks[i][0], 1.0) << rows[i];
      EXPECT_GT(peaks[i][1], 1.0) << rows[i];
    }
    // The live bytes come from the malloc counter, not from RSS: a rank's
    // heap is smaller than its resident set (which adds code, stacks, and
    // what glibc keeps).
    EXPECT_LT(peaks[0][0], peaks[1][0]) << rows[0] << "\n" << rows[1];
    EXPECT_LT(peaks[0][1], peaks[1][1]) << rows[0] << "\n" << rows[1];
  }
}

// The malloc counter the memory benchmark preloads, on a process whose
// allocations are known: MallocCounterCountsLiveBytes runs this test binary
// again with the shim preloaded and only MallocCounterProbe selected, which
// then, between two quiet points, holds at most 96 MiB more than at exit.
TEST(BenchSmoke, MallocCounterProbe) {
  if (std::getenv("FSDP_MALLOC_COUNTER_PROBE") == nullptr) GTEST_SKIP() << "run by MallocCounterCountsLiveBytes";
  constexpr size_t kMiB = size_t{1} << 20;
  void* p = nullptr;
  ASSERT_EQ(posix_memalign(&p, 64, 64 * kMiB), 0);
  std::memset(p, 1, 64 * kMiB);
  p = std::realloc(p, 96 * kMiB);  // the peak: 96 MiB, not 64 + 96
  ASSERT_NE(p, nullptr);
  std::free(p);
  // Several smaller blocks alive together, below the peak: 40 MiB.
  std::vector<void*> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(std::calloc(8, kMiB));
  for (int i = 0; i < 5; ++i) blocks.push_back(std::malloc(kMiB / 2));
  blocks.push_back(aligned_alloc(4096, 2 * kMiB));
  for (void* b : blocks) std::free(b);
  ::setenv("RANK", "5", 1);  // read when the report is written, at exit
}

TEST(BenchSmoke, MallocCounterCountsLiveBytes) {
  fsdp::testing::ScratchDir dir("bench_smoke");
  ::setenv("LD_PRELOAD", FSDP_MALLOC_COUNTER, 1);
  ::setenv("FSDP_MALLOC_COUNTER_DIR", dir.path().c_str(), 1);
  ::setenv("FSDP_MALLOC_COUNTER_PROBE", "1", 1);
  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const RunResult run = run_program(self, {"--gtest_filter=BenchSmoke.MallocCounterProbe"});
  ::unsetenv("LD_PRELOAD");
  ::unsetenv("FSDP_MALLOC_COUNTER_DIR");
  ::unsetenv("FSDP_MALLOC_COUNTER_PROBE");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.output.find("SKIPPED"), std::string::npos) << run.output;
  std::vector<std::string> reports;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) reports.push_back(entry.path().string());
  ASSERT_EQ(reports.size(), 1u) << "one report from the probe process";
  std::ifstream in(reports[0]);
  const std::string report((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto number = [&](const std::string& key) {
    const size_t at = report.find("\"" + key + "\": ");
    EXPECT_NE(at, std::string::npos) << key << " missing: " << report;
    return at == std::string::npos ? -1.0 : std::strtod(report.c_str() + at + key.size() + 4, nullptr);
  };
  EXPECT_EQ(number("rank"), 5) << report;
  const double mib = 1 << 20;
  const double over_exit = (number("peak_live_bytes") - number("live_at_exit")) / mib;
  // 96 MiB plus malloc's slack and what gtest holds while the probe runs.
  EXPECT_GE(over_exit, 96.0) << report;
  EXPECT_LT(over_exit, 98.0) << report;
  // The split at the peak puts the 96 MiB block in the 64-128 MiB class.
  EXPECT_NE(report.find("[67108864, 1006"), std::string::npos) << report;
}

TEST(BenchSmoke, SpeedBenchPrintsAllThreeSystemsPerWorldSize) {
  const RunResult run = run_program(FSDP_SPEED_BENCH, {"--quick", "--cpu-only", "--world-sizes", "1,2"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* column : {"(a) ms", "(b) ms", "(c) ms", "b/a", "b/c", "a MiB", "b MiB", "c MiB"}) {
    EXPECT_NE(run.output.find(column), std::string::npos) << column << " missing:\n" << run.output;
  }
  const auto rows = lines_starting_with(run.output, "cpu ");
  ASSERT_EQ(rows.size(), 2u) << "one row per world size:\n" << run.output;
  for (size_t i = 0; i < rows.size(); ++i) {
    // device, 8 words of the model's name, then ws and the figures.
    EXPECT_NE(rows[i].find(i == 0 ? "  1 " : "  2 "), std::string::npos) << rows[i];
    expect_positive_numbers(rows[i], 9);
  }
}

// --repeats: each ratio is the median of the per-repeat ones, so it lies
// within their printed range.
TEST(BenchSmoke, SpeedBenchRepeatsReportRatiosWithTheirRange) {
  const RunResult run =
      run_program(FSDP_SPEED_BENCH, {"--quick", "--cpu-only", "--world-sizes", "1", "--repeats", "3"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("3 repeats per row in rotating order"), std::string::npos) << run.output;
  const auto rows = lines_starting_with(run.output, "cpu ");
  ASSERT_EQ(rows.size(), 1u) << run.output;
  expect_positive_numbers(rows[0], 9);
  // ws, (a), (b), (c), then b/a lo hi, b/c lo hi, then three MiB.
  const std::vector<double> v = numbers_from(rows[0], 9);
  ASSERT_EQ(v.size(), 13u) << rows[0];
  for (size_t ratio : {4u, 7u}) {
    EXPECT_LE(v[ratio + 1], v[ratio]) << "lo above the median in: " << rows[0];
    EXPECT_LE(v[ratio], v[ratio + 2]) << "hi below the median in: " << rows[0];
  }
}

TEST(BenchSmoke, SpeedBenchRejectsZeroRepeats) {
  const RunResult run = run_program(FSDP_SPEED_BENCH, {"--quick", "--cpu-only", "--repeats", "0"});
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_NE(run.output.find("--repeats takes a count of 1 or more (got 0)"), std::string::npos) << run.output;
}

// A PyTorch side that dies of SIGABRT once (as fsdp2_bench.py's ranks were
// seen to in CI) costs a retry, announced with the failed run's output, not
// the row.
TEST(BenchSmoke, PyTorchRunThatDiesOnceIsRetriedAndAnnounced) {
  char dir_template[] = "/tmp/fsdp2cpp_fake_python_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string fake = dir + "/python";
  {
    std::ofstream out(fake);
    out << "#!/bin/sh\n"
        << "if [ ! -e " << dir << "/failed_once ]; then\n"
        << "  touch " << dir << "/failed_once\n"
        << "  echo 'fake rank 0 aborts' >&2\n"
        << "  kill -ABRT $$\n"
        << "fi\n"
        << "echo 'RESULT {\"median_step_s\": 0.01, \"peak_bytes\": 1048576, \"loss_first\": 5.0, "
           "\"loss_last\": 4.0, \"world_size\": 1}'\n";
  }
  ASSERT_EQ(::chmod(fake.c_str(), 0700), 0);
  const RunResult run =
      run_program(FSDP_SPEED_BENCH, {"--quick", "--cpu-only", "--world-sizes", "1", "--python", fake});
  std::remove((dir + "/failed_once").c_str());
  std::remove(fake.c_str());
  ::rmdir(dir.c_str());
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("running it once more"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("fake rank 0 aborts"), std::string::npos) << "the failed run's output:\n" << run.output;
  const auto rows = lines_starting_with(run.output, "cpu ");
  ASSERT_EQ(rows.size(), 1u) << run.output;
  expect_positive_numbers(rows[0], 9);
}

TEST(BenchSmoke, OverheadBenchPrintsPerGroupFiguresAndTheRatio) {
  const RunResult run = run_program(FSDP_OVERHEAD_BENCH, {"--quick"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("per-group us"), std::string::npos) << run.output;
  const auto ours = lines_starting_with(run.output, "fsdp2cpp ");
  const auto theirs = lines_starting_with(run.output, "PyTorch FSDP2 ");
  ASSERT_EQ(ours.size(), 1u) << run.output;
  ASSERT_EQ(theirs.size(), 1u) << run.output;
  // Step times are positive; the per-group difference is noise in --quick.
  std::istringstream fields(ours[0]);
  std::string name;
  double unsharded = 0, sharded = 0;
  fields >> name >> unsharded >> sharded;
  EXPECT_GT(unsharded, 0) << ours[0];
  EXPECT_GT(sharded, 0) << ours[0];
  std::smatch m;
  ASSERT_TRUE(std::regex_search(run.output, m, std::regex(R"(ours / PyTorch per group: (\S+))"))) << run.output;
  EXPECT_TRUE(std::isfinite(std::stod(m[1]))) << run.output;
  // The same stack in strict mode (FSDP2CPP_STRICT_COLLECTIVES=1), and the
  // flight recorder's own cost per collective.
  const auto strict = lines_starting_with(run.output, "strict mode ");
  ASSERT_EQ(strict.size(), 1u) << run.output;
  const std::vector<double> strict_times = numbers_from(strict[0], 2);
  ASSERT_GE(strict_times.size(), 2u) << strict[0];
  EXPECT_GT(strict_times[0], 0) << strict[0];
  EXPECT_GT(strict_times[1], 0) << strict[0];
  ASSERT_TRUE(std::regex_search(run.output, m, std::regex(R"(flight recorder per collective .*: (\d+) ns)")))
      << run.output;
  EXPECT_GT(std::stod(m[1]), 0) << run.output;
}

// fsdp_ac_bench: one row per --ac mode, both systems' peaks and step times
// and the ratios; --quick makes no half-row runs, so act is "-".
TEST(BenchSmoke, AcBenchPrintsOneRowPerModeForBothSystems) {
  const RunResult run = run_program(FSDP_AC_BENCH, {"--quick"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* column : {"ours live", "pt live", "ours rss", "pt rss", "ours act", "pt act", "ours ms", "pt ms",
                             "ours/none", "pt/none"}) {
    EXPECT_NE(run.output.find(column), std::string::npos) << column << " missing:\n" << run.output;
  }
  for (const std::string mode : {"none", "full", "selective"}) {
    const auto rows = lines_starting_with(run.output, mode + " ");
    ASSERT_EQ(rows.size(), 1u) << "one row for --ac " << mode << ":\n" << run.output;
    // live x2, o/p, rss x2, o/p, act x2, o/p, ms x2, o/p, ours/none, pt/none.
    const std::vector<double> v = numbers_from(rows[0], 1);
    ASSERT_EQ(v.size(), 14u) << rows[0];
    for (size_t i : {0u, 1u, 2u, 3u, 4u, 5u, 9u, 10u, 11u, 12u, 13u}) {
      EXPECT_TRUE(std::isfinite(v[i]) && v[i] > 0) << "field " << i + 1 << " of: " << rows[0];
    }
    for (size_t i : {6u, 7u, 8u}) EXPECT_TRUE(std::isnan(v[i])) << "act is not measured in --quick: " << rows[0];
    // The live heap is part of the resident set.
    EXPECT_LT(v[0], v[3]) << rows[0];
    EXPECT_LT(v[1], v[4]) << rows[0];
  }
}

TEST(BenchSmoke, PlanTimeBenchPrintsSimulatedAndMeasuredPerWorldSize) {
  const RunResult run = run_program(FSDP_PLAN_TIME_BENCH, {"--quick"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (const char* column : {"simulated ms", "measured ms", "sim/meas"}) {
    EXPECT_NE(run.output.find(column), std::string::npos) << column << " missing:\n" << run.output;
  }
  const auto rows = lines_starting_with(run.output, "tiny ");
  ASSERT_EQ(rows.size(), 2u) << "world sizes 1 and 2:\n" << run.output;
  for (const std::string& row : rows) {
    const std::vector<double> v = numbers_from(row, 1);  // ranks, simulated, measured, ratio
    ASSERT_EQ(v.size(), 4u) << row;
    for (double x : v) EXPECT_TRUE(std::isfinite(x) && x > 0) << row;
    EXPECT_NEAR(v[3], v[1] / v[2], 0.02) << row;  // all three printed to 2 decimals
  }
}

}  // namespace
}  // namespace fsdp_train_test
