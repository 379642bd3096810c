// Stream order on a real GPU. Each test delays, with at::cuda::sleep, the
// stream whose work another stream must wait for: an optimizer step in the
// post-accumulate-grad hooks (run on the reduction stream), an optimizer on a
// side stream behind set_post_optim_event, one rank's compute under Gloo. A
// missing event then lets the waiting stream read stale parameters. The
// delayed run must equal the undelayed one bit for bit (the same kernels in
// the same order on the same data) and the unsharded reference closely.
//
// One GPU cannot hold two NCCL ranks: world size 1 runs NCCL off the fast
// path (a pass-through custom all-gather keeps copy-in, all-gather and
// copy-out on their streams), world sizes 2-4 run Gloo on CUDA tensors.
// Skips without a GPU; the stream-order checker (docs/gpu.md) proves the
// multi-rank NCCL order on CPU.
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <sys/wait.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "fsdp2/custom_collectives.h"
#include "fsdp_common/config.h"
#if FSDP2CPP_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif
#include "fsdp2_test_util.h"

namespace fsdp::test {
namespace {

constexpr int kSteps = 4;
constexpr int64_t kRows = 12;  // divides evenly at world sizes 1-4
constexpr double kSgdLr = 0.05;

// About 25 ms at an H100's 1.98 GHz: far longer than a block's kernels, so
// a stream that does not wait for the delayed one runs ahead of it.
void delay_current_stream() {
#if FSDP2CPP_WITH_CUDA
  at::cuda::sleep(50'000'000);
#endif
}

// Bit-for-bit comparisons of two runs need deterministic kernels (the tied
// embedding's backward, cuBLAS's workspaces); where an op has none, it warns.
void use_deterministic_kernels() {
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
}

enum class Optimizer {
  kSgdInBackward,    // SGD in every parameter's post-accumulate-grad hook
  kSideStreamAdamW,  // AdamW on a side stream, then set_post_optim_event
};

struct RunOptions {
  Optimizer optimizer = Optimizer::kSgdInBackward;
  bool delay = false;  // sleep on the stream of the step before each update
  std::optional<double> divide_factor;
  bool delay_compute = false;  // sleep on the current stream before each forward
};

// What a run produced, on the host: the loss of every step (this rank's),
// the gradients of the last backward and the final parameters, gathered.
struct Trace {
  std::vector<at::Tensor> losses;
  std::vector<std::pair<std::string, at::Tensor>> grads;
  std::vector<std::pair<std::string, at::Tensor>> params;
};

// Keeps a world-size-1 group off the fast path, which computes on the
// shards on the current stream and has no copy-in or copy-out to order.
class PassThroughAllGather : public AllGather {
 public:
  collectives::Work all_gather(const at::Tensor& output, const at::Tensor& input,
                               collectives::Communicator& comm) override {
    return comm.all_gather_into_tensor(output, input);
  }
};

// The optimizer-in-backward pattern: the hook updates the sharded parameter
// with its reduced gradient, on the stream the runtime runs hooks on (the
// reduction stream), after an optional delay of that stream.
struct SgdStepInHook : torch::autograd::PostAccumulateGradHook {
  explicit SgdStepInHook(bool delay) : delay(delay) {}
  void operator()(const torch::autograd::Variable& p) override {
    if (delay) delay_current_stream();
    c10::NoGradGuard no_grad;
    p.detach().add_(p.grad(), -kSgdLr);
  }
  bool delay;
};

at::Tensor gathered(const at::Tensor& sharded, const at::Tensor& like, const DeviceMesh& mesh) {
  return full_param(sharded, like.sizes().vec(), mesh).cpu();
}

Trace train_sharded(testing::RankContext& ctx, const RunOptions& run) {
  use_deterministic_kernels();
  const c10::Device device = ctx.device();
  auto model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  auto shapes = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  model->to(device);
  const FullyShardOptions fs = mesh_options(ctx);
  std::vector<FSDPModule> modules;
  for (auto& block : model->blocks()) modules.push_back(fully_shard(block, fs));
  FSDPModule root = fully_shard(model, fs);
  modules.push_back(root);
  for (auto& m : modules) {
    if (ctx.world_size() == 1) m.set_custom_all_gather(std::make_shared<PassThroughAllGather>());
    if (run.divide_factor) m.set_gradient_divide_factor(*run.divide_factor);
  }
  std::unique_ptr<torch::optim::AdamW> adamw;
  if (run.optimizer == Optimizer::kSgdInBackward) {
    for (const auto& p : model->parameters()) {
      torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<SgdStepInHook>(run.delay));
    }
  } else {
    adamw = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  }
  const c10::impl::VirtualGuardImpl guard_impl(device.type());
  const c10::Stream side = guard_impl.getStreamFromGlobalPool(device);
  // On the device before the loop: a copy from pageable memory waits for
  // the current stream, and a host that waits gives a late stream time to
  // catch up, which would hide a missing event.
  std::vector<Batch> batches;
  for (int step = 0; step < kSteps; ++step) {
    const Batch local = make_batch(ModelKind::kTransformer, step, kRows).slice(ctx.rank(), ctx.world_size());
    batches.push_back({local.x.to(device), local.y.to(device)});
  }
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    if (run.delay_compute) delay_current_stream();
    at::Tensor loss = call_module(*model, batches[step].x, batches[step].y);
    loss.backward();
    // Kept on the device: a host read here would synchronize and hide a race.
    trace.losses.push_back(loss.detach().clone());
    if (step == kSteps - 1) {
      for (const auto& item : model->named_parameters()) {
        trace.grads.emplace_back(item.key(),
                                 gathered(item.value().grad(), shapes->named_parameters()[item.key()], ctx.mesh()));
      }
    }
    if (adamw) {
      // The side stream starts after backward's end (the current stream has
      // waited for the reductions); the next forward's all-gathers wait for
      // the step through the event, the compute stream does not.
      c10::Event backward_done(device.type());
      backward_done.record(guard_impl.getStream(device));
      backward_done.block(side);
      auto post_optim = std::make_shared<c10::Event>(device.type());
      {
        c10::StreamGuard on_side(side);
        if (run.delay) delay_current_stream();
        adamw->step();
        // The gradients were made on the runtime's streams; the step reads
        // them here, so their blocks must wait for this stream when freed.
        for (const auto& p : model->parameters()) {
          if (p.grad().defined()) p.grad().record_stream(side);
        }
        adamw->zero_grad();
        post_optim->record(side);
      }
      root.set_post_optim_event(post_optim);
    } else {
      for (const auto& p : model->parameters()) p.mutable_grad().reset();
    }
  }
  // The program reads the parameters after the last step: its own wait.
  c10::Event last_step_done(device.type());
  last_step_done.record(side);
  last_step_done.block(guard_impl.getStream(device));
  for (auto& loss : trace.losses) loss = loss.cpu();
  for (const auto& item : model->named_parameters()) {
    trace.params.emplace_back(item.key(), gathered(item.value(), shapes->named_parameters()[item.key()], ctx.mesh()));
  }
  return trace;
}

// The same training unsharded on the device: each rank's loss is the mean
// over its slice, so the global-batch mean equals the ranks' mean, and the
// gradients are the global mean's scaled by world / divide factor.
Trace train_reference(c10::Device device, int world, const RunOptions& run) {
  use_deterministic_kernels();
  auto model = make_model(ModelKind::kTransformer);
  model->to(device);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const double grad_scale = run.divide_factor ? world / *run.divide_factor : 1.0;
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(ModelKind::kTransformer, step, kRows);
    at::Tensor loss = model->forward(batch.x.to(device), batch.y.to(device));
    (grad_scale == 1.0 ? loss : loss * grad_scale).backward();
    trace.losses.push_back(loss.detach().cpu());
    if (step == kSteps - 1) {
      for (const auto& item : model->named_parameters())
        trace.grads.emplace_back(item.key(), item.value().grad().cpu());
    }
    if (run.optimizer == Optimizer::kSgdInBackward) {
      c10::NoGradGuard no_grad;
      for (const auto& p : model->parameters()) p.add_(p.grad(), -kSgdLr);
    } else {
      adamw.step();
    }
    adamw.zero_grad();
  }
  for (const auto& item : model->named_parameters()) trace.params.emplace_back(item.key(), item.value().detach().cpu());
  return trace;
}

double mean_loss_over_ranks(testing::RankContext& ctx, const at::Tensor& loss) {
  at::Tensor t = loss.to(ctx.device(), at::kFloat).reshape({1}).clone();
  ctx.world_group()->all_reduce(t, collectives::ReduceOp::avg()).wait();
  return t.item<double>();
}

void expect_bitwise_equal(const Trace& actual, const Trace& expected, const std::string& what) {
  ASSERT_EQ(actual.losses.size(), expected.losses.size());
  for (size_t i = 0; i < actual.losses.size(); ++i) {
    EXPECT_TRUE(at::equal(actual.losses[i], expected.losses[i])) << what << ": loss of step " << i;
  }
  ASSERT_EQ(actual.params.size(), expected.params.size());
  for (size_t i = 0; i < actual.params.size(); ++i) {
    const at::Tensor& a = actual.params[i].second;
    const at::Tensor& e = expected.params[i].second;
    EXPECT_TRUE(at::equal(a, e)) << what << ": " << actual.params[i].first << ", max abs diff "
                                 << (a - e).abs().max().item<double>();
    EXPECT_TRUE(at::equal(actual.grads[i].second, expected.grads[i].second))
        << what << ": " << actual.grads[i].first << ".grad";
  }
}

// Close to the unsharded reference; the last element of every gradient is
// checked on its own too (a one-rank AVG reduce-scatter on NCCL < 2.29.7
// leaves the tail of its output unwritten).
void expect_matches_reference(testing::RankContext& ctx, const Trace& actual, const Trace& reference) {
  for (size_t i = 0; i < reference.losses.size(); ++i) {
    const double expected = reference.losses[i].item<double>();
    EXPECT_NEAR(mean_loss_over_ranks(ctx, actual.losses[i]), expected, 1e-4 * std::abs(expected)) << "step " << i;
  }
  ASSERT_EQ(actual.params.size(), reference.params.size());
  for (size_t i = 0; i < reference.params.size(); ++i) {
    ASSERT_EQ(actual.params[i].first, reference.params[i].first);
    expect_close(actual.params[i].second, reference.params[i].second, actual.params[i].first, 1e-4, 1e-5);
    const at::Tensor grad = actual.grads[i].second.reshape({-1});
    const at::Tensor ref_grad = reference.grads[i].second.reshape({-1});
    expect_close(grad, ref_grad, actual.grads[i].first + ".grad", 1e-4, 1e-5);
    const int64_t last = grad.numel() - 1;
    EXPECT_NEAR(grad[last].item<double>(), ref_grad[last].item<double>(),
                1e-4 * std::abs(ref_grad[last].item<double>()) + 1e-5)
        << actual.grads[i].first << ".grad's last element";
  }
}

testing::DistributedTestOptions nccl_world_size_one() { return testing::cuda_options(1); }

// The update a hook makes on the reduction stream is seen by the next
// forward's copy-in: the post-reduce event is recorded after the hooks.
TEST(Fsdp2GpuOrder, OptimizerInBackwardUpdatesBeforeTheNextAllGather) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(nccl_world_size_one(), [](testing::RankContext& ctx) {
    EXPECT_EQ(ctx.world_group()->backend_kind(), collectives::BackendKind::kNccl);
    const Trace plain = train_sharded(ctx, {Optimizer::kSgdInBackward, /*delay=*/false});
    const Trace delayed = train_sharded(ctx, {Optimizer::kSgdInBackward, /*delay=*/true});
    expect_bitwise_equal(delayed, plain, "hooks delayed");
    expect_matches_reference(ctx, delayed, train_reference(ctx.device(), 1, {Optimizer::kSgdInBackward}));
  });
}

// An optimizer on a side stream behind set_post_optim_event: the next
// forward's all-gathers wait for the event, not for the whole current
// stream, and still see the step.
TEST(Fsdp2GpuOrder, SideStreamOptimizerBehindThePostOptimEvent) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(nccl_world_size_one(), [](testing::RankContext& ctx) {
    const Trace plain = train_sharded(ctx, {Optimizer::kSideStreamAdamW, /*delay=*/false});
    const Trace delayed = train_sharded(ctx, {Optimizer::kSideStreamAdamW, /*delay=*/true});
    expect_bitwise_equal(delayed, plain, "side-stream optimizer delayed");
    expect_matches_reference(ctx, delayed, train_reference(ctx.device(), 1, {Optimizer::kSideStreamAdamW}));
  });
}

// A divide factor at shard size 1 on NCCL: the reduction sums and divides
// locally (never a one-rank AVG or PREMUL_SUM), and every element of every
// gradient is written.
TEST(Fsdp2GpuOrder, ShardSizeOneDivideFactorWritesEveryElement) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  testing::run_distributed(nccl_world_size_one(), [](testing::RankContext& ctx) {
    for (const double factor : {3.0, 0.5}) {
      SCOPED_TRACE("divide factor " + std::to_string(factor));
      RunOptions run{Optimizer::kSideStreamAdamW, /*delay=*/false, factor};
      expect_matches_reference(ctx, train_sharded(ctx, run), train_reference(ctx.device(), 1, run));
    }
  });
}

// Gloo moving CUDA tensors, one rank's streams delayed: training still
// equals its undelayed self and the reference, at world sizes 2-4.
TEST(Fsdp2GpuOrder, GlooOnCudaWithOneRankDelayed) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  for (const int world : {2, 3, 4}) {
    const testing::DistributedTestOptions options = testing::cuda_options(world, collectives::BackendKind::kGloo);
    testing::run_distributed(options, [](testing::RankContext& ctx) {
      SCOPED_TRACE("world size " + std::to_string(ctx.world_size()));
      const bool slow_rank = ctx.rank() == ctx.world_size() - 1;
      for (const Optimizer optimizer : {Optimizer::kSgdInBackward, Optimizer::kSideStreamAdamW}) {
        const Trace plain = train_sharded(ctx, {optimizer, /*delay=*/false});
        const Trace delayed = train_sharded(ctx, {optimizer, slow_rank, std::nullopt, slow_rank});
        expect_bitwise_equal(delayed, plain, "last rank delayed");
        expect_matches_reference(ctx, delayed, train_reference(ctx.device(), ctx.world_size(), {optimizer}));
      }
    });
  }
}

// Without the caching allocator every free waits for the device, so a block
// freed while another stream still reads it cannot be reused early. The
// results must not change: run the delayed trainings in two child processes,
// with and without PYTORCH_NO_CUDA_MEMORY_CACHING=1, and compare bit for bit.
constexpr char kTraceFileVariable[] = "FSDP2CPP_GPU_ORDER_TRACE_FILE";

std::vector<at::Tensor> flatten(const Trace& trace) {
  std::vector<at::Tensor> out = trace.losses;
  for (const auto& item : trace.grads) out.push_back(item.second);
  for (const auto& item : trace.params) out.push_back(item.second);
  return out;
}

TEST(Fsdp2GpuOrder, SameResultsWithoutTheCachingAllocator) {
  FSDP2CPP_SKIP_WITHOUT_CUDA();
  if (const char* trace_file = std::getenv(kTraceFileVariable)) {
    // The child: train and write what it saw (from the rank's process).
    const std::string path = trace_file;
    testing::run_distributed(nccl_world_size_one(), [&path](testing::RankContext& ctx) {
      std::vector<at::Tensor> seen;
      for (const Optimizer optimizer : {Optimizer::kSgdInBackward, Optimizer::kSideStreamAdamW}) {
        for (const at::Tensor& t : flatten(train_sharded(ctx, {optimizer, /*delay=*/true}))) seen.push_back(t);
      }
      torch::save(seen, path);
    });
    return;
  }
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("fsdp2_gpu_order_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<std::vector<at::Tensor>> traces;
  for (const bool caching : {true, false}) {
    const std::string name = caching ? "cached" : "uncached";
    const std::filesystem::path file = dir / (name + ".pt");
    const std::filesystem::path log = dir / (name + ".log");
    const std::string command =
        std::string("env ") + (caching ? "-u PYTORCH_NO_CUDA_MEMORY_CACHING " : "PYTORCH_NO_CUDA_MEMORY_CACHING=1 ") +
        kTraceFileVariable + "='" + file.string() + "' '" + self.string() +
        "' --gtest_filter=Fsdp2GpuOrder.SameResultsWithoutTheCachingAllocator > '" + log.string() + "' 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << name << " child failed:\n" << text.str();
    std::vector<at::Tensor> trace;
    torch::load(trace, file.string());
    traces.push_back(std::move(trace));
  }
  std::filesystem::remove_all(dir);
  ASSERT_EQ(traces[0].size(), traces[1].size());
  ASSERT_FALSE(traces[0].empty());
  for (size_t i = 0; i < traces[0].size(); ++i) {
    EXPECT_TRUE(at::equal(traces[0][i], traces[1][i])) << "tensor " << i << " of the trace";
  }
}

}  // namespace
}  // namespace fsdp::test
