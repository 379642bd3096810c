// Custom collectives (fsdp2/custom_collectives.h): a user-supplied
// all-gather and reduce-scatter per module (FSDP2's set_custom_all_gather /
// set_custom_reduce_scatter), and Int8AllGather, the quantized all-gather.
//
// - A pass-through custom all-gather and reduce-scatter that count their
//   calls and allocations train exactly as the default (against the
//   unsharded reference, as fsdp2_training_test.cc), at world sizes 1-4,
//   one rank included (a group with a custom collective leaves the world
//   size 1 fast path), and are called once per all-gather / reduce-scatter
//   the runtime reports.
// - Int8AllGather: its round trip (zero blocks, outliers, the error bound,
//   non-finite values), the unsharded parameters it produces (every rank the
//   same bits, equal to quantizing each rank's chunk), the bytes it moves
//   (the exact formula, about 1/4 of fp32's and 1/2 of bf16's), and training
//   with it staying close to the unquantized run, fp32 and bf16.
// - Errors name the module and say what to do.
#include <cmath>
#include <cstdio>

#include "fsdp2/custom_collectives.h"
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

class CountingAllGather : public AllGather {  // in namespace fsdp
 public:
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return AllGather::allocate(sizes, dtype, device);
  }
  collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                               collectives::Communicator& comm) override {
    ++calls;
    return comm.all_gather_into_tensor(output, input);
  }
  int64_t calls = 0;
  int64_t allocations = 0;
};

class CountingReduceScatter : public ReduceScatter {
 public:
  at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return ReduceScatter::allocate(sizes, dtype, device);
  }
  collectives::Work reduce_scatter(const at::Tensor& output, const at::Tensor& input, const collectives::ReduceOp& op,
                                   collectives::Communicator& comm) override {
    ++calls;
    return comm.reduce_scatter_tensor(output, input, op);
  }
  int64_t calls = 0;
  int64_t allocations = 0;
};

constexpr int64_t kRows = 12;  // divisible by every world size 1-4

struct RunOptions {
  ModelKind kind = ModelKind::kMlp;
  Optim optim = Optim::kSgd;
  int steps = 5;
  std::optional<ReshardAfterForward> reshard_after_forward;
  MixedPrecisionPolicy mp;
  // Applied to every sharded module (the blocks and the root).
  std::function<void(FSDPModule&)> configure;
};

struct TrainedRun {
  std::shared_ptr<LossModel> model;
  std::vector<FSDPModule> modules;  // the blocks, then the root
  std::vector<double> losses;       // mean over ranks, per step
  RuntimeStats stats;               // over all steps
};

TrainedRun train_sharded(testing::RankContext& ctx, const RunOptions& o) {
  TrainedRun run;
  run.model = make_model(o.kind);
  FullyShardOptions fs;
  fs.mesh = ctx.mesh();
  fs.reshard_after_forward = o.reshard_after_forward;
  fs.mp_policy = o.mp;
  for (auto& block : run.model->blocks()) run.modules.push_back(fully_shard(block, fs));
  run.modules.push_back(fully_shard(run.model, fs));
  if (o.configure) {
    for (auto& m : run.modules) o.configure(m);
  }
  auto optim = make_optimizer(o.optim, run.model->parameters());
  for (int step = 0; step < o.steps; ++step) {
    const Batch local = make_batch(o.kind, step, kRows).slice(ctx.rank(), ctx.world_size());
    optim->zero_grad();
    at::Tensor loss = call_module(*run.model, local.x, local.y);
    loss.backward();
    optim->step();
    run.losses.push_back(mean_over_ranks(ctx, loss.item<double>()));
  }
  run.stats = run.modules.back().runtime_stats();
  return run;
}

std::vector<double> train_reference(const RunOptions& o, std::shared_ptr<LossModel>* model_out = nullptr) {
  auto model = make_model(o.kind);
  auto optim = make_optimizer(o.optim, model->parameters());
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    const Batch batch = make_batch(o.kind, step, kRows);
    optim->zero_grad();
    at::Tensor loss = model->forward(batch.x, batch.y);
    loss.backward();
    optim->step();
    losses.push_back(loss.item<double>());
  }
  if (model_out) *model_out = model;
  return losses;
}

class CustomCollectives : public ::testing::TestWithParam<int> {};

// ---- Pass-through custom collectives ----

// Trains `o` sharded, and expects the losses and parameters of the unsharded
// reference trained the same way.
TrainedRun train_sharded_matching_reference(testing::RankContext& ctx, const RunOptions& o) {
  TrainedRun run = train_sharded(ctx, o);
  std::shared_ptr<LossModel> reference;
  const std::vector<double> ref_losses = train_reference(o, &reference);
  for (size_t i = 0; i < ref_losses.size(); ++i) {
    EXPECT_NEAR(run.losses[i], ref_losses[i], 1e-5 * std::abs(ref_losses[i]) + 1e-7) << "step " << i;
  }
  expect_params_match(*run.model, *reference, ctx.mesh());
  return run;
}

void expect_pass_through_matches_reference(testing::RankContext& ctx, RunOptions o, const std::string& name) {
  SCOPED_TRACE(name);
  auto all_gather = std::make_shared<CountingAllGather>();
  auto reduce_scatter = std::make_shared<CountingReduceScatter>();
  o.configure = [&](FSDPModule& m) {
    m.set_custom_all_gather(all_gather);  // one object for every module
    m.set_custom_reduce_scatter(reduce_scatter);
  };
  const TrainedRun run = train_sharded_matching_reference(ctx, o);
  // Every all-gather and reduce-scatter went through them, one rank included
  // (no world size 1 fast path), each with its own allocations.
  EXPECT_GT(run.stats.all_gathers, 0);
  EXPECT_EQ(all_gather->calls, run.stats.all_gathers);
  EXPECT_EQ(all_gather->allocations, all_gather->calls);
  EXPECT_GT(run.stats.reduce_scatters, 0);
  EXPECT_EQ(reduce_scatter->calls, run.stats.reduce_scatters);
  EXPECT_EQ(reduce_scatter->allocations, 2 * reduce_scatter->calls);  // input and output
}

TEST_P(CustomCollectives, PassThroughTrainsLikeTheUnshardedReference) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_pass_through_matches_reference(ctx, {.kind = ModelKind::kMlp}, "MLP, SGD");
    expect_pass_through_matches_reference(ctx, {.kind = ModelKind::kTransformer, .optim = Optim::kAdamW},
                                          "Transformer, AdamW");
    if (ctx.world_size() == 4) {
      // Backward gathers over the post-forward group of 2 ranks.
      expect_pass_through_matches_reference(
          ctx, {.kind = ModelKind::kTransformer, .optim = Optim::kAdamW, .reshard_after_forward = 2},
          "Transformer, reshard_after_forward=2");
    }
  });
}

TEST_P(CustomCollectives, NullRestoresTheDefault) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    auto all_gather = std::make_shared<CountingAllGather>();
    RunOptions o;
    o.configure = [&](FSDPModule& m) {
      m.set_custom_all_gather(all_gather);
      m.set_custom_reduce_scatter(std::make_shared<CountingReduceScatter>());
      m.set_custom_all_gather(nullptr);  // the default again
      m.set_custom_reduce_scatter(nullptr);
    };
    const TrainedRun run = train_sharded_matching_reference(ctx, o);
    EXPECT_EQ(all_gather->calls, 0);
    // At one rank the group is back on the fast path: no collective at all.
    if (ctx.world_size() == 1) {
      EXPECT_EQ(run.stats.all_gathers, 0);
      EXPECT_EQ(run.stats.reduce_scatters, 0);
    }
  });
}

// ---- Int8AllGather: the round trip ----

// Quantizes `x` (1-D) as one rank and dequantizes it back.
at::Tensor round_trip(const Int8AllGather& q, const at::Tensor& x) {
  at::Tensor row = at::empty({q.row_bytes(x.numel())}, x.options().dtype(at::kByte));
  q.quantize(x, row);
  at::Tensor out = at::empty_like(x);
  q.dequantize(row.view({1, -1}), out);
  return out;
}

// The largest magnitude of each element's block.
at::Tensor block_absmax(const at::Tensor& x, int64_t block) {
  const int64_t blocks = (x.numel() + block - 1) / block;
  at::Tensor padded = at::constant_pad_nd(x.abs(), {0, blocks * block - x.numel()});
  return padded.view({blocks, block}).amax(1).repeat_interleave(block).narrow(0, 0, x.numel());
}

TEST(Int8AllGatherRoundTrip, ErrorIsAtMostHalfAStepOfEachBlock) {
  const Int8AllGather q(64);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  // 1000 elements: 15 full blocks and a tail of 40; blocks of very
  // different magnitudes, so a value scaled by another block's scale shows.
  at::Tensor x = at::randn({1000}, gen) * at::pow(10.0, at::arange(1000) / 64 % 5 - 2);
  const at::Tensor y = round_trip(q, x);
  const at::Tensor bound = block_absmax(x, 64) / 254 * (1 + 1e-5);
  EXPECT_TRUE((y - x).abs().le(bound).all().item<bool>()) << "max excess " << ((y - x).abs() - bound).max();
  // Each block's largest magnitude is kept to fp32 rounding (q = +-127).
  const at::Tensor absmax = block_absmax(x, 64);
  EXPECT_TRUE(at::allclose(block_absmax(y, 64), absmax, 1e-6, 0));
}

TEST(Int8AllGatherRoundTrip, ZeroBlockAndOutlier) {
  const Int8AllGather q(128);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor x = at::randn({3 * 128}, gen) * 0.01;
  x.narrow(0, 0, 128).zero_();  // block 0: zeros
  x[128 + 5] = 1000.0;          // block 1: one huge outlier among small values
  at::Tensor row = at::empty({q.row_bytes(x.numel())}, at::kByte);
  q.quantize(x, row);
  const at::Tensor scales = row.narrow(0, 0, 12).view(at::kFloat);
  EXPECT_EQ(scales[0].item<float>(), 0.0f);  // no division by zero
  EXPECT_FLOAT_EQ(scales[1].item<float>(), 1000.0f / 127);
  at::Tensor y = at::empty_like(x);
  q.dequantize(row.view({1, -1}), y);
  EXPECT_TRUE(y.narrow(0, 0, 128).eq(0).all().item<bool>());
  EXPECT_NEAR(y[128 + 5].item<double>(), 1000.0, 1000.0 * 1e-6);
  // The outlier's step (7.9) swallows its block's small values: they become 0.
  at::Tensor rest = at::cat({y.narrow(0, 128, 5), y.narrow(0, 134, 122)});
  EXPECT_TRUE(rest.eq(0).all().item<bool>());
  // The next block keeps its own scale: half a step of its own absmax.
  const at::Tensor last = x.narrow(0, 256, 128);
  EXPECT_LE((y.narrow(0, 256, 128) - last).abs().max().item<double>(),
            last.abs().max().item<double>() / 254 * (1 + 1e-5));
}

TEST(Int8AllGatherRoundTrip, NonFiniteValuesStayInTheirBlock) {
  const Int8AllGather q(16);
  at::Tensor x = at::linspace(-1, 1, 48);
  x[20] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor y = round_trip(q, x);
  EXPECT_TRUE(y.narrow(0, 16, 16).isnan().all().item<bool>());
  EXPECT_TRUE(y.narrow(0, 0, 16).isfinite().all().item<bool>());
  EXPECT_TRUE(y.narrow(0, 32, 16).isfinite().all().item<bool>());
}

TEST(Int8AllGatherRoundTrip, Bf16AndSizes) {
  const Int8AllGather q;  // 256
  EXPECT_EQ(q.num_blocks(1000), 4);
  EXPECT_EQ(q.row_bytes(1000), 16 + 1000);
  EXPECT_EQ(q.row_bytes(1001), 1020);  // 16 + 1001, padded to a multiple of 4
  EXPECT_EQ(q.row_bytes(0), 0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randn({1001}, gen).to(at::kBFloat16);
  const at::Tensor y = round_trip(q, x);
  ASSERT_EQ(y.scalar_type(), at::kBFloat16);
  const at::Tensor xf = x.to(at::kFloat);
  // Half a step, plus the rounding of the result to bf16 (2^-8 relative).
  const at::Tensor bound = block_absmax(xf, 256) / 254 + xf.abs() / 256 + 1e-6;
  EXPECT_TRUE((y.to(at::kFloat) - xf).abs().le(bound).all().item<bool>());
}

// ---- Int8AllGather: what the ranks gather ----

// A Linear of 13 x 300 (uneven shards at 2-4 ranks; blocks span rows).
struct Wide : torch::nn::Module {
  Wide() : fc(register_module("fc", torch::nn::Linear(300, 13))) {}
  torch::nn::Linear fc;
};

// What Int8AllGather makes of the full `weight` and `bias` at `world` ranks:
// each rank's chunk (its padded weight rows, then its padded bias rows)
// quantized on its own.
std::pair<at::Tensor, at::Tensor> expected_int8_unsharded(const Int8AllGather& q, const at::Tensor& weight,
                                                          const at::Tensor& bias, int64_t world) {
  const int64_t rows = weight.size(0), chunk = (rows + world - 1) / world;
  std::vector<at::Tensor> w_parts, b_parts;
  for (int64_t r = 0; r < world; ++r) {
    const int64_t begin = std::min(r * chunk, rows), len = std::min(chunk, rows - begin);
    at::Tensor w = at::zeros({chunk, weight.size(1)});
    at::Tensor b = at::zeros({chunk});
    w.narrow(0, 0, len).copy_(weight.narrow(0, begin, len));
    b.narrow(0, 0, len).copy_(bias.narrow(0, begin, len));
    const at::Tensor back = round_trip(q, at::cat({w.view({-1}), b}));
    w_parts.push_back(back.narrow(0, 0, w.numel()).view({chunk, weight.size(1)}).narrow(0, 0, len));
    b_parts.push_back(back.narrow(0, w.numel(), chunk).narrow(0, 0, len));
  }
  return {at::cat(w_parts), at::cat(b_parts)};
}

TEST_P(CustomCollectives, Int8UnshardedParametersAreTheSameBitsOnEveryRank) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    torch::manual_seed(0);
    auto model = std::make_shared<Wide>();
    const at::Tensor full_w = model->fc->weight.detach().clone(), full_b = model->fc->bias.detach().clone();
    FullyShardOptions fs = mesh_options(ctx);
    FSDPModule m = fully_shard(model, fs);
    auto int8 = std::make_shared<Int8AllGather>(64);  // the quantized all-gather, blocks of 64
    m.set_custom_all_gather(int8);
    m.unshard();
    const at::Tensor w = model->fc->weight.detach().clone(), b = model->fc->bias.detach().clone();
    m.reshard();
    const auto [exp_w, exp_b] = expected_int8_unsharded(*int8, full_w, full_b, ctx.world_size());
    EXPECT_TRUE(w.equal(exp_w)) << "max diff " << (w - exp_w).abs().max();
    EXPECT_TRUE(b.equal(exp_b)) << "max diff " << (b - exp_b).abs().max();
    // Every rank holds the same bits (its own chunk comes from the gathered
    // bytes too).
    const at::Tensor mine = at::cat({w.view({-1}), b});
    at::Tensor all = at::empty({ctx.world_size() * mine.numel()});
    ctx.world_group()->all_gather_into_tensor(all, mine).wait();
    for (int r = 0; r < ctx.world_size(); ++r) {
      EXPECT_TRUE(all.narrow(0, r * mine.numel(), mine.numel()).equal(mine)) << "rank " << r;
    }
  });
}

TEST_P(CustomCollectives, Int8MovesAQuarterOfFp32AndHalfOfBf16) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    const int64_t world = ctx.world_size();
    const int64_t chunk_rows = (13 + world - 1) / world;
    const int64_t n = chunk_rows * 300 + chunk_rows;  // one rank's all-gather input: weight and bias shards
    for (const c10::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(c10::toString(dtype));
      auto bytes_of_one_all_gather = [&](bool int8) {
        torch::manual_seed(0);
        auto model = std::make_shared<Wide>();
        FullyShardOptions fs = mesh_options(ctx);
        fs.mp_policy.param_dtype = dtype;
        FSDPModule m = fully_shard(model, fs);
        if (int8) m.set_custom_all_gather(std::make_shared<Int8AllGather>());
        m.unshard();
        m.reshard();
        const RuntimeStats stats = m.runtime_stats();
        EXPECT_EQ(stats.all_gathers, world == 1 && !int8 && dtype == at::kFloat ? 0 : 1);
        return stats.all_gather_bytes;
      };
      const int64_t plain = bytes_of_one_all_gather(false);
      const int64_t int8 = bytes_of_one_all_gather(true);
      EXPECT_EQ(plain, (world - 1) * n * static_cast<int64_t>(c10::elementSize(dtype)));
      // Scales (4 bytes per block of 256) and values (1 byte each) in one
      // row per rank, padded to 4 bytes.
      const int64_t row = ((n + 255) / 256 * 4 + n + 3) / 4 * 4;
      EXPECT_EQ(int8, (world - 1) * row);
      if (world > 1) {
        const double ratio = static_cast<double>(int8) / static_cast<double>(plain);
        const double ideal = dtype == at::kFloat ? 0.25 : 0.5;
        EXPECT_GE(ratio, ideal);
        // At most 3 bytes of padding per row besides the scales.
        EXPECT_LE(ratio, ideal * (1 + 4.0 / 256) + 7.0 * static_cast<double>(world - 1) / static_cast<double>(plain));
      }
    }
  });
}

// ---- Int8AllGather: training ----

// [Note: int8 loss bound] Every gathered weight is off by at most half a
// quantization step, max|block| / 254 (0.39% of its block's largest
// magnitude; most elements much less). These small models' losses move by
// well under that relative amount over 5 steps (measured: see docs/fsdp2.md);
// the bound below, 1% of the loss, is 2.5x the worst per-weight error and
// fails for a scale from the wrong block or a missing dequantization (both
// were planted: the loss is then off by far more). Under bf16 the loss
// itself is a bf16 value (the test models compute it in param_dtype): each
// rank's loss is rounded to 2^-8 relative, so two runs' losses may differ by
// two such roundings on top.
constexpr double kInt8LossRelTol = 1e-2;
constexpr double kBf16LossRounding = 2.0 / 256;

void expect_int8_close_to_unquantized(testing::RankContext& ctx, RunOptions o, const std::string& name) {
  SCOPED_TRACE(name);
  const TrainedRun plain = train_sharded(ctx, o);
  o.configure = [](FSDPModule& m) { m.set_custom_all_gather(std::make_shared<Int8AllGather>()); };
  const TrainedRun int8 = train_sharded(ctx, o);
  double max_rel = 0;
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    const double rel = std::abs(int8.losses[i] - plain.losses[i]) / std::abs(plain.losses[i]);
    max_rel = std::max(max_rel, rel);
    EXPECT_LE(rel, kInt8LossRelTol + (o.mp.param_dtype == at::kBFloat16 ? kBf16LossRounding : 0.0))
        << "step " << i << ": int8 " << int8.losses[i] << ", plain " << plain.losses[i];
  }
  // It is quantized: the losses are not the unquantized ones.
  EXPECT_GT(max_rel, 0.0);
  // Shown with FSDP2CPP_TEST_VERBOSE=1 (docs/fsdp2.md quotes it).
  if (ctx.rank() == 0)
    std::printf("%s, world %d: max relative loss difference %.3g\n", name.c_str(), ctx.world_size(), max_rel);
  EXPECT_EQ(int8.stats.all_gathers, plain.stats.all_gathers == 0 ? int8.stats.all_gathers : plain.stats.all_gathers);
  EXPECT_GT(int8.stats.all_gathers, 0);
}

TEST_P(CustomCollectives, Int8TrainingStaysCloseToUnquantized) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    expect_int8_close_to_unquantized(ctx, {.kind = ModelKind::kMlp}, "MLP, SGD, fp32");
    expect_int8_close_to_unquantized(ctx, {.kind = ModelKind::kTransformer, .optim = Optim::kAdamW},
                                     "Transformer, AdamW, fp32");
    MixedPrecisionPolicy bf16;
    bf16.param_dtype = at::kBFloat16;
    expect_int8_close_to_unquantized(ctx, {.kind = ModelKind::kTransformer, .optim = Optim::kAdamW, .mp = bf16},
                                     "Transformer, AdamW, bf16");
  });
}

// ---- Errors ----

TEST_P(CustomCollectives, ErrorsNameTheModule) {
  testing::run_distributed(GetParam(), [](testing::RankContext& ctx) {
    EXPECT_THROW_WITH(Int8AllGather(0), "block size must be positive");
    {
      // Mid-step: between forward and backward, the root (not resharded
      // after forward) is unsharded.
      auto model = make_model(ModelKind::kMlp);
      FullyShardOptions fs = mesh_options(ctx);
      for (auto& block : model->blocks()) fully_shard(block, fs);
      FSDPModule root = fully_shard(model, fs);
      const Batch local = make_batch(ModelKind::kMlp, 0, kRows).slice(ctx.rank(), ctx.world_size());
      at::Tensor loss = call_module(*model, local.x, local.y);
      EXPECT_THROW_WITH(root.set_custom_reduce_scatter(std::make_shared<CountingReduceScatter>()),
                        "set_custom_reduce_scatter: the root module (", "in the middle of a step",
                        "set custom collectives between steps");
      loss.backward();
      root.set_custom_all_gather(std::make_shared<Int8AllGather>());  // between steps: fine
    }
    {
      // A module whose parameters all belong to its sharded submodules.
      struct Holder : torch::nn::Module {
        Holder() : block(register_module("block", MLPBlock(7, 3))) {}
        MLPBlock block;
      };
      auto model = std::make_shared<Holder>();
      FullyShardOptions fs = mesh_options(ctx);
      fully_shard(model->block, fs);
      FSDPModule root = fully_shard(model, fs);
      EXPECT_THROW_WITH(root.set_custom_all_gather(std::make_shared<Int8AllGather>()), "has no parameters of its own",
                        "call it on the modules");
    }
    {
      // allocate that ignores the size it is given; an all-gather that throws.
      struct BadAllocate : CountingAllGather {
        at::Tensor allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) override {
          return at::empty({sizes[0] + 1}, at::TensorOptions().dtype(dtype).device(device));
        }
      };
      struct Throwing : CountingAllGather {
        collectives::Work all_gather(const at::Tensor&, const at::Tensor&, collectives::Communicator&) override {
          TORCH_CHECK(false, "out of carrier pigeons");
        }
      };
      auto model = make_model(ModelKind::kMlp);
      FullyShardOptions fs = mesh_options(ctx);
      FSDPModule b0 = fully_shard(model->blocks()[0], fs);
      FSDPModule b1 = fully_shard(model->blocks()[1], fs);
      FSDPModule root = fully_shard(model, fs);
      b0.set_custom_all_gather(std::make_shared<BadAllocate>());
      const Batch local = make_batch(ModelKind::kMlp, 0, kRows).slice(ctx.rank(), ctx.world_size());
      EXPECT_THROW_WITH(call_module(*model, local.x, local.y), "module 'b0': the custom all-gather's allocate returned",
                        "], Float on cpu; expected a contiguous tensor of shape [",
                        "], Float on cpu. allocate must return a buffer of exactly");
      root.reset_iter_state();
      b0.set_custom_all_gather(nullptr);
      b1.set_custom_all_gather(std::make_shared<Throwing>());
      EXPECT_THROW_WITH(call_module(*model, local.x, local.y), "module 'b1': the custom all-gather failed",
                        "out of carrier pigeons");
      root.reset_iter_state();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CustomCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace fsdp::test
