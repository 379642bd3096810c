// fsdp::Profiler (fsdp2/profiler.h): which steps each trace holds and which
// files it writes under a schedule (torch.profiler.schedule's meaning); the
// FSDP phases of a sharded model in each rank's trace at 1-3 ranks, the root's
// group named, a module's groups on different meshes told apart; no Kineto
// error on a host without a GPU; RAII (a partial cycle written at destruction, nothing when an
// exception unwinds); and each misuse, named.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <nlohmann/json.hpp>

#include "fsdp2/profiler.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

// A fresh directory under /tmp, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "fsdp2_profiler_test.XXXXXX").string();
    TORCH_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// How many complete ("X") events of each name a Chrome trace holds.
std::map<std::string, int> event_counts(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "no trace at ", path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  TORCH_CHECK(trace.contains("traceEvents"), path, " is not a Chrome trace");
  std::map<std::string, int> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.contains("name") && e.value("ph", "") == "X") ++out[e.at("name").get<std::string>()];
  }
  return out;
}

// The ProfilerStep numbers a trace holds.
std::vector<int> profiled_steps(const std::string& path) {
  std::vector<int> out;
  for (const auto& [name, count] : event_counts(path)) {
    if (name.rfind("ProfilerStep#", 0) == 0) out.push_back(std::stoi(name.substr(13)));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// One step of a "training loop" with an operator the trace can show.
void some_work() { (void)at::mm(at::ones({8, 8}), at::ones({8, 8})); }

// Rank 0's options writing into `dir`, with the schedule's counts.
ProfilerOptions options_in(const TempDir& dir, int64_t wait = 1, int64_t warmup = 1, int64_t active = 2,
                           int64_t repeat = 1) {
  ProfilerOptions o;
  o.trace_dir = dir.path();
  o.rank = 0;
  o.schedule.wait = wait;
  o.schedule.warmup = warmup;
  o.schedule.active = active;
  o.schedule.repeat = repeat;
  return o;
}

TEST(Profiler, ScheduleRecordsEachCycleIntoItsOwnTrace) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir, /*wait=*/1, /*warmup=*/1, /*active=*/2, /*repeat=*/2);
  o.schedule.skip_first = 1;
  Profiler profiler(o);
  for (int step = 0; step < 11; ++step) {
    EXPECT_EQ(profiler.step_number(), step);
    some_work();
    profiler.step();
  }
  // Step 0 skipped; each cycle: 1 waits, 2 warms up, 3-4 recorded; then 5-8;
  // then nothing (two cycles).
  const std::vector<std::string> expected = {dir.path() + "/trace_rank0_steps3-4.json",
                                             dir.path() + "/trace_rank0_steps7-8.json"};
  ASSERT_EQ(profiler.traces_written(), expected);
  EXPECT_EQ(profiled_steps(expected[0]), (std::vector<int>{3, 4}));
  EXPECT_EQ(profiled_steps(expected[1]), (std::vector<int>{7, 8}));
  EXPECT_GE(event_counts(expected[0])["aten::mm"], 2);
}

TEST(Profiler, OneCycleWritesTraceRankFileNumberedFromTheFirstStep) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir, /*wait=*/0, /*warmup=*/0, /*active=*/1);
  o.rank = 3;
  o.first_step_number = 1;
  Profiler profiler(o);
  for (int i = 0; i < 4; ++i) {
    some_work();
    profiler.step();
  }
  ASSERT_EQ(profiler.traces_written(), std::vector<std::string>{dir.path() + "/trace_rank3.json"});
  EXPECT_EQ(profiled_steps(dir.path() + "/trace_rank3.json"), std::vector<int>{1});
  EXPECT_EQ(profiler.step_number(), 5);
}

TEST(Profiler, RepeatZeroCyclesUntilDestroyedAndTheLastPartialCycleIsWritten) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir, /*wait=*/0, /*warmup=*/1, /*active=*/2, /*repeat=*/0);
  {
    Profiler profiler(o);
    for (int step = 0; step < 8; ++step) {  // ends inside the third cycle's active steps
      some_work();
      profiler.step();
    }
    EXPECT_EQ(profiler.traces_written().size(), 2u);
  }
  EXPECT_EQ(profiled_steps(dir.path() + "/trace_rank0_steps1-2.json"), (std::vector<int>{1, 2}));
  EXPECT_EQ(profiled_steps(dir.path() + "/trace_rank0_steps4-5.json"), (std::vector<int>{4, 5}));
  // Written by the destructor, as torch.profiler's __exit__ does: step 7,
  // and step 8 that had begun.
  const std::vector<int> last = profiled_steps(dir.path() + "/trace_rank0_steps7-8.json");
  ASSERT_FALSE(last.empty());
  EXPECT_EQ(last.front(), 7);
}

TEST(Profiler, StopWritesTheRecordingCycleAndEndsProfiling) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir, /*wait=*/0, /*warmup=*/0, /*active=*/5);
  Profiler profiler(o);
  some_work();
  profiler.step();
  some_work();
  profiler.stop();
  ASSERT_EQ(profiler.traces_written(), std::vector<std::string>{dir.path() + "/trace_rank0.json"});
  EXPECT_EQ(profiled_steps(dir.path() + "/trace_rank0.json"), (std::vector<int>{0, 1}));
  EXPECT_THROW_WITH(profiler.step(), "step() after stop()");
  EXPECT_THROW_WITH(profiler.stop(), "stop() called twice");
}

TEST(Profiler, NothingIsWrittenWhenAnExceptionUnwindsTheLoop) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir, /*wait=*/0, /*warmup=*/0, /*active=*/3);
  try {
    Profiler profiler(o);
    some_work();
    profiler.step();
    throw std::runtime_error("the loop failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/trace_rank0.json"));
  // The profiler was ended: another can run.
  Profiler again(o);
  some_work();
  again.stop();
  EXPECT_EQ(profiled_steps(dir.path() + "/trace_rank0.json"), std::vector<int>{0});
}

TEST(Profiler, RankComesFromTheEnvironmentWhenNotGiven) {
  const TempDir dir;
  ProfilerOptions o = options_in(dir);
  o.rank = -1;
  ::setenv("RANK", "5", 1);
  {
    Profiler profiler(o);
    EXPECT_EQ(profiler.rank(), 5);
  }
  ::setenv("RANK", "two", 1);
  EXPECT_THROW_WITH(Profiler{o}, "$RANK is 'two', not a rank; set ProfilerOptions::rank");
  ::unsetenv("RANK");
  ::unsetenv("SLURM_PROCID");
  Profiler profiler(o);
  EXPECT_EQ(profiler.rank(), 0);
}

TEST(Profiler, MisuseIsRejectedNamingTheOption) {
  const TempDir dir;
  const auto with = [&](auto&& edit) {
    ProfilerOptions o = options_in(dir);
    edit(o);
    return o;
  };
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.trace_dir.clear(); })}, "trace_dir is empty");
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.schedule.active = 0; })}, "ProfilerSchedule::active is 0");
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.schedule.wait = -1; })}, "ProfilerSchedule::wait is -1");
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.schedule.repeat = -2; })},
                    "ProfilerSchedule::repeat is -2");
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.rank = -3; })}, "ProfilerOptions::rank is -3");
  EXPECT_THROW_WITH(Profiler{with([](ProfilerOptions& o) { o.trace_dir = "/proc/no/such/dir"; })},
                    "cannot create the trace directory '/proc/no/such/dir'");
  // One at a time: LibTorch's profiler is process-wide.
  Profiler first(options_in(dir));
  EXPECT_THROW_WITH(Profiler{options_in(dir)}, "another Profiler exists in this process");
}

class ProfilerOfAShardedModel : public ::testing::TestWithParam<int> {};

// Each rank profiles its own training loop of an MLP sharded per block and at
// the root; its trace names every group's phases, the root's as "(root)",
// as often as one step runs them.
TEST_P(ProfilerOfAShardedModel, EachRankWritesItsPhasesWithTheRootNamed) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const TempDir dir;
    auto model = std::static_pointer_cast<MLP>(make_model(ModelKind::kMlp));
    const FullyShardOptions fs = mesh_options(ctx);
    for (auto& b : model->blocks()) fully_shard(b, fs);
    fully_shard(model, fs);
    auto optim = make_optimizer(Optim::kSgd, model->parameters());

    ProfilerOptions o;
    o.trace_dir = dir.path() + "/traces";
    o.rank = ctx.rank();
    o.schedule.wait = 1;
    o.schedule.warmup = 1;
    o.schedule.active = 1;
    Profiler profiler(o);
    for (int step = 0; step < 4; ++step) {
      const Batch local = make_batch(ModelKind::kMlp, step, 12).slice(ctx.rank(), ctx.world_size());
      call_module(*model, local.x, local.y).backward();
      optim->step();
      optim->zero_grad();
      profiler.step();
    }
    const std::string path = o.trace_dir + "/trace_rank" + std::to_string(ctx.rank()) + ".json";
    ASSERT_EQ(profiler.traces_written(), std::vector<std::string>{path});
    EXPECT_EQ(profiled_steps(path), std::vector<int>{2});
    std::map<std::string, int> events = event_counts(path);
    std::map<std::string, int> expected = {
        {"FSDP::all_gather (root)", 1},  {"FSDP::pre_forward (root)", 1},   {"FSDP::pre_forward (b0)", 1},
        {"FSDP::post_backward (b1)", 1}, {"FSDP::post_backward (root)", 1}, {"FSDP::root_pre_forward", 1},
    };
    if (ctx.world_size() > 1) {
      // The blocks reshard after forward and are gathered again in backward;
      // the root keeps its parameters until backward. (One rank gathers and
      // reduces nothing.)
      expected.insert({{"FSDP::all_gather (b0)", 2},
                       {"FSDP::all_gather (b1)", 2},
                       {"FSDP::reduce_scatter (b0)", 1},
                       {"FSDP::reduce_scatter (b1)", 1},
                       {"FSDP::reduce_scatter (root)", 1}});
    }
    for (const auto& [name, count] : expected) EXPECT_EQ(events[name], count) << name << " in " << path;
    EXPECT_EQ(events.count("FSDP::all_gather"), 0u) << "an unnamed all-gather in " << path;
  });
}

// A module with two FSDPParamGroups (its "experts" on a mesh of their own,
// the ranks reversed): each group's phases carry its index and shard mesh,
// so the trace tells them apart; single-group modules keep plain labels.
struct TwoMeshBlockImpl : torch::nn::Module {
  TwoMeshBlockImpl()
      : dense(register_module("dense", torch::nn::Linear(7, 5))),
        experts(register_module("experts", torch::nn::Linear(5, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return experts(at::tanh(dense(x))); }
  torch::nn::Linear dense, experts;
};
FSDP2CPP_MODULE(TwoMeshBlock);

struct TwoMeshModel : torch::nn::Module {
  TwoMeshModel()
      : block(register_module("block", TwoMeshBlock())), head(register_module("head", torch::nn::Linear(3, 3))) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) { return at::mse_loss(head(block(x)), y); }
  TwoMeshBlock block;
  torch::nn::Linear head;
};

TEST(ProfilerGroupLabels, GroupsOfOneModuleAreNamedByIndexAndMesh) {
  testing::run_distributed(2, [](testing::RankContext& ctx) {
    const TempDir dir;
    torch::manual_seed(0);
    auto model = std::make_shared<TwoMeshModel>();
    const DeviceMesh expert(ctx.world(), ctx.mesh().device_type(), at::arange(1, -1, -1, at::kLong), {"ep"});
    FullyShardOptions fs = mesh_options(ctx);
    const c10::TensorImpl* expert_weight = model->block->experts->weight.unsafeGetTensorImpl();
    const c10::TensorImpl* expert_bias = model->block->experts->bias.unsafeGetTensorImpl();
    fs.shard_placement_fn = [=](const at::Tensor& p) -> ShardPlacementResult {
      if (p.unsafeGetTensorImpl() == expert_weight || p.unsafeGetTensorImpl() == expert_bias) {
        return {Placement::shard(0), expert};
      }
      return std::nullopt;
    };
    fully_shard(model->block, fs);
    fully_shard(model, mesh_options(ctx));

    ProfilerOptions o;
    o.trace_dir = dir.path();
    o.rank = ctx.rank();
    o.schedule.wait = 0;
    o.schedule.warmup = 0;
    o.schedule.active = 1;
    o.record_cuda = false;
    {
      Profiler profiler(o);
      const Batch local = make_batch(ModelKind::kMlp, 0, 12).slice(ctx.rank(), ctx.world_size());
      call_module(*model, local.x, local.y).backward();
      profiler.step();
    }
    const std::string dense_mesh = ctx.mesh().group(0)->name();
    const std::string expert_mesh = expert.group(0)->name();
    ASSERT_NE(dense_mesh, expert_mesh);
    std::map<std::string, int> events = event_counts(dir.path() + "/trace_rank" + std::to_string(ctx.rank()) + ".json");
    const std::string group0 = "block, group 0, mesh " + dense_mesh;
    const std::string group1 = "block, group 1, mesh " + expert_mesh;
    for (const std::string phase : {"all_gather", "reduce_scatter", "pre_forward", "post_backward"}) {
      EXPECT_GE(events["FSDP::" + phase + " (" + group0 + ")"], 1) << phase;
      EXPECT_GE(events["FSDP::" + phase + " (" + group1 + ")"], 1) << phase;
      EXPECT_EQ(events.count("FSDP::" + phase + " (block)"), 0u) << phase << ": a label that names no group";
      EXPECT_GE(events["FSDP::" + phase + " (root)"], 1) << phase << ": the root has one group, a plain label";
    }
  });
}

// Kineto asks CUDA for the device count whenever it writes a trace; on a
// host without a GPU driver (the CUDA wheel on a CPU machine, as here) that
// printed "gpuGetDeviceCount failed with code 35" on every rank. A trace of
// CPU activity only (record_cuda false, or unset without a device) prints
// nothing from Kineto. Each case runs in fresh rank processes: Kineto asks
// once per process. (On a host with a GPU there is nothing to print.)
TEST(ProfilerOnACpuHost, WritesATraceWithoutKinetosDeviceErrors) {
  for (const std::optional<bool> record_cuda : {std::optional<bool>(false), std::optional<bool>()}) {
    testing::run_distributed(1, [&](testing::RankContext&) {
      const TempDir dir;
      const std::string log = dir.path() + "/stderr.txt";
      std::fflush(stderr);
      const int saved = ::dup(STDERR_FILENO);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ASSERT_GE(fd, 0);
      ::dup2(fd, STDERR_FILENO);
      ::close(fd);
      {
        ProfilerOptions o = options_in(dir, 0, 0, 1);
        o.trace_dir = dir.path() + "/traces";
        o.record_cuda = record_cuda;
        Profiler profiler(o);
        some_work();
        profiler.step();
        EXPECT_EQ(profiler.traces_written().size(), 1u);
      }
      std::cerr.flush();
      std::fflush(stderr);
      ::dup2(saved, STDERR_FILENO);
      ::close(saved);
      std::ifstream in(log);
      const std::string printed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_EQ(printed.find("gpuGetDeviceCount"), std::string::npos) << printed;
      EXPECT_EQ(printed.find("ERROR:"), std::string::npos) << printed;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ProfilerOfAShardedModel, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace fsdp::test
