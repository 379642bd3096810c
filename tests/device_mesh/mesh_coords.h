// Coordinates in a mesh of the device_mesh tests: a rank's place in a
// row-major mesh of a given shape, and back.
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp::test {

// The coordinate of flat index `index` in a row-major mesh of `shape`.
inline std::vector<int64_t> row_major(int64_t index, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coord(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    coord[d] = index % shape[d];
    index /= shape[d];
  }
  return coord;
}

// The flat index of `coord` in a row-major mesh of `shape`.
inline int64_t flat_index(const std::vector<int64_t>& coord, const std::vector<int64_t>& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + coord[d];
  return flat;
}

}  // namespace fsdp::test
