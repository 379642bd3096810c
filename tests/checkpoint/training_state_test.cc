// One-call training states (checkpoint/training_state.h, fsdp_state.h) on
// real ranks: an MLP sharded with fully_shard trains a few AdamW steps at
// world size N, saves model, optimizer, the user's tensors and JSON values
// and the CPU generator with save_training_state, and a run at world size M
// (weights of 13, 10 and 3 rows: uneven shards at 2, 3 and 4) loads them with
// load_latest_training_state. The loaded values are checked against the
// saved files (exactly) and an unsharded reference run (closely), the next
// random numbers against the saving run's, and two more steps against the
// uninterrupted reference. Then the errors: a missing directory, a missing
// item, a wrong kind or type, a checkpoint not written by
// save_training_state, name clashes.
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/fsdp_state.h"
#include "checkpoint/internal/async_save_hook.h"
#include "checkpoint/sharded.h"
#include "checkpoint/training_state.h"
#include "checkpoint_test_util.h"
#include "fsdp2/state_dict.h"
#include "fsdp2_test_util.h"

namespace {

namespace ckpt = fsdp::checkpoint;
using fsdp::testing::RankContext;

constexpr int kStepsBeforeSave = 3;
constexpr int kStepsAfterLoad = 2;
constexpr int64_t kBatchRows = 12;  // divisible by 1..4: every rank gets the same number of rows

torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01); }

// The user's own state beside the model and the optimizer.
struct UserState {
  int64_t step = 0;
  double lr_scale = 1.0;
  std::string run_name = "fresh";
  std::string schedule = "{}";
  bool warmed_up = false;
  at::Tensor step_marks = at::zeros({kStepsBeforeSave + kStepsAfterLoad}, at::kDouble);
};

// The values the saving run leaves in UserState after kStepsBeforeSave steps.
void fill_user_state(UserState& u) {
  u.step = kStepsBeforeSave;
  u.lr_scale = 0.375;
  u.run_name = "resharded run";
  u.schedule = R"({"decay":[0.5,0.25],"warmup":3})";
  u.warmed_up = true;
  for (int s = 1; s <= kStepsBeforeSave; ++s) u.step_marks[s - 1] = s + 0.25;
}

void register_items(ckpt::TrainingState& state, ckpt::ModelState& model, ckpt::OptimizerState& optim, UserState& u) {
  state.add("model", model)
      .add("optim", optim)
      .add_int64("step", u.step)
      .add_double("lr_scale", u.lr_scale)
      .add_string("run_name", u.run_name)
      .add_json("schedule", u.schedule)
      .add_bool("warmed_up", u.warmed_up)
      .add_tensor("step_marks", u.step_marks)
      .add_rng("cpu_rng", at::detail::getDefaultCPUGenerator());
}

std::shared_ptr<fsdp::test::MLP> sharded_mlp(RankContext& ctx, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = std::make_shared<fsdp::test::MLP>();
  fsdp::FullyShardOptions options = fsdp::test::mesh_options(ctx);
  for (auto& block : model->blocks()) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
  return model;
}

void sharded_step(RankContext& ctx, fsdp::test::LossModel& model, torch::optim::Optimizer& optim, int step) {
  const auto batch =
      fsdp::test::make_batch(fsdp::test::ModelKind::kMlp, step, kBatchRows).slice(ctx.rank(), ctx.world_size());
  optim.zero_grad();
  fsdp::call_module(model, batch.x, batch.y).backward();
  optim.step();
}

// The uninterrupted run, unsharded, in this process: the model (seed 0) and
// its AdamW after `steps` steps on the whole batches.
struct Reference {
  std::shared_ptr<fsdp::test::MLP> model;
  std::unique_ptr<torch::optim::AdamW> optim;
};

Reference reference_after(int steps) {
  Reference r;
  torch::manual_seed(0);
  r.model = std::make_shared<fsdp::test::MLP>();
  r.optim = std::make_unique<torch::optim::AdamW>(r.model->parameters(), adamw_options());
  for (int step = 1; step <= steps; ++step) {
    const auto batch = fsdp::test::make_batch(fsdp::test::ModelKind::kMlp, step, kBatchRows);
    r.optim->zero_grad();
    r.model->forward(batch.x, batch.y).backward();
    r.optim->step();
  }
  return r;
}

// The random numbers the saving run draws right after its save.
at::Tensor random_numbers_after_save() {
  torch::manual_seed(777);
  at::randn({3});
  return at::randn({6});
}

// `full`'s rows that `value` (this rank's piece) covers.
at::Tensor rows_of(const at::Tensor& full, const fsdp::StateValue& value) {
  if (full.dim() == 0) return full;
  return full.narrow(0, value.local_offset()[0], value.local().size(0));
}

// Zero full tensors with the keys and shapes of `like` (a plain state dict),
// filled from `dir` in this process: what the files hold, whatever wrote them.
fsdp::StateDict read_full(const fsdp::StateDict& like, const std::string& dir) {
  fsdp::StateDict full;
  for (const auto& [key, value] : like) full.insert(key, at::zeros_like(value.local()));
  ckpt::load_sharded(full, dir);
  return full;
}

// Each piece of `actual` (this rank's) equals the rows of `saved` exactly
// and the rows of `reference` closely.
void expect_pieces(const fsdp::StateDict& actual, const fsdp::StateDict& saved, const fsdp::StateDict& reference,
                   const std::string& what) {
  ASSERT_EQ(actual.keys(), reference.keys()) << what;
  for (const auto& [key, value] : actual) {
    SCOPED_TRACE(what + " " + key);
    const at::Tensor local = value.local().detach();
    EXPECT_TRUE(local.equal(rows_of(saved.at(key).local(), value))) << "not what the files hold";
    fsdp::test::expect_close(local, rows_of(reference.at(key).local().detach(), value), key);
  }
}

struct WorldSizes {
  int save;
  int load;
};

class TrainingStateResharding : public ::testing::TestWithParam<WorldSizes> {};

TEST_P(TrainingStateResharding, LoadAtAnotherWorldSizeContinuesTheUninterruptedRun) {
  const WorldSizes sizes = GetParam();
  ckpt_test::SharedDir root;

  fsdp::testing::run_distributed(sizes.save, [&](RankContext& ctx) {
    auto model = sharded_mlp(ctx, 0);
    torch::optim::AdamW optim(model->parameters(), adamw_options());
    for (int step = 1; step <= kStepsBeforeSave; ++step) sharded_step(ctx, *model, optim, step);
    UserState user;
    fill_user_state(user);
    torch::manual_seed(777);
    at::randn({3});

    ckpt::ModelState model_state(*model);
    ckpt::OptimizerState optim_state(*model, optim);
    ckpt::TrainingState state;
    register_items(state, model_state, optim_state, user);
    ckpt::TrainingStateSaveOptions options;
    options.mesh = "shard " + std::to_string(ctx.world_size());
    const auto saved = ckpt::save_training_state(root.path(), kStepsBeforeSave, state, ctx.world_group(), options);
    EXPECT_EQ(saved.dir, root / "step-3");
    EXPECT_GT(saved.bytes, 0);
    // Saving draws no random numbers.
    const at::Tensor drawn = at::randn({6});
    EXPECT_TRUE(drawn.equal(random_numbers_after_save()));
  });

  fsdp::testing::run_distributed(sizes.load, [&](RankContext& ctx) {
    const at::Tensor expected_random = random_numbers_after_save();
    // Another initialisation, generator state and user state: the load must
    // replace them all.
    auto model = sharded_mlp(ctx, 5);
    torch::optim::AdamW optim(model->parameters(), adamw_options());
    UserState user;
    torch::manual_seed(999);

    ckpt::ModelState model_state(*model);
    ckpt::OptimizerState optim_state(*model, optim);
    ckpt::TrainingState state;
    register_items(state, model_state, optim_state, user);
    const at::Tensor marks_handle = user.step_marks;  // loaded in place: a copy of the handle sees the values
    const auto loaded = ckpt::load_latest_training_state(root.path(), state, ctx.world_group());
    ASSERT_TRUE(loaded.has_value());
    EXPECT_EQ(loaded->dir, root / "step-3");
    EXPECT_EQ(loaded->step, kStepsBeforeSave);
    EXPECT_EQ(loaded->saved_world_size, sizes.save);
    EXPECT_EQ(loaded->saved_mesh, "shard " + std::to_string(sizes.save));
    EXPECT_TRUE(loaded->missing_items.empty());
    EXPECT_TRUE(loaded->unloaded_items.empty());

    // The generator continues where the saving run's did.
    EXPECT_TRUE(at::randn({6}).equal(expected_random));

    // The user's values and tensor.
    UserState expected;
    fill_user_state(expected);
    EXPECT_EQ(user.step, expected.step);
    EXPECT_EQ(user.lr_scale, expected.lr_scale);
    EXPECT_EQ(user.run_name, expected.run_name);
    EXPECT_EQ(user.schedule, expected.schedule);
    EXPECT_EQ(user.warmed_up, expected.warmed_up);
    EXPECT_TRUE(marks_handle.equal(expected.step_marks)) << marks_handle;

    // Model and AdamW state: the files' values exactly, the reference's closely.
    Reference ref = reference_after(kStepsBeforeSave);
    const fsdp::StateDict ref_model = fsdp::get_model_state_dict(*ref.model);
    const fsdp::StateDict ref_optim = fsdp::get_optimizer_state_dict(*ref.model, *ref.optim).state;
    expect_pieces(fsdp::get_model_state_dict(*model), read_full(ref_model, root / "step-3/model"), ref_model, "model");
    const fsdp::StateDict optim_sd = fsdp::get_optimizer_state_dict(*model, optim).state;
    expect_pieces(optim_sd, read_full(ref_optim, root / "step-3/optim"), ref_optim, "optim");
    int checked = 0;
    for (const auto& [key, value] : optim_sd) {
      if (key.size() > 5 && key.compare(key.size() - 5, 5, ".step") == 0) {
        EXPECT_EQ(value.local().item<double>(), kStepsBeforeSave) << key;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 6) << "one AdamW step count per parameter";
    // The param groups came back (lr and weight decay as saved).
    const auto& group_options = static_cast<const torch::optim::AdamWOptions&>(optim.param_groups()[0].options());
    EXPECT_EQ(group_options.lr(), 1e-2);
    EXPECT_EQ(group_options.weight_decay(), 0.01);

    // Two more steps equal the uninterrupted run's.
    for (int step = kStepsBeforeSave + 1; step <= kStepsBeforeSave + kStepsAfterLoad; ++step) {
      sharded_step(ctx, *model, optim, step);
    }
    Reference full_run = reference_after(kStepsBeforeSave + kStepsAfterLoad);
    fsdp::test::expect_params_match(*model, *full_run.model, ctx.mesh());
  });
}

INSTANTIATE_TEST_SUITE_P(SaveAtNLoadAtM, TrainingStateResharding,
                         ::testing::Values(WorldSizes{2, 2}, WorldSizes{4, 1}, WorldSizes{1, 4}, WorldSizes{2, 3},
                                           WorldSizes{3, 2}, WorldSizes{4, 3}),
                         [](const ::testing::TestParamInfo<WorldSizes>& info) {
                           return "Save" + std::to_string(info.param.save) + "Load" + std::to_string(info.param.load);
                         });

// A Stateful without FSDP: a plain tensor and a JSON member.
class Counter : public ckpt::Stateful {
 public:
  explicit Counter(std::string member = "counter_note") : member_(std::move(member)) {}
  ckpt::StatefulState state_dict() override {
    ckpt::StatefulState s;
    s.tensors.insert("counts", counts);
    s.json[member_] = "\"" + note + "\"";
    return s;
  }
  void load_state_dict(const ckpt::StatefulState& s) override {
    ASSERT_EQ(s.json.count(member_), 1u);
    note = s.json.at(member_).substr(1, s.json.at(member_).size() - 2);
  }
  at::Tensor counts = at::arange(5, at::kFloat);
  std::string note = "saved";

 private:
  std::string member_;
};

// Saves {counter, step = 7, tensor "weights"} at 2 ranks as ROOT/step-7.
void save_small(const std::string& root) {
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    Counter counter;
    int64_t step = 7;
    ckpt::TrainingState state;
    state.add("counter", counter).add_int64("step", step).add_tensor("weights", at::full({2, 3}, 1.5));
    ckpt::save_training_state(root, 7, state, ctx.world_group());
  });
}

TEST(TrainingStateErrors, MissingDirectoryAndMissingManifestSayWhatToLoad) {
  ckpt_test::SharedDir root;
  save_small(root.path());
  fsdp::testing::run_distributed(1, [&](RankContext& ctx) {
    int64_t step = 0;
    ckpt::TrainingState state;
    state.add_int64("step", step);
    CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-8", state, ctx.world_group()),
                           "step-8' does not exist", "load_latest_training_state");
    // An unfinished save has no manifest.
    ASSERT_EQ(::mkdir((root / "step-9").c_str(), 0755), 0);
    CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-9", state, ctx.world_group()),
                           "step-9' has no manifest.json", "list_checkpoints");
    // An empty root is a first run: nothing is touched.
    const auto none = ckpt::load_latest_training_state(root / "nothing-here", state, ctx.world_group());
    EXPECT_FALSE(none.has_value());
    EXPECT_EQ(step, 0);
    // The latest complete one is step-7 (step-9 has no manifest).
    const auto latest = ckpt::load_latest_training_state(root.path(), state, ctx.world_group());
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(step, 7);
    EXPECT_EQ(latest->unloaded_items, (std::vector<std::string>{"counter", "weights"}));
  });
}

TEST(TrainingStateErrors, MissingItemNamesItAndWhatTheCheckpointHolds) {
  ckpt_test::SharedDir root;
  save_small(root.path());
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    int64_t step = 0;
    int64_t epoch = 41;
    ckpt::TrainingState state;
    state.add_int64("step", step).add_int64("epoch", epoch);
    CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-7", state, ctx.world_group()),
                           "holds no 'epoch' (registered with add_int64)", "counter (stateful)", "step (int64)",
                           "weights (tensor)", "strict = false");
    EXPECT_EQ(step, 0) << "nothing is loaded when an item is missing";
    ckpt::TrainingStateLoadOptions lenient;
    lenient.strict = false;
    const auto loaded = ckpt::load_training_state(root / "step-7", state, ctx.world_group(), lenient);
    EXPECT_EQ(loaded.missing_items, std::vector<std::string>{"epoch"});
    EXPECT_EQ(step, 7);
    EXPECT_EQ(epoch, 41);
  });
}

// A Stateful whose tensors differ from the saved ones (a MoE model with an
// expert more, or of another width): the errors name the option of
// load_training_state that relaxes them (strict_tensors, not load_sharded's
// strict), and a complete checkpoint is never said to miss a file.
class CounterWithExpert : public Counter {
 public:
  ckpt::StatefulState state_dict() override {
    ckpt::StatefulState s = Counter::state_dict();
    s.tensors.insert("experts.1.weight", expert);
    return s;
  }
  at::Tensor expert = at::full({2, 2}, 3.0);
};

TEST(TrainingStateErrors, TensorMismatchesNameStrictTensorsAndNoMissingFile) {
  ckpt_test::SharedDir root;
  save_small(root.path());
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    const std::string dir = root / "step-7";
    {
      CounterWithExpert counter;
      ckpt::TrainingState state;
      state.add("counter", counter);
      EXPECT_EQ(ckpt_test::error_of([&] { ckpt::load_training_state(dir, state, ctx.world_group()); }),
                "checkpoint: loading '" + dir +
                    "/counter' (strict): missing keys (in the target, not saved): 'experts.1.weight'. Set "
                    "TrainingStateLoadOptions::strict_tensors = false to load the keys both have.");
      ckpt::TrainingStateLoadOptions lenient;
      lenient.strict_tensors = false;
      ckpt::load_training_state(dir, state, ctx.world_group(), lenient);
      EXPECT_TRUE(counter.counts.equal(at::arange(5, at::kFloat)));
      EXPECT_TRUE(counter.expert.equal(at::full({2, 2}, 3.0))) << "the unsaved tensor is left as it is";
    }
    {
      Counter counter;
      counter.counts = at::zeros({6});
      ckpt::TrainingState state;
      state.add("counter", counter);
      EXPECT_EQ(ckpt_test::error_of([&] { ckpt::load_training_state(dir, state, ctx.world_group()); }),
                "checkpoint: key 'counts' has the global shape [6] in the target but [5] in '" + dir + "/counter'");
    }
  });
}

TEST(TrainingStateErrors, WrongKindOrTypeNamesBothAndTheCallToUse) {
  ckpt_test::SharedDir root;
  save_small(root.path());
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    {
      std::string step;
      ckpt::TrainingState state;
      state.add_string("step", step);
      CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-7", state, ctx.world_group()), "'step'",
                             "saved as int64 (with add_int64)", "registered as string (with add_string)",
                             "register it with add_int64");
    }
    {
      at::Tensor step = at::zeros({});
      ckpt::TrainingState state;
      state.add_tensor("step", step);
      CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-7", state, ctx.world_group()), "saved as int64",
                             "registered as tensor (with add_tensor)");
    }
    {
      int64_t weights = 0;
      ckpt::TrainingState state;
      state.add_int64("weights", weights);
      CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-7", state, ctx.world_group()), "'weights'",
                             "saved as tensor (with add_tensor)", "registered as int64");
    }
    {
      // A tensor of another shape: load_sharded names the key and both shapes.
      ckpt::TrainingState state;
      state.add_tensor("weights", at::zeros({3, 2}));
      CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-7", state, ctx.world_group()), "weights");
    }
    {
      // add_json reads any value, as its JSON text.
      std::string step;
      ckpt::TrainingState state;
      state.add_json("step", step);
      ckpt::load_training_state(root / "step-7", state, ctx.world_group());
      EXPECT_EQ(step, "7");
    }
    {
      // The Stateful and the user tensor, loaded in place.
      Counter counter;
      counter.counts.zero_();
      counter.note = "fresh";
      const at::Tensor weights = at::zeros({2, 3});
      ckpt::TrainingState state;
      state.add("counter", counter).add_tensor("weights", weights);
      ckpt::load_training_state(root / "step-7", state, ctx.world_group());
      EXPECT_TRUE(counter.counts.equal(at::arange(5, at::kFloat)));
      EXPECT_EQ(counter.note, "saved");
      EXPECT_TRUE(weights.equal(at::full({2, 3}, 1.5)));
    }
  });
}

TEST(TrainingStateErrors, CheckpointNotWrittenBySaveTrainingStateIsRefused) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    ckpt::CheckpointWriter writer(root.path(), 3, ctx.world_group());
    writer.commit(R"({"param_groups": []})");
    int64_t step = 0;
    ckpt::TrainingState state;
    state.add_int64("step", step);
    CKPT_EXPECT_THROW_WITH(ckpt::load_training_state(root / "step-3", state, ctx.world_group()),
                           "save_training_state did not write it", "load_sharded");
  });
}

TEST(TrainingStateErrors, NamesMustBeUniquePlainAndUnreserved) {
  int64_t a = 0;
  double b = 0;
  ckpt::TrainingState state;
  state.add_int64("step", a);
  CKPT_EXPECT_THROW_WITH(state.add_double("step", b), "'step' is registered twice", "first as int64", "now as double");
  CKPT_EXPECT_THROW_WITH(state.add_double("a/b", b), "'a/b' is not a plain file name");
  CKPT_EXPECT_THROW_WITH(state.add_double(".hidden", b), "not a plain file name");
  CKPT_EXPECT_THROW_WITH(state.add_double("tensors", b), "'tensors' is reserved");
  CKPT_EXPECT_THROW_WITH(state.add_double("training_state", b), "'training_state' is reserved");
  EXPECT_EQ(state.names(), std::vector<std::string>{"step"});
}

TEST(TrainingStateErrors, JsonMemberClashAndBadJsonFailTheSaveBeforeWriting) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    {
      Counter counter("note");
      std::string note = "\"mine\"";
      ckpt::TrainingState state;
      state.add_json("note", note).add("counter", counter);
      CKPT_EXPECT_THROW_WITH(ckpt::save_training_state(root.path(), 1, state, ctx.world_group()),
                             "Stateful 'counter' stores 'note'", "another item", "rename");
    }
    {
      std::string bad = "{not json";
      ckpt::TrainingState state;
      state.add_json("schedule", bad);
      CKPT_EXPECT_THROW_WITH(ckpt::save_training_state(root.path(), 1, state, ctx.world_group()),
                             "the JSON value 'schedule'");
    }
    EXPECT_TRUE(ckpt::list_checkpoints(root.path()).empty());
  });
}

// A Stateful over a fixed state dict (its local tensors are "live": the
// test changes them after an async save returns).
class Fixed : public ckpt::Stateful {
 public:
  explicit Fixed(fsdp::StateDict tensors) : tensors(std::move(tensors)) {}
  ckpt::StatefulState state_dict() override { return {tensors, {}}; }
  void load_state_dict(const ckpt::StatefulState&) override {}
  fsdp::StateDict tensors;
};

const std::vector<fsdp::Placement> kShard0 = {fsdp::Placement::shard(0)};

TEST(TrainingStateAsync, SaveReturnsAfterStagingAndWritesWhatWasStaged) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    // The saver's own communicator: its commit runs beside the training's collectives.
    ckpt::AsyncTrainingStateSaver saver(ctx.world()->new_group(ctx.world()->all_ranks(), c10::kCPU));
    Fixed model(ckpt_test::make_state(ctx.mesh(), kShard0));
    int64_t step = 1;
    ckpt::TrainingState state;
    state.add("model", model).add_int64("step", step);
    const ckpt::AsyncSaveStaged staged = saver.save(root.path(), 1, state);
    EXPECT_GT(staged.staged_bytes, 0);
    EXPECT_TRUE(saver.pending());
    // Training goes on: the live tensors and values change, and the
    // training's communicator is used while the save may be in flight.
    for (auto& [key, value] : model.tensors) value.local().fill_(0);
    step = 99;
    at::Tensor sum = at::ones({1});
    ctx.world_group()->all_reduce(sum, fsdp::collectives::ReduceOp::sum()).wait();
    EXPECT_EQ(sum.item<float>(), 3.0f);
    const auto done = saver.wait();
    ASSERT_TRUE(done.has_value());
    EXPECT_EQ(done->dir, root / "step-1");
    EXPECT_FALSE(saver.pending());
    EXPECT_FALSE(saver.wait().has_value()) << "nothing in flight";

    // Two saves back to back: the second waits for the first.
    step = 2;
    saver.save(root.path(), 2, state);
    step = 3;
    saver.save(root.path(), 3, state);
    ASSERT_TRUE(saver.wait().has_value());
    std::vector<int64_t> steps;
    for (const auto& ref : ckpt::list_checkpoints(root.path())) steps.push_back(ref.step);
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3}));

    // Step 1 holds what was staged, not what the tensors became.
    Fixed loaded(ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true));
    int64_t loaded_step = 0;
    ckpt::TrainingState target;
    target.add("model", loaded).add_int64("step", loaded_step);
    ckpt::load_training_state(root / "step-1", target, ctx.world_group());
    ckpt_test::expect_state_equals_formula(loaded.tensors);
    EXPECT_EQ(loaded_step, 1);
    ckpt::load_training_state(root / "step-3", target, ctx.world_group());
    EXPECT_EQ(loaded_step, 3);
  });
}

TEST(TrainingStateAsync, ABackgroundFailureIsRethrownByWaitAndThePreviousCheckpointStays) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    ckpt::AsyncTrainingStateSaver saver(ctx.world()->new_group(ctx.world()->all_ranks(), c10::kCPU));
    int64_t step = 4;
    ckpt::TrainingState state;
    state.add_int64("step", step);
    saver.save(root.path(), 4, state);
    ASSERT_TRUE(saver.wait().has_value());
    // A root below a regular file cannot be created: the background thread
    // fails, and wait() says so, naming the path.
    if (ctx.rank() == 0) ckpt_test::write_bytes(root / "blocker", "x");
    ctx.world_group()->barrier().wait();
    saver.save(root / "blocker/sub", 5, state);
    CKPT_EXPECT_THROW_WITH(saver.wait(), "blocker");
    EXPECT_FALSE(saver.pending());
    const auto latest = ckpt::find_latest_checkpoint(root.path());
    ASSERT_TRUE(latest.has_value());
    EXPECT_EQ(latest->step, 4);
  });
}

// Sets every local tensor of `sd` to the formula with `seed_offset`.
void fill_formula(RankContext& ctx, fsdp::StateDict& sd, int64_t seed_offset) {
  const fsdp::StateDict values = ckpt_test::make_state(ctx.mesh(), kShard0, seed_offset);
  for (auto& [key, value] : sd) value.local().copy_(values.find(key)->local());
}

// The staging buffers are kept between saves and refilled by the next one.
// The first save's write is held back (a hook) until the second save is about
// to wait for it, so a save that refilled the buffers before that wait would
// deterministically put the second values into the first checkpoint.
TEST(TrainingStateAsync, ReusedStagingBuffersHoldEachSavesOwnValues) {
  ckpt_test::SharedDir root;
  fsdp::testing::run_distributed(3, [&](RankContext& ctx) {
    ckpt::AsyncTrainingStateSaver saver(ctx.world()->new_group(ctx.world()->all_ranks(), c10::kCPU));
    Fixed model(ckpt_test::make_state(ctx.mesh(), kShard0));
    ckpt::TrainingState state;
    state.add("model", model);

    std::mutex mutex;
    std::condition_variable cv;
    bool second_save_waits = false;
    ckpt::internal::set_async_save_hook_for_testing([&](ckpt::internal::AsyncSavePoint point, int64_t step) {
      std::unique_lock<std::mutex> lock(mutex);
      if (point == ckpt::internal::AsyncSavePoint::kBeforeWaitForPrevious && step == 2) {
        second_save_waits = true;
        cv.notify_all();
      } else if (point == ckpt::internal::AsyncSavePoint::kBeforeWrite && step == 1) {
        // Bounded only so that a save that never waits fails instead of hanging.
        EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return second_save_waits; }));
      }
    });
    const ckpt::AsyncSaveStaged first = saver.save(root.path(), 1, state);
    EXPECT_EQ(first.reused_bytes, 0) << "a fresh saver has no buffers to reuse";
    fill_formula(ctx, model.tensors, /*seed_offset=*/1);
    const ckpt::AsyncSaveStaged second = saver.save(root.path(), 2, state);
    EXPECT_EQ(second.reused_bytes, second.staged_bytes) << "the same shapes refill the first save's buffers";
    EXPECT_GT(second.reused_bytes, 0);
    fill_formula(ctx, model.tensors, /*seed_offset=*/2);
    ASSERT_TRUE(saver.wait().has_value());
    ckpt::internal::set_async_save_hook_for_testing(nullptr);

    for (int64_t step : {1, 2}) {
      Fixed loaded(ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true));
      ckpt::TrainingState target;
      target.add("model", loaded);
      ckpt::load_training_state(root / ("step-" + std::to_string(step)), target, ctx.world_group());
      SCOPED_TRACE("step-" + std::to_string(step));
      ckpt_test::expect_state_equals_formula(loaded.tensors, /*seed_offset=*/step - 1);
    }

    // A state of other shapes gets new buffers, and its values.
    const std::vector<fsdp::Placement> replicated = {fsdp::Placement::replicate()};
    Fixed other(ckpt_test::make_state(ctx.mesh(), replicated, /*seed_offset=*/5));
    ckpt::TrainingState reshaped;
    reshaped.add("model", other);
    const ckpt::AsyncSaveStaged third = saver.save(root.path(), 3, reshaped);
    EXPECT_LT(third.reused_bytes, third.staged_bytes);
    ASSERT_TRUE(saver.wait().has_value());
    Fixed loaded(ckpt_test::make_state(ctx.mesh(), replicated, 0, /*zeros=*/true));
    ckpt::TrainingState target;
    target.add("model", loaded);
    ckpt::load_training_state(root / "step-3", target, ctx.world_group());
    ckpt_test::expect_state_equals_formula(loaded.tensors, /*seed_offset=*/5);
  });
}

// Every rank process exits (std::_Exit, as a killed or crashed job would)
// on the background thread after writing its files of step 2 and before the
// commit. The next run finds step 1, with step 1's values, and ignores the
// partial .tmp-step-2.
TEST(TrainingStateAsync, AProcessThatDiesDuringTheBackgroundWriteLeavesThePreviousCheckpoint) {
  constexpr int kDiedMidWrite = 43;
  ckpt_test::SharedDir root;
  fsdp::testing::DistributedTestOptions options;
  options.world_size = 2;
  const auto outcomes = fsdp::testing::run_distributed_collect(options, [&](RankContext& ctx) {
    ckpt::AsyncTrainingStateSaver saver(ctx.world()->new_group(ctx.world()->all_ranks(), c10::kCPU));
    Fixed model(ckpt_test::make_state(ctx.mesh(), kShard0));
    int64_t step = 1;
    ckpt::TrainingState state;
    state.add("model", model).add_int64("step", step);
    saver.save(root.path(), 1, state);
    ASSERT_TRUE(saver.wait().has_value());

    fill_formula(ctx, model.tensors, /*seed_offset=*/1);
    step = 2;
    ckpt::internal::set_async_save_hook_for_testing([](ckpt::internal::AsyncSavePoint point, int64_t at_step) {
      if (point == ckpt::internal::AsyncSavePoint::kBeforeCommit && at_step == 2) std::_Exit(kDiedMidWrite);
    });
    saver.save(root.path(), 2, state);
    saver.wait();
    ADD_FAILURE() << "rank " << ctx.rank() << " outlived its background write";
  });
  if (!fsdp::testing::is_rank_process()) {
    ASSERT_EQ(outcomes.size(), 2u);
    for (const auto& outcome : outcomes) {
      EXPECT_TRUE(outcome.exited && outcome.exit_code == kDiedMidWrite) << outcome.describe() << "\n" << outcome.output;
    }
    // The write was under way: step 2's files are there, uncommitted.
    for (const char* shard : {"00001", "00002"}) {
      const std::string file = std::string(".tmp-step-2/model/shard-") + shard + "-model-00001-of-00001.safetensors";
      EXPECT_TRUE(ckpt_test::path_exists(root / file)) << file;
    }
    EXPECT_FALSE(ckpt_test::path_exists(root / "step-2"));
  }

  fsdp::testing::run_distributed(2, [&](RankContext& ctx) {
    Fixed loaded(ckpt_test::make_state(ctx.mesh(), kShard0, 0, /*zeros=*/true));
    int64_t loaded_step = 0;
    ckpt::TrainingState target;
    target.add("model", loaded).add_int64("step", loaded_step);
    const auto result = ckpt::load_latest_training_state(root.path(), target, ctx.world_group());
    ASSERT_TRUE(result.has_value());
    EXPECT_EQ(result->step, 1);
    EXPECT_EQ(loaded_step, 1);
    ckpt_test::expect_state_equals_formula(loaded.tensors);
  });
}

}  // namespace
