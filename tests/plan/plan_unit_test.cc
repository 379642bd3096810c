// The planner in one process: the caching allocator model's rules, the dry
// run's exact prediction for a model small enough to add up by hand, the
// simulation of large jobs (1,024 ranks, HSDP), the errors, and the tool's
// batch search.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "fsdp2/fully_shard.h"
#include "fsdp_plan/caching_allocator.h"
#include "fsdp_plan/dry_run.h"
#include "plan_models.h"
#include "trainer_plan.h"

namespace fsdp_plan::test {
namespace {

using ::testing::HasSubstr;

TEST(PlanCachingAllocator, RoundsSmallRequestsTo512Bytes) {
  EXPECT_EQ(round_size(1), 512);
  EXPECT_EQ(round_size(512), 512);
  EXPECT_EQ(round_size(513), 1024);
  EXPECT_EQ(round_size(3 << 20), 3 << 20);
}

TEST(PlanCachingAllocator, SegmentsAre2MiB20MiBOrRoundedTo2MiB) {
  EXPECT_EQ(segment_size(512), 2 << 20);      // small pool
  EXPECT_EQ(segment_size(1 << 20), 2 << 20);  // the largest small request
  EXPECT_EQ(segment_size((1 << 20) + 512), 20 << 20);
  EXPECT_EQ(segment_size(10 << 20), 10 << 20);  // kMinLargeAlloc and up: rounded to 2 MiB
  EXPECT_EQ(segment_size((10 << 20) + 1), 12 << 20);
}

TEST(PlanCachingAllocator, SplitsReusesAndMergesBlocksPerStream) {
  CachingAllocatorModel cuda;
  const auto a = cuda.allocate(3 << 20, 0);  // cut from a new 20 MiB segment
  const auto b = cuda.allocate(3 << 20, 0);  // from its remainder
  EXPECT_EQ(cuda.reserved(), 20 << 20);
  EXPECT_EQ(cuda.allocated(), 6 << 20);
  cuda.free(a);
  cuda.free(b);  // merged back into one free 20 MiB block
  const auto c = cuda.allocate(15 << 20, 0);
  EXPECT_EQ(cuda.reserved(), 20 << 20);   // reused, no new segment
  const auto d = cuda.allocate(1000, 1);  // another stream: its own segment
  EXPECT_EQ(cuda.reserved(), (20 << 20) + (2 << 20));
  cuda.free(c);
  // A large block is split only when more than 1 MiB would remain, so 19.5
  // MiB out of the 20 MiB block is handed out whole: allocated counts 20 MiB.
  const auto e = cuda.allocate((19 << 20) + (1 << 19), 0);
  EXPECT_EQ(cuda.allocated(), (20 << 20) + 1024);
  EXPECT_EQ(cuda.peak_allocated(), (20 << 20) + 1024);
  cuda.free(d);
  cuda.free(e);
  EXPECT_EQ(cuda.allocated(), 0);
}

struct LinearBlockImpl : torch::nn::Module {
  LinearBlockImpl() : fc(register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(64, 64).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(LinearBlock);

struct TwoBlocks : torch::nn::Module {
  TwoBlocks() : b0(register_module("b0", LinearBlock())), b1(register_module("b1", LinearBlock())) {}
  at::Tensor forward(const at::Tensor& x) { return b1(b0(x)); }
  LinearBlock b0, b1;
};

// Each block of `model` sharded with `options` over `mesh`, then the root.
fsdp::FSDPModule shard_two_blocks(const std::shared_ptr<TwoBlocks>& model, const fsdp::DeviceMesh& mesh,
                                  fsdp::FullyShardOptions options = {}) {
  options.mesh = mesh;
  fsdp::fully_shard(model->b0, options);
  fsdp::fully_shard(model->b1, options);
  return fsdp::fully_shard(model, options);
}

// Two steps of 8 rows of `model` under `dry`, each phase marked.
void train_two_steps(DryRun& dry, TwoBlocks& model, torch::optim::Optimizer& optim) {
  for (int step = 0; step < 2; ++step) {
    dry.begin(StepPhase::kForward);
    optim.zero_grad();
    at::Tensor loss = fsdp::call_module(model, at::randn({8, 64})).sum();
    dry.begin(StepPhase::kBackward);
    loss.backward();
    loss.reset();
    dry.begin(StepPhase::kOptimizer);
    optim.step();
  }
}

// `ops` and `allocations`, when given, receive the run's kernels and
// collectives and its allocations; `engine` is the communicators' semantics.
// The hand count below leaves out cuBLAS's workspaces (`blas_workspace_bytes`
// 0); PlanDryRun.ACudaJobHoldsOneCublasWorkspacePerHandleAndStream counts them.
MemoryReport two_blocks_at_world_size_2(std::vector<OpRecord>* ops = nullptr,
                                        fsdp::collectives::BackendKind engine = fsdp::collectives::BackendKind::kNccl,
                                        std::vector<AllocationRecord>* allocations = nullptr,
                                        int64_t blas_workspace_bytes = 0) {
  DryRunOptions options;
  options.world_size = 2;
  options.engine = engine;
  options.blas_workspace_bytes = blas_workspace_bytes;
  DryRun dry(options);
  auto model = std::make_shared<TwoBlocks>();
  shard_two_blocks(model, dry.mesh());
  torch::optim::AdamW optim(model->parameters(), 1e-3);
  dry.track(model);
  train_two_steps(dry, *model, optim);
  if (ops != nullptr) *ops = dry.ops();
  if (allocations != nullptr) *allocations = dry.allocations();
  return dry.memory();
}

// Two bias-free Linear(64, 64) blocks, each its own group, AdamW, 8 rows of
// input, NCCL semantics (the all-gather in place in its output), rank 0 of
// 2. A weight is 64 x 64 x 4 = 16,384 bytes; a shard 8,192. The peak falls
// in step 2's backward, when block 0's parameters are copied out of their
// all-gather (block 1 is done: its gradient reduce-scattered):
//   sharded parameters       2 x 8,192                       16,384
//   AdamW's two moments      2 x 2 x 8,192                   32,768
//   block 0's all-gather output (freed after the copy-out)   16,384
//   block 0's unsharded weight (the copy-out)                16,384
//   block 1's reduce-scatter input (kept until the next
//     group's reduce-scatter begins: one input in flight)    16,384
//   block 1's sharded gradient (the reduce-scatter output)    8,192
//   the input x, saved by block 0's matmul                    2,048
//   the gradient reaching block 0's output                    2,048
//   the loss and its gradient (two scalars)                       8
//                                                    total  110,600
// max_memory_allocated rounds each block to 512 bytes (the scalars take 512
// each): 111,616. Reserved: a 2 MiB small-pool segment on each stream that
// allocates: the compute stream, the all-gather copy-in stream (the
// all-gather outputs) and the reduce-scatter stream (the sharded gradients,
// which the post-reduce makes there).
// Any change to when the runtime frees one of these buffers (an all-gather
// output kept one block longer, a reduce-scatter input freed earlier)
// changes these numbers.
TEST(PlanDryRun, PredictsThePeakOfTwoLinearBlocksAtWorldSize2ToTheByte) {
  const MemoryReport r = two_blocks_at_world_size_2();
  EXPECT_EQ(r.peak_bytes, 110600);
  EXPECT_EQ(r.peak_allocated, 111616);
  EXPECT_EQ(r.peak_reserved, 3 * (2 << 20));
  EXPECT_EQ(r.peak_step, 2);
  EXPECT_EQ(r.peak_step_phase, StepPhase::kBackward);
  EXPECT_EQ(r.peak_fsdp_phase, "FSDP::all_gather_copy_out (b0)");
  const auto held = [&](Holder h) { return r.peak_by_holder[static_cast<size_t>(h)]; };
  EXPECT_EQ(held(Holder::kParameters), 16384);
  EXPECT_EQ(held(Holder::kOptimizerState), 32768);
  EXPECT_EQ(held(Holder::kAllGather), 16384);
  EXPECT_EQ(held(Holder::kUnshardedParameters), 16384);
  EXPECT_EQ(held(Holder::kReduceScatter), 16384);
  EXPECT_EQ(held(Holder::kGradients), 8192);
  EXPECT_EQ(held(Holder::kActivations), 2048 + 4);   // x and the loss, alive when backward starts
  EXPECT_EQ(held(Holder::kTemporaries), 2048 + 4);   // the gradient into block 0, the loss's gradient
  EXPECT_EQ(r.end_bytes, 16384 + 32768 + 2 * 8192);  // shards, moments, sharded gradients
}

// The same run's ops, for the time model. Per step, 8 rows through two
// Linear(64, 64): forward two matmuls of 2 * 8 * 64 * 64 = 65,536 FLOPs;
// backward, block 1's gradient of its input and of its weight, block 0's of
// its weight only (the input needs none): three more. Each block's
// all-gather runs on the all-gather stream, once in forward and once in
// backward (reshard after forward), and its reduce-scatter on the
// reduce-scatter stream, reading what a compute-stream kernel wrote.
TEST(PlanDryRun, RecordsEachMatmulsFlopsAndTheStreamOfEachCollective) {
  std::vector<OpRecord> ops;
  two_blocks_at_world_size_2(&ops);
  int64_t forward_flops = 0, backward_flops = 0;
  int all_gathers = 0, reduce_scatters = 0;
  std::map<int64_t, int> writer_stream;         // allocation -> the stream of its last writer
  int reduce_scatters_after_their_copy_in = 0;  // every storage they read was written on the compute stream
  for (const OpRecord& op : ops) {
    if (op.step == 2 && op.matmul) (op.step_phase == StepPhase::kForward ? forward_flops : backward_flops) += op.flops;
    if (op.step == 2 && op.kind == OpRecord::Kind::kCollective) {
      if (op.name == "all_gather_into_tensor") {
        ++all_gathers;
        EXPECT_EQ(op.stream, 2);
      }
      if (op.name == "reduce_scatter_tensor") {
        ++reduce_scatters;
        EXPECT_EQ(op.stream, 3);
        bool all = !op.reads.empty();
        for (int64_t a : op.reads) all = all && writer_stream.count(a) && writer_stream[a] == 0;
        reduce_scatters_after_their_copy_in += all;
      }
    }
    for (int64_t a : op.writes) writer_stream[a] = op.stream;
  }
  EXPECT_EQ(forward_flops, 2 * 65536);
  EXPECT_EQ(backward_flops, 3 * 65536);
  EXPECT_EQ(all_gathers, 4);
  EXPECT_EQ(reduce_scatters, 2);
  EXPECT_EQ(reduce_scatters_after_their_copy_in, 2);
}

// A CUDA job's dry run (NCCL) gives the meta device streams, so the runtime
// takes its CUDA paths and its events are recorded; a CPU job's (Gloo) has
// none, as a CPU has none. So in step 2's forward, block 0's all-gather
// output (16,384 bytes, made in its copy-in) outlives block 1's copy-in in a
// CUDA job ([Note: all-gather output lifetime]: it goes at block 1's wait,
// so that block 0's copy-out overlaps block 1's all-gather) and goes at its
// own copy-out in a CPU job; and in
// backward, block 0's reduce-scatter copy-in waits by an event for block 1's
// reduce-scatter (one reduce-scatter input in flight).
TEST(PlanDryRun, ACudaJobsDryRunTakesTheRuntimesStreamPathsAndRecordsItsEvents) {
  for (const auto engine : {fsdp::collectives::BackendKind::kNccl, fsdp::collectives::BackendKind::kGloo}) {
    const bool cuda = engine == fsdp::collectives::BackendKind::kNccl;
    SCOPED_TRACE(cuda ? "NCCL" : "Gloo");
    std::vector<OpRecord> ops;
    std::vector<AllocationRecord> allocations;
    two_blocks_at_world_size_2(&ops, engine, &allocations);
    const AllocationRecord* output = nullptr;
    int64_t b1_copy_in = INT64_MAX;
    for (const AllocationRecord& a : allocations) {
      if (a.step != 2 || a.step_phase != StepPhase::kForward) continue;
      if (a.fsdp_phase == "FSDP::all_gather_copy_in (b0)" && a.bytes == 16384) output = &a;
      if (a.fsdp_phase == "FSDP::all_gather_copy_in (b1)") b1_copy_in = std::min(b1_copy_in, a.allocated_at);
    }
    ASSERT_NE(output, nullptr);
    ASSERT_NE(b1_copy_in, INT64_MAX);
    EXPECT_EQ(output->freed_at > b1_copy_in, cuda);

    int64_t b1_reduce_scatter = -1, events = 0;
    bool b0_copy_in_seen = false;
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpRecord& op = ops[i];
      events += static_cast<int64_t>(op.after.size() + op.host_after.size());
      if (op.step != 2 || op.step_phase != StepPhase::kBackward) continue;
      if (op.name == "reduce_scatter_tensor" && op.fsdp_phase.find("(b1)") != std::string::npos) {
        b1_reduce_scatter = static_cast<int64_t>(i);
      }
      if (op.fsdp_phase == "FSDP::reduce_scatter_copy_in (b0)" && !b0_copy_in_seen) {
        b0_copy_in_seen = true;
        ASSERT_GE(b1_reduce_scatter, 0);
        const int64_t waited_for = op.after.empty() ? -1 : *std::max_element(op.after.begin(), op.after.end());
        EXPECT_EQ(waited_for >= b1_reduce_scatter, cuda) << "waits for op " << waited_for;
      }
    }
    EXPECT_TRUE(b0_copy_in_seen);
    EXPECT_EQ(events > 0, cuda);
  }
}

// cuBLAS gives each handle a workspace per stream, and PyTorch keeps it:
// the host thread's handle makes one at step 1's first forward matmul,
// autograd's device thread's at its first backward matmul, both on the
// compute stream, so the hand-counted peak above gains exactly two. A CPU
// job (Gloo) has none.
TEST(PlanDryRun, ACudaJobHoldsOneCublasWorkspacePerHandleAndStream) {
  constexpr int64_t kWorkspace = int64_t{32} << 20;
  std::vector<AllocationRecord> allocations;
  const MemoryReport r =
      two_blocks_at_world_size_2(nullptr, fsdp::collectives::BackendKind::kNccl, &allocations, kWorkspace);
  EXPECT_EQ(r.peak_bytes, 110600 + 2 * kWorkspace);
  EXPECT_EQ(r.peak_by_holder[static_cast<size_t>(Holder::kWorkspaces)], 2 * kWorkspace);
  EXPECT_EQ(r.peak_fsdp_phase, "FSDP::all_gather_copy_out (b0)");
  EXPECT_EQ(r.end_bytes, 16384 + 32768 + 2 * 8192 + 2 * kWorkspace);
  std::vector<const AllocationRecord*> workspaces;
  for (const AllocationRecord& a : allocations) {
    if (a.bytes == kWorkspace) workspaces.push_back(&a);
  }
  ASSERT_EQ(workspaces.size(), 2u);
  for (const AllocationRecord* a : workspaces) {
    EXPECT_EQ(a->step, 1);
    EXPECT_EQ(a->stream, 0);
    EXPECT_EQ(a->freed_at, INT64_MAX);
  }
  EXPECT_EQ(workspaces[0]->step_phase, StepPhase::kForward);
  EXPECT_EQ(workspaces[1]->step_phase, StepPhase::kBackward);

  const MemoryReport gloo =
      two_blocks_at_world_size_2(nullptr, fsdp::collectives::BackendKind::kGloo, nullptr, kWorkspace);
  EXPECT_EQ(gloo.peak_by_holder[static_cast<size_t>(Holder::kWorkspaces)], 0);
}

// CPU offload in a CUDA job's dry run: the two blocks of the hand count
// above keep their sharded state in host memory, which the report gives
// apart from the device's. Rank 0's shards are 8,192 bytes a weight:
//   host: sharded parameters (pinned)   2 x 8,192      16,384
//         sharded gradients (pinned)    2 x 8,192      16,384
//         AdamW's two moments           2 x 2 x 8,192  32,768
// all held between steps (65,536 bytes) and at the host's peak, with the
// optimizer step's temporaries on top; pinned blocks of 8,192 bytes are
// powers of two already. The device keeps none of it: between steps it
// holds nothing. Each all-gather copies its shard in from the host (8,192
// bytes over the host link), each reduced gradient goes back to it, and the
// optimizer's kernels run on the host.
TEST(PlanDryRun, ACudaJobWithCpuOffloadKeepsTheShardedStateInHostMemory) {
  DryRunOptions options;
  options.world_size = 2;
  options.blas_workspace_bytes = 0;
  std::vector<OpRecord> ops;
  MemoryReport r;
  {
    DryRun dry(options);
    auto model = std::make_shared<TwoBlocks>();
    fsdp::FullyShardOptions offload;
    offload.offload_policy.offload_to_cpu = true;
    shard_two_blocks(model, dry.mesh(), offload);
    torch::optim::AdamW optim(model->parameters(), 1e-3);
    dry.track(model);
    train_two_steps(dry, *model, optim);
    r = dry.memory();
    ops = dry.ops();
  }
  const auto on_host = [&](Holder h) { return r.host_peak_by_holder[static_cast<size_t>(h)]; };
  const auto on_device = [&](Holder h) { return r.peak_by_holder[static_cast<size_t>(h)]; };
  EXPECT_EQ(on_host(Holder::kParameters), 16384);
  EXPECT_EQ(on_host(Holder::kGradients), 16384);
  EXPECT_EQ(on_host(Holder::kOptimizerState), 32768);
  EXPECT_EQ(r.host_end_bytes, 65536);
  EXPECT_GE(r.host_peak_bytes, 65536);
  EXPECT_EQ(r.host_pinned_peak, 4 * 8192);
  EXPECT_EQ(on_device(Holder::kParameters), 0);
  EXPECT_EQ(on_device(Holder::kGradients), 0);
  EXPECT_EQ(on_device(Holder::kOptimizerState), 0);
  EXPECT_EQ(r.end_bytes, 0);
  // The device's peak loses the sharded state: 110,600 - 16,384 (shards) -
  // 32,768 (moments) - 8,192 (block 1's sharded gradient, now on the host).
  // Without the sharded state the device's peak moves from step 2's copy-out
  // of block 0 (110,600 - 16,384 - 32,768 - 8,192 = 53,256 now) to step 1's
  // backward, when block 1's weight gradient is made while block 0's
  // all-gather is already in flight: block 0's all-gather output 16,384,
  // block 1's unsharded weight 16,384 and its full gradient 16,384, x and
  // block 0's output (saved for backward) 2 x 2,048 and the loss 4, the
  // gradient into block 1's output 2,048 and the loss's 4: 55,304.
  EXPECT_EQ(r.peak_bytes, 55304);
  EXPECT_EQ(r.peak_step, 1);
  EXPECT_EQ(r.peak_step_phase, StepPhase::kBackward);
  EXPECT_EQ(on_device(Holder::kAllGather), 16384);
  EXPECT_EQ(on_device(Holder::kUnshardedParameters), 16384);
  EXPECT_EQ(on_device(Holder::kUnreducedGradients), 16384);
  EXPECT_EQ(on_device(Holder::kActivations), 2 * 2048 + 4);
  EXPECT_EQ(on_device(Holder::kTemporaries), 2048 + 4);

  int64_t copied_in = 0, copied_back = 0, optimizer_on_host = 0, optimizer_on_device = 0;
  for (const OpRecord& op : ops) {
    if (op.step != 2) continue;
    if (op.fsdp_phase.rfind("FSDP::all_gather_copy_in", 0) == 0) copied_in += op.host_link_bytes;
    if (op.step_phase == StepPhase::kBackward) copied_back += op.host_link_bytes;
    if (op.step_phase == StepPhase::kOptimizer && op.kind == OpRecord::Kind::kKernel) {
      ++(op.on_host ? optimizer_on_host : optimizer_on_device);
    }
  }
  EXPECT_EQ(copied_in, 4 * 8192);    // each block's shard, in forward and again in backward
  EXPECT_EQ(copied_back, 4 * 8192);  // backward's two all-gathers in, the two reduced gradients out
  EXPECT_GT(optimizer_on_host, 0);
  EXPECT_EQ(optimizer_on_device, 0);
}

// Causal attention's backward in a CUDA job's dry run makes
// FlashAttention-2's float32 scratch and frees it before returning: for
// query [2, 4, 200, 64], softmax_d [2, 4, 256] (8,192 bytes) and the dq
// accumulator [2, 256, 4, 64] (524,288). A CPU job's kernel has neither.
TEST(PlanDryRun, ACudaJobsAttentionBackwardMakesFlashAttentionsScratch) {
  for (const auto engine : {fsdp::collectives::BackendKind::kNccl, fsdp::collectives::BackendKind::kGloo}) {
    const bool cuda = engine == fsdp::collectives::BackendKind::kNccl;
    SCOPED_TRACE(cuda ? "NCCL" : "Gloo");
    DryRunOptions options;
    options.engine = engine;
    DryRun dry(options);
    dry.begin(StepPhase::kForward);
    const at::Tensor q = at::randn({2, 4, 200, 64}).requires_grad_(), k = at::randn({2, 4, 200, 64}).requires_grad_(),
                     v = at::randn({2, 4, 200, 64}).requires_grad_();
    at::Tensor loss = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true).sum();
    dry.begin(StepPhase::kBackward);
    loss.backward();
    std::multiset<int64_t> float_scratch;
    for (const AllocationRecord& a : dry.allocations()) {
      if (a.step_phase != StepPhase::kBackward) continue;
      if (a.bytes == 8192 || a.bytes == 524288) {
        float_scratch.insert(a.bytes);
        EXPECT_NE(a.freed_at, INT64_MAX) << a.bytes << " bytes never freed";
      }
    }
    const std::multiset<int64_t> expected = cuda ? std::multiset<int64_t>{8192, 524288} : std::multiset<int64_t>{};
    EXPECT_EQ(float_scratch, expected);
  }
}

// The groups the runtime makes for itself are dry communicators too: with
// reshard_after_forward 2 at world size 8, each block keeps after forward
// the rows of 4 of the 8 shards (half its weight, 8,192 bytes) and
// backward rebuilds its weight (16,384 bytes) by an all-gather within 2
// ranks; forward's all-gathers span all 8. With a separate reduce-scatter
// group, the reduce-scatters run on a communicator of their own.
TEST(PlanDryRun, PlansTheGroupsTheRuntimeMakesItself) {
  DryRunOptions options;
  options.world_size = 8;
  DryRun dry(options);
  auto model = std::make_shared<TwoBlocks>();
  fsdp::FullyShardOptions opts;
  opts.reshard_after_forward = fsdp::ReshardAfterForward(2);
  fsdp::FSDPModule root = shard_two_blocks(model, dry.mesh(), opts);
  root.set_separate_reduce_scatter_group();
  torch::optim::AdamW optim(model->parameters(), 1e-3);
  dry.track(model);
  train_two_steps(dry, *model, optim);
  std::map<std::string, int> forward, backward;  // "op over N ranks, B bytes" -> count
  std::set<const std::vector<int>*> all_gather_groups, reduce_scatter_groups;
  for (const OpRecord& op : dry.ops()) {
    if (op.step != 2 || op.kind != OpRecord::Kind::kCollective) continue;
    const std::string what =
        op.name + " over " + std::to_string(op.group->size()) + " ranks, " + std::to_string(op.bytes) + " bytes";
    ++(op.step_phase == StepPhase::kForward ? forward : backward)[what];
    if (op.name == "all_gather_into_tensor") all_gather_groups.insert(op.group.get());
    if (op.name == "reduce_scatter_tensor") reduce_scatter_groups.insert(op.group.get());
  }
  EXPECT_EQ(forward, (std::map<std::string, int>{{"all_gather_into_tensor over 8 ranks, 16384 bytes", 2}}));
  EXPECT_EQ(backward["all_gather_into_tensor over 2 ranks, 16384 bytes"], 2);
  EXPECT_EQ(backward["reduce_scatter_tensor over 8 ranks, 16384 bytes"], 2);
  ASSERT_FALSE(reduce_scatter_groups.empty());
  for (const std::vector<int>* group : reduce_scatter_groups) EXPECT_EQ(all_gather_groups.count(group), 0u);
}

fsdp_train::TrainConfig small_trainer() { return trainer_shape(2, 64, 4, 32); }

// The trainer's --prefetch 2 as fsdp_plan plans it (fsdp_train's
// set_block_prefetch): in step 2 of 4 blocks, forward issues the root's and
// block 0's all-gathers before its first matmul, and with prefetch 2 also
// blocks 1 and 2's; backward issues block 3's and, implicitly, block 2's
// before its first reduce-scatter (block 3's), and with prefetch 2 block
// 1's too.
TEST(PlanDryRun, TheTrainersPrefetchDepthIssuesThatManyAllGathersAhead) {
  const auto all_gathers_before = [](const std::vector<OpRecord>& ops, StepPhase phase, const std::string& op_name) {
    int count = 0;
    for (const OpRecord& op : ops) {
      if (op.step != 2 || op.step_phase != phase) continue;
      if (op.name == op_name) return count;
      if (op.name == "all_gather_into_tensor") ++count;
    }
    return -1;
  };
  DryRunOptions options;
  options.world_size = 4;
  fsdp_train::TrainConfig c = trainer_shape(4, 64, 4, 32);
  for (const int64_t prefetch : {0, 2}) {
    SCOPED_TRACE("prefetch " + std::to_string(prefetch));
    c.prefetch = prefetch;
    const std::vector<OpRecord> ops = fsdp_plan_tool::plan_trainer(c, options, 1, 2).ops;
    EXPECT_EQ(all_gathers_before(ops, StepPhase::kForward, "aten::mm"), prefetch == 0 ? 2 : 4);
    EXPECT_EQ(all_gathers_before(ops, StepPhase::kBackward, "reduce_scatter_tensor"), prefetch == 0 ? 2 : 3);
  }
}

// Every reduce-scatter of the trainer's step (bf16 parameters, fp32
// reduction: the copy-in casts) reads only what the compute stream's copy-in
// wrote: the edge that keeps the time model from running it before the
// backward that makes its gradients. (An op's schema is looked up by
// overload: _chunk_cat.out writes its `out`, _chunk_cat writes nothing; keyed
// by name alone the copy-in lost its write.)
TEST(PlanDryRun, EachReduceScatterReadsWhatItsCopyInWrote) {
  DryRunOptions options;
  options.world_size = 4;
  fsdp_train::TrainConfig c = small_trainer();
  c.param_dtype = "bf16";
  const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(c, options, 2, 2);
  std::map<int64_t, std::string> writer_phase;
  int reduce_scatters = 0;
  for (const OpRecord& op : plan.ops) {
    if (op.step == 2 && op.name == "reduce_scatter_tensor") {
      ++reduce_scatters;
      ASSERT_FALSE(op.reads.empty());
      for (int64_t a : op.reads) {
        ASSERT_TRUE(writer_phase.count(a)) << "a reduce-scatter in " << op.fsdp_phase << " reads what nothing wrote";
        EXPECT_EQ(writer_phase[a].rfind("FSDP::reduce_scatter_copy_in", 0), 0u) << writer_phase[a];
      }
    }
    for (int64_t a : op.writes) writer_phase[a] = op.fsdp_phase;
  }
  EXPECT_EQ(reduce_scatters, 3);  // two blocks and the root
}

TEST(PlanDryRun, SimulatesOneRankOfAThousandAndTwentyFour) {
  DryRunOptions options;
  options.world_size = 1024;
  options.rank = 1023;
  const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(small_trainer(), options, 1, 2);
  // 256 x 64 embedding rows and output rows shard 1 per rank at most: rank
  // 1023 holds what torch.chunk gives it, most of the model on few ranks.
  EXPECT_LT(plan.local_parameters, plan.parameters / 100);
  bool saw_world_group = false;
  for (const auto& c : plan.collectives) saw_world_group = saw_world_group || c.group_size == 1024;
  EXPECT_TRUE(saw_world_group);
  EXPECT_GT(plan.memory.peak_bytes, 0);
}

TEST(PlanDryRun, HsdpAllReducesAcrossReplicas) {
  fsdp_train::TrainConfig c = small_trainer();
  c.mesh = "2x4";
  DryRunOptions options;
  options.world_size = 8;
  const fsdp_plan_tool::TrainerPlan plan = fsdp_plan_tool::plan_trainer(c, options, 1, 1);
  int all_reduces = 0, reduce_scatters = 0;
  for (const auto& rec : plan.collectives) {
    if (rec.op == "all_reduce" && rec.group_size == 2) ++all_reduces;
    if (rec.op.rfind("reduce_scatter", 0) == 0 && rec.group_size == 4) ++reduce_scatters;
  }
  EXPECT_EQ(all_reduces, 3);  // one per group: two blocks and the root
  EXPECT_EQ(reduce_scatters, 3);
}

TEST(PlanDryRun, MixedPrecisionShrinksTheUnshardedParameters) {
  DryRunOptions options;
  options.world_size = 8;
  fsdp_train::TrainConfig c = small_trainer();
  const auto fp32 = fsdp_plan_tool::plan_trainer(c, options, 2, 2).memory;
  c.param_dtype = "bf16";
  const auto bf16 = fsdp_plan_tool::plan_trainer(c, options, 2, 2).memory;
  EXPECT_LT(bf16.peak_by_holder[static_cast<size_t>(Holder::kUnshardedParameters)],
            fp32.peak_by_holder[static_cast<size_t>(Holder::kUnshardedParameters)]);
}

TEST(PlanDryRun, ActivationCheckpointingLowersThePeak) {
  DryRunOptions options;
  options.world_size = 4;
  fsdp_train::TrainConfig c = small_trainer();
  c.seq_len = 64;
  const auto plain = fsdp_plan_tool::plan_trainer(c, options, 8, 1).memory;
  c.ac = "full";
  const auto checkpointed = fsdp_plan_tool::plan_trainer(c, options, 8, 1).memory;
  EXPECT_LT(checkpointed.peak_by_holder[static_cast<size_t>(Holder::kActivations)],
            plain.peak_by_holder[static_cast<size_t>(Holder::kActivations)]);
  EXPECT_LT(checkpointed.peak_bytes, plain.peak_bytes);
}

TEST(PlanDryRun, RejectsInconsistentOptionsNamingThem) {
  DryRunOptions options;
  options.world_size = 8;
  options.mesh_shape = {3, 2};
  EXPECT_THAT([&] { DryRun dry(options); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("mesh_shape")));
  options.mesh_shape = {};
  options.rank = 8;
  EXPECT_THAT([&] { DryRun dry(options); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("rank 8")));
  options.rank = 0;
  options.blas_workspace_bytes = -1;
  EXPECT_THAT([&] { DryRun dry(options); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("blas_workspace_bytes")));
  options.blas_workspace_bytes = 0;
  DryRun first(options);
  EXPECT_THAT([&] { DryRun second(options); }, ::testing::ThrowsMessage<c10::Error>(HasSubstr("another DryRun")));
}

TEST(PlanTool, LargestLocalBatchFitsAndTheNextDoesNot) {
  DryRunOptions options;
  options.world_size = 4;
  const fsdp_train::TrainConfig c = small_trainer();
  const int64_t budget = (8 << 20) + 2 * options.blas_workspace_bytes;  // cuBLAS's workspaces on top
  const int64_t batch = fsdp_plan_tool::largest_local_batch(c, options, budget);
  ASSERT_GT(batch, 0);
  EXPECT_LE(fsdp_plan_tool::plan_trainer(c, options, batch, 2).memory.peak_reserved, budget);
  EXPECT_GT(fsdp_plan_tool::plan_trainer(c, options, batch + 1, 2).memory.peak_reserved, budget);
}

}  // namespace
}  // namespace fsdp_plan::test
