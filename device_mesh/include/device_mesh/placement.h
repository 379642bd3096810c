// Placements: how a tensor is laid out along one mesh dimension, as DTensor's
// Shard(dim), Replicate() and Partial(op).
#pragma once

#include <cstdint>
#include <string>

#include "collectives/reduce_op.h"

namespace fsdp {

class Placement {
 public:
  enum class Kind { kShard, kReplicate, kPartial };

  // Split along tensor dim `dim` with torch.chunk semantics.
  static Placement shard(int64_t dim);
  // Every rank holds the whole tensor.
  static Placement replicate();
  // Every rank holds a partial value; the tensor is their reduction by `op`.
  static Placement partial(collectives::ReduceOp op = collectives::ReduceOp::sum());

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  bool is_partial() const { return kind_ == Kind::kPartial; }
  // REQUIRES: is_shard().
  int64_t dim() const;
  // REQUIRES: is_partial().
  const collectives::ReduceOp& reduce_op() const;
  std::string to_string() const;

  friend bool operator==(const Placement& a, const Placement& b);
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }

 private:
  Placement(Kind kind, int64_t dim, collectives::ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int64_t dim_;
  collectives::ReduceOp op_;
};

// torch.chunk semantics for `size` rows over `num_chunks` ranks: every chunk
// has ceil(size / num_chunks) rows except the trailing ones, which may be
// short or empty. Returns {offset, length} of chunk `index`.
struct ChunkExtent {
  int64_t offset;
  int64_t length;
};
ChunkExtent chunk_extent(int64_t size, int64_t num_chunks, int64_t index);

}  // namespace fsdp
