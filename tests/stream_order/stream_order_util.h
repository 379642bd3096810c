// Helpers shared by the stream-order tests (tests/stream_order): the
// transformer of tests/fsdp2 sharded block by block, and the check that a
// Checker found no race.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp2_test_util.h"  // tests/fsdp2
#include "stream_check/stream_check.h"

namespace fsdp::test {

inline constexpr int64_t kStreamOrderRows = 12;

inline void expect_no_races(const stream_check::Checker& checker) {
  for (const stream_check::Report& r : checker.reports()) ADD_FAILURE() << r.message;
}

// Options for `world_size` ranks; a non-empty `mesh_shape` makes the mesh
// 2-D, named (replicate, shard) as HSDP wants it.
inline testing::DistributedTestOptions rank_options(int world_size, const std::vector<int64_t>& mesh_shape) {
  testing::DistributedTestOptions options;
  options.world_size = world_size;
  if (!mesh_shape.empty()) {
    options.mesh_shape = mesh_shape;
    options.mesh_dim_names = {"replicate", "shard"};
  }
  return options;
}

// The host synchronizations, one a line, for a failure's message.
inline std::string describe(const std::vector<stream_check::HostSync>& syncs) {
  std::string text;
  for (const auto& h : syncs) text += "\n  " + h.what + " (" + h.phase + ")";
  return text;
}

struct Sharded {
  std::shared_ptr<Transformer> model;
  std::optional<FSDPModule> root;
};

// The transformer with fully_shard on each block and then the root, over
// the rank's mesh and `extra`'s other options.
inline Sharded shard_transformer(testing::RankContext& ctx, const FullyShardOptions& extra = {}) {
  Sharded s;
  s.model = std::static_pointer_cast<Transformer>(make_model(ModelKind::kTransformer));
  FullyShardOptions o = extra;
  o.mesh = ctx.mesh();
  for (auto& b : s.model->blocks()) fully_shard(b, o);
  s.root = fully_shard(s.model, o);
  return s;
}

}  // namespace fsdp::test
