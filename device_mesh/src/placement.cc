// Placements (Shard, Replicate, Partial) and torch.chunk extents.
#include "device_mesh/placement.h"

#include <algorithm>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace fsdp {

Placement Placement::shard(int64_t dim) {
  TORCH_CHECK(dim >= 0, "Placement::shard: the tensor dim must be >= 0 (got ", dim,
              "); normalise negative dims against the tensor's rank first");
  return Placement(Kind::kShard, dim, collectives::ReduceOp::sum());
}

Placement Placement::replicate() { return Placement(Kind::kReplicate, -1, collectives::ReduceOp::sum()); }

Placement Placement::partial(collectives::ReduceOp op) { return Placement(Kind::kPartial, -1, op); }

int64_t Placement::dim() const {
  TORCH_CHECK(is_shard(), "Placement::dim() called on ", to_string(), "; only Shard placements have a dim");
  return dim_;
}

const collectives::ReduceOp& Placement::reduce_op() const {
  TORCH_CHECK(is_partial(), "Placement::reduce_op() called on ", to_string(),
              "; only Partial placements have a reduce op");
  return op_;
}

std::string Placement::to_string() const {
  switch (kind_) {
    case Kind::kShard: return c10::str("Shard(", dim_, ")");
    case Kind::kReplicate: return "Replicate()";
    case Kind::kPartial: return c10::str("Partial(", op_.to_string(), ")");
  }
  return "Placement(?)";
}

bool operator==(const Placement& a, const Placement& b) {
  if (a.kind_ != b.kind_) return false;
  switch (a.kind_) {
    case Placement::Kind::kShard: return a.dim_ == b.dim_;
    case Placement::Kind::kReplicate: return true;
    case Placement::Kind::kPartial: return a.op_ == b.op_;
  }
  return false;
}

ChunkExtent chunk_extent(int64_t size, int64_t num_chunks, int64_t index) {
  TORCH_CHECK(size >= 0, "chunk_extent: size must be >= 0, got ", size);
  TORCH_CHECK(num_chunks >= 1, "chunk_extent: num_chunks must be >= 1, got ", num_chunks);
  TORCH_CHECK(index >= 0 && index < num_chunks, "chunk_extent: index ", index, " is out of range [0, ", num_chunks,
              ")");
  const int64_t chunk = (size + num_chunks - 1) / num_chunks;
  const int64_t offset = std::min(index * chunk, size);
  const int64_t length = std::clamp<int64_t>(size - offset, 0, chunk);
  return ChunkExtent{offset, length};
}

}  // namespace fsdp
