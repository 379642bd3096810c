// DeviceMesh over real processes and Gloo groups: coordinates, the members of
// each dim's group, slicing, flattening, and a collective along every dim.
#include "device_mesh/device_mesh.h"

#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "fsdp_testing/distributed_test.h"
#include "mesh_coords.h"

namespace fsdp {
namespace {

using test::flat_index;
using test::row_major;
using testing::DistributedTestOptions;
using testing::RankContext;

struct MeshCase {
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  std::string label;
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// Global ranks along `dim` through `coord`, in order.
std::vector<int> line(const std::vector<int64_t>& coord, const std::vector<int64_t>& shape, size_t dim) {
  std::vector<int> ranks;
  for (int64_t i = 0; i < shape[dim]; ++i) {
    std::vector<int64_t> c = coord;
    c[dim] = i;
    ranks.push_back(static_cast<int>(flat_index(c, shape)));
  }
  return ranks;
}

// Sum of the global ranks in `group`, computed by an all-reduce over it.
double all_reduce_rank_sum(const std::shared_ptr<collectives::Communicator>& group, int rank) {
  auto t = at::full({2}, static_cast<double>(rank), at::kDouble);
  group->all_reduce(t, collectives::ReduceOp::sum()).wait();
  EXPECT_TRUE(t[0].equal(t[1]));
  return t[0].item<double>();
}

double sum_of(const std::vector<int>& ranks) { return std::accumulate(ranks.begin(), ranks.end(), 0.0); }

class DeviceMeshLayout : public ::testing::TestWithParam<MeshCase> {};

TEST_P(DeviceMeshLayout, GroupsCoordinatesSlicesAndFlatten) {
  const MeshCase mc = GetParam();
  DistributedTestOptions options;
  options.world_size = static_cast<int>(numel_of(mc.shape));
  options.mesh_shape = mc.shape;
  options.mesh_dim_names = mc.names;
  testing::run_distributed(options, [mc](RankContext& ctx) {
    const DeviceMesh& mesh = ctx.mesh();
    const int rank = ctx.rank();
    const std::vector<int64_t> coord = row_major(rank, mc.shape);

    // Layout.
    ASSERT_EQ(mesh.ndim(), static_cast<int64_t>(mc.shape.size()));
    EXPECT_EQ(mesh.size(), ctx.world_size());
    EXPECT_EQ(mesh.coordinate(), coord);
    EXPECT_EQ(mesh.global_rank(), rank);
    EXPECT_EQ(mesh.device_type(), c10::kCPU);
    EXPECT_EQ(mesh.dim_names(), mc.names);
    EXPECT_TRUE(mesh.mesh().equal(at::arange(ctx.world_size(), at::kLong).view(mc.shape)));

    // One group per dim: the members, this rank's place, and a collective.
    for (size_t d = 0; d < mc.shape.size(); ++d) {
      SCOPED_TRACE("mesh dim " + std::to_string(d) + " (" + mc.names[d] + ")");
      const std::vector<int> members = line(coord, mc.shape, d);
      const auto& group = mesh.group(static_cast<int64_t>(d));
      EXPECT_EQ(group->global_ranks(), members);
      EXPECT_EQ(group->rank(), coord[d]);
      EXPECT_EQ(group->size(), mc.shape[d]);
      EXPECT_EQ(mesh.size(static_cast<int64_t>(d)), mc.shape[d]);
      EXPECT_EQ(mesh.size(mc.names[d]), mc.shape[d]);
      EXPECT_EQ(mesh.local_rank(static_cast<int64_t>(d)), coord[d]);
      EXPECT_EQ(mesh.local_rank(mc.names[d]), coord[d]);
      EXPECT_EQ(mesh.group(mc.names[d]).get(), group.get());
      EXPECT_EQ(mesh.dim_index(mc.names[d]), static_cast<int64_t>(d));
      EXPECT_EQ(all_reduce_rank_sum(group, rank), sum_of(members));

      // Slicing one dim reuses the parent's group.
      DeviceMesh sub = mesh[mc.names[d]];
      EXPECT_EQ(sub.ndim(), 1);
      EXPECT_EQ(sub.group(0).get(), group.get());
      EXPECT_EQ(sub.local_rank(0), coord[d]);
      EXPECT_EQ(sub.coordinate(), std::vector<int64_t>{coord[d]});
      std::vector<int64_t> sub_ranks(sub.mesh().data_ptr<int64_t>(), sub.mesh().data_ptr<int64_t>() + sub.size());
      EXPECT_EQ(std::vector<int>(sub_ranks.begin(), sub_ranks.end()), members);
    }

    if (mc.shape.size() == 2) {
      DeviceMesh both = mesh.slice(mc.names);
      EXPECT_EQ(both.group(0).get(), mesh.group(0).get());
      EXPECT_EQ(both.group(1).get(), mesh.group(1).get());
      EXPECT_TRUE(both.mesh().equal(mesh.mesh()));
      EXPECT_THROW(mesh.slice({mc.names[1], mc.names[0]}), c10::Error);

      // Flattening the inner slice spans that slice's ranks only.
      DeviceMesh inner = mesh[mc.names[1]].flatten("inner_flat");
      EXPECT_EQ(inner.group(0)->global_ranks(), line(coord, mc.shape, 1));
      EXPECT_NE(inner.group(0).get(), mesh.group(1).get());
      EXPECT_EQ(all_reduce_rank_sum(inner.group(0), rank), sum_of(line(coord, mc.shape, 1)));
    }

    // Flattening the whole mesh: one new group over every rank, row-major.
    DeviceMesh flat = mesh.flatten();
    std::string joined;
    for (const auto& n : mc.names) joined += (joined.empty() ? "" : "_") + n;
    EXPECT_EQ(flat.dim_names(), std::vector<std::string>{joined});
    EXPECT_EQ(flat.ndim(), 1);
    EXPECT_EQ(flat.size(), ctx.world_size());
    EXPECT_EQ(flat.local_rank(0), rank);
    EXPECT_EQ(flat.group(0)->global_ranks(), ctx.world()->all_ranks());
    EXPECT_EQ(all_reduce_rank_sum(flat.group(0), rank), sum_of(ctx.world()->all_ranks()));
    // The parent's groups still work after flatten made a new one.
    EXPECT_EQ(all_reduce_rank_sum(mesh.group(0), rank), sum_of(line(coord, mc.shape, 0)));
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, DeviceMeshLayout,
                         ::testing::Values(MeshCase{{1}, {"dp"}, "1"}, MeshCase{{2}, {"dp"}, "2"},
                                           MeshCase{{3}, {"dp"}, "3"}, MeshCase{{4}, {"dp"}, "4"},
                                           MeshCase{{1, 4}, {"replicate", "shard"}, "1x4"},
                                           MeshCase{{4, 1}, {"replicate", "shard"}, "4x1"},
                                           MeshCase{{2, 2}, {"replicate", "shard"}, "2x2"},
                                           MeshCase{{2, 3}, {"dp", "tp"}, "2x3"}),
                         [](const auto& info) { return "mesh" + info.param.label; });

TEST(DeviceMeshDistributed, MeshFromAnExplicitRankTensorAndFromCommunicators) {
  testing::run_distributed(4, [](RankContext& ctx) {
    // Ranks in a non-arange order: [[3, 1], [2, 0]].
    at::Tensor layout = at::tensor({3, 1, 2, 0}, at::kLong).view({2, 2});
    DeviceMesh mesh(ctx.world(), c10::kCPU, layout, {"a", "b"});
    const int r = ctx.rank();
    const std::vector<std::vector<int64_t>> coords = {{1, 1}, {0, 1}, {1, 0}, {0, 0}};
    EXPECT_EQ(mesh.coordinate(), coords[r]);
    const std::vector<std::vector<int>> rows = {{2, 0}, {3, 1}, {2, 0}, {3, 1}};
    const std::vector<std::vector<int>> cols = {{1, 0}, {1, 0}, {3, 2}, {3, 2}};
    EXPECT_EQ(mesh.group("b")->global_ranks(), rows[r]);
    EXPECT_EQ(mesh.group("a")->global_ranks(), cols[r]);
    EXPECT_EQ(all_reduce_rank_sum(mesh.group("a"), r), sum_of(cols[r]));
    EXPECT_EQ(all_reduce_rank_sum(mesh.group("b"), r), sum_of(rows[r]));

    // The same layout wrapped around the existing communicators.
    DeviceMesh again = DeviceMesh::from_communicators(ctx.world(), layout, {mesh.group(0), mesh.group(1)}, {"x", "y"});
    EXPECT_EQ(again.coordinate(), coords[r]);
    EXPECT_EQ(again.group("y").get(), mesh.group("b").get());
    EXPECT_THROW(DeviceMesh::from_communicators(ctx.world(), layout, {mesh.group(1), mesh.group(0)}), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp
