// Internal: "0,2,3" for a member list, as group names and errors print it.
#pragma once

#include <string>
#include <vector>

namespace fsdp::collectives::detail {

inline std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(ranks[i]);
  }
  return out;
}

}  // namespace fsdp::collectives::detail
