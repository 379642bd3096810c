// fsdp_train end to end: the same seed and global batch give the same
// per-step losses at world sizes 1, 2 and 3 (the global batch is split
// across ranks, never changed by the split), and the loss falls; so does a
// model with grouped-query attention and a larger vocabulary.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "run_binary.h"

namespace fsdp_train_test {
namespace {

constexpr int kSteps = 20;

// `extra`: more flags (the model's shape); `name` keeps their files apart.
TrainRecord train(ScratchDir& dir, int world_size, bool use_launcher, const std::vector<std::string>& extra = {},
                  const std::string& name = "world", std::string* output = nullptr) {
  const std::string json = dir / (name + std::to_string(world_size) + ".json");
  std::vector<std::string> args = small_run_flags(json);
  args.insert(args.end(), extra.begin(), extra.end());
  if (use_launcher) {
    args.push_back("--nproc");
    args.push_back(std::to_string(world_size));
  }
  const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
  EXPECT_EQ(run.exit_code, 0) << "world size " << world_size << ":\n" << run.output;
  const TrainRecord record = read_train_json(json);
  EXPECT_TRUE(record.ok) << "no --json record for world size " << world_size << ":\n" << run.output;
  EXPECT_EQ(record.world_size, world_size);
  if (output != nullptr) *output = run.output;
  return record;
}

// Every step's loss of `other` within 1e-4 (relative) of `one`'s, the
// steps numbered 1, 2, ..., and the final loss the last step's.
void expect_same_losses(const TrainRecord& one, const TrainRecord& other) {
  ASSERT_EQ(other.losses.size(), one.losses.size()) << "world size " << other.world_size;
  for (size_t i = 0; i < one.losses.size(); ++i) {
    EXPECT_EQ(other.steps[i], static_cast<int>(i) + 1);
    EXPECT_NEAR(other.losses[i], one.losses[i], 1e-4 * std::abs(one.losses[i]))
        << "step " << i + 1 << ", world size " << other.world_size << " vs 1";
  }
  EXPECT_DOUBLE_EQ(other.final_loss, other.losses.back());
}

TEST(FsdpTrainParity, LossesAgreeAcrossWorldSizesAndFall) {
  ScratchDir dir;
  // World size 1 runs without the launcher (the single-rank path); 2 and 3
  // through --nproc (the env:// path torchrun also takes).
  const TrainRecord one = train(dir, 1, /*use_launcher=*/false);
  const TrainRecord two = train(dir, 2, /*use_launcher=*/true);
  const TrainRecord three = train(dir, 3, /*use_launcher=*/true);
  ASSERT_TRUE(one.ok && two.ok && three.ok);
  ASSERT_EQ(one.losses.size(), static_cast<size_t>(kSteps));
  for (const TrainRecord* other : {&two, &three}) expect_same_losses(one, *other);
  EXPECT_LT(one.losses.back(), one.losses.front()) << "the loss did not fall in " << kSteps << " steps";
  EXPECT_NEAR(one.losses.front(), std::log(256.0), 0.5) << "a fresh byte-level model starts near ln(256)";
}

// Grouped-query attention (4 query heads sharing 2 key/value heads, the
// Llama 3 layout) and a vocabulary larger than the bytes (rows no token
// uses): the same losses at world sizes 1 and 2 as the default model has,
// and the model is the one asked for.
TEST(FsdpTrainParity, GroupedQueryAttentionAndLargerVocabAgreeAcrossWorldSizes) {
  ScratchDir dir;
  const std::vector<std::string> gqa = {"--kv-heads", "2", "--vocab", "320"};  // small_run_flags: --heads 4
  std::string output;
  const TrainRecord one = train(dir, 1, /*use_launcher=*/false, gqa, "gqa", &output);
  const TrainRecord two = train(dir, 2, /*use_launcher=*/true, gqa, "gqa");
  ASSERT_TRUE(one.ok && two.ok);
  ASSERT_EQ(one.losses.size(), static_cast<size_t>(kSteps));
  // dim 32, head size 8: qkv 32 x (32 + 2 * 2 * 8), proj 32 x 32, SwiGLU 3 x 32 x 96, two norms, per block;
  // embeddings and output 2 x 320 x 32, final norm 32.
  EXPECT_NE(output.find("4 heads (2 KV), SwiGLU hidden 96, vocab 320: 45,216 parameters"), std::string::npos) << output;
  expect_same_losses(one, two);
  EXPECT_LT(one.losses.back(), one.losses.front()) << "the loss did not fall in " << kSteps << " steps";
  EXPECT_NEAR(one.losses.front(), std::log(320.0), 0.5) << "a fresh model starts near ln(vocab)";
}

// --prefetch 2 (each block all-gathers the next two in forward, the previous
// two in backward) moves when the all-gathers are issued, not what they
// carry: at 3 ranks (uneven shards) every loss equals the run without it,
// bit for bit, and the run says it prefetches.
TEST(FsdpTrainParity, PrefetchChangesNoLoss) {
  ScratchDir dir;
  std::string output;
  const TrainRecord plain = train(dir, 3, /*use_launcher=*/true, {}, "plain");
  const TrainRecord prefetched = train(dir, 3, /*use_launcher=*/true, {"--prefetch", "2"}, "prefetch", &output);
  ASSERT_TRUE(plain.ok && prefetched.ok);
  ASSERT_EQ(prefetched.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) EXPECT_EQ(prefetched.losses[i], plain.losses[i]) << "step " << i + 1;
  EXPECT_NE(output.find(", prefetch 2 blocks"), std::string::npos) << output;
}

// HSDP (2 replicas x 2 shards) trains exactly as one rank does. Global batch
// 8 (divisible by 4 and 1).
TEST(FsdpTrainParity, HsdpMeshMatchesOneRank) {
  ScratchDir dir;
  auto run = [&](int world_size, const std::string& mesh) {
    const std::string json = dir / ("hsdp" + std::to_string(world_size) + ".json");
    std::vector<std::string> args = small_run_flags(json);
    args[3] = "8";   // --global-batch
    args[1] = "10";  // --steps
    if (world_size > 1) args.insert(args.end(), {"--nproc", std::to_string(world_size), "--mesh", mesh});
    const RunResult result = run_program(FSDP_TRAIN_BINARY, args);
    EXPECT_EQ(result.exit_code, 0) << result.output;
    return read_train_json(json);
  };
  const TrainRecord one = run(1, "");
  const TrainRecord hsdp = run(4, "2x2");
  ASSERT_TRUE(one.ok && hsdp.ok);
  EXPECT_EQ(hsdp.world_size, 4);
  ASSERT_EQ(hsdp.losses.size(), one.losses.size());
  for (size_t i = 0; i < one.losses.size(); ++i) {
    EXPECT_NEAR(hsdp.losses[i], one.losses[i], 1e-4 * std::abs(one.losses[i])) << "step " << i + 1;
  }
}

// --compare-all-gather: the plain and the int8 all-gather trained in one run
// (2 ranks), and the table that compares them: the int8 run all-gathers
// fewer bytes (the blocks' at about 1/4, the root's unquantized) and its
// loss curve stays close.
TEST(FsdpTrainParity, Int8AllGatherComparison) {
  std::vector<std::string> args = small_run_flags("", 10);
  args.resize(args.size() - 2);  // no --json
  args.insert(args.end(), {"--nproc", "2", "--all-gather-dtype", "int8", "--compare-all-gather"});
  const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("int8 all-gather (blocks)"), std::string::npos) << run.output;
  const size_t table = run.output.find("all-gather comparison (2 ranks");
  ASSERT_NE(table, std::string::npos) << run.output;
  const size_t ratio_at = run.output.find("ratio int8/param", table);
  ASSERT_NE(ratio_at, std::string::npos) << run.output;
  const double bytes_ratio = std::stod(run.output.substr(ratio_at + std::string("ratio int8/param").size()));
  EXPECT_GT(bytes_ratio, 0.25) << run.output;
  EXPECT_LT(bytes_ratio, 0.5) << run.output;
  const size_t diff_at = run.output.find("max |loss difference|", table);
  ASSERT_NE(diff_at, std::string::npos) << run.output;
  const double max_diff = std::stod(run.output.substr(diff_at + std::string("max |loss difference|").size()));
  EXPECT_GT(max_diff, 0.0) << run.output;   // it is quantized
  EXPECT_LT(max_diff, 0.05) << run.output;  // and close: about 1% of a loss near 3-5
}

// --ac full (every block, and every second one), --ac selective and --ac
// torchtitan recompute the blocks in backward with the same kernels in the
// same order (selective reusing the matmuls' kept outputs, torchtitan every
// other one of them): on CPU the losses equal
// those of --ac none bit for bit, and the per-step JSON keeps its peak
// memory. Two ranks, so that the recomputation runs between the
// pre-backward all-gather and the reduce-scatter.
TEST(ActivationCheckpointTrainer, LossesEqualWithoutCheckpointing) {
  ScratchDir dir;
  auto run = [&](const std::string& name, const std::vector<std::string>& ac) {
    const std::string json = dir / (name + ".json");
    std::vector<std::string> args = small_run_flags(json, 8);
    args.insert(args.end(), {"--nproc", "2", "--layers", "3"});
    args.insert(args.end(), ac.begin(), ac.end());
    const RunResult result = run_program(FSDP_TRAIN_BINARY, args);
    EXPECT_EQ(result.exit_code, 0) << name << ":\n" << result.output;
    if (!ac.empty()) {
      EXPECT_NE(result.output.find("activation checkpointing of"), std::string::npos) << result.output;
    }
    std::ifstream in(json);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t peaks = 0;
    for (size_t at = text.find("\"peak_mem_bytes\""); at != std::string::npos;
         at = text.find("\"peak_mem_bytes\"", at + 1)) {
      ++peaks;
    }
    EXPECT_EQ(peaks, 8u) << name << ": one peak_mem_bytes per step";
    return read_train_json(json);
  };
  const TrainRecord none = run("none", {});
  const TrainRecord full = run("full", {"--ac", "full"});
  const TrainRecord every2 = run("every2", {"--ac", "full", "--ac-every", "2"});
  const TrainRecord selective = run("selective", {"--ac", "selective"});
  const TrainRecord torchtitan = run("torchtitan", {"--ac", "torchtitan"});
  ASSERT_TRUE(none.ok && full.ok && every2.ok && selective.ok && torchtitan.ok);
  for (const TrainRecord* other : {&full, &every2, &selective, &torchtitan}) {
    ASSERT_EQ(other->losses.size(), none.losses.size());
    for (size_t i = 0; i < none.losses.size(); ++i) EXPECT_EQ(other->losses[i], none.losses[i]) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace fsdp_train_test
