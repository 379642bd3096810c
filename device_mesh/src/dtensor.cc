// DTensorSpec and DTensor: local shapes, redistribution and distribution.
#include "device_mesh/dtensor.h"

#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace fsdp {

namespace {

std::string placements_string(const std::vector<Placement>& placements) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < placements.size(); ++i) out << (i ? ", " : "") << placements[i].to_string();
  out << ")";
  return out.str();
}

std::vector<int64_t> contiguous_stride(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t s = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    stride[d] = s;
    s *= std::max<int64_t>(shape[d], 1);
  }
  return stride;
}

// Local shape and global offset of the rank at `coordinate` for `placements`
// over a mesh of sizes `mesh_sizes` (nested chunking in mesh-dim order).
void compute_local(const std::vector<int64_t>& shape, const std::vector<int64_t>& mesh_sizes,
                   const std::vector<Placement>& placements, const std::vector<int64_t>& coordinate,
                   std::vector<int64_t>* local_shape, std::vector<int64_t>* local_offset) {
  std::vector<int64_t> sizes = shape;
  std::vector<int64_t> offsets(shape.size(), 0);
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const int64_t d = placements[m].dim();
    const ChunkExtent ext = chunk_extent(sizes[d], mesh_sizes[m], coordinate[m]);
    offsets[d] += ext.offset;
    sizes[d] = ext.length;
  }
  if (local_shape) *local_shape = std::move(sizes);
  if (local_offset) *local_offset = std::move(offsets);
}

std::vector<int64_t> mesh_sizes(const DeviceMesh& mesh) {
  std::vector<int64_t> sizes;
  for (int64_t m = 0; m < mesh.ndim(); ++m) sizes.push_back(mesh.size(m));
  return sizes;
}

// All-gathers `local` (this rank's torch.chunk piece of a tensor whose dim `d`
// has `full_size` entries) along mesh dim `m`.
at::Tensor gather_shards(const at::Tensor& local, int64_t d, int64_t full_size, const DeviceMesh& mesh, int64_t m) {
  const auto& group = mesh.group(m);
  const int64_t n = group->size();
  if (n == 1) return local;
  const int64_t chunk = (full_size + n - 1) / n;
  at::Tensor front = local.movedim(d, 0);
  std::vector<int64_t> padded_shape = front.sizes().vec();
  padded_shape[0] = chunk;
  at::Tensor padded = at::zeros(padded_shape, local.options());
  if (front.size(0) > 0) padded.narrow(0, 0, front.size(0)).copy_(front);
  std::vector<int64_t> out_shape = padded_shape;
  out_shape[0] = n * chunk;
  at::Tensor out = at::empty(out_shape, local.options());
  group->all_gather_into_tensor(out, padded).wait();
  // torch.chunk pieces are full except the trailing ones, so the valid rows
  // are the first full_size rows of the rank-major output.
  return out.narrow(0, 0, full_size).movedim(0, d).contiguous();
}

// Reduce-scatters the full-size (along `d`) partial `local` along mesh dim
// `m` into this rank's torch.chunk piece of dim `d`.
at::Tensor reduce_scatter_shards(const at::Tensor& local, int64_t d, const collectives::ReduceOp& op,
                                 const DeviceMesh& mesh, int64_t m) {
  const auto& group = mesh.group(m);
  const int64_t n = group->size();
  const int64_t full_size = local.size(d);
  const int64_t chunk = (full_size + n - 1) / n;
  at::Tensor front = local.movedim(d, 0);
  std::vector<int64_t> padded_shape = front.sizes().vec();
  padded_shape[0] = n * chunk;
  at::Tensor padded = at::zeros(padded_shape, local.options());
  if (full_size > 0) padded.narrow(0, 0, full_size).copy_(front);
  std::vector<int64_t> out_shape = padded_shape;
  out_shape[0] = chunk;
  at::Tensor out = at::empty(out_shape, local.options());
  group->reduce_scatter_tensor(out, padded, op).wait();
  const ChunkExtent ext = chunk_extent(full_size, n, mesh.local_rank(m));
  return out.narrow(0, 0, ext.length).movedim(0, d).contiguous();
}

// Turns a replicated (along mesh dim `m`) `local` into the placement `to`.
at::Tensor from_replicate(const at::Tensor& local, const Placement& to, const DeviceMesh& mesh, int64_t m) {
  if (to.is_replicate()) return local;
  const int64_t n = mesh.size(m);
  const int64_t me = mesh.local_rank(m);
  if (to.is_shard()) {
    const int64_t d = to.dim();
    const ChunkExtent ext = chunk_extent(local.size(d), n, me);
    return local.narrow(d, ext.offset, ext.length).clone(at::MemoryFormat::Contiguous);
  }
  // Partial: the reduction of the pieces over the dim must be `local`.
  const collectives::ReduceOp& op = to.reduce_op();
  switch (op.kind()) {
    case collectives::ReduceOp::Kind::kSum: return me == 0 ? local : at::zeros_like(local);
    case collectives::ReduceOp::Kind::kPremulSum: return me == 0 ? local / op.factor() : at::zeros_like(local);
    case collectives::ReduceOp::Kind::kAvg:
    case collectives::ReduceOp::Kind::kMax:
    case collectives::ReduceOp::Kind::kMin: return local;
  }
  return local;
}

void check_placements(const DeviceMesh& mesh, const std::vector<Placement>& placements, int64_t tensor_dim,
                      const char* where) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), where, ": ", placements.size(), " placements ",
              placements_string(placements), " given for the ", mesh.ndim(), "-d mesh ", mesh.to_string(),
              "; give one per mesh dim");
  for (const auto& p : placements) {
    if (p.is_shard()) {
      TORCH_CHECK(p.dim() < tensor_dim, where, ": placement ", p.to_string(), " shards dim ", p.dim(), " of a ",
                  tensor_dim, "-d tensor (placements ", placements_string(placements), ", mesh ", mesh.to_string(),
                  ")");
    }
  }
}

}  // namespace

DTensorSpec::DTensorSpec(DeviceMesh mesh_in, std::vector<Placement> placements_in, std::vector<int64_t> shape_in,
                         c10::ScalarType dtype_in)
    : mesh(std::move(mesh_in)),
      placements(std::move(placements_in)),
      shape(std::move(shape_in)),
      stride(contiguous_stride(shape)),
      dtype(dtype_in) {
  check_placements(mesh, placements, static_cast<int64_t>(shape.size()), "DTensorSpec");
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 0, "DTensorSpec: global shape ", c10::IntArrayRef(shape), " has a negative size");
  }
}

std::vector<int64_t> DTensorSpec::local_shape(const std::vector<int64_t>& coordinate) const {
  TORCH_CHECK(static_cast<int64_t>(coordinate.size()) == mesh.ndim(), "DTensorSpec::local_shape: coordinate ",
              c10::IntArrayRef(coordinate), " does not fit the ", mesh.ndim(), "-d mesh ", mesh.to_string());
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    TORCH_CHECK(coordinate[m] >= 0 && coordinate[m] < mesh.size(m), "DTensorSpec::local_shape: coordinate ",
                c10::IntArrayRef(coordinate), " is outside the mesh ", mesh.to_string());
  }
  std::vector<int64_t> out;
  compute_local(shape, mesh_sizes(mesh), placements, coordinate, &out, nullptr);
  return out;
}

std::vector<int64_t> DTensorSpec::local_offset(const std::vector<int64_t>& coordinate) const {
  local_shape(coordinate);  // validates the coordinate
  std::vector<int64_t> out;
  compute_local(shape, mesh_sizes(mesh), placements, coordinate, nullptr, &out);
  return out;
}

std::vector<int64_t> DTensorSpec::local_shape() const { return local_shape(mesh.coordinate()); }

std::vector<int64_t> DTensorSpec::local_offset() const { return local_offset(mesh.coordinate()); }

DTensor::DTensor(at::Tensor local, DTensorSpec spec) : local_(std::move(local)), spec_(std::move(spec)) {
  TORCH_CHECK(local_.defined(), "DTensor: the local tensor is undefined (mesh ", spec_.mesh.to_string(), ")");
  TORCH_CHECK(local_.scalar_type() == spec_.dtype, "DTensor: the local tensor has dtype ", local_.scalar_type(),
              " but the spec says ", spec_.dtype);
  TORCH_CHECK(local_.device().type() == spec_.mesh.device_type(), "DTensor: the local tensor is on ", local_.device(),
              " but the mesh ", spec_.mesh.to_string(), " is on ", spec_.mesh.device_type());
  const std::vector<int64_t> expected = spec_.local_shape();
  TORCH_CHECK(local_.sizes().vec() == expected, "DTensor: the local tensor of rank ", spec_.mesh.global_rank(),
              " (coordinate ", c10::IntArrayRef(spec_.mesh.coordinate()), ") has shape ", local_.sizes(),
              " but global shape ", c10::IntArrayRef(spec_.shape), " with placements ",
              placements_string(spec_.placements), " on ", spec_.mesh.to_string(), " gives local shape ",
              c10::IntArrayRef(expected));
}

DTensor DTensor::from_local(const at::Tensor& local, DeviceMesh mesh, std::vector<Placement> placements,
                            std::optional<std::vector<int64_t>> shape) {
  TORCH_CHECK(local.defined(), "DTensor::from_local: the local tensor is undefined (mesh ", mesh.to_string(), ")");
  check_placements(mesh, placements, local.dim(), "DTensor::from_local");
  std::vector<int64_t> global;
  if (shape) {
    global = *shape;
    TORCH_CHECK(static_cast<int64_t>(global.size()) == local.dim(), "DTensor::from_local: global shape ",
                c10::IntArrayRef(global), " and local shape ", local.sizes(), " have different ranks");
  } else {
    global = local.sizes().vec();
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      if (placements[m].is_shard()) global[placements[m].dim()] *= mesh.size(m);
    }
  }
  DTensorSpec spec(std::move(mesh), std::move(placements), std::move(global), local.scalar_type());
  return DTensor(local, std::move(spec));
}

at::Tensor DTensor::full_tensor() const {
  std::vector<Placement> replicated(spec_.placements.size(), Placement::replicate());
  return redistribute(replicated).to_local();
}

DTensor DTensor::redistribute(const std::vector<Placement>& target) const {
  const DeviceMesh& mesh = spec_.mesh;
  const int64_t ndim = mesh.ndim();
  check_placements(mesh, target, static_cast<int64_t>(spec_.shape.size()), "DTensor::redistribute");
  const std::vector<Placement>& current = spec_.placements;

  // Mesh dims before `first` keep their placement: they are the outer level
  // of the nested chunking and need no communication.
  int64_t first = 0;
  while (first < ndim && current[first] == target[first]) ++first;
  if (first == ndim) return *this;

  const std::vector<int64_t> sizes = mesh_sizes(mesh);
  const std::vector<int64_t> coord = mesh.coordinate();
  // In-place collectives must never write into the caller's tensor.
  at::Tensor local = local_.clone(at::MemoryFormat::Contiguous);
  std::vector<Placement> now = current;

  // 1. From the last mesh dim down to `first`, make each dim Replicate (a
  //    Partial -> Shard(d) at `first` is done as one reduce-scatter).
  bool first_done = false;
  for (int64_t m = ndim - 1; m >= first; --m) {
    const Placement& from = now[m];
    if (from.is_replicate()) continue;
    if (from.is_shard()) {
      const int64_t d = from.dim();
      // The size of dim d before mesh dim m chunked it.
      std::vector<Placement> outer = now;
      for (int64_t j = m; j < ndim; ++j) outer[j] = Placement::replicate();
      std::vector<int64_t> outer_shape;
      compute_local(spec_.shape, sizes, outer, coord, &outer_shape, nullptr);
      local = gather_shards(local, d, outer_shape[d], mesh, m);
    } else if (m == first && target[m].is_shard()) {
      local = reduce_scatter_shards(local, target[m].dim(), from.reduce_op(), mesh, m);
      first_done = true;
    } else {
      mesh.group(m)->all_reduce(local, from.reduce_op()).wait();
    }
    now[m] = Placement::replicate();
  }

  // 2. From `first` up, apply the target placements to the replicated dims.
  for (int64_t m = first; m < ndim; ++m) {
    if (m == first && first_done) {
      now[m] = target[m];
      continue;
    }
    local = from_replicate(local, target[m], mesh, m);
    now[m] = target[m];
  }
  DTensorSpec spec(mesh, target, spec_.shape, spec_.dtype);
  return DTensor(local.contiguous(), std::move(spec));
}

DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, const std::vector<Placement>& placements,
                          std::optional<int> src_rank) {
  TORCH_CHECK(full.defined(), "distribute_tensor: the tensor is undefined (mesh ", mesh.to_string(), ")");
  check_placements(mesh, placements, full.dim(), "distribute_tensor");
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_partial(), "distribute_tensor: placement ", p.to_string(),
                " is not allowed: a full tensor is not partial (use Replicate, then redistribute); mesh ",
                mesh.to_string());
  }
  TORCH_CHECK(full.device().type() == mesh.device_type(), "distribute_tensor: the tensor is on ", full.device(),
              " but the mesh ", mesh.to_string(), " is on ", mesh.device_type());
  at::Tensor local = full.detach().clone(at::MemoryFormat::Contiguous);
  if (src_rank) {
    // Find the source's coordinate.
    const at::Tensor& layout = mesh.mesh();
    const int64_t* ranks = layout.const_data_ptr<int64_t>();
    int64_t index = -1;
    for (int64_t i = 0; i < layout.numel(); ++i) {
      if (ranks[i] == *src_rank) index = i;
    }
    TORCH_CHECK(index >= 0, "distribute_tensor: src_rank ", *src_rank, " is not in ", mesh.to_string());
    std::vector<int64_t> src(mesh.ndim());
    for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
      src[d] = index % mesh.size(d);
      index /= mesh.size(d);
    }
    // After step m, every rank whose coordinates on dims > m equal the
    // source's holds the source's values; lines that do not contain such a
    // rank broadcast values that a later step overwrites.
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      if (mesh.size(m) > 1) mesh.group(m)->broadcast(local, static_cast<int>(src[m])).wait();
    }
  }
  std::vector<int64_t> shape = full.sizes().vec();
  for (int64_t m = 0; m < mesh.ndim(); ++m) local = from_replicate(local, placements[m], mesh, m);
  DTensorSpec spec(mesh, placements, std::move(shape), full.scalar_type());
  return DTensor(local.contiguous(), std::move(spec));
}

}  // namespace fsdp
