// CPU-only builds: NCCL communicators cannot be made.
#include <c10/util/Exception.h>

#include "backends.h"

namespace fsdp::collectives::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& /*store*/, int /*rank*/,
                                                    int /*size*/, std::chrono::milliseconds /*timeout*/) {
  TORCH_CHECK(false,
              "fsdp2cpp: this build of fsdp2cpp has no NCCL (configured with FSDP2CPP_CUDA=OFF or without a CUDA "
              "toolkit); rebuild with CUDA to use CUDA communicators, or ask for BackendKind::kGloo");
}

bool nccl_compiled() { return false; }

}  // namespace fsdp::collectives::detail
