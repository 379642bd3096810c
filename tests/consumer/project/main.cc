// Link-level proof that the installed package works: calls into
// libfsdp2cpp_device_mesh, libfsdp2cpp_collectives and LibTorch through the
// include paths, definitions and libraries that fsdp2cpp::device_mesh carries.
// No GPU, no peers.
#include <cstdio>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>

#include "collectives/reduce_op.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/placement.h"
#include "fsdp_common/config.h"

int main() {
  std::printf("fsdp2cpp %s (CUDA paths %d)\n", FSDP2CPP_VERSION, FSDP2CPP_WITH_CUDA);

  // chunk_extent follows torch.chunk: compare with LibTorch itself.
  const fsdp::ChunkExtent last = fsdp::chunk_extent(10, 4, 3);
  const at::Tensor torch_last = at::arange(10).chunk(4).at(3);
  std::printf("chunk_extent(10, 4, 3) = {%lld, %lld}; torch.chunk: {%lld, %lld}\n", static_cast<long long>(last.offset),
              static_cast<long long>(last.length), static_cast<long long>(torch_last.storage_offset()),
              static_cast<long long>(torch_last.numel()));

  std::printf("reduce op: %s\n", fsdp::collectives::ReduceOp::sum().to_string().c_str());
  std::printf("placement: %s\n", fsdp::Placement::shard(0).to_string().c_str());
  return 0;
}
