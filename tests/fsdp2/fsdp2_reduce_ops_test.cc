// How gradients are reduced (FSDP2's _get_gradient_divide_factors), and what
// the debug log says runs (single process).
#include <gtest/gtest.h>

#include "../../fsdp2/src/fsdp_param_group.h"

namespace fsdp::detail {
namespace {

using collectives::BackendKind;
using collectives::ReduceOp;

TEST(GradientReduceOps, AverageWithTheCollectivesInFp32AndBf16) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const ReduceOps fsdp = gradient_reduce_ops(4, 1, dtype, std::nullopt, false);
    EXPECT_EQ(fsdp.reduce_scatter, ReduceOp::avg());
    EXPECT_EQ(fsdp.all_reduce, ReduceOp::avg());
    EXPECT_EQ(fsdp.pre_divide, 1.0);
    EXPECT_EQ(fsdp.post_divide, 1.0);
  }
}

TEST(GradientReduceOps, OneRankSumsBecauseNcclAvgIsUnreliableThere) {
  // pytorch#144045: NCCL's AVG at one rank (bf16, before 2.29.7) leaves
  // elements unwritten.
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const ReduceOps ops = gradient_reduce_ops(1, 1, dtype, std::nullopt, false);
    EXPECT_EQ(ops.reduce_scatter, ReduceOp::sum());
    EXPECT_EQ(ops.all_reduce, ReduceOp::sum());
    EXPECT_EQ(ops.post_divide, 1.0);
  }
  // HSDP with one shard but two replicas still averages, in the all-reduce
  // only: the one-rank reduce-scatter sums (an AVG there is what NCCL gets
  // wrong), in mixed precision too (where the fast path does not apply).
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const ReduceOps hsdp = gradient_reduce_ops(1, 2, dtype, std::nullopt, false);
    EXPECT_EQ(hsdp.reduce_scatter, ReduceOp::sum());
    EXPECT_EQ(hsdp.all_reduce, ReduceOp::avg());
    EXPECT_EQ(hsdp.post_divide, 1.0);
  }
}

TEST(GradientReduceOps, NoScaledOpReachesAOneRankReduceScatter) {
  // A divide factor at shard size 1 (FSDP at one rank, or HSDP with one
  // shard) divides locally after a SUM: no AVG or PREMUL_SUM on one rank.
  for (int64_t replicas : {1, 2, 4}) {
    for (double factor : {1.0, 3.0}) {
      const ReduceOps ops = gradient_reduce_ops(1, replicas, at::kFloat, factor, false);
      EXPECT_EQ(ops.reduce_scatter, ReduceOp::sum()) << replicas << " replicas, factor " << factor;
      EXPECT_EQ(ops.all_reduce, ReduceOp::sum());
      EXPECT_EQ(ops.pre_divide * ops.post_divide, factor);
    }
  }
}

TEST(GradientReduceOps, DivideFactor) {
  const ReduceOps premul = gradient_reduce_ops(4, 2, at::kFloat, 3.0, false);
  EXPECT_EQ(premul.reduce_scatter, ReduceOp::premul_sum(1.0 / 3.0));
  EXPECT_EQ(premul.all_reduce, ReduceOp::sum());
  EXPECT_EQ(premul.post_divide, 1.0);
  // A factor equal to the shard size is an average.
  EXPECT_EQ(gradient_reduce_ops(4, 1, at::kFloat, 4.0, false).reduce_scatter, ReduceOp::avg());
}

TEST(GradientReduceOps, ForceSumDividesLocally) {
  const ReduceOps ops = gradient_reduce_ops(4, 2, at::kFloat, std::nullopt, true);
  EXPECT_EQ(ops.reduce_scatter, ReduceOp::sum());
  EXPECT_EQ(ops.all_reduce, ReduceOp::sum());
  EXPECT_EQ(ops.pre_divide, 1.0);
  EXPECT_EQ(ops.post_divide, 8.0);
  EXPECT_EQ(gradient_reduce_ops(4, 1, at::kFloat, 3.0, true).post_divide, 3.0);
}

TEST(GradientReduceOps, Fp16SplitsTheDivisionAroundTheSum) {
  const ReduceOps ops = gradient_reduce_ops(16, 1, at::kHalf, std::nullopt, false);
  EXPECT_EQ(ops.reduce_scatter, ReduceOp::sum());
  EXPECT_EQ(ops.pre_divide, 4.0);
  EXPECT_EQ(ops.post_divide, 4.0);
  const ReduceOps odd = gradient_reduce_ops(3, 1, at::kHalf, std::nullopt, false);
  EXPECT_EQ(odd.pre_divide * odd.post_divide, 3.0);
}

TEST(DescribeReduce, GlooSaysWhatReallyRuns) {
  EXPECT_EQ(describe_reduce(ReduceOp::avg(), BackendKind::kGloo, 2), "SUM, then a local division by 2");
  EXPECT_EQ(describe_reduce(ReduceOp::sum(), BackendKind::kGloo, 2), "SUM");
  EXPECT_EQ(describe_reduce(ReduceOp::avg(), BackendKind::kNccl, 2), "AVG");
}

}  // namespace
}  // namespace fsdp::detail
