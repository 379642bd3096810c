// fsdp_train --profile: the trainer, run for a few steps on 2 CPU ranks,
// writes one Kineto trace per rank as Chrome trace JSON, holding exactly the
// profiled steps and, inside them, the FSDP phases of each sharded block.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "profile.h"
#include "run_binary.h"

namespace fsdp_train_test {
namespace {

struct Span {
  double begin = 0;
  double end = 0;
};

// Complete ("X") events by name: every occurrence's time span.
std::map<std::string, std::vector<Span>> spans_of(const nlohmann::json& trace) {
  std::map<std::string, std::vector<Span>> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (!e.contains("name") || e.value("ph", "") != "X") continue;
    const double ts = e.at("ts").get<double>(), dur = e.value("dur", 0.0);
    out[e.at("name").get<std::string>()].push_back({ts, ts + dur});
  }
  return out;
}

bool inside(const Span& s, const std::vector<Span>& outer) {
  for (const Span& o : outer) {
    if (s.begin >= o.begin && s.end <= o.end) return true;
  }
  return false;
}

TEST(FsdpTrainProfile, WritesAChromeTraceOfTheProfiledStepsWithTheFsdpPhases) {
  char dir_template[] = "/tmp/fsdp_train_profile.XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = std::string(dir_template) + "/prof";  // created by the trainer
  const RunResult run = run_program(
      FSDP_TRAIN_BINARY,
      {"--nproc",   "2",  "--steps",        "4", "--layers",    "2", "--dim",     "32", "--heads",         "2",
       "--seq-len", "16", "--global-batch", "4", "--log-every", "1", "--profile", dir,  "--profile-steps", "2:3"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("profile       steps 2..3 in " + fsdp_train::trace_path(dir, 0)), std::string::npos)
      << run.output;

  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const std::string path = fsdp_train::trace_path(dir, rank);
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << "no trace at " << path;
    nlohmann::json trace;
    ASSERT_NO_THROW(trace = nlohmann::json::parse(in)) << path << " is not valid JSON";
    ASSERT_TRUE(trace.contains("traceEvents")) << path << " is not a Chrome trace (no traceEvents)";
    const auto spans = spans_of(trace);

    // Exactly steps 2 and 3.
    EXPECT_EQ(spans.count("ProfilerStep#1"), 0u);
    EXPECT_EQ(spans.count("ProfilerStep#4"), 0u);
    ASSERT_EQ(spans.count("ProfilerStep#2"), 1u);
    ASSERT_EQ(spans.count("ProfilerStep#3"), 1u);
    std::vector<Span> steps = spans.at("ProfilerStep#2");
    steps.push_back(spans.at("ProfilerStep#3").front());

    // Each phase of both blocks, inside the profiled steps, as often as it
    // runs in two steps: the blocks reshard after forward, so they are
    // gathered again in backward.
    const std::vector<std::pair<const char*, size_t>> phases = {
        {"FSDP::pre_forward", 2},  {"FSDP::all_gather", 4},    {"FSDP::post_forward", 2},
        {"FSDP::pre_backward", 2}, {"FSDP::post_backward", 2}, {"FSDP::reduce_scatter", 2}};
    for (const auto& [phase, count] : phases) {
      for (const char* module : {"layers.0", "layers.1"}) {
        const std::string name = std::string(phase) + " (" + module + ")";
        const auto it = spans.find(name);
        ASSERT_NE(it, spans.end()) << "no '" << name << "' event in " << path;
        EXPECT_EQ(it->second.size(), count) << name;
        for (const Span& s : it->second) EXPECT_TRUE(inside(s, steps)) << name << " outside the profiled steps";
      }
    }
    // The root's own phases, its group named "root" (the empty FQN; FSDP2
    // leaves it unnamed). The root keeps its parameters from forward to
    // backward, so it is gathered once a step.
    ASSERT_EQ(spans.count("FSDP::root_pre_forward"), 1u);
    EXPECT_EQ(spans.at("FSDP::root_pre_forward").size(), 2u);
    for (const auto& [name, count] : std::vector<std::pair<const char*, size_t>>{
             {"FSDP::all_gather (root)", 2}, {"FSDP::reduce_scatter (root)", 2}, {"FSDP::pre_forward (root)", 2}}) {
      const auto it = spans.find(name);
      ASSERT_NE(it, spans.end()) << "no '" << name << "' event in " << path;
      EXPECT_EQ(it->second.size(), count) << name;
    }
    EXPECT_EQ(spans.count("FSDP::all_gather"), 0u) << "an unnamed all-gather in " << path;
    EXPECT_GE(spans.count("aten::mm") + spans.count("aten::matmul") + spans.count("aten::addmm"), 1u);
  }
  for (int rank = 0; rank < 2; ++rank) std::remove(fsdp_train::trace_path(dir, rank).c_str());
  ::rmdir(dir.c_str());
  ::rmdir(dir_template);
}

TEST(FsdpTrainProfile, BadProfileFlagsFailBeforeTraining) {
  const auto expect_error = [](const std::vector<std::string>& args, const std::string& detail) {
    const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_NE(run.output.find(detail), std::string::npos) << run.output;
    EXPECT_EQ(run.output.find("step 1"), std::string::npos) << "training started:\n" << run.output;
  };
  expect_error({"--steps", "5", "--profile-steps", "2:3"}, "--profile-steps 2:3 needs --profile DIR");
  expect_error({"--steps", "5", "--profile", "/tmp", "--profile-steps", "0:2"}, "--profile-steps 0:2 must satisfy");
  expect_error({"--steps", "5", "--profile", "/tmp", "--profile-steps", "3:9"}, "<= --steps (5)");
  expect_error({"--steps", "5", "--profile", "/tmp", "--profile-steps", "two"}, "--profile-steps must be A:B");
  expect_error({"--steps", "5", "--profile", "/proc/no/such/dir"}, "--profile: cannot create the directory");
}

TEST(FsdpTrainProfile, ParsesProfileSteps) {
  const auto a = fsdp_train::parse_profile_steps("", 10);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, 2);
  EXPECT_EQ(a->last, 3);
  const auto one_step_run = fsdp_train::parse_profile_steps("", 1);
  ASSERT_TRUE(one_step_run.ok());
  EXPECT_EQ(one_step_run->first, 1);
  EXPECT_EQ(one_step_run->last, 1);
  const auto single = fsdp_train::parse_profile_steps("7", 10);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->first, 7);
  EXPECT_EQ(single->last, 7);
  EXPECT_FALSE(fsdp_train::parse_profile_steps("3:2", 10).ok());
  EXPECT_FALSE(fsdp_train::parse_profile_steps("1:", 10).ok());
}

// --profile-steps A:B as an fsdp::Profiler schedule: one warm-up step before A
// where the run has one; after --resume, only the steps still to run.
TEST(FsdpTrainProfile, ProfileStepsBecomeTheProfilerSchedule) {
  fsdp_train::TrainConfig c;
  c.steps = 10;
  c.profile_dir = "/tmp/unused";
  c.profile_steps = "6:8";
  const c10::Device cpu(c10::kCPU);
  auto o = fsdp_train::profiler_options(c, 1, cpu, /*run_first_step=*/1);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->rank, 1);
  EXPECT_EQ(o->first_step_number, 1);
  EXPECT_EQ(o->schedule.wait, 4);    // steps 1-4
  EXPECT_EQ(o->schedule.warmup, 1);  // step 5
  EXPECT_EQ(o->schedule.active, 3);  // steps 6-8
  EXPECT_EQ(o->schedule.repeat, 1);
  EXPECT_EQ(o->record_cuda, false);
  EXPECT_EQ(fsdp_train::describe_profile(*o, "f.json"), "steps 6..8 in f.json (one file per rank)");

  // Resumed at step 7: steps 7-8, no room for a warm-up step.
  o = fsdp_train::profiler_options(c, 0, cpu, 7);
  ASSERT_TRUE(o.has_value());
  EXPECT_EQ(o->first_step_number, 7);
  EXPECT_EQ(o->schedule.wait + o->schedule.warmup, 0);
  EXPECT_EQ(o->schedule.active, 2);
  EXPECT_EQ(fsdp_train::describe_profile(*o, "f.json"), "steps 7..8 in f.json (one file per rank)");
  // Resumed after the profiled steps: nothing to profile.
  EXPECT_FALSE(fsdp_train::profiler_options(c, 0, cpu, 9).has_value());
  c.profile_dir.clear();
  c.profile_steps.clear();
  EXPECT_FALSE(fsdp_train::profiler_options(c, 0, cpu, 1).has_value());
}

}  // namespace
}  // namespace fsdp_train_test
