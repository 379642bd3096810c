// DeviceMesh: an N-D arrangement of global ranks with named dimensions, and
// the process group along each dimension.
//
// As in PyTorch, mesh dimension d of rank r groups r with every rank that
// differs from it only in coordinate d. For a 2x3 mesh over ranks 0..5
// (row-major) named {"replicate", "shard"}:
//
//     shard ->  0 1 2
//               3 4 5
//   rank 4: coordinate {1, 1}; group("shard") = [3,4,5]; group("replicate") = [1,4].
//
// A 2x2 mesh of 4 ranks (examples/distributed_test_example.cc):
//
//   auto mesh = fsdp::init_device_mesh(world, c10::kCPU, {2, 2}, {"replicate", "shard"});
//   auto shard_comm = mesh.group("shard");
//   fsdp::DeviceMesh dp = mesh["shard"];               // 1-D slice, same group
//
// DeviceMesh is a cheap value type: copies and slices share the per-dimension
// communicators, which live as long as any mesh uses them. Construction is
// collective over all ranks of the mesh: each rank creates the groups it is a
// member of, once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include "collectives/communicator.h"
#include "collectives/world.h"

namespace fsdp {

class DeviceMesh {
 public:
  // Builds a mesh over `mesh` (an int64 tensor of distinct global ranks, any
  // number of dims >= 1), with optional names, one per dim and unique.
  // Collective over every rank in `mesh`; this rank must be in it.
  // Throws on duplicate/unknown/out-of-range ranks, wrong name count, or
  // duplicate names.
  DeviceMesh(std::shared_ptr<collectives::World> world, c10::DeviceType device_type, const at::Tensor& mesh,
             std::vector<std::string> dim_names = {}, const collectives::CommunicatorOptions& options = {});

  // Builds a mesh from communicators that already exist, one per dim (for
  // instance, made by another library). `mesh` gives the rank layout and
  // must agree with each communicator's member list. Not collective.
  static DeviceMesh from_communicators(std::shared_ptr<collectives::World> world, const at::Tensor& mesh,
                                       std::vector<std::shared_ptr<collectives::Communicator>> groups,
                                       std::vector<std::string> dim_names = {});

  int64_t ndim() const;
  // Number of ranks along `dim` / in the whole mesh.
  int64_t size(int64_t dim) const;
  int64_t size(const std::string& dim_name) const;
  int64_t size() const;
  c10::DeviceType device_type() const;
  // The rank layout (int64, CPU). Do not modify.
  const at::Tensor& mesh() const;
  const std::vector<std::string>& dim_names() const;
  // Index of a named dim; throws listing the known names when absent.
  int64_t dim_index(const std::string& dim_name) const;

  // The communicator along `dim` for this rank.
  const std::shared_ptr<collectives::Communicator>& group(int64_t dim = 0) const;
  const std::shared_ptr<collectives::Communicator>& group(const std::string& dim_name) const;

  // This rank's index along `dim` (its group rank in group(dim)).
  int64_t local_rank(int64_t dim = 0) const;
  int64_t local_rank(const std::string& dim_name) const;
  // This rank's coordinate in the mesh.
  std::vector<int64_t> coordinate() const;
  int global_rank() const;
  const std::shared_ptr<collectives::World>& world() const;

  // Sub-mesh of the named dims containing this rank, reusing this mesh's
  // groups (no communication). Names must be in this mesh's order:
  // mesh["replicate", "shard"] is fine, mesh["shard", "replicate"] throws.
  DeviceMesh operator[](const std::string& dim_name) const;
  DeviceMesh slice(const std::vector<std::string>& dim_names) const;

  // A 1-D mesh whose single dim (named `name`, default the names joined by
  // "_") spans all of this mesh's dims, with its own new group. Collective
  // over all ranks of this mesh.
  DeviceMesh flatten(const std::string& name = "") const;

  std::string to_string() const;

 private:
  struct State;
  explicit DeviceMesh(std::shared_ptr<const State> state);
  std::shared_ptr<const State> state_;
};

// Builds a mesh of shape `shape` over ranks 0..prod(shape)-1 (row-major).
// REQUIRES: prod(shape) == world->size(). Collective over all ranks.
DeviceMesh init_device_mesh(std::shared_ptr<collectives::World> world, c10::DeviceType device_type,
                            const std::vector<int64_t>& shape, std::vector<std::string> dim_names = {},
                            const collectives::CommunicatorOptions& options = {});

}  // namespace fsdp
