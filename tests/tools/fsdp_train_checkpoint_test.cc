// fsdp_train's checkpoints end to end: a run stopped after 10 of 20 steps and
// resumed from its checkpoint trains exactly as the uninterrupted run (at
// the same world size bit for bit, at another one within 1e-5), a process
// killed in a save leaves the previous checkpoint usable, a rank killed under
// --max-restarts restarts the group from its newest checkpoint, the
// Hugging Face export carries the same weights as the sharded checkpoint,
// and PyTorch reads, continues and recomputes what the trainer saved.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "run_binary.h"

namespace fsdp_train_test {
namespace {

bool exists(const std::string& path) { return std::filesystem::exists(path); }

int64_t file_size(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  return ec ? -1 : static_cast<int64_t>(size);
}

constexpr int kSteps = 20;
constexpr int kStopAfter = 10;

void remove_tree(const std::string& path) {
  std::error_code ignored;
  std::filesystem::remove_all(path, ignored);
}

// small_run_flags (run_binary.h) at `nproc` ranks.
std::vector<std::string> run_flags(const std::string& json, int nproc) {
  std::vector<std::string> flags = small_run_flags(json, kSteps);
  if (nproc > 1) flags.insert(flags.end(), {"--nproc", std::to_string(nproc)});
  return flags;
}

TrainRecord train(const std::vector<std::string>& args, const char* what) {
  const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
  EXPECT_EQ(run.exit_code, 0) << what << ":\n" << run.output;
  TrainRecord record;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--json") record = read_train_json(args[i + 1]);
  }
  EXPECT_TRUE(record.ok) << what << ": no --json record:\n" << run.output;
  return record;
}

std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// The losses of steps 11..20 of `full` against the resumed run's.
void expect_tail_matches(const TrainRecord& full, const TrainRecord& resumed, double rtol) {
  ASSERT_EQ(full.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(kSteps - kStopAfter));
  for (size_t i = 0; i < resumed.losses.size(); ++i) {
    EXPECT_EQ(resumed.steps[i], kStopAfter + 1 + static_cast<int>(i));
    const double expected = full.losses[kStopAfter + i];
    if (rtol == 0) {
      EXPECT_EQ(resumed.losses[i], expected) << "step " << resumed.steps[i];
    } else {
      EXPECT_NEAR(resumed.losses[i], expected, rtol * std::abs(expected)) << "step " << resumed.steps[i];
    }
  }
}

TEST(FsdpTrainCheckpoint, ResumeAtTheSameWorldSizeIsBitExact) {
  ScratchDir dir("fsdp_ckpt_test");
  const TrainRecord full = train(run_flags(dir / "full.json", 2), "uninterrupted run");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "first.json", 2),
             {"--save-dir", saves, "--save-every", "5", "--stop-after", std::to_string(kStopAfter)}),
        "first half");
  EXPECT_TRUE(exists(saves + "/step-5/manifest.json"));
  EXPECT_TRUE(exists(saves + "/step-10/manifest.json"));
  EXPECT_TRUE(exists(saves + "/step-10/model/shard-00002-model-00001-of-00001.safetensors"));
  EXPECT_TRUE(exists(saves + "/step-10/optim/shard-00001-model-00001-of-00001.safetensors"));
  {
    std::ifstream manifest(saves + "/step-10/manifest.json");
    std::string text;  // without spaces and line breaks
    for (char ch; manifest.get(ch);) {
      if (ch != ' ' && ch != '\n') text += ch;
    }
    for (const char* field :
         {"\"param_groups\":[{", "\"samples_seen\":60", "\"cpu_rng_state\":\"", "\"world_size\":2"}) {
      EXPECT_NE(text.find(field), std::string::npos) << "manifest lacks " << field << ": " << text;
    }
  }
  const TrainRecord resumed =
      train(with(run_flags(dir / "resumed.json", 2), {"--save-dir", saves, "--resume"}), "resumed run");
  expect_tail_matches(full, resumed, 0.0);
}

// The processes whose parent is `parent` (from /proc/<pid>/stat).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t end_of_name = stat.rfind(')');  // the command may hold spaces and parentheses
    if (end_of_name == std::string::npos) continue;
    std::istringstream fields(stat.substr(end_of_name + 1));
    char state = 0;
    pid_t ppid = -1;
    if (fields >> state >> ppid && ppid == parent) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

// fsdp_train --nproc 2 --max-restarts 1 --resume: a rank killed (SIGKILL)
// once step 5's checkpoint is committed stops the group, which restarts and
// resumes from the newest complete checkpoint; every step it then trains
// equals the uninterrupted run's, bit for bit.
TEST(FsdpTrainCheckpoint, KilledRankRestartsTheGroupFromTheNewestCheckpoint) {
  constexpr int kLongRun = 200;  // the kill lands long before the end
  ScratchDir dir("fsdp_ckpt_test");
  std::vector<std::string> flags = small_run_flags(dir / "full.json", kLongRun);
  flags.insert(flags.end(), {"--nproc", "2"});
  const TrainRecord full = train(flags, "uninterrupted run");
  ASSERT_EQ(full.losses.size(), static_cast<size_t>(kLongRun));

  const std::string saves = dir / "saves";
  std::vector<std::string> restartable = {FSDP_TRAIN_BINARY};
  for (const std::string& flag : small_run_flags(dir / "restarted.json", kLongRun)) restartable.push_back(flag);
  restartable.insert(restartable.end(), {"--nproc", "2", "--max-restarts", "1", "--save-dir", saves, "--save-every",
                                         "5", "--resume", "--keep", "0"});
  // A thread of the test watches for step 5's checkpoint while run_child
  // reads the launcher's output; step-5 appears when its save is committed
  // (renamed from .tmp-step-5).
  std::thread killer;
  std::vector<pid_t> ranks;
  fsdp::ChildOptions options;
  options.on_start = [&](pid_t launcher) {
    killer = std::thread([&ranks, &saves, launcher] {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
      while (!exists(saves + "/step-5") && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      ranks = children_of(launcher);
      if (!ranks.empty()) ::kill(ranks.back(), SIGKILL);
    });
  };
  const RunResult run = fsdp::run_child(restartable, options);
  if (killer.joinable()) killer.join();
  EXPECT_EQ(ranks.size(), 2u) << "the launcher's rank processes";
  const std::string& output = run.output;
  ASSERT_EQ(run.exit_code, 0) << output;
  EXPECT_NE(output.find("; restarting the group (restart 1 of 1)"), std::string::npos) << output;

  // The restarted attempt's record: from the step after a committed
  // checkpoint to the end, each loss the uninterrupted run's.
  const TrainRecord restarted = read_train_json(dir / "restarted.json");
  ASSERT_TRUE(restarted.ok) << output;
  ASSERT_FALSE(restarted.steps.empty());
  const int first = restarted.steps.front();
  EXPECT_GE(first, 6) << output;
  EXPECT_EQ((first - 1) % 5, 0) << "resumed from step " << first - 1 << ", not a checkpoint";
  EXPECT_LT(first, kLongRun) << "the kill came after the run ended:\n" << output;
  ASSERT_EQ(restarted.losses.size(), static_cast<size_t>(kLongRun - first + 1));
  for (size_t i = 0; i < restarted.losses.size(); ++i) {
    EXPECT_EQ(restarted.steps[i], first + static_cast<int>(i));
    EXPECT_EQ(restarted.losses[i], full.losses[first - 1 + i]) << "step " << restarted.steps[i];
  }
}

// --async-save writes the same checkpoints in the background: a run that
// saved that way (the last save waited for at its end) resumes bit-exactly,
// at 3 ranks (uneven shards).
TEST(FsdpTrainCheckpoint, AsyncSaveResumesBitExactly) {
  ScratchDir dir("fsdp_ckpt_test");
  const TrainRecord full = train(run_flags(dir / "full.json", 3), "uninterrupted run");
  const std::string saves = dir / "saves";
  const RunResult first = run_program(FSDP_TRAIN_BINARY, with(run_flags(dir / "first.json", 3),
                                                              {"--save-dir", saves, "--save-every", "5", "--async-save",
                                                               "--stop-after", std::to_string(kStopAfter)}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("checkpoint  staged step-5: "), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("writing in the background"), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("saved " + saves + "/step-10"), std::string::npos) << first.output;
  EXPECT_TRUE(exists(saves + "/step-5/manifest.json"));
  EXPECT_TRUE(exists(saves + "/step-10/manifest.json"));
  const TrainRecord resumed =
      train(with(run_flags(dir / "resumed.json", 3), {"--save-dir", saves, "--resume"}), "resumed run");
  expect_tail_matches(full, resumed, 0.0);
}

TEST(FsdpTrainCheckpoint, ResumeAtAnotherWorldSizeAndMesh) {
  ScratchDir dir("fsdp_ckpt_test");
  const TrainRecord full = train(run_flags(dir / "full.json", 2), "uninterrupted run");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "first.json", 2), {"--save-dir", saves, "--stop-after", std::to_string(kStopAfter)}),
        "first half at 2 ranks");
  // The last step of a run that stops is always saved.
  ASSERT_TRUE(exists(saves + "/step-10/manifest.json"));
  const TrainRecord at3 =
      train(with(run_flags(dir / "three.json", 3), {"--save-dir", saves, "--resume"}), "resumed at 3 ranks");
  expect_tail_matches(full, at3, 1e-5);
  // The run at 3 ranks saved its last step; resume at 1 rank from step 10.
  remove_tree(saves + "/step-20");
  const TrainRecord at1 =
      train(with(run_flags(dir / "one.json", 1), {"--save-dir", saves, "--resume"}), "resumed at 1 rank");
  expect_tail_matches(full, at1, 1e-5);
}

// Saved on a 2x2 HSDP mesh (only replica 0 writes), resumed on a 1-D mesh of
// 3 ranks. Global batch 12: divisible by 4 and 3.
TEST(FsdpTrainCheckpoint, HsdpSaveResumesOnAnotherMesh) {
  ScratchDir dir("fsdp_ckpt_test");
  auto flags = [&](const std::string& json, int nproc) {
    std::vector<std::string> f = run_flags(json, nproc);
    f[3] = "12";  // --global-batch
    return f;
  };
  const TrainRecord full = train(flags(dir / "full.json", 3), "uninterrupted run at 3 ranks");
  const std::string saves = dir / "saves";
  train(with(flags(dir / "first.json", 4),
             {"--mesh", "2x2", "--save-dir", saves, "--stop-after", std::to_string(kStopAfter)}),
        "first half on a 2x2 mesh");
  // Replicas 0 (ranks 0 and 1) write; ranks 2 and 3 hold the same rows.
  EXPECT_TRUE(exists(saves + "/step-10/model/shard-00002-model-00001-of-00001.safetensors"));
  EXPECT_FALSE(exists(saves + "/step-10/model/shard-00003-model-00001-of-00001.safetensors"));
  const TrainRecord at3 =
      train(with(flags(dir / "three.json", 3), {"--save-dir", saves, "--resume"}), "resumed at 3 ranks");
  expect_tail_matches(full, at3, 1e-5);
}

TEST(FsdpTrainCheckpoint, KeepPrunesOldCheckpointsAndUnfinishedSavesAreIgnored) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "a.json", 1),
             {"--save-dir", saves, "--save-every", "4", "--keep", "2", "--stop-after", "12"}),
        "saving run");
  EXPECT_FALSE(exists(saves + "/step-4"));
  EXPECT_TRUE(exists(saves + "/step-8/manifest.json"));
  EXPECT_TRUE(exists(saves + "/step-12/manifest.json"));
  // A save killed before its rename leaves a temporary directory, which a
  // resume ignores: it continues from step 12.
  ASSERT_EQ(::mkdir((saves + "/.tmp-step-16").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((saves + "/.tmp-step-16/model").c_str(), 0755), 0);
  std::ofstream(saves + "/.tmp-step-16/model/shard-00001-model-00001-of-00001.safetensors") << "partial";
  const RunResult run =
      run_program(FSDP_TRAIN_BINARY, with(run_flags(dir / "b.json", 1), {"--save-dir", saves, "--resume"}));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("checkpoint  loaded " + saves + "/step-12"), std::string::npos) << run.output;
  const TrainRecord resumed = read_train_json(dir / "b.json");
  ASSERT_TRUE(resumed.ok);
  EXPECT_EQ(resumed.steps.front(), 13);
}

TEST(FsdpTrainCheckpoint, CorruptCheckpointIsRefusedNamingTheFile) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "a.json", 2), {"--save-dir", saves, "--stop-after", "3"}), "saving run");
  const std::string victim = saves + "/step-3/model/shard-00001-model-00001-of-00001.safetensors";
  ASSERT_TRUE(exists(victim));
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(file_size(victim) - 4));
    f.write("\x01\x02\x03\x04", 4);
  }
  const RunResult run =
      run_program(FSDP_TRAIN_BINARY, with(run_flags(dir / "b.json", 2), {"--save-dir", saves, "--resume"}));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("shard-00001-model-00001-of-00001.safetensors"), std::string::npos) << run.output;
}

// One bit flipped in the middle of a rank's optimizer file (the size is
// unchanged and the file still parses, so only the manifest's CRC32 can tell)
// makes --resume and --init-from refuse the checkpoint on every rank, naming
// the file and the checksum.
TEST(FsdpTrainCheckpoint, FlippedBitInTheOptimizerStateFailsTheChecksum) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "a.json", 2), {"--save-dir", saves, "--stop-after", "3"}), "saving run");
  const std::string name = "optim/shard-00002-model-00001-of-00001.safetensors";
  const std::string victim = saves + "/step-3/" + name;
  ASSERT_TRUE(exists(victim));
  const int64_t size = file_size(victim);
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t header = 0;  // safetensors: u64 little-endian header size, header, data
    f.read(reinterpret_cast<char*>(&header), sizeof(header));
    const auto middle = static_cast<std::streamoff>(8 + header + (size - 8 - static_cast<int64_t>(header)) / 2);
    ASSERT_LT(8 + static_cast<int64_t>(header), size);
    char byte = 0;
    f.seekg(middle);
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(middle);
    f.write(&byte, 1);
  }
  ASSERT_EQ(file_size(victim), size);
  for (const auto& [flags, what] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--save-dir", saves, "--resume"}, "--resume"}, {{"--init-from", saves}, "--init-from"}}) {
    const RunResult run = run_program(FSDP_TRAIN_BINARY, with(run_flags(dir / "b.json", 2), flags));
    EXPECT_NE(run.exit_code, 0) << what << ":\n" << run.output;
    EXPECT_NE(run.output.find("checksum mismatch"), std::string::npos) << what << ":\n" << run.output;
    EXPECT_NE(run.output.find(name), std::string::npos) << what << ":\n" << run.output;
    // Rank 1, which did not verify, fails too instead of waiting.
    EXPECT_NE(run.output.find("rank 0 found"), std::string::npos) << what << ":\n" << run.output;
  }
}

// --export-hf and the sharded checkpoint hold the same weights: runs
// initialised from either have the same step-1 loss (computed before any
// update), which differs from a fresh model's.
TEST(FsdpTrainCheckpoint, ExportAndInitFromAgree) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves", hf = dir / "hf";
  train(with(run_flags(dir / "a.json", 2), {"--save-dir", saves, "--stop-after", "8", "--export-hf", hf}),
        "exporting run");
  ASSERT_TRUE(exists(hf + "/model.safetensors.index.json"));
  auto first_loss = [&](const std::string& source, int nproc, const char* name) {
    const TrainRecord r = train(with(run_flags(dir / name, nproc), {"--steps", "1", "--init-from", source}), name);
    return r.ok ? r.losses.front() : std::nan("");
  };
  const double from_hf = first_loss(hf, 3, "hf.json");
  const double from_sharded = first_loss(saves + "/step-8", 1, "sharded.json");
  const double from_root = first_loss(saves, 2, "root.json");
  const TrainRecord fresh = train(with(run_flags(dir / "fresh.json", 1), {"--steps", "1"}), "fresh");
  EXPECT_NEAR(from_hf, from_sharded, 1e-5 * std::abs(from_sharded));
  EXPECT_NEAR(from_root, from_sharded, 1e-5 * std::abs(from_sharded));
  ASSERT_TRUE(fresh.ok);
  EXPECT_GT(std::abs(fresh.losses.front() - from_sharded), 1e-2) << "the initialised run looks like a fresh model";
}

// PyTorch reads the trainer's checkpoints with its own readers (the sharded
// model/ folder with HuggingFaceStorageReader, the export with
// safetensors.torch.load_file) and they agree bit for bit; a checkpoint
// PyTorch writes from 3 ranks with HuggingFaceStorageWriter(save_distributed)
// and the trainer's FQNs starts a 2-rank run with the same weights.
TEST(FsdpTrainCheckpoint, PyTorchReadsAndWritesTrainerCheckpoints) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves", hf = dir / "hf", written_by_pytorch = dir / "pytorch";
  train(with(run_flags(dir / "a.json", 2), {"--save-dir", saves, "--stop-after", "6", "--export-hf", hf}),
        "exporting run");
  const RunResult compared =
      run_program(FSDP2CPP_TEST_PYTHON, {FSDP_TRAIN_INTEROP_PY, "compare", saves + "/step-6/model", hf});
  ASSERT_EQ(compared.exit_code, 0) << compared.output;
  const RunResult rewritten =
      run_program(FSDP2CPP_TEST_PYTHON, {FSDP_TRAIN_INTEROP_PY, "rewrite", hf, written_by_pytorch, "3"});
  ASSERT_EQ(rewritten.exit_code, 0) << rewritten.output;
  ASSERT_TRUE(exists(written_by_pytorch + "/shard-00003-model-00001-of-00001.safetensors")) << rewritten.output;
  const TrainRecord from_pytorch =
      train(with(run_flags(dir / "pt.json", 2), {"--steps", "1", "--init-from", written_by_pytorch}), "from PyTorch");
  const TrainRecord from_export =
      train(with(run_flags(dir / "hf.json", 1), {"--steps", "1", "--init-from", hf}), "from the export");
  ASSERT_TRUE(from_pytorch.ok && from_export.ok);
  EXPECT_NEAR(from_pytorch.losses.front(), from_export.losses.front(), 1e-5 * std::abs(from_export.losses.front()));
}

// The export at 3 ranks (every 1-D norm weight of 32 rows split 11, 11, 10)
// holds the full tensors: PyTorch's HuggingFaceStorageReader reads the same
// shapes and values from the sharded checkpoint.
TEST(FsdpTrainCheckpoint, ExportAtThreeRanksHoldsFullOneDimensionalTensors) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves", hf = dir / "hf";
  train(with(run_flags(dir / "a.json", 3), {"--save-dir", saves, "--stop-after", "4", "--export-hf", hf}),
        "exporting run at 3 ranks");
  const RunResult compared =
      run_program(FSDP2CPP_TEST_PYTHON, {FSDP_TRAIN_INTEROP_PY, "compare", saves + "/step-4/model", hf});
  ASSERT_EQ(compared.exit_code, 0) << compared.output;
  // 2 blocks with two norms each, and the final norm.
  EXPECT_NE(compared.output.find("(5 of them 1-D)"), std::string::npos) << compared.output;
}

// PyTorch's torch.optim.AdamW, loaded with the trainer's step-5 parameters and
// optimizer state (the FQN keys state.<fqn>.exp_avg, exp_avg_sq, step and
// the manifest's param groups), takes step 6 to the trainer's step-6
// parameters and state (trainer_interop.py adamw). 3 ranks: uneven shards.
TEST(FsdpTrainCheckpoint, PyTorchsAdamWContinuesFromTheTrainersOptimizerState) {
  ScratchDir dir("fsdp_ckpt_test");
  const std::string saves = dir / "saves";
  train(with(run_flags(dir / "a.json", 3), {"--save-dir", saves, "--save-every", "5", "--stop-after", "6"}),
        "saving run");
  ASSERT_TRUE(exists(saves + "/step-5/manifest.json"));
  ASSERT_TRUE(exists(saves + "/step-6/manifest.json"));
  const RunResult checked =
      run_program(FSDP2CPP_TEST_PYTHON, {FSDP_TRAIN_INTEROP_PY, "adamw", saves + "/step-5", saves + "/step-6"});
  ASSERT_EQ(checked.exit_code, 0) << checked.output;
  EXPECT_NE(checked.output.find("PyTorch's AdamW step 6 equals the trainer's"), std::string::npos) << checked.output;
}

// The trainer equals a plain-PyTorch replica of itself (trainer_interop.py
// loss: fsdp2_bench.py's Transformer, the trainer's sampler rebuilt in
// Python): loaded with the trainer's step-2 parameters, the replica computes
// the loss the trainer records for step 3 bit for bit, each rank's rows
// apart and their mean as the trainer takes it. The default model, and
// grouped-query attention (4 query heads over 2 key/value heads) with a
// vocabulary larger than the bytes; 2 ranks, one thread each.
TEST(FsdpTrainCheckpoint, PyTorchReplicaComputesTheTrainersLossBitForBit) {
  ScratchDir dir("fsdp_ckpt_test");
  for (const std::vector<std::string>& model :
       {std::vector<std::string>{}, std::vector<std::string>{"--kv-heads", "2", "--vocab", "320"}}) {
    const std::string name = model.empty() ? "mha" : "gqa", saves = dir / name, json = dir / (name + ".json");
    std::vector<std::string> args =
        with(small_run_flags(json, 3),
             {"--nproc", "2", "--threads", "1", "--data", FSDP_TRAIN_CORPUS, "--save-dir", saves, "--save-every", "1"});
    args = with(args, model);
    train(args, name.c_str());
    std::vector<std::string> check = {
        FSDP_TRAIN_INTEROP_PY, "loss", saves + "/step-2", json, FSDP_TRAIN_CORPUS, "--world", "2"};
    // The shape and data flags of small_run_flags.
    for (const char* flag : {"--seed", "--global-batch", "--seq-len", "--heads"}) {
      const auto at = std::find(args.begin(), args.end(), flag);
      ASSERT_NE(at, args.end()) << flag;
      check.insert(check.end(), {flag, *(at + 1)});
    }
    check = with(check, {"--kv-heads", model.empty() ? "0" : "2"});
    const RunResult checked = run_program(FSDP2CPP_TEST_PYTHON, check);
    ASSERT_EQ(checked.exit_code, 0) << name << ":\n" << checked.output;
    EXPECT_NE(checked.output.find("loss of step 3 equals the trainer's bit for bit"), std::string::npos)
        << checked.output;
    EXPECT_NE(
        checked.output.find(model.empty() ? "4 heads / 4 KV heads, vocab 256" : "4 heads / 2 KV heads, vocab 320"),
        std::string::npos)
        << checked.output;
  }
}

TEST(FsdpTrainCheckpoint, FlagErrors) {
  ScratchDir dir("fsdp_ckpt_test");
  const auto expect_error = [&](const std::vector<std::string>& more, const std::string& fragment) {
    const RunResult run = run_program(FSDP_TRAIN_BINARY, with(run_flags(dir / "e.json", 1), more));
    EXPECT_EQ(run.exit_code, 2) << run.output;
    EXPECT_NE(run.output.find(fragment), std::string::npos) << run.output;
  };
  expect_error({"--resume"}, "--resume needs --save-dir");
  expect_error({"--async-save"}, "--async-save needs --save-dir");
  expect_error({"--save-every", "5"}, "--save-every needs --save-dir");
  expect_error({"--save-dir", dir / "s", "--keep", "-1"}, "--keep");
  expect_error({"--init-from", dir / "missing"}, "--init-from");
  expect_error({"--stop-after", "99"}, "--stop-after must be between 1 and --steps");
}

}  // namespace
}  // namespace fsdp_train_test
