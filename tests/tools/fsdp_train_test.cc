// fsdp_train's pieces: flag spelling, flag checks (in the library and in the
// binary, which must fail before starting anything, naming the flag), the
// data split that makes a run independent of the world size, and the
// model's grouped-query attention.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "config.h"
#include "data.h"
#include "model.h"
#include "run_binary.h"

namespace fsdp_train_test {
namespace {

using fsdp_train::TrainConfig;

std::vector<std::string> normalize(std::vector<std::string> args) {
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return fsdp_train::normalize_flag_names(static_cast<int>(argv.size()), argv.data());
}

TEST(FlagNames, DashesInTheNameBecomeUnderscoresButValuesStay) {
  EXPECT_EQ(normalize({"prog", "--global-batch=8", "--seq-len", "32", "--data", "my-file.txt", "-log-every=2"}),
            (std::vector<std::string>{"prog", "--global_batch=8", "--seq_len", "32", "--data", "my-file.txt",
                                      "-log_every=2"}));
  // A negative number is a value, not a flag; nothing after "--" is a flag.
  EXPECT_EQ(normalize({"prog", "--lr", "-1e-3", "--", "--not-a-flag"}),
            (std::vector<std::string>{"prog", "--lr", "-1e-3", "--", "--not-a-flag"}));
}

TEST(FlagNames, RemoveFlagDropsEverySpelling) {
  const std::vector<std::string> args = {"prog", "--nproc", "2", "--steps=3", "--nproc=4", "-nproc", "5", "--x"};
  EXPECT_EQ(fsdp_train::remove_flag(args, "nproc"), (std::vector<std::string>{"prog", "--steps=3", "--x"}));
}

TEST(Validate, DefaultsAreValidForOneToFourRanks) {
  for (int n : {1, 2, 4}) EXPECT_TRUE(fsdp_train::validate(TrainConfig{}, n).ok()) << n;
}

TEST(Validate, MessagesNameTheFlag) {
  TrainConfig c;
  c.dim = 64;
  c.heads = 5;
  EXPECT_EQ(fsdp_train::validate(c, 1).message(), "--heads must divide --dim (got 64 and 5)");
  c = TrainConfig{};
  c.global_batch = 6;
  EXPECT_NE(fsdp_train::validate(c, 4).message().find("--global-batch"), std::string::npos);
  c = TrainConfig{};
  c.device = "tpu";
  EXPECT_NE(fsdp_train::validate(c, 1).message().find("--device"), std::string::npos);
  c = TrainConfig{};
  c.mesh = "2x3";
  EXPECT_NE(fsdp_train::validate(c, 4).message().find("--mesh"), std::string::npos);
  c = TrainConfig{};
  c.reduce_dtype = "fp64";
  EXPECT_NE(fsdp_train::validate(c, 1).message().find("--reduce-dtype"), std::string::npos);
}

TEST(Validate, AllGatherDtypeFlags) {
  TrainConfig c;
  c.all_gather_dtype = "int8";
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.compare_all_gather = true;
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.all_gather_dtype = "fp8";
  EXPECT_EQ(fsdp_train::validate(c, 2).message(), "--all-gather-dtype must be param or int8 (got 'fp8')");
  c = TrainConfig{};
  c.compare_all_gather = true;
  EXPECT_NE(fsdp_train::validate(c, 2).message().find("add --all-gather-dtype int8"), std::string::npos);
  c = TrainConfig{};
  c.no_shard = true;
  c.all_gather_dtype = "int8";
  EXPECT_NE(fsdp_train::validate(c, 1).message().find("--no-shard gathers nothing"), std::string::npos);
}

TEST(Validate, PrefetchFlag) {
  fsdp_train::TrainConfig c;
  c.prefetch = 2;
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.prefetch = -1;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(), "--prefetch must be >= 0 (got -1)");
  c.prefetch = 1;
  c.no_shard = true;
  EXPECT_EQ(fsdp_train::validate(c, 1).message(), "--no-shard gathers nothing: --prefetch is for fully_shard; drop it");
}

TEST(Validate, ActivationCheckpointingFlags) {
  fsdp_train::TrainConfig c;
  c.ac = "full";
  c.ac_every = 2;
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.ac = "some";
  EXPECT_EQ(fsdp_train::validate(c, 2).message(), "--ac must be none, full, selective or torchtitan (got 'some')");
  c.ac = "selective";
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.ac = "full";
  c.ac_every = 0;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(), "--ac-every must be >= 1 (got 0)");
  c.ac = "none";
  c.ac_every = 3;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(),
            "--ac-every 3 says which blocks --ac checkpoints; add --ac full or selective");
}

TEST(Validate, KvHeadsMustDivideHeadsAndVocabCoverTheBytes) {
  TrainConfig c;  // 4 heads
  for (int64_t kv : {0, 1, 2, 4}) {
    c.kv_heads = kv;
    EXPECT_TRUE(fsdp_train::validate(c, 2).ok()) << kv;
  }
  c.kv_heads = 3;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(),
            "--kv-heads must divide --heads (got 4 and 3): each key/value head serves an equal group of query heads");
  c.kv_heads = 8;  // more key/value heads than query heads
  EXPECT_NE(fsdp_train::validate(c, 2).message().find("(got 4 and 8)"), std::string::npos);
  c.kv_heads = -1;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(), "--kv-heads must be >= 0 (0: as many as --heads; got -1)");
  c = TrainConfig{};
  c.vocab = 128256;
  EXPECT_TRUE(fsdp_train::validate(c, 2).ok());
  c.vocab = 255;
  EXPECT_EQ(fsdp_train::validate(c, 2).message(),
            "--vocab must be >= 256, the byte-level corpus's 256 token values (got 255)");
}

TEST(Validate, MeshIsReplicateTimesShard) {
  auto mesh = fsdp_train::parse_mesh("2x3", 6);
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->replicate, 2);
  EXPECT_EQ(mesh->shard, 3);
  mesh = fsdp_train::parse_mesh("", 4);
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->replicate, 1);
  EXPECT_EQ(mesh->shard, 4);
  EXPECT_FALSE(fsdp_train::parse_mesh("2by3", 6).ok());
}

TEST(BatchSampler, RankSlicesMakeUpTheGlobalBatchAtEveryWorldSize) {
  const auto corpus = fsdp_train::load_corpus("", 64);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const fsdp_train::BatchSampler sampler(corpus->bytes, /*global_batch=*/6, /*seq_len=*/16, /*seed=*/3);
  for (int64_t step : {1, 2, 50}) {
    const fsdp_train::Batch global = sampler.local_batch(step, 0, 1);
    ASSERT_EQ(global.inputs.sizes(), (std::vector<int64_t>{6, 16}));
    // Targets are the inputs shifted by one byte.
    EXPECT_TRUE(global.inputs.narrow(1, 1, 15).equal(global.targets.narrow(1, 0, 15)));
    for (int64_t parts : {2, 3, 6}) {
      std::vector<at::Tensor> inputs, targets;
      for (int64_t r = 0; r < parts; ++r) {
        const fsdp_train::Batch local = sampler.local_batch(step, r, parts);
        EXPECT_EQ(local.inputs.size(0), 6 / parts);
        inputs.push_back(local.inputs);
        targets.push_back(local.targets);
      }
      EXPECT_TRUE(at::cat(inputs).equal(global.inputs)) << "step " << step << ", " << parts << " parts";
      EXPECT_TRUE(at::cat(targets).equal(global.targets)) << "step " << step << ", " << parts << " parts";
    }
  }
}

TEST(BatchSampler, MoreOrUnequalPartsThanRowsThrow) {
  const auto corpus = fsdp_train::load_corpus("", 64);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const fsdp_train::BatchSampler sampler(corpus->bytes, /*global_batch=*/2, /*seq_len=*/16, /*seed=*/3);
  EXPECT_THROW(sampler.local_batch(1, 3, 4), c10::Error);  // parts 2 and 3 would be empty
  const fsdp_train::BatchSampler six(corpus->bytes, /*global_batch=*/6, /*seq_len=*/16, /*seed=*/3);
  EXPECT_THROW(six.local_batch(1, 0, 4), c10::Error);  // 6 rows do not split into 4 equal parts
}

TEST(BatchSampler, BatchesDependOnSeedAndStepOnly) {
  const auto corpus = fsdp_train::load_corpus("", 64);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const fsdp_train::BatchSampler a(corpus->bytes, 8, 16, 1), b(corpus->bytes, 8, 16, 1), c(corpus->bytes, 8, 16, 2);
  EXPECT_EQ(a.offsets(5), b.offsets(5));
  EXPECT_NE(a.offsets(5), a.offsets(6));
  EXPECT_NE(a.offsets(5), c.offsets(5));
  // seed 1, step 2 is not seed 2, step 1 (seed and step are not just added).
  EXPECT_NE(a.offsets(2), c.offsets(1));
}

TEST(Corpus, ShippedCorpusIsFoundAndAMissingFileNamesData) {
  const auto corpus = fsdp_train::load_corpus("", 64);
  ASSERT_TRUE(corpus.ok());
  EXPECT_EQ(corpus->source, fsdp_train::default_corpus_path());
  EXPECT_GT(corpus->bytes.numel(), 20000);
  const auto missing = fsdp_train::load_corpus("/nonexistent/corpus.txt", 64);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--data"), std::string::npos);
  EXPECT_GT(fsdp_train::generated_text(1000).size(), 999u);
}

fsdp_train::ModelConfig small_model(int64_t kv_heads) {
  fsdp_train::ModelConfig config;  // dim 64, 4 heads of 16
  config.kv_heads = kv_heads;
  config.vocab = 300;
  return config;
}

// kv_heads 0 is multi-head attention: the parameters, their names and
// shapes of the model before grouped-query attention existed.
TEST(Model, DefaultKvHeadsIsMultiHeadAttention) {
  const fsdp_train::Transformer model(small_model(0));
  const auto params = model.named_parameters();
  EXPECT_EQ(params["layers.0.attention.qkv.weight"].sizes(), (std::vector<int64_t>{3 * 64, 64}));
  EXPECT_EQ(params["tok_embeddings.weight"].sizes(), (std::vector<int64_t>{300, 64}));
  EXPECT_EQ(params["output.weight"].sizes(), (std::vector<int64_t>{300, 64}));
  int64_t numel = 0;
  for (const auto& p : params) numel += p.value().numel();
  EXPECT_EQ(numel, fsdp_train::parameter_count(small_model(0)));
}

TEST(Model, KvHeadsShrinkTheKeyAndValueRows) {
  const fsdp_train::Transformer model(small_model(2));
  // q: 64 rows; k and v: 2 heads of 16 rows each.
  EXPECT_EQ(model.named_parameters()["layers.1.attention.qkv.weight"].sizes(), (std::vector<int64_t>{64 + 2 * 32, 64}));
  int64_t numel = 0;
  for (const auto& p : model.parameters()) numel += p.numel();
  EXPECT_EQ(numel, fsdp_train::parameter_count(small_model(2)));
  EXPECT_EQ(fsdp_train::parameter_count(small_model(0)) - numel, 2 * 64 * 64) << "2 blocks, 2 x 32 rows fewer each";
}

// The specification of grouped-query attention: 4 query heads over 2
// key/value heads equal multi-head attention whose key/value heads 0 and 1
// are the first key/value head and heads 2 and 3 the second
// (repeat_interleave: consecutive query heads share one, as in Llama).
TEST(Model, GroupedQueryAttentionEqualsMultiHeadWithEachKvHeadRepeatedForItsGroup) {
  const torch::NoGradGuard no_grad;
  const fsdp_train::ModelConfig gqa_config = small_model(2), mha_config = small_model(0);
  fsdp_train::Attention gqa(gqa_config), mha(mha_config);
  const int64_t d = 64, hd = 16;
  const at::Tensor w = gqa->qkv->weight;  // [q (4 x 16) ; k (2 x 16) ; v (2 x 16)] rows
  const auto repeated = [&](int64_t start) {
    const at::Tensor heads = w.narrow(0, start, 2 * hd).view({2, hd, d});
    return at::cat({heads[0], heads[0], heads[1], heads[1]});
  };
  mha->qkv->weight.copy_(at::cat({w.narrow(0, 0, d), repeated(d), repeated(d + 2 * hd)}));
  mha->proj->weight.copy_(gqa->proj->weight);
  const fsdp_train::RotaryTables rope = fsdp_train::rotary_tables(16, hd, 10000.0);
  const at::Tensor x = at::randn({2, 16, d});
  const at::Tensor expected = mha->forward(x, rope.cos, rope.sin);
  const at::Tensor got = gqa->forward(x, rope.cos, rope.sin);
  EXPECT_TRUE(at::allclose(got, expected, /*rtol=*/1e-5, /*atol=*/1e-6))
      << "max |difference| " << (got - expected).abs().max().item<float>();
}

// The binary: bad flags fail at once, with a message naming the flag.
void expect_flag_error(const std::vector<std::string>& args, const std::string& flag, const std::string& detail = "") {
  const RunResult run = run_program(FSDP_TRAIN_BINARY, args);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find(flag), std::string::npos) << "expected the message to name " << flag << ":\n" << run.output;
  if (!detail.empty()) {
    EXPECT_NE(run.output.find(detail), std::string::npos) << run.output;
  }
  EXPECT_EQ(run.output.find("step 1"), std::string::npos) << "training started:\n" << run.output;
}

TEST(FsdpTrainFlags, HeadsMustDivideDim) {
  expect_flag_error({"--dim", "64", "--heads", "5"}, "--heads", "(got 64 and 5)");
}

TEST(FsdpTrainFlags, KvHeadsMustDivideHeadsAndVocabCoverTheBytes) {
  expect_flag_error({"--heads", "4", "--kv-heads", "3"}, "--kv-heads must divide --heads", "(got 4 and 3)");
  expect_flag_error({"--vocab", "100"}, "--vocab", "(got 100)");
}

TEST(FsdpTrainFlags, GlobalBatchMustDivideAmongRanks) {
  expect_flag_error({"--nproc", "4", "--global-batch", "6"}, "--global-batch", "(got 6 for 4 ranks)");
  // The underscore spelling is the same flag.
  expect_flag_error({"--nproc=4", "--global_batch=7"}, "--global-batch", "(got 7 for 4 ranks)");
}

// More ranks than rows used to be the divisibility message alone; it now says
// which ranks would train on nothing and what to do.
TEST(FsdpTrainFlags, MoreRanksThanGlobalBatchRowsIsAClearError) {
  expect_flag_error({"--nproc", "4", "--global-batch", "2"}, "--global-batch",
                    "(got 2 for 4 ranks): a global batch of 2 rows over 4 data-parallel ranks leaves ranks 2..3 "
                    "without a row");
  expect_flag_error({"--nproc", "3", "--global-batch", "1"}, "--global-batch",
                    "use a global batch of at least 3 rows (a multiple of 3) or fewer ranks");
}

TEST(FsdpTrainFlags, UnknownDeviceIsRejected) { expect_flag_error({"--device", "tpu"}, "--device", "'tpu'"); }

TEST(FsdpTrainFlags, CpuOffloadNeedsCuda) {
  expect_flag_error({"--cpu-offload"}, "--cpu-offload needs --device cuda", "(got --device cpu)");
}

TEST(FsdpTrainFlags, MeshMustCoverTheWorld) {
  expect_flag_error({"--nproc", "2", "--mesh", "3x1"}, "--mesh", "world size is 2");
}

TEST(FsdpTrainFlags, UnknownDtypeIsRejected) { expect_flag_error({"--param-dtype", "fp8"}, "--param-dtype", "'fp8'"); }

TEST(FsdpTrainFlags, UnreadableDataIsRejectedBeforeStarting) {
  expect_flag_error({"--nproc", "2", "--data", "/nonexistent/corpus.txt"}, "--data", "/nonexistent/corpus.txt");
}

}  // namespace
}  // namespace fsdp_train_test
