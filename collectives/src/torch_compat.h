// Internal: where the LibTorch C++ API differs between the torch versions the
// build accepts (2.11 to 2.15, [Note: supported torch versions] in
// cmake/Fsdp2cppTorch.cmake), one function per difference, so that no other
// file tests a torch version. Each entry says what changed, where, and how we
// know. (The C++ standard, which also differs, is set by the build: [Note: the
// C++ standard torch needs] in the same file.)
#pragma once

#include <torch/headeronly/version.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fsdp::collectives::detail {

// PREMUL_SUM as a c10d::ReduceOp: each input multiplied by `factor`, then
// summed (NCCL's ncclRedOpCreatePreMulSum).
// torch 2.11.0's c10d/Types.hpp names the maker makeNCCLPreMulSum; 2.15.0's
// names it makePreMulSum and no longer has the old name (pytorch/pytorch#172216,
// merged after 2.11's branch was cut: projects that follow PyTorch's main
// branch adapted to it on 2026-03-25). 2.12 to 2.14 were not built here; by
// that date they carry the new name.
inline c10d::ReduceOp make_premul_sum(double factor) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
  return c10d::makeNCCLPreMulSum(factor);
#else
  return c10d::makePreMulSum(factor);
#endif
}

}  // namespace fsdp::collectives::detail
