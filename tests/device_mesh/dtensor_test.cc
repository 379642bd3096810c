// DTensor over real processes: distribute -> full_tensor round trips and
// redistributions with uneven shards, on 1-D meshes of 1-4 ranks and on 2-D
// meshes.
#include "device_mesh/dtensor.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp_testing/distributed_test.h"

namespace fsdp {
namespace {

using testing::DistributedTestOptions;
using testing::RankContext;
using Shape = std::vector<int64_t>;

at::Tensor make_full(const Shape& shape) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  return at::arange(numel, at::kFloat).view(shape) * 0.5 + 1.0;
}

std::string placements_string(const std::vector<Placement>& placements) {
  std::string out = "(";
  for (size_t i = 0; i < placements.size(); ++i) out += (i ? ", " : "") + placements[i].to_string();
  return out + ")";
}

// What this rank should hold of `full` for a spec without Partial dims.
at::Tensor expected_local(const at::Tensor& full, const DTensorSpec& spec) {
  const Shape shape = spec.local_shape();
  const Shape offset = spec.local_offset();
  at::Tensor t = full;
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), offset[d], shape[d]);
  return t;
}

class DTensorOneDim : public ::testing::TestWithParam<int> {};

TEST_P(DTensorOneDim, RoundTripsAndRedistributions) {
  testing::run_distributed(GetParam(), [](RankContext& ctx) {
    const DeviceMesh& mesh = ctx.mesh();
    const int n = ctx.world_size();
    const int r = ctx.rank();
    const double rank_factor_sum = n * (n + 1) / 2.0;  // sum of (rank + 1)
    for (const Shape& shape : {Shape{10, 3}, Shape{2, 5}, Shape{7}, Shape{1, 4}}) {
      SCOPED_TRACE("shape " + c10::str(c10::IntArrayRef(shape)));
      const at::Tensor full = make_full(shape);
      for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
        SCOPED_TRACE("Shard(" + std::to_string(d) + ")");
        const ChunkExtent ext = chunk_extent(shape[d], n, r);
        DTensor dt = distribute_tensor(full, mesh, {Placement::shard(d)});
        EXPECT_TRUE(dt.to_local().equal(full.narrow(d, ext.offset, ext.length)));
        EXPECT_EQ(dt.shape(), shape);
        EXPECT_TRUE(dt.full_tensor().equal(full));

        // Shard -> Replicate -> Shard.
        DTensor rep = dt.redistribute({Placement::replicate()});
        EXPECT_TRUE(rep.to_local().equal(full));
        DTensor back = rep.redistribute({Placement::shard(d)});
        EXPECT_TRUE(back.to_local().equal(dt.to_local()));

        // Partial(sum) -> Shard(d) as a reduce-scatter of padded chunks.
        DTensor partial = DTensor::from_local(full * (r + 1.0), mesh, {Placement::partial()}, shape);
        DTensor scattered = partial.redistribute({Placement::shard(d)});
        EXPECT_TRUE(scattered.to_local().equal((full * rank_factor_sum).narrow(d, ext.offset, ext.length)));
        EXPECT_TRUE(scattered.full_tensor().equal(full * rank_factor_sum));
      }

      // Partial -> Replicate with sum, avg and max.
      DTensor sum = DTensor::from_local(full * (r + 1.0), mesh, {Placement::partial()});
      EXPECT_TRUE(sum.full_tensor().equal(full * rank_factor_sum));
      DTensor avg = DTensor::from_local(full * (r + 1.0), mesh, {Placement::partial(collectives::ReduceOp::avg())});
      EXPECT_TRUE(avg.full_tensor().allclose(full * (rank_factor_sum / n)));
      DTensor max = DTensor::from_local(full * (r + 1.0), mesh, {Placement::partial(collectives::ReduceOp::max())});
      EXPECT_TRUE(max.full_tensor().equal(full * static_cast<double>(n)));
      // The caller's local tensor is never reduced in place.
      EXPECT_TRUE(sum.to_local().equal(full * (r + 1.0)));

      // Replicate -> Partial -> Replicate.
      DTensor rep = distribute_tensor(full, mesh, {Placement::replicate()});
      DTensor made_partial = rep.redistribute({Placement::partial()});
      EXPECT_TRUE(made_partial.to_local().equal(r == 0 ? full : at::zeros_like(full)));
      EXPECT_TRUE(made_partial.full_tensor().equal(full));

      // From a source rank: the others' values are ignored.
      const int src = n - 1;
      const at::Tensor mine = r == src ? full : at::full_like(full, -7.0);
      DTensor from_src = distribute_tensor(mine, mesh, {Placement::shard(0)}, src);
      EXPECT_TRUE(from_src.full_tensor().equal(full));
      EXPECT_TRUE(mine.equal(r == src ? full : at::full_like(full, -7.0)));  // input untouched
      DTensor rep_src = distribute_tensor(mine, mesh, {Placement::replicate()}, src);
      EXPECT_TRUE(rep_src.to_local().equal(full));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DTensorOneDim, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ws" + std::to_string(info.param); });

class DTensorTwoDim : public ::testing::TestWithParam<Shape> {};

TEST_P(DTensorTwoDim, EveryPairOfPlacementsRoundTrips) {
  const Shape mesh_shape = GetParam();
  const DistributedTestOptions options = testing::hsdp_options(mesh_shape[0], mesh_shape[1]);
  testing::run_distributed(options, [mesh_shape](RankContext& ctx) {
    const DeviceMesh& mesh = ctx.mesh();
    const auto R = Placement::replicate();
    const auto S0 = Placement::shard(0);
    const auto S1 = Placement::shard(1);
    const std::vector<std::vector<Placement>> layouts = {{R, S0}, {S0, S0}, {S0, S1}, {S1, S0}, {R, R}, {S0, R}};
    for (const Shape& shape : {Shape{7, 3}, Shape{2, 5}}) {
      const at::Tensor full = make_full(shape);
      for (const auto& from : layouts) {
        SCOPED_TRACE("shape " + c10::str(c10::IntArrayRef(shape)) + ", from " + placements_string(from));
        DTensor dt = distribute_tensor(full, mesh, from);
        EXPECT_TRUE(dt.to_local().equal(expected_local(full, dt.spec())));
        EXPECT_TRUE(dt.full_tensor().equal(full));
        for (const auto& to : layouts) {
          SCOPED_TRACE("to " + placements_string(to));
          DTensor moved = dt.redistribute(to);
          EXPECT_TRUE(moved.to_local().equal(expected_local(full, moved.spec())));
        }
      }

      // Partial on one mesh dim, Shard(0) on the other.
      const double outer_sum = mesh_shape[0] * (mesh_shape[0] + 1) / 2.0;
      const double inner_sum = mesh_shape[1] * (mesh_shape[1] + 1) / 2.0;
      const int64_t c0 = mesh.local_rank(0);
      const int64_t c1 = mesh.local_rank(1);
      DTensor hsdp = distribute_tensor(full, mesh, {R, S0});
      DTensor partial_outer =
          DTensor::from_local(hsdp.to_local() * (c0 + 1.0), mesh, {Placement::partial(), S0}, shape);
      EXPECT_TRUE(partial_outer.full_tensor().equal(full * outer_sum));
      DTensor nested = partial_outer.redistribute({S0, S0});
      EXPECT_TRUE(nested.to_local().equal(expected_local(full * outer_sum, nested.spec())));
      DTensor outer_shard = distribute_tensor(full, mesh, {S0, R});
      DTensor partial_inner =
          DTensor::from_local(outer_shard.to_local() * (c1 + 1.0), mesh, {S0, Placement::partial()}, shape);
      EXPECT_TRUE(partial_inner.full_tensor().equal(full * inner_sum));
      DTensor inner_scattered = partial_inner.redistribute({S0, S1});
      EXPECT_TRUE(inner_scattered.to_local().equal(expected_local(full * inner_sum, inner_scattered.spec())));

      // From the last rank, with both dims sharded.
      const int src = ctx.world_size() - 1;
      const at::Tensor mine = ctx.rank() == src ? full : at::zeros_like(full);
      DTensor from_src = distribute_tensor(mine, mesh, {S0, S1}, src);
      EXPECT_TRUE(from_src.full_tensor().equal(full));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, DTensorTwoDim, ::testing::Values(Shape{2, 2}, Shape{2, 3}), [](const auto& info) {
  return "mesh" + std::to_string(info.param[0]) + "x" + std::to_string(info.param[1]);
});

}  // namespace
}  // namespace fsdp
