// CPU offload (OffloadPolicy) as a GPU runs it, on CPU: under the
// stream-order checker the CPU mesh is a modelled device and the host an
// agent of its own (docs/gpu.md, "The host as an agent"). The shards, host
// gradients and AdamW state are host memory (pinned when asked); the copy-in
// uploads them on the copy-in stream, the reduced gradients come back on the
// reduce-scatter stream, and the host's optimizer reads and writes them. What
// must hold, at world sizes 1-4, with HSDP and with gradient accumulation, in
// the Gloo and the NCCL model: training equals the unsharded reference, the
// checker finds no race, and the host synchronizations of a steady step are
// exactly the ones offload needs (named below).
#include <map>
#include <string>
#include <vector>

#include "stream_order_util.h"  // tests/stream_order

namespace fsdp::test {
namespace {

struct OffloadModelCase {
  const char* name;
  int world_size;
  std::vector<int64_t> mesh_shape;  // empty: 1-D
  stream_check::CollectiveModel model;
  bool pin_memory = true;
  int micro_batches = 1;  // > 1: accumulate without gradient sync, then sync
};

// How many of `syncs` are `what`.
int count(const std::vector<stream_check::HostSync>& syncs, const std::string& what) {
  int n = 0;
  for (const auto& h : syncs) n += h.what == what ? 1 : 0;
  return n;
}

void expect_in_host_memory(const at::Tensor& t, bool pinned, const std::string& what) {
  if (t.numel() == 0) return;  // an empty shard (a world larger than the rows) has no memory
  EXPECT_EQ(stream_check::memory_of(t),
            pinned ? stream_check::Memory::kPinnedHost : stream_check::Memory::kPageableHost)
      << what;
}

// Parameters whose shard on this rank is not empty (an empty one has no
// gradient to copy).
int64_t nonempty_shards(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel() > 0 ? 1 : 0;
  return n;
}

class OffloadModel : public ::testing::TestWithParam<OffloadModelCase> {};

TEST_P(OffloadModel, TrainingMatchesTheUnshardedReference) {
  const OffloadModelCase c = GetParam();
  testing::run_distributed(rank_options(c.world_size, c.mesh_shape), [&c](testing::RankContext& ctx) {
    stream_check::Options checking;
    checking.collectives = c.model;
    stream_check::Checker checker(checking);
    auto reference = make_model(ModelKind::kTransformer);
    FullyShardOptions o;
    o.offload_policy.offload_to_cpu = true;
    o.offload_policy.pin_memory = c.pin_memory;
    Sharded s = shard_transformer(ctx, o);
    const int64_t groups = static_cast<int64_t>(s.model->blocks().size()) + 1;
    for (const auto& item : s.model->named_parameters()) {
      expect_in_host_memory(item.value(), c.pin_memory, item.key());
    }
    torch::optim::AdamW optim(s.model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW ref_optim(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      const Batch batch = make_batch(ModelKind::kTransformer, step, kStreamOrderRows * c.micro_batches);
      ref_optim.zero_grad();
      optim.zero_grad();
      stream_check::clear_host_syncs();
      std::vector<at::Tensor> losses, ref_losses;
      for (int m = 0; m < c.micro_batches; ++m) {
        const Batch micro = batch.slice(m, c.micro_batches);
        s.root->set_requires_gradient_sync(m + 1 == c.micro_batches);
        const Batch local = micro.slice(ctx.rank(), ctx.world_size());
        at::Tensor loss = call_module(*s.model, local.x, local.y) / c.micro_batches;
        loss.backward();
        losses.push_back(loss.detach());
        at::Tensor ref_loss = call_module(*reference, micro.x, micro.y) / c.micro_batches;
        ref_loss.backward();
        ref_losses.push_back(ref_loss.detach());
      }
      optim.step();  // on the host
      ref_optim.step();
      const std::vector<stream_check::HostSync> syncs = stream_check::host_syncs();
      if (step > 0) {
        // [Note: offload's host synchronizations] What a steady step waits
        // for, and why:
        //  - every backward's end synchronizes each group's last copy-in
        //    event (the optimizer, or the next accumulation, may overwrite
        //    the shards it uploaded);
        //  - the backward that reduces copies each parameter's gradient
        //    shard to the host: pinned, without blocking, then its event is
        //    synchronized at the end of backward (the optimizer reads it; as
        //    FSDP2's grad_offload_event); pageable, the copy itself waits.
        // Uploads never block the host (from pageable memory they are staged).
        const int64_t backward_ends = groups * c.micro_batches;
        const int64_t downloads = nonempty_shards(*s.model);
        const std::string download = c.pin_memory ? "event synchronize" : "aten::copy_ device to host (blocking)";
        EXPECT_EQ(count(syncs, "event synchronize"), backward_ends + (c.pin_memory ? downloads : 0)) << describe(syncs);
        EXPECT_EQ(count(syncs, download), (c.pin_memory ? backward_ends : 0) + downloads) << describe(syncs);
        EXPECT_EQ(static_cast<int64_t>(syncs.size()), backward_ends + downloads) << describe(syncs);
        for (const auto& h : syncs) {
          const std::string phase =
              h.what == "event synchronize" ? "FSDP::root_post_backward" : "FSDP::post_backward_reduce";
          EXPECT_EQ(h.phase.rfind(phase, 0), 0u) << h.what << " in " << h.phase;
        }
      }
      for (int m = 0; m < c.micro_batches; ++m) {
        const double expected = ref_losses[m].item<double>();
        EXPECT_NEAR(mean_over_ranks(ctx, losses[m].item<double>()), expected, 1e-5 * std::abs(expected))
            << "step " << step << " micro-batch " << m;
      }
      for (const auto& item : s.model->named_parameters()) {
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        expect_in_host_memory(item.value().grad(), c.pin_memory, item.key() + "'s gradient");
      }
    }
    for (const auto& [impl, state] : optim.state()) {
      const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
      expect_in_host_memory(adam.exp_avg(), /*pinned=*/false, "AdamW's exp_avg");
    }
    expect_params_match(*s.model, *reference, ctx.mesh(), 1e-4, 1e-5);
    expect_no_races(checker);
  });
}

using stream_check::CollectiveModel;

INSTANTIATE_TEST_SUITE_P(
    Configurations, OffloadModel,
    ::testing::Values(OffloadModelCase{"ws1_gloo", 1, {}, CollectiveModel::kGloo},
                      OffloadModelCase{"ws2_nccl", 2, {}, CollectiveModel::kNccl},
                      OffloadModelCase{"ws3_gloo", 3, {}, CollectiveModel::kGloo},
                      OffloadModelCase{"ws3_nccl_pageable", 3, {}, CollectiveModel::kNccl, /*pin_memory=*/false},
                      OffloadModelCase{"ws4_nccl", 4, {}, CollectiveModel::kNccl},
                      OffloadModelCase{"hsdp2x2_nccl", 4, {2, 2}, CollectiveModel::kNccl},
                      OffloadModelCase{"ws2_gloo_accumulation_without_sync", 2, {}, CollectiveModel::kGloo, true, 2},
                      OffloadModelCase{"ws3_nccl_accumulation_pageable", 3, {}, CollectiveModel::kNccl, false, 2}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace fsdp::test
