// Compiled with USE_C10D_GLOO (see collectives/CMakeLists.txt): the only
// translation unit that sees ProcessGroupGloo.hpp and gloo's headers.
#include <sstream>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "backends.h"

namespace fsdp::collectives::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                    std::chrono::milliseconds timeout, const std::string& host,
                                                    bool is_interface) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (is_interface) {
    // GLOO_SOCKET_IFNAME may list several interfaces ("eth0,eth1"), as in
    // PyTorch: one gloo device per interface.
    std::istringstream names(host);
    std::string name;
    while (std::getline(names, name, ',')) {
      if (!name.empty()) options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
    TORCH_CHECK(!options->devices.empty(), "fsdp2cpp: no network interface named in '", host,
                "'; set GLOO_SOCKET_IFNAME (or CommunicatorOptions::gloo_interface) to an interface such as eth0");
  } else if (host.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(host));
  }
  // The constructor connects the full mesh through `store`; it is collective
  // over the group and fails after `timeout` when a member does not come.
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace fsdp::collectives::detail
