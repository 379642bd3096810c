// NVTX ranges on CUDA builds (header-only NVTX3 from the CUDA toolkit: costs
// nothing unless a tool such as Nsight Systems is attached), nothing on CPU
// builds.
#include "fsdp_common/config.h"
#include "phase.h"

#if FSDP2CPP_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace fsdp::detail {

NvtxRange::NvtxRange(const char* name) {
#if FSDP2CPP_WITH_CUDA
  nvtxRangePushA(name);
  pushed_ = true;
#else
  (void)name;
#endif
}

NvtxRange::~NvtxRange() {
#if FSDP2CPP_WITH_CUDA
  if (pushed_) nvtxRangePop();
#endif
}

}  // namespace fsdp::detail
