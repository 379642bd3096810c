// Placements and torch.chunk extents (single process).
#include "device_mesh/placement.h"

#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

std::vector<std::pair<int64_t, int64_t>> extents(int64_t size, int64_t n) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    const ChunkExtent e = chunk_extent(size, n, i);
    out.emplace_back(e.offset, e.length);
  }
  return out;
}

using Extents = std::vector<std::pair<int64_t, int64_t>>;

TEST(ChunkExtent, EvenSplit) { EXPECT_EQ(extents(8, 4), (Extents{{0, 2}, {2, 2}, {4, 2}, {6, 2}})); }

TEST(ChunkExtent, UnevenSplitHasAShortLastChunk) {
  EXPECT_EQ(extents(10, 4), (Extents{{0, 3}, {3, 3}, {6, 3}, {9, 1}}));
  EXPECT_EQ(extents(7, 3), (Extents{{0, 3}, {3, 3}, {6, 1}}));
}

TEST(ChunkExtent, TrailingChunksMayBeEmpty) {
  EXPECT_EQ(extents(2, 4), (Extents{{0, 1}, {1, 1}, {2, 0}, {2, 0}}));
  EXPECT_EQ(extents(4, 3), (Extents{{0, 2}, {2, 2}, {4, 0}}));
  EXPECT_EQ(extents(0, 3), (Extents{{0, 0}, {0, 0}, {0, 0}}));
}

TEST(ChunkExtent, OneChunkIsEverything) { EXPECT_EQ(extents(5, 1), (Extents{{0, 5}})); }

TEST(ChunkExtent, MatchesTorchChunk) {
  for (int64_t size = 0; size <= 13; ++size) {
    for (int64_t n = 1; n <= 6; ++n) {
      at::Tensor t = at::arange(size);
      auto pieces = t.chunk(n);
      for (int64_t i = 0; i < n; ++i) {
        const ChunkExtent e = chunk_extent(size, n, i);
        // torch.chunk returns fewer pieces when the trailing ones are empty.
        const int64_t expected = i < static_cast<int64_t>(pieces.size()) ? pieces[i].numel() : 0;
        EXPECT_EQ(e.length, expected) << "size " << size << " over " << n << ", chunk " << i;
        if (expected > 0) {
          EXPECT_EQ(e.offset, pieces[i][0].item<int64_t>());
        }
      }
    }
  }
}

TEST(ChunkExtent, RejectsBadArguments) {
  EXPECT_THROW(chunk_extent(4, 0, 0), c10::Error);
  EXPECT_THROW(chunk_extent(4, 2, 2), c10::Error);
  EXPECT_THROW(chunk_extent(4, 2, -1), c10::Error);
  EXPECT_THROW(chunk_extent(-1, 2, 0), c10::Error);
}

TEST(Placement, KindsAndNames) {
  EXPECT_TRUE(Placement::shard(1).is_shard());
  EXPECT_TRUE(Placement::shard(1).is_shard(1));
  EXPECT_FALSE(Placement::shard(1).is_shard(0));
  EXPECT_EQ(Placement::shard(1).dim(), 1);
  EXPECT_TRUE(Placement::replicate().is_replicate());
  EXPECT_TRUE(Placement::partial().is_partial());
  EXPECT_EQ(Placement::partial().reduce_op(), collectives::ReduceOp::sum());
  EXPECT_EQ(Placement::shard(0).to_string(), "Shard(0)");
  EXPECT_EQ(Placement::replicate().to_string(), "Replicate()");
  EXPECT_EQ(Placement::partial(collectives::ReduceOp::avg()).to_string(),
            "Partial(" + collectives::ReduceOp::avg().to_string() + ")");
}

TEST(Placement, Equality) {
  EXPECT_EQ(Placement::shard(0), Placement::shard(0));
  EXPECT_NE(Placement::shard(0), Placement::shard(1));
  EXPECT_EQ(Placement::replicate(), Placement::replicate());
  EXPECT_NE(Placement::replicate(), Placement::shard(0));
  EXPECT_EQ(Placement::partial(), Placement::partial(collectives::ReduceOp::sum()));
  EXPECT_NE(Placement::partial(), Placement::partial(collectives::ReduceOp::avg()));
}

TEST(Placement, AccessorsOfTheWrongKindThrow) {
  EXPECT_THROW(Placement::replicate().dim(), c10::Error);
  EXPECT_THROW(Placement::shard(0).reduce_op(), c10::Error);
  EXPECT_THROW(Placement::shard(-1), c10::Error);
}

}  // namespace
}  // namespace fsdp
