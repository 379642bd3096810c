// Helpers shared by the stream-order tests (tests/stream_order): the
// transformer of tests/fsdp2 sharded block by block, and the check that a
// Checker found no race.
#pragma once

#include <memory>
#include <optional>

#include "fsdp2_test_util.h"  // tests/fsdp2
#include "stream_check/stream_check.h"

namespace fsdp::test {

inline constexpr int64_t kStreamOrderRows = 12;

inline void expect_no_races(const stream_check::Checker& checker) {
  for (const stream_check::Report& r : checker.reports()) ADD_FAILURE() << r.message;
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
