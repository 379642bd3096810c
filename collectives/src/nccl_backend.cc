// Compiled in CUDA builds only; USE_C10D_NCCL comes from fsdp2cpp::torch_cuda.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "backends.h"

namespace fsdp::collectives::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  TORCH_CHECK(c10::cuda::device_count() > 0,
              "fsdp2cpp: an NCCL communicator needs a CUDA device, and this process sees none; run on a GPU "
              "machine (check CUDA_VISIBLE_DEVICES) or use a CPU communicator (Gloo)");
  auto options = c10d::ProcessGroupNCCL::Options::create();
  // NCCL's watchdog aborts a collective that runs longer than this.
  options->timeout = timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  // As init_process_group(device_id=...) does: collectives that carry no
  // tensor (barrier) then run on this rank's device instead of a device
  // guessed from the rank.
  backend->setBoundDeviceId(at::Device(at::kCUDA, c10::cuda::current_device()));
  return backend;
}

bool nccl_compiled() { return true; }

}  // namespace fsdp::collectives::detail
