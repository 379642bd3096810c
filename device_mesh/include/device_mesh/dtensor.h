// DTensorSpec and a small DTensor: a local tensor plus where it sits in a
// global tensor laid out over a DeviceMesh.
//
// Uneven sharding follows torch.chunk (see placement.h): with 10 rows over 4
// ranks the local row counts are 3, 3, 3, 1; with 2 rows over 4 ranks they are
// 1, 1, 0, 0. Several mesh dims may shard the same tensor dim (the chunking
// then nests in mesh-dim order, as DTensor does). Over a 1-D mesh `dp`
// (examples/distributed_test_example.cc):
//
//   auto dt = fsdp::distribute_tensor(full, dp, {fsdp::Placement::shard(0)});
//   at::Tensor again = dt.full_tensor();               // == full on every rank
//   auto rep = dt.redistribute({fsdp::Placement::replicate()});
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "device_mesh/device_mesh.h"
#include "device_mesh/placement.h"

namespace fsdp {

struct DTensorSpec {
  DeviceMesh mesh;
  std::vector<Placement> placements;  // one per mesh dim
  std::vector<int64_t> shape;         // global shape
  std::vector<int64_t> stride;        // global contiguous stride
  c10::ScalarType dtype;

  // Builds and validates a spec: one placement per mesh dim, Shard dims
  // within the tensor's rank. Throws otherwise.
  DTensorSpec(DeviceMesh mesh, std::vector<Placement> placements, std::vector<int64_t> shape, c10::ScalarType dtype);

  // Local shape and offset (per tensor dim) of the rank at `coordinate`.
  std::vector<int64_t> local_shape(const std::vector<int64_t>& coordinate) const;
  std::vector<int64_t> local_offset(const std::vector<int64_t>& coordinate) const;
  // The same for this rank.
  std::vector<int64_t> local_shape() const;
  std::vector<int64_t> local_offset() const;
};

class DTensor {
 public:
  // Wraps `local` as this rank's piece of a global tensor. `shape` defaults to
  // the shape implied by the local shapes with even (non-trailing) chunks.
  // Throws when `local`'s shape does not match the spec's local shape.
  static DTensor from_local(const at::Tensor& local, DeviceMesh mesh, std::vector<Placement> placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt);

  const at::Tensor& to_local() const { return local_; }
  const DTensorSpec& spec() const { return spec_; }
  const std::vector<int64_t>& shape() const { return spec_.shape; }
  const std::vector<Placement>& placements() const { return spec_.placements; }
  const DeviceMesh& mesh() const { return spec_.mesh; }

  // The global tensor on every rank (all-gathers Shard dims, reduces Partial
  // dims). Collective over the mesh.
  at::Tensor full_tensor() const;

  // Changes placements. Supported per mesh dim: Shard(d) <-> Replicate,
  // Partial -> Replicate, Partial -> Shard(d), Replicate -> Partial (rank 0
  // of that dim keeps the value, others zero). Collective over the mesh.
  DTensor redistribute(const std::vector<Placement>& placements) const;

  DTensor(at::Tensor local, DTensorSpec spec);

 private:
  at::Tensor local_;
  DTensorSpec spec_;
};

// Lays `full` out over `mesh`: Shard dims are sliced locally, Replicate dims
// keep the whole tensor. With `src_rank` unset every rank must pass the same
// value and nothing is communicated; with `src_rank` set (a global rank in
// the mesh), that rank's values are broadcast first and the others' are
// ignored (they still pass a tensor of the same shape and dtype), which makes
// the call collective over the mesh. Partial placements are rejected (a full
// tensor is not partial).
DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, const std::vector<Placement>& placements,
                          std::optional<int> src_rank = std::nullopt);

}  // namespace fsdp
