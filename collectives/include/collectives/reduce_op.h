// Reduction operators for collectives, with the semantics fsdp2cpp guarantees
// on every backend.
//
// c10d's reduce ops are not dependable everywhere: Gloo's reduce-scatter is an
// all-reduce plus a narrow whose op may be ignored (pytorch/pytorch#162338),
// and Gloo has no PREMUL_SUM. The Communicator therefore lowers AVG and
// PREMUL_SUM to what each backend computes correctly (SUM, then a scale on the
// result at Work::wait) and callers can rely on the meaning below. NCCL
// computes all of them natively. AVG and PREMUL_SUM are for floating-point
// tensors only (integer averages would round differently per backend).
#pragma once

#include <string>

namespace fsdp::collectives {

class ReduceOp {
 public:
  enum class Kind { kSum, kAvg, kPremulSum, kMax, kMin };

  // Element-wise sum over the group.
  static ReduceOp sum() { return ReduceOp(Kind::kSum, 1.0); }
  // Sum divided by the group size.
  static ReduceOp avg() { return ReduceOp(Kind::kAvg, 1.0); }
  // Sum of (factor * x) over the group; FSDP uses factor = 1 / divide_factor.
  static ReduceOp premul_sum(double factor) { return ReduceOp(Kind::kPremulSum, factor); }
  static ReduceOp max() { return ReduceOp(Kind::kMax, 1.0); }
  static ReduceOp min() { return ReduceOp(Kind::kMin, 1.0); }

  Kind kind() const { return kind_; }
  // The pre-multiplication factor (1 unless kind() == kPremulSum).
  double factor() const { return factor_; }
  std::string to_string() const;

  friend bool operator==(const ReduceOp& a, const ReduceOp& b) { return a.kind_ == b.kind_ && a.factor_ == b.factor_; }

 private:
  ReduceOp(Kind kind, double factor) : kind_(kind), factor_(factor) {}
  Kind kind_;
  double factor_;
};

}  // namespace fsdp::collectives
