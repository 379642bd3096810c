#include "collectives/reduce_op.h"

#include <sstream>

namespace fsdp::collectives {

std::string ReduceOp::to_string() const {
  switch (kind_) {
    case Kind::kSum: return "SUM";
    case Kind::kAvg: return "AVG";
    case Kind::kMax: return "MAX";
    case Kind::kMin: return "MIN";
    case Kind::kPremulSum: {
      std::ostringstream out;
      out << "PREMUL_SUM(" << factor_ << ")";
      return out.str();
    }
  }
  return "UNKNOWN";
}

}  // namespace fsdp::collectives
