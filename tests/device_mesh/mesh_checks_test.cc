// DeviceMesh and DTensor in one process: the Worlds of all ranks rendezvous
// through an in-memory store from threads, and meshes are built with
// from_communicators over communicators whose engine never runs. This covers
// layouts, slicing, local shapes and every argument check without starting
// processes; the collectives themselves are covered by the distributed tests.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "collectives/world.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/dtensor.h"
#include "device_mesh/placement.h"
#include "fsdp_testing/test_helpers.h"
#include "mesh_coords.h"

namespace fsdp {
namespace {

using collectives::Communicator;
using collectives::World;
using fsdp::testing::error_of;
using test::row_major;
using ::testing::HasSubstr;

// An engine that is never asked to communicate.
class InertBackend : public c10d::Backend {
 public:
  InertBackend(int rank, int size) : c10d::Backend(rank, size) {}
  const std::string getBackendName() const override { return "inert"; }
};

std::vector<std::shared_ptr<World>> make_worlds(int n) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<World>> worlds(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        worlds[r] = World::from_store(store, r, n, "hash://mesh_checks_test");
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return worlds;
}

std::shared_ptr<Communicator> inert_communicator(int group_rank, std::vector<int> ranks) {
  const int size = static_cast<int>(ranks.size());
  return std::make_shared<Communicator>(c10::make_intrusive<InertBackend>(group_rank, size),
                                        collectives::BackendKind::kGloo, c10::kCPU, group_rank, std::move(ranks),
                                        collectives::CommunicatorOptions{});
}

// The mesh `shape` over ranks 0..n-1 as seen by `world`'s rank.
DeviceMesh inert_mesh(const std::shared_ptr<World>& world, const std::vector<int64_t>& shape,
                      std::vector<std::string> names = {}) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  at::Tensor layout = at::arange(n, at::kLong).view(shape);
  const std::vector<int64_t> coord = row_major(world->rank(), shape);
  std::vector<std::shared_ptr<Communicator>> groups;
  for (size_t d = 0; d < shape.size(); ++d) {
    std::vector<int> line;
    for (int64_t i = 0; i < shape[d]; ++i) {
      std::vector<int64_t> c = coord;
      c[d] = i;
      int64_t flat = 0;
      for (size_t e = 0; e < shape.size(); ++e) flat = flat * shape[e] + c[e];
      line.push_back(static_cast<int>(flat));
    }
    groups.push_back(inert_communicator(static_cast<int>(coord[d]), line));
  }
  return DeviceMesh::from_communicators(world, layout, groups, std::move(names));
}

class MeshChecks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    worlds4_ = new std::vector<std::shared_ptr<World>>(make_worlds(4));
    worlds6_ = new std::vector<std::shared_ptr<World>>(make_worlds(6));
  }
  static void TearDownTestSuite() {
    delete worlds4_;
    delete worlds6_;
  }
  static const std::shared_ptr<World>& world4(int r) { return (*worlds4_)[r]; }
  static const std::shared_ptr<World>& world6(int r) { return (*worlds6_)[r]; }
  static std::vector<std::shared_ptr<World>>* worlds4_;
  static std::vector<std::shared_ptr<World>>* worlds6_;
};
std::vector<std::shared_ptr<World>>* MeshChecks::worlds4_ = nullptr;
std::vector<std::shared_ptr<World>>* MeshChecks::worlds6_ = nullptr;

// ---- layout and slicing --------------------------------------------------------

TEST_F(MeshChecks, TwoByThreeLayoutMatchesTheHeaderExample) {
  DeviceMesh mesh = inert_mesh(world6(4), {2, 3}, {"replicate", "shard"});
  EXPECT_EQ(mesh.ndim(), 2);
  EXPECT_EQ(mesh.size(), 6);
  EXPECT_EQ(mesh.size("replicate"), 2);
  EXPECT_EQ(mesh.size("shard"), 3);
  EXPECT_EQ(mesh.coordinate(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(mesh.group("shard")->global_ranks(), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(mesh.group("replicate")->global_ranks(), (std::vector<int>{1, 4}));
  EXPECT_EQ(mesh.local_rank("shard"), 1);
  EXPECT_EQ(mesh.local_rank("replicate"), 1);
  EXPECT_EQ(mesh.global_rank(), 4);
  EXPECT_EQ(mesh.to_string(), "DeviceMesh(cpu, [[0, 1, 2], [3, 4, 5]], dim_names=[\"replicate\", \"shard\"])");
}

TEST_F(MeshChecks, SlicesReuseTheParentsCommunicators) {
  DeviceMesh mesh = inert_mesh(world6(5), {2, 3}, {"replicate", "shard"});
  DeviceMesh shard = mesh["shard"];
  EXPECT_EQ(shard.ndim(), 1);
  EXPECT_EQ(shard.group(0).get(), mesh.group(1).get());
  EXPECT_TRUE(shard.mesh().equal(at::tensor({3, 4, 5}, at::kLong)));
  EXPECT_EQ(shard.dim_names(), (std::vector<std::string>{"shard"}));
  EXPECT_EQ(shard.local_rank(0), 2);
  DeviceMesh replicate = mesh["replicate"];
  EXPECT_EQ(replicate.group(0).get(), mesh.group(0).get());
  EXPECT_TRUE(replicate.mesh().equal(at::tensor({2, 5}, at::kLong)));
  DeviceMesh both = mesh.slice({"replicate", "shard"});
  EXPECT_EQ(both.group(0).get(), mesh.group(0).get());
  EXPECT_EQ(both.group(1).get(), mesh.group(1).get());
  EXPECT_TRUE(both.mesh().equal(mesh.mesh()));
  // Copies share too.
  DeviceMesh copy = mesh;
  EXPECT_EQ(copy.group("shard").get(), mesh.group("shard").get());
}

TEST_F(MeshChecks, SlicingOutOfOrderNamesTheRightOrder) {
  DeviceMesh mesh = inert_mesh(world4(0), {2, 2}, {"dp", "tp"});
  const std::string error = error_of([&] { mesh.slice({"tp", "dp"}); });
  EXPECT_THAT(error, HasSubstr("not in the order"));
  EXPECT_THAT(error, HasSubstr("[\"dp\", \"tp\"] instead"));
}

TEST_F(MeshChecks, SlicingUnknownOrRepeatedNamesThrows) {
  DeviceMesh mesh = inert_mesh(world4(1), {2, 2}, {"dp", "tp"});
  const std::string unknown = error_of([&] { mesh["pp"]; });
  EXPECT_THAT(unknown, HasSubstr("no dim named \"pp\""));
  EXPECT_THAT(unknown, HasSubstr("known names are [\"dp\", \"tp\"]"));
  EXPECT_THAT(error_of([&] { mesh.slice({"dp", "dp"}); }), HasSubstr("appears more than once"));
  EXPECT_THAT(error_of([&] { mesh.slice({}); }), HasSubstr("no dim names given"));
  DeviceMesh unnamed = inert_mesh(world4(1), {4});
  EXPECT_THAT(error_of([&] { unnamed["dp"]; }), HasSubstr("has no dim names"));
}

TEST_F(MeshChecks, DimIndexOutOfRangeThrows) {
  DeviceMesh mesh = inert_mesh(world4(2), {4});
  EXPECT_THAT(error_of([&] { mesh.group(1); }), HasSubstr("dim 1 is out of range"));
  EXPECT_THAT(error_of([&] { mesh.size(-1); }), HasSubstr("out of range"));
  EXPECT_THAT(error_of([&] { mesh.local_rank(3); }), HasSubstr("out of range"));
}

// ---- construction checks ---------------------------------------------------------

TEST_F(MeshChecks, InitDeviceMeshRejectsAShapeThatDoesNotMatchTheWorld) {
  const std::string error = error_of([&] { init_device_mesh(world4(0), c10::kCPU, {3}); });
  EXPECT_THAT(error, HasSubstr("mesh shape [3] holds 3 ranks"));
  EXPECT_THAT(error, HasSubstr("has 4"));
  EXPECT_THAT(error_of([&] { init_device_mesh(world4(0), c10::kCPU, {2, 3}); }), HasSubstr("holds 6 ranks"));
  EXPECT_THAT(error_of([&] { init_device_mesh(world4(0), c10::kCPU, {}); }), HasSubstr("shape is empty"));
  EXPECT_THAT(error_of([&] { init_device_mesh(world4(0), c10::kCPU, {4, 0}); }), HasSubstr("dim of size 0"));
}

TEST_F(MeshChecks, DuplicateDimNamesThrow) {
  const std::string error = error_of([&] { init_device_mesh(world4(0), c10::kCPU, {2, 2}, {"dp", "dp"}); });
  EXPECT_THAT(error, HasSubstr("dim name \"dp\" appears more than once"));
}

TEST_F(MeshChecks, WrongNumberOfDimNamesThrows) {
  const std::string error = error_of([&] { init_device_mesh(world4(0), c10::kCPU, {2, 2}, {"dp"}); });
  EXPECT_THAT(error, HasSubstr("1 dim names [\"dp\"] given for a 2-d mesh"));
  EXPECT_THAT(error_of([&] { init_device_mesh(world4(0), c10::kCPU, {4}, {""}); }), HasSubstr("empty dim name"));
}

TEST_F(MeshChecks, BadRanksInTheMeshTensorThrow) {
  EXPECT_THAT(error_of([&] {
                DeviceMesh(world4(0), c10::kCPU, at::tensor({0, 1, 4}, at::kLong));
              }),
              HasSubstr("rank 4 in DeviceMesh(cpu, [0, 1, 4]) is out of range [0, 4)"));
  EXPECT_THAT(error_of([&] {
                DeviceMesh(world4(0), c10::kCPU, at::tensor({0, 1, 1}, at::kLong));
              }),
              HasSubstr("rank 1 appears more than once"));
  EXPECT_THAT(error_of([&] {
                DeviceMesh(world4(0), c10::kCPU, at::tensor({1, 2}, at::kLong));
              }),
              HasSubstr("this rank (0) is not in DeviceMesh(cpu, [1, 2])"));
  EXPECT_THAT(error_of([&] { DeviceMesh(world4(0), c10::kCPU, at::tensor({0.0, 1.0})); }), HasSubstr("integer ranks"));
}

TEST_F(MeshChecks, FromCommunicatorsChecksMembers) {
  const auto& world = world4(1);
  at::Tensor layout = at::arange(4, at::kLong).view({2, 2});
  // Rank 1 is at {0, 1}: dim 0 is [1, 3], dim 1 is [0, 1].
  auto good0 = inert_communicator(0, {1, 3});
  auto good1 = inert_communicator(1, {0, 1});
  auto bad1 = inert_communicator(1, {2, 1});
  EXPECT_NO_THROW(DeviceMesh::from_communicators(world, layout, {good0, good1}));
  const std::string error = error_of([&] { DeviceMesh::from_communicators(world, layout, {good0, bad1}); });
  EXPECT_THAT(error, HasSubstr("has members [2, 1] but dim 1"));
  EXPECT_THAT(error, HasSubstr("is [0, 1]"));
  EXPECT_THAT(error_of([&] { DeviceMesh::from_communicators(world, layout, {good0}); }),
              HasSubstr("1 communicators given for the 2-d mesh"));
}

// ---- DTensorSpec shapes ------------------------------------------------------------

using Shape = std::vector<int64_t>;

TEST_F(MeshChecks, SpecLocalShapesFollowTorchChunk) {
  DeviceMesh mesh = inert_mesh(world4(0), {4});
  DTensorSpec rows10(mesh, {Placement::shard(0)}, {10, 3}, at::kFloat);
  EXPECT_EQ(rows10.local_shape({0}), (Shape{3, 3}));
  EXPECT_EQ(rows10.local_shape({2}), (Shape{3, 3}));
  EXPECT_EQ(rows10.local_shape({3}), (Shape{1, 3}));
  EXPECT_EQ(rows10.local_offset({3}), (Shape{9, 0}));
  EXPECT_EQ(rows10.local_shape(), (Shape{3, 3}));
  EXPECT_EQ(rows10.stride, (Shape{3, 1}));

  DTensorSpec rows2(mesh, {Placement::shard(0)}, {2, 5}, at::kFloat);
  EXPECT_EQ(rows2.local_shape({1}), (Shape{1, 5}));
  EXPECT_EQ(rows2.local_shape({2}), (Shape{0, 5}));
  EXPECT_EQ(rows2.local_shape({3}), (Shape{0, 5}));
  EXPECT_EQ(rows2.local_offset({1}), (Shape{1, 0}));
  EXPECT_EQ(rows2.local_offset({3}), (Shape{2, 0}));

  DTensorSpec cols(mesh, {Placement::shard(1)}, {2, 5}, at::kFloat);
  EXPECT_EQ(cols.local_shape({1}), (Shape{2, 2}));
  EXPECT_EQ(cols.local_shape({2}), (Shape{2, 1}));
  EXPECT_EQ(cols.local_offset({2}), (Shape{0, 4}));

  DTensorSpec replicated(mesh, {Placement::replicate()}, {2, 5}, at::kFloat);
  EXPECT_EQ(replicated.local_shape({3}), (Shape{2, 5}));
  EXPECT_EQ(replicated.local_offset({3}), (Shape{0, 0}));
  DTensorSpec partial(mesh, {Placement::partial()}, {2, 5}, at::kFloat);
  EXPECT_EQ(partial.local_shape({3}), (Shape{2, 5}));
}

TEST_F(MeshChecks, SpecShardsNestInMeshDimOrder) {
  DeviceMesh mesh = inert_mesh(world4(0), {2, 2});
  // 7 rows: mesh dim 0 splits 4 | 3, then mesh dim 1 splits 2 | 2 and 2 | 1.
  DTensorSpec nested(mesh, {Placement::shard(0), Placement::shard(0)}, {7}, at::kFloat);
  EXPECT_EQ(nested.local_shape({0, 0}), (Shape{2}));
  EXPECT_EQ(nested.local_offset({0, 1}), (Shape{2}));
  EXPECT_EQ(nested.local_shape({1, 0}), (Shape{2}));
  EXPECT_EQ(nested.local_offset({1, 0}), (Shape{4}));
  EXPECT_EQ(nested.local_shape({1, 1}), (Shape{1}));
  EXPECT_EQ(nested.local_offset({1, 1}), (Shape{6}));
  // 2 rows: 1 | 1, then 1 | 0 each.
  DTensorSpec tiny(mesh, {Placement::shard(0), Placement::shard(0)}, {2}, at::kFloat);
  EXPECT_EQ(tiny.local_shape({0, 1}), (Shape{0}));
  EXPECT_EQ(tiny.local_offset({1, 0}), (Shape{1}));
  EXPECT_EQ(tiny.local_offset({1, 1}), (Shape{2}));

  DTensorSpec two_dims(mesh, {Placement::shard(0), Placement::shard(1)}, {5, 3}, at::kFloat);
  EXPECT_EQ(two_dims.local_shape({0, 0}), (Shape{3, 2}));
  EXPECT_EQ(two_dims.local_shape({1, 1}), (Shape{2, 1}));
  EXPECT_EQ(two_dims.local_offset({1, 1}), (Shape{3, 2}));

  DTensorSpec hsdp(mesh, {Placement::replicate(), Placement::shard(0)}, {5}, at::kFloat);
  EXPECT_EQ(hsdp.local_shape({1, 0}), (Shape{3}));
  EXPECT_EQ(hsdp.local_shape({1, 1}), (Shape{2}));
  EXPECT_EQ(hsdp.local_offset({0, 1}), (Shape{3}));
}

TEST_F(MeshChecks, SpecRejectsBadPlacementsAndCoordinates) {
  DeviceMesh mesh = inert_mesh(world4(0), {2, 2});
  EXPECT_THAT(error_of([&] { DTensorSpec(mesh, {Placement::shard(0)}, {4}, at::kFloat); }),
              HasSubstr("1 placements (Shard(0)) given for the 2-d mesh"));
  EXPECT_THAT(error_of([&] {
                DTensorSpec(mesh, {Placement::replicate(), Placement::shard(1)}, {4}, at::kFloat);
              }),
              HasSubstr("shards dim 1 of a 1-d tensor"));
  DTensorSpec spec(mesh, {Placement::replicate(), Placement::shard(0)}, {4}, at::kFloat);
  EXPECT_THAT(error_of([&] { spec.local_shape({0, 2}); }), HasSubstr("outside the mesh"));
  EXPECT_THAT(error_of([&] { spec.local_shape({0}); }), HasSubstr("does not fit"));
}

// ---- DTensor without communication ---------------------------------------------------

TEST_F(MeshChecks, FromLocalRejectsAWrongLocalShape) {
  DeviceMesh mesh = inert_mesh(world4(3), {4});
  // Rank 3 holds the last row of 10 (3, 3, 3, 1).
  EXPECT_NO_THROW(DTensor::from_local(at::zeros({1, 2}), mesh, {Placement::shard(0)}, Shape{10, 2}));
  const std::string error = error_of([&] {
    DTensor::from_local(at::zeros({3, 2}), mesh, {Placement::shard(0)}, Shape{10, 2});
  });
  EXPECT_THAT(error, HasSubstr("has shape [3, 2] but global shape [10, 2]"));
  EXPECT_THAT(error, HasSubstr("gives local shape [1, 2]"));
  EXPECT_THAT(error_of([&] {
                DTensor::from_local(at::zeros({1, 2}), mesh, {Placement::shard(0)}, Shape{10});
              }),
              HasSubstr("different ranks"));
}

TEST_F(MeshChecks, FromLocalDefaultsToEvenShards) {
  DeviceMesh mesh = inert_mesh(world4(2), {4});
  DTensor dt = DTensor::from_local(at::zeros({3, 2}), mesh, {Placement::shard(0)});
  EXPECT_EQ(dt.shape(), (Shape{12, 2}));
  DTensor rep = DTensor::from_local(at::zeros({3, 2}), mesh, {Placement::replicate()});
  EXPECT_EQ(rep.shape(), (Shape{3, 2}));
}

TEST_F(MeshChecks, DistributeWithoutSourceSlicesLocally) {
  at::Tensor full = at::arange(30, at::kFloat).view({10, 3});
  for (int r = 0; r < 4; ++r) {
    DeviceMesh mesh = inert_mesh(world4(r), {4});
    DTensor dt = distribute_tensor(full, mesh, {Placement::shard(0)});
    const ChunkExtent e = chunk_extent(10, 4, r);
    EXPECT_TRUE(dt.to_local().equal(full.narrow(0, e.offset, e.length))) << "rank " << r;
    EXPECT_TRUE(dt.to_local().is_contiguous());
    // Replicate -> Shard and Replicate -> Partial need no communication.
    DTensor rep = distribute_tensor(full, mesh, {Placement::replicate()});
    EXPECT_TRUE(rep.redistribute({Placement::shard(0)}).to_local().equal(dt.to_local()));
    DTensor part = rep.redistribute({Placement::partial()});
    EXPECT_TRUE(part.to_local().equal(r == 0 ? full : at::zeros_like(full))) << "rank " << r;
    DTensor avg = rep.redistribute({Placement::partial(collectives::ReduceOp::avg())});
    EXPECT_TRUE(avg.to_local().equal(full));
  }
}

TEST_F(MeshChecks, DistributeRejectsPartialAndWrongDevices) {
  DeviceMesh mesh = inert_mesh(world4(0), {4});
  EXPECT_THAT(error_of([&] { distribute_tensor(at::zeros({4}), mesh, {Placement::partial()}); }),
              HasSubstr("a full tensor is not partial"));
  EXPECT_THAT(error_of([&] { distribute_tensor(at::zeros({4}), mesh, {Placement::shard(1)}); }),
              HasSubstr("shards dim 1 of a 1-d tensor"));
  EXPECT_THAT(error_of([&] { distribute_tensor(at::zeros({4}), mesh, {Placement::shard(0)}, 7); }),
              HasSubstr("src_rank 7 is not in"));
}

}  // namespace
}  // namespace fsdp
