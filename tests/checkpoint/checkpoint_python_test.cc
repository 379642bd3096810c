// Python interop, both ways, with the venv's torch and safetensors
// (interop.py): PyTorch's HuggingFaceStorageReader loads our sharded
// checkpoint; a checkpoint PyTorch's HuggingFaceStorageWriter wrote at world
// size 3 loads into ours at 2; safetensors.torch.load_file reads our HF
// export; Python's zlib.crc32 agrees with our manifest; PyTorch reads the
// model and optimizer parts, the values and the generator of a
// save_training_state checkpoint. Both sides compare with the same formula,
// computed independently.
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/hf.h"
#include "checkpoint/sharded.h"
#include "checkpoint/training_state.h"
#include "checkpoint_test_util.h"

namespace {

namespace ckpt = fsdp::checkpoint;
using fsdp::Placement;
using fsdp::testing::RankContext;

const std::vector<Placement> kShard0 = {Placement::shard(0)};

struct PythonResult {
  int exit_code = -1;
  std::string output;
};

// Runs `script` with the venv's Python and `args` (each quoted), stdout and
// stderr together.
PythonResult run_python(const std::string& script, const std::vector<std::string>& args) {
  std::string cmd = std::string("'") + FSDP2CPP_TEST_PYTHON + "' '" + script + "'";
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  PythonResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

PythonResult run_interop(const std::string& command, const std::string& dir) {
  return run_python(FSDP2CPP_CHECKPOINT_INTEROP_PY, {command, dir});
}

const std::string kSourceDir = FSDP2CPP_SOURCE_DIR;
const std::string kHelper = kSourceDir + "/checkpoint/python/fsdp2cpp_checkpoint.py";

#define SKIP_WITHOUT_PYTHON()                                                                         \
  do {                                                                                                \
    if (std::string(FSDP2CPP_TEST_PYTHON).empty()) GTEST_SKIP() << "no Python with torch configured"; \
  } while (false)

// Saves the formula's state sharded at 3 ranks as step 7 of `root`
// (root/step-7/model).
void save_step_7_at_three_ranks(const ckpt_test::SharedDir& root) {
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0);
    ckpt::CheckpointWriter writer(root.path(), 7, ctx.world_group());
    writer.record(ckpt::save_sharded(sd, writer.subdir("model"), ctx.rank()));
    writer.commit();
  });
}

TEST(CheckpointPython, PyTorchsHuggingFaceStorageReaderLoadsOurShardedCheckpoint) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir root;
  save_step_7_at_three_ranks(root);
  if (fsdp::testing::is_rank_process()) return;
  auto r = run_interop("read_sharded", root / "step-7/model");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read_sharded: 7 tensors equal the formula"), std::string::npos) << r.output;
  // docs/checkpoints.md's load under torch.distributed, in the venv (no numpy).
  r = run_interop("read_sharded_distributed", root / "step-7/model");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read_sharded_distributed: 7 tensors equal the formula on 2 ranks"), std::string::npos)
      << r.output;
  r = run_interop("verify_manifest", root / "step-7");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("verify_manifest: 3 files match"), std::string::npos) << r.output;
}

TEST(CheckpointPython, ACheckpointPyTorchWroteAtThreeLoadsAtTwo) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir dir;
  if (!fsdp::testing::is_rank_process()) {
    auto r = run_interop("write_sharded", dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_TRUE(ckpt_test::path_exists(dir / ckpt::sharded_file_name(2))) << r.output;
  }
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    fsdp::StateDict target = ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true);
    auto result = ckpt::load_sharded(target, dir.path());
    EXPECT_EQ(result.files, 3);
    ckpt_test::expect_state_equals_formula(target);
  });
}

TEST(CheckpointPython, SafetensorsLoadFileReadsOurHfExport) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir dir;
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0);
    ckpt::ExportOptions options;
    options.max_shard_bytes = 128;
    ckpt::export_hf(sd, dir.path(), ctx.world_group(), options);
  });
  if (fsdp::testing::is_rank_process()) return;
  auto r = run_interop("read_hf", dir.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read_hf: 7 tensors equal the formula, total_size 314"), std::string::npos) << r.output;
}

// A Stateful over fixed tensors and JSON members (what ModelState and
// OptimizerState hand over, without a model).
class FixedState : public ckpt::Stateful {
 public:
  FixedState(fsdp::StateDict tensors, std::map<std::string, std::string> json)
      : tensors_(std::move(tensors)), json_(std::move(json)) {}
  ckpt::StatefulState state_dict() override { return {tensors_, json_}; }
  void load_state_dict(const ckpt::StatefulState&) override {}

 private:
  fsdp::StateDict tensors_;
  std::map<std::string, std::string> json_;
};

// save_training_state at 3 ranks: "model" holds the formula state, "optim"
// PyTorch's flattened optimizer keys (state.<fqn>.exp_avg with seed + 100,
// state.<fqn>.step = 5) and param_groups; then PyTorch's dcp.load reads
// model/ and optim/, the manifest's values are PyTorch's JSON, and
// torch.set_rng_state takes the saved generator state (the next numbers
// equal those of the same seed drawn in Python).
TEST(CheckpointPython, PyTorchReadsTheModelOptimizerAndGeneratorOfATrainingState) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    fsdp::StateDict optim;
    for (const auto& [key, value] : ckpt_test::make_state(ctx.mesh(), kShard0, 100)) {
      optim.insert("state." + key + ".exp_avg", value);
      optim.insert("state." + key + ".step", at::full({}, 5.0, at::kFloat));
    }
    FixedState model_state(ckpt_test::make_state(ctx.mesh(), kShard0), {});
    FixedState optim_state(optim, {{"param_groups", R"([{"lr": 0.01, "params": ["embed.weight"]}])"}});
    int64_t step = 5;
    at::manual_seed(31);
    at::randn({2});
    ckpt::TrainingState state;
    state.add("model", model_state).add("optim", optim_state).add_int64("step", step);
    state.add_rng("cpu_rng", at::detail::getDefaultCPUGenerator());
    ckpt::save_training_state(root.path(), 5, state, ctx.world_group());
  });
  if (fsdp::testing::is_rank_process()) return;
  const auto r = run_interop("read_training_state", root / "step-5");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read_training_state: model 7 and optim 14 tensors, step 5, param_groups and the "
                          "generator as saved"),
            std::string::npos)
      << r.output;
}

// checkpoint/python/fsdp2cpp_checkpoint.py lists a checkpoint saved at 3
// ranks (every key, dtype, global shape, and each piece's file and rows),
// and its state_dict_skeleton is what dcp.load needs (interop.py compares
// the loaded values with the formula).
TEST(CheckpointPython, HelperListsTheTensorsAndBuildsTheSkeletonDcpLoadNeeds) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir root;
  save_step_7_at_three_ranks(root);
  if (fsdp::testing::is_rank_process()) return;
  auto r = run_python(kHelper, {"list", root / "step-7"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Rank 2 holds no row of layers.0.idx (2 rows), so writes no piece of it.
  EXPECT_EQ(r.output, R"(model/
  embed.weight  F32  [10, 3]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 4)
    shard-00002-model-00001-of-00001.safetensors  rows [4, 8)
    shard-00003-model-00001-of-00001.safetensors  rows [8, 10)
  layers.0.bias  BF16  [7]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 3)
    shard-00002-model-00001-of-00001.safetensors  rows [3, 6)
    shard-00003-model-00001-of-00001.safetensors  rows [6, 7)
  layers.0.idx  I64  [2, 5]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 1)
    shard-00002-model-00001-of-00001.safetensors  rows [1, 2)
  layers.1.weight  F16  [9, 2, 2]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 3)
    shard-00002-model-00001-of-00001.safetensors  rows [3, 6)
    shard-00003-model-00001-of-00001.safetensors  rows [6, 9)
  norm.weight  F32  [5]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 5)
  scale  F64  []
    shard-00001-model-00001-of-00001.safetensors  whole
  empty  F32  [0, 4]
    shard-00001-model-00001-of-00001.safetensors  rows [0, 0)
)");
  r = run_interop("read_with_skeleton", root / "step-7/model");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("read_with_skeleton: 7 tensors of the listed shapes and dtypes equal the formula"),
            std::string::npos)
      << r.output;
  r = run_python(kHelper, {"list", root.path()});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds no *.safetensors file, nor subdirectories with some"), std::string::npos) << r.output;
}

// How many ```python blocks README.md and docs/*.md hold, counted here
// apart from doc_snippets.py's own extraction.
int python_blocks_in_docs() {
  int n = 0;
  std::vector<std::string> files = {kSourceDir + "/README.md"};
  for (const char* doc :
       {"benchmarks", "build", "checkpoints", "debugging", "fsdp2", "gpu", "porting", "testing", "trainer"}) {
    files.push_back(kSourceDir + "/docs/" + doc + ".md");
  }
  for (const auto& f : files) {
    std::istringstream in(ckpt_test::read_bytes(f));
    for (std::string line; std::getline(in, line);) n += line == "```python" ? 1 : 0;
  }
  return n;
}

// Every ```python block of the docs runs (doc_snippets.py) in a directory
// that holds what they open: ROOT/step-100, a training state whose "model"
// is the state of doc_snippets.py's small_model() (Linear(3, 4), ReLU,
// Linear(4, 2)) saved at 2 ranks, with "step" and "cpu_rng"; and hf/, an
// HF export of the same tensors in several files.
TEST(CheckpointPython, EveryPythonBlockOfTheDocsRuns) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir work;
  if (!fsdp::testing::is_rank_process()) {
    ASSERT_EQ(::mkdir((work / "hf").c_str(), 0755), 0);
  }
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    const std::vector<std::pair<std::string, std::vector<int64_t>>> params = {
        {"0.weight", {4, 3}}, {"0.bias", {4}}, {"2.weight", {2, 4}}, {"2.bias", {2}}};
    fsdp::StateDict sd;
    int64_t seed = 0;
    for (const auto& [key, shape] : params) {
      const at::Tensor full = ckpt_test::formula(shape, at::kFloat, ++seed);
      auto dt = fsdp::distribute_tensor(full, ctx.mesh(), kShard0);
      sd.insert(key, fsdp::DTensor::from_local(dt.to_local().clone(), ctx.mesh(), kShard0, shape));
    }
    FixedState model_state(sd, {});
    int64_t step = 100;
    ckpt::TrainingState state;
    state.add("model", model_state).add_int64("step", step);
    state.add_rng("cpu_rng", at::detail::getDefaultCPUGenerator());
    ckpt::save_training_state(work / "ROOT", 100, state, ctx.world_group());
    ckpt::ExportOptions options;
    options.max_shard_bytes = 40;
    ckpt::export_hf(sd, work / "hf", ctx.world_group(), options);
  });
  if (fsdp::testing::is_rank_process()) return;
  const int blocks = python_blocks_in_docs();
  ASSERT_GT(blocks, 0);
  const auto r = run_python(kSourceDir + "/tests/checkpoint/doc_snippets.py", {kSourceDir, work.path()});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("doc_snippets: " + std::to_string(blocks) + " python blocks ran"), std::string::npos)
      << r.output;
}

}  // namespace
