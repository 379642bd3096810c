// Multi-process tests of the checkpoint layer on synthetic DTensor state
// dicts: resharding loads (save at 4, load at 1, 2, 3; save on a 2x2
// replicate x shard mesh, load at 3), Hugging Face export at 3 and import at
// 2, tied values, the manifest's checks, and a rank killed in the middle of
// a save. Every value is compared with the formula, never only with what
// our own writer wrote.
#include <signal.h>

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/hf.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded.h"
#include "checkpoint_test_util.h"

namespace {

namespace ckpt = fsdp::checkpoint;
using fsdp::Placement;
using fsdp::testing::RankContext;

const std::vector<Placement> kShard0 = {Placement::shard(0)};

// Saves the formula state (seed offset `seed`) at `world` ranks as ROOT/step-`step`.
void save_checkpoint(const std::string& root, int world, int64_t step, int64_t seed = 0) {
  fsdp::testing::run_distributed(world, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0, seed);
    ckpt::CheckpointWriterOptions options;
    options.mesh = std::to_string(world);
    ckpt::CheckpointWriter writer(root, step, ctx.world_group(), options);
    writer.record(ckpt::save_sharded(sd, writer.subdir("model"), ctx.rank()));
    const std::string dir = writer.commit(R"({"note": "seed )" + std::to_string(seed) + R"("})");
    EXPECT_EQ(dir, root + "/step-" + std::to_string(step));
  });
}

void load_and_check(const std::string& model_dir, int world, int64_t seed = 0) {
  fsdp::testing::run_distributed(world, [&](RankContext& ctx) {
    fsdp::StateDict target = ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true);
    std::vector<const void*> storage;
    for (const auto& [k, v] : target) storage.push_back(v.local().data_ptr());
    auto r = ckpt::load_sharded(target, model_dir);
    EXPECT_TRUE(r.missing_keys.empty());
    ckpt_test::expect_state_equals_formula(target, seed);
    size_t i = 0;
    for (const auto& [k, v] : target) EXPECT_EQ(v.local().data_ptr(), storage[i++]) << k << " was replaced";
  });
}

TEST(CheckpointResharding, SavedAtFourLoadsAtOneTwoAndThree) {
  ckpt_test::SharedDir root;
  save_checkpoint(root.path(), 4, 10);
  const std::string model = root / "step-10/model";
  if (!fsdp::testing::is_rank_process()) {
    // Rank 3 owns no row of the 2-row and the 0-row tensors, but rows of others.
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(ckpt_test::path_exists(model + "/" + ckpt::sharded_file_name(r))) << r;
    auto f = ckpt::SafetensorsFile::open(model + "/" + ckpt::sharded_file_name(1));
    EXPECT_NE(f.metadata().at("DCP_SHARDING_INFO").find(R"("embed.weight":{"saved_offsets":[3,0]})"), std::string::npos)
        << f.metadata().at("DCP_SHARDING_INFO");
    EXPECT_EQ(f.find("norm.weight"), nullptr) << "plain tensors are written by rank 0 only";
    auto m = ckpt::verify_checkpoint(root / "step-10");
    EXPECT_EQ(m.step, 10);
    EXPECT_EQ(m.world_size, 4);
    EXPECT_EQ(m.extra_json, R"({"note":"seed 0"})");
    EXPECT_EQ(m.files.size(), 4u);
  }
  load_and_check(model, 1);
  load_and_check(model, 2);
  load_and_check(model, 3);
  if (!fsdp::testing::is_rank_process()) {
    // And into plain full tensors in this (single) process.
    fsdp::StateDict full = ckpt_test::make_full_zeros();
    ckpt::load_sharded(full, model);
    ckpt_test::expect_state_equals_formula(full);
  }
}

TEST(CheckpointResharding, HsdpTwoByTwoWritesReplicaZeroAndLoadsAtThree) {
  ckpt_test::SharedDir root;
  const fsdp::testing::DistributedTestOptions options = fsdp::testing::hsdp_options(2, 2);
  fsdp::testing::run_distributed(options, [&](RankContext& ctx) {
    const std::vector<Placement> hsdp = {Placement::replicate(), Placement::shard(0)};
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), hsdp);
    ckpt::CheckpointWriterOptions writer_options;
    writer_options.mesh = "2x2 (replicate, shard)";
    ckpt::CheckpointWriter writer(root.path(), 1, ctx.world_group(), writer_options);
    writer.record(ckpt::save_sharded(sd, writer.subdir("model"), ctx.rank()));
    writer.commit();
  });
  const std::string model = root / "step-1/model";
  if (!fsdp::testing::is_rank_process()) {
    // Ranks 0 and 1 are replicate index 0; 2 and 3 hold copies and write nothing.
    EXPECT_TRUE(ckpt_test::path_exists(model + "/" + ckpt::sharded_file_name(0)));
    EXPECT_TRUE(ckpt_test::path_exists(model + "/" + ckpt::sharded_file_name(1)));
    EXPECT_FALSE(ckpt_test::path_exists(model + "/" + ckpt::sharded_file_name(2)));
    EXPECT_FALSE(ckpt_test::path_exists(model + "/" + ckpt::sharded_file_name(3)));
    EXPECT_EQ(ckpt::read_manifest(root / "step-1").mesh, "2x2 (replicate, shard)");
  }
  load_and_check(model, 3);
}

TEST(CheckpointResharding, ColumnShardedPiecesLoadIntoOtherColumnShards) {
  // Shard(1): the overlap of a saved piece and a target is a block of
  // columns, read row-wise and narrowed (the staging path of the loader).
  ckpt_test::SharedDir dir;
  const std::vector<Placement> shard1 = {Placement::shard(1)};
  const at::Tensor full = ckpt_test::formula({4, 11}, at::kFloat, 21);
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    fsdp::StateDict sd;
    sd.insert("w", fsdp::distribute_tensor(full, ctx.mesh(), shard1));
    ckpt::save_sharded(sd, dir.path(), ctx.rank());
  });
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    auto target = fsdp::distribute_tensor(at::zeros({4, 11}), ctx.mesh(), shard1);
    fsdp::StateDict sd;
    sd.insert("w", target);
    ckpt::load_sharded(sd, dir.path());
    const int64_t c0 = ctx.rank() * 6;
    EXPECT_TRUE(target.to_local().equal(full.narrow(1, c0, std::min<int64_t>(6, 11 - c0)))) << target.to_local();
  });
}

TEST(CheckpointTied, TiedValuesAreWrittenOnceAndLoadUnderBothKeys) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    auto dt = fsdp::distribute_tensor(ckpt_test::formula({8, 2}, at::kFloat, 11), ctx.mesh(), kShard0);
    fsdp::StateDict sd;
    sd.insert("embed.weight", dt);
    sd.insert("lm_head.weight", dt);  // the same local tensor: tied
    ckpt::save_sharded(sd, root.path(), ctx.rank());
  });
  if (fsdp::testing::is_rank_process()) return;
  auto f = ckpt::SafetensorsFile::open(root / ckpt::sharded_file_name(0));
  EXPECT_EQ(f.tensors().size(), 1u);
  EXPECT_EQ(f.metadata().at(ckpt::kTiedMetadataKey), R"({"lm_head.weight":"embed.weight"})");
  fsdp::StateDict target;
  target.insert("embed.weight", at::zeros({8, 2}));
  target.insert("lm_head.weight", at::zeros({8, 2}));  // untied in the target: both get the values
  ckpt::load_sharded(target, root.path());
  EXPECT_TRUE(target.at("embed.weight").local().equal(ckpt_test::formula({8, 2}, at::kFloat, 11)));
  EXPECT_TRUE(target.at("lm_head.weight").local().equal(ckpt_test::formula({8, 2}, at::kFloat, 11)));
}

TEST(CheckpointHf, ExportAtThreeImportsAtTwo) {
  ckpt_test::SharedDir dir;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0);
    ckpt::ExportOptions options;
    options.max_shard_bytes = 100;  // several files
    auto r = ckpt::export_hf(sd, dir.path(), ctx.world_group(), options);
    EXPECT_EQ(r.files.empty(), ctx.rank() != 0);
  });
  if (!fsdp::testing::is_rank_process()) {
    // files: embed 120 B | bias 14 + idx 80 B | layers.1 72 + norm 20 + scale 8 + empty 0 B
    EXPECT_TRUE(ckpt_test::path_exists(dir / "model-00001-of-00003.safetensors"));
    EXPECT_TRUE(ckpt_test::path_exists(dir / "model-00003-of-00003.safetensors"));
    const std::string index = ckpt_test::read_bytes(dir / "model.safetensors.index.json");
    EXPECT_NE(index.find(R"("total_size": 314)"), std::string::npos) << index;
    EXPECT_NE(index.find(R"("layers.0.idx": "model-00002-of-00003.safetensors")"), std::string::npos) << index;
    auto f = ckpt::SafetensorsFile::open(dir / "model-00001-of-00003.safetensors");
    EXPECT_TRUE(f.read("embed.weight").equal(ckpt_test::formula({10, 3}, at::kFloat, 1)));
  }
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    fsdp::StateDict target = ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true);
    ckpt::import_hf(target, dir.path());
    ckpt_test::expect_state_equals_formula(target);
  });
}

TEST(CheckpointDir, MissingPiecesAndCorruptFilesAreReportedByName) {
  ckpt_test::SharedDir root;
  save_checkpoint(root.path(), 3, 5);
  if (fsdp::testing::is_rank_process()) return;
  const std::string ckpt_dir = root / "step-5";
  const std::string shard1_name = ckpt::sharded_file_name(1);
  const std::string shard1 = ckpt_dir + "/model/" + shard1_name;
  const std::string original = ckpt_test::read_bytes(shard1);

  // One byte of the data flipped: the checksum names the file.
  std::string flipped = original;
  flipped[flipped.size() - 3] ^= 0x40;
  ckpt_test::write_bytes(shard1, flipped);
  CKPT_EXPECT_THROW_WITH(ckpt::verify_checkpoint(ckpt_dir), "checksum mismatch", shard1_name.c_str());
  // Truncated: the size check names it; the reader refuses it too.
  ckpt_test::write_bytes(shard1, original.substr(0, original.size() - 8));
  CKPT_EXPECT_THROW_WITH(ckpt::verify_checkpoint(ckpt_dir), shard1_name.c_str(), "bytes but the manifest");
  // Missing: rank 1's rows (the middle ones, so the global shape is still
  // known from rank 2's file) are not covered.
  ::unlink(shard1.c_str());
  fsdp::StateDict full = ckpt_test::make_full_zeros();
  const std::string lacks_shard1 = "lacks '" + shard1_name + "'";
  CKPT_EXPECT_THROW_WITH(ckpt::load_sharded(full, ckpt_dir + "/model"), "key 'embed.weight'", "hold only 18 of the 30",
                         lacks_shard1.c_str());
  EXPECT_TRUE(full.at("embed.weight").local().equal(at::zeros({10, 3}))) << "nothing is half-loaded";
  ckpt_test::write_bytes(shard1, original);
  EXPECT_NO_THROW(ckpt::verify_checkpoint(ckpt_dir));
  // The last file missing: nothing in the files records the global shapes,
  // so the saved ones come out too small. The checkpoint's manifest lists
  // the file, so the error names it as missing.
  const std::string shard2_name = ckpt::sharded_file_name(2);
  const std::string shard2 = ckpt_dir + "/model/" + shard2_name;
  const std::string original2 = ckpt_test::read_bytes(shard2);
  ::unlink(shard2.c_str());
  EXPECT_EQ(ckpt_test::error_of([&] { ckpt::load_sharded(full, ckpt_dir + "/model"); }),
            "checkpoint: key 'embed.weight' has the global shape [10, 3] in the target but [8, 3] in '" + ckpt_dir +
                "/model': '" + ckpt_dir + "/model' lacks '" + shard2_name + "', which " + ckpt_dir +
                "/manifest.json lists; copy the whole checkpoint directory");
  // The same files without a manifest (what --init-from DIR/model or a copy
  // of PyTorch's files meets): a missing last file and a model saved with
  // smaller sizes look alike, and the error says both.
  const std::string bare = root / "bare-model";
  ASSERT_EQ(::mkdir(bare.c_str(), 0755), 0);
  for (int r = 0; r < 2; ++r) {
    const std::string name = ckpt::sharded_file_name(r);
    ckpt_test::write_bytes(bare + "/" + name, ckpt_test::read_bytes(ckpt_dir + "/model/" + name));
  }
  EXPECT_EQ(ckpt_test::error_of([&] { ckpt::load_sharded(full, bare); }),
            "checkpoint: key 'embed.weight' has the global shape [10, 3] in the target but [8, 3] in '" + bare +
                "': '" + bare + "' holds " + ckpt::sharded_file_name(0) + " to " + ckpt::sharded_file_name(1) +
                " and no manifest lists its files, so either the model was saved with smaller sizes than the "
                "target's or " +
                shard2_name +
                " (the next writing rank's file, or more after it) is missing; build the model with the saved "
                "sizes, or copy the whole directory");
  ckpt_test::write_bytes(shard2, original2);
  // Every file there, the model wider than the one saved (a user's model of
  // another width): the shapes say it all, and no file is called missing.
  {
    fsdp::StateDict wider = ckpt_test::make_full_zeros();
    wider.insert_or_assign("embed.weight", at::zeros({12, 3}));
    EXPECT_EQ(ckpt_test::error_of([&] { ckpt::load_sharded(wider, ckpt_dir + "/model"); }),
              "checkpoint: key 'embed.weight' has the global shape [12, 3] in the target but [10, 3] in '" + ckpt_dir +
                  "/model'");
  }
  // The first file missing: the plain tensors (rank 0 writes them) are missing keys.
  const std::string shard0_name = ckpt::sharded_file_name(0);
  const std::string shard0 = ckpt_dir + "/model/" + shard0_name;
  const std::string original0 = ckpt_test::read_bytes(shard0);
  ::unlink(shard0.c_str());
  const std::string lacks_shard0 = "lacks '" + shard0_name + "'";
  CKPT_EXPECT_THROW_WITH(ckpt::load_sharded(full, ckpt_dir + "/model"), "missing keys", "norm.weight",
                         lacks_shard0.c_str());
  ckpt_test::write_bytes(shard0, original0);
  EXPECT_NO_THROW(ckpt::verify_checkpoint(ckpt_dir));

  // A manifest naming a file outside the checkpoint is refused.
  const std::string manifest_path = ckpt_dir + "/manifest.json";
  const std::string manifest = ckpt_test::read_bytes(manifest_path);
  for (const std::string bad : {"../evil", "/etc/passwd", "model/../../x", ""}) {
    std::string m = manifest;
    const std::string from = "model/" + ckpt::sharded_file_name(0);
    m.replace(m.find(from), from.size(), bad);
    ckpt_test::write_bytes(manifest_path, m);
    CKPT_EXPECT_THROW_WITH(ckpt::read_manifest(ckpt_dir), "manifest.json", "not a relative path of plain names");
  }
  // No manifest: not a complete checkpoint, and not listed.
  ::unlink(manifest_path.c_str());
  CKPT_EXPECT_THROW_WITH(ckpt::verify_checkpoint(ckpt_dir), "step-5", "no manifest.json");
  EXPECT_FALSE(ckpt::find_latest_checkpoint(root.path()).has_value());
}

TEST(CheckpointDir, ARankKilledDuringASaveLeavesThePreviousCheckpointLoadable) {
  ckpt_test::SharedDir root;
  save_checkpoint(root.path(), 2, 1, /*seed=*/0);
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 2;
  options.communicator.timeout = std::chrono::seconds(5);
  auto outcomes = fsdp::testing::run_distributed_collect(options, [&](RankContext& ctx) {
    fsdp::StateDict sd = ckpt_test::make_state(ctx.mesh(), kShard0, /*seed_offset=*/100);
    ckpt::CheckpointWriterOptions writer_options;
    writer_options.timeout = std::chrono::seconds(5);
    ckpt::CheckpointWriter writer(root.path(), 2, ctx.world_group(), writer_options);
    writer.record(ckpt::save_sharded(sd, writer.subdir("model"), ctx.rank()));
    if (ctx.rank() == 1) ::raise(SIGKILL);  // dies with its file written, before the commit
    writer.commit();
  });
  if (fsdp::testing::is_rank_process()) return;
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(outcomes[1].signal, SIGKILL) << outcomes[1].describe();
  EXPECT_FALSE(outcomes[0].ok()) << "rank 0 must fail (not hang, not commit) when rank 1 dies";
  EXPECT_NE(outcomes[0].output.find("did not arrive"), std::string::npos) << outcomes[0].output;

  EXPECT_TRUE(ckpt_test::path_exists(root / ".tmp-step-2"));
  EXPECT_FALSE(ckpt_test::path_exists(root / "step-2"));
  auto latest = ckpt::find_latest_checkpoint(root.path());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 1);
  ckpt::verify_checkpoint(latest->path);
  fsdp::StateDict full = ckpt_test::make_full_zeros();
  ckpt::load_sharded(full, latest->path + "/model");
  ckpt_test::expect_state_equals_formula(full, /*seed_offset=*/0);

  // Pruning removes the abandoned temporary directory, keeps the checkpoint.
  auto removed = ckpt::prune_checkpoints(root.path(), 1);
  EXPECT_EQ(removed, std::vector<std::string>{root / ".tmp-step-2"});
  EXPECT_TRUE(ckpt_test::path_exists(root / "step-1/manifest.json"));
}

TEST(CheckpointDir, PruneKeepsTheNewestAndASecondSaveOfAStepReplacesIt) {
  ckpt_test::SharedDir root;
  save_checkpoint(root.path(), 1, 1);
  save_checkpoint(root.path(), 1, 2);
  save_checkpoint(root.path(), 1, 3, /*seed=*/4);
  save_checkpoint(root.path(), 1, 3, /*seed=*/5);  // the same step again
  if (fsdp::testing::is_rank_process()) return;
  auto all = ckpt::list_checkpoints(root.path());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(ckpt::read_manifest(all.back().path).extra_json, R"({"note":"seed 5"})");
  fsdp::StateDict full = ckpt_test::make_full_zeros();
  ckpt::load_sharded(full, all.back().path + "/model");
  ckpt_test::expect_state_equals_formula(full, 5);
  auto removed = ckpt::prune_checkpoints(root.path(), 2);
  EXPECT_EQ(removed, std::vector<std::string>{root / "step-1"});
  EXPECT_EQ(ckpt::list_checkpoints(root.path()).size(), 2u);
  CKPT_EXPECT_THROW_WITH(ckpt::prune_checkpoints(root.path(), 0), "keep at least one");
}

}  // namespace
