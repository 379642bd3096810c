#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp_plan/dry_run.h"

namespace fsdp_plan {
namespace {

std::string mib(int64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return text;
}

std::string peak_phase(const MemoryReport& r) {
  std::string where =
      r.peak_step == 0 ? "setup" : "step " + std::to_string(r.peak_step) + ", " + to_string(r.peak_step_phase);
  if (!r.peak_fsdp_phase.empty()) where += ", in " + r.peak_fsdp_phase;
  return where;
}

}  // namespace

std::string format_memory(const MemoryReport& r) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line), "  peak allocated  %s (max_memory_allocated; %lld bytes)\n",
                mib(r.peak_allocated).c_str(), static_cast<long long>(r.peak_allocated));
  out += line;
  std::snprintf(line, sizeof(line), "  peak reserved   %s (max_memory_reserved)\n", mib(r.peak_reserved).c_str());
  out += line;
  std::snprintf(line, sizeof(line), "  tensor bytes    %s at the peak (%lld bytes, before the allocator's rounding)\n",
                mib(r.peak_bytes).c_str(), static_cast<long long>(r.peak_bytes));
  out += line;
  out += "  peak falls in   " + peak_phase(r) + "\n";
  out += "  held at the peak:\n";
  for (int h = 0; h < kHolderCount; ++h) {
    const int64_t bytes = r.peak_by_holder[static_cast<size_t>(h)];
    if (bytes == 0) continue;
    std::snprintf(line, sizeof(line), "    %-24s %12s  %5.1f%%\n", to_string(static_cast<Holder>(h)).c_str(),
                  mib(bytes).c_str(), r.peak_bytes > 0 ? 100.0 * static_cast<double>(bytes) / r.peak_bytes : 0.0);
    out += line;
  }
  std::snprintf(line, sizeof(line), "  between steps   %s (sharded state)\n", mib(r.end_bytes).c_str());
  out += line;
  if (r.host_peak_bytes > 0) {
    std::snprintf(line, sizeof(line), "  host memory     %s at its peak (%lld bytes; pinned: %s as allocated)\n",
                  mib(r.host_peak_bytes).c_str(), static_cast<long long>(r.host_peak_bytes),
                  mib(r.host_pinned_peak).c_str());
    out += line;
    for (int h = 0; h < kHolderCount; ++h) {
      const int64_t bytes = r.host_peak_by_holder[static_cast<size_t>(h)];
      if (bytes == 0) continue;
      std::snprintf(line, sizeof(line), "    %-24s %12s\n", to_string(static_cast<Holder>(h)).c_str(),
                    mib(bytes).c_str());
      out += line;
    }
  }
  return out;
}

std::string memory_json(const MemoryReport& r) {
  nlohmann::ordered_json holders = nlohmann::ordered_json::object();
  nlohmann::ordered_json host_holders = nlohmann::ordered_json::object();
  for (int h = 0; h < kHolderCount; ++h) {
    holders[to_string(static_cast<Holder>(h))] = r.peak_by_holder[static_cast<size_t>(h)];
    host_holders[to_string(static_cast<Holder>(h))] = r.host_peak_by_holder[static_cast<size_t>(h)];
  }
  const nlohmann::ordered_json j = {{"peak_allocated_bytes", r.peak_allocated},
                                    {"peak_reserved_bytes", r.peak_reserved},
                                    {"peak_tensor_bytes", r.peak_bytes},
                                    {"peak_step", r.peak_step},
                                    {"peak_step_phase", to_string(r.peak_step_phase)},
                                    {"peak_fsdp_phase", r.peak_fsdp_phase},
                                    {"peak_by_holder_bytes", holders},
                                    {"step_peak_tensor_bytes", r.step_peaks},
                                    {"end_tensor_bytes", r.end_bytes},
                                    {"allocations", r.allocations},
                                    {"host_peak_bytes", r.host_peak_bytes},
                                    {"host_peak_by_holder_bytes", host_holders},
                                    {"host_pinned_peak_bytes", r.host_pinned_peak},
                                    {"host_end_bytes", r.host_end_bytes}};
  return j.dump(2);
}

}  // namespace fsdp_plan
