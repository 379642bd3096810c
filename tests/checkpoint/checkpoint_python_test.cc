// Python interop, both ways, with the venv's torch and safetensors
// (interop.py): PyTorch's HuggingFaceStorageReader loads our sharded
// checkpoint; a checkpoint PyTorch's HuggingFaceStorageWriter wrote at world
// size 3 loads into ours at 2; safetensors.torch.load_file reads our HF
// export; Python's zlib.crc32 agrees with our manifest. Both sides compare
// with the same formula, computed independently.
#include <stdio.h>
#include <sys/wait.h>

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/hf.h"
#include "checkpoint/sharded.h"
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

PythonResult run_interop(const std::string& command, const std::string& dir) {
  const std::string cmd = std::string("'") + FSDP2CPP_TEST_PYTHON + "' '" + FSDP2CPP_CHECKPOINT_INTEROP_PY + "' " +
                          command + " '" + dir + "' 2>&1";
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

#define SKIP_WITHOUT_PYTHON()                                                                         \
  do {                                                                                                \
    if (std::string(FSDP2CPP_TEST_PYTHON).empty()) GTEST_SKIP() << "no Python with torch configured"; \
  } while (false)

TEST(CheckpointPython, PyTorchsHuggingFaceStorageReaderLoadsOurShardedCheckpoint) {
  SKIP_WITHOUT_PYTHON();
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0);
    ckpt::CheckpointWriter writer(root.path(), 7, ctx.world_group());
    writer.record(ckpt::save_sharded(sd, writer.subdir("model"), ctx.rank()));
    writer.commit();
  });
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

}  // namespace
