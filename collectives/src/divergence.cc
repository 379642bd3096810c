#include "collectives/divergence.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include "collectives/communicator.h"
#include "join_ranks.h"

namespace fsdp::collectives {
namespace {

using detail::join_ranks;

// Parses a non-negative decimal; nullopt when `text` is not one.
std::optional<double> parse_seconds(const char* text) {
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(value) || value < 0) return std::nullopt;
  return value;
}

std::string seconds(double s) { return c10::str(std::round(s * 10) / 10, " s"); }

// "forward" or "backward" when the label around a collective says which pass
// issued it (FSDP's pre_forward, forward_prefetch, pre_backward,
// backward_prefetch, post_backward scopes), else empty. Part of what must
// agree: a forward all-gather of a group and a backward one have equal
// fingerprints otherwise.
std::string pass_of(const std::string& context) {
  if (context.find("backward") != std::string::npos) return "backward";
  if (context.find("forward") != std::string::npos) return "forward";
  return "";
}

std::string describe(const CollectiveRecord& r) {
  std::string text = r.fingerprint.describe();
  if (!r.context.empty()) text += " [in " + r.context + "]";
  return text;
}

std::string ranks_phrase(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + join_ranks(ranks);
}

// Whether the ranks issued one reduce-scatter of one group (same op,
// reduction, dtype and label) that differs only in size: FSDP reduces only
// the parameters that got a gradient, unless told to reduce the unused ones.
bool differ_only_in_reduce_scatter_size(
    const std::vector<std::pair<const CollectiveRecord*, std::vector<int>>>& issued) {
  if (issued.size() < 2) return false;
  const CollectiveFingerprint& first = issued.front().first->fingerprint;
  if (first.op.rfind("reduce_scatter", 0) != 0) return false;
  return std::all_of(issued.begin(), issued.end(), [&](const auto& entry) {
    const CollectiveFingerprint& f = entry.first->fingerprint;
    return f.op == first.op && f.reduction == first.reduction && f.dtype == first.dtype && f.label == first.label;
  });
}

// One rank's records on one communicator, by sequence number.
struct RankView {
  std::map<int64_t, const CollectiveRecord*> by_seq;
  int64_t last_seq = 0;
  // The oldest sequence number the ring still holds: earlier ones may have
  // been dropped, so nothing is concluded about them.
  int64_t first_known = 1;
};

const CollectiveRecord* waiting_record(const FlightLog& log) {
  for (auto it = log.records.rbegin(); it != log.records.rend(); ++it) {
    if (it->state == CollectiveState::kWaiting) return &*it;
  }
  return nullptr;
}

// The divergence on communicator `id` (members `ranks`), or empty when its
// members agree on everything they issued.
std::string diverged_on(const std::string& id, const std::vector<int>& ranks,
                        const std::vector<std::optional<FlightLog>>& logs, bool count_ranks_behind) {
  std::map<int, RankView> views;
  for (int r : ranks) {
    if (r < 0 || r >= static_cast<int>(logs.size()) || !logs[r]) continue;
    RankView& view = views[r];
    for (const auto& record : logs[r]->records) {
      if (record.communicator != id) continue;
      view.by_seq[record.seq] = &record;
      view.last_seq = std::max(view.last_seq, record.seq);
    }
    if (logs[r]->dropped > 0) view.first_known = view.by_seq.empty() ? view.last_seq + 1 : view.by_seq.begin()->first;
  }
  if (views.empty()) return "";
  int64_t lo = 1, hi = 0;
  for (const auto& [r, view] : views) {
    lo = std::max(lo, view.first_known);
    hi = std::max(hi, view.last_seq);
  }
  for (int64_t seq = lo; seq <= hi; ++seq) {
    // Ranks grouped by what they issued as collective `seq`.
    std::vector<std::pair<const CollectiveRecord*, std::vector<int>>> issued;
    std::vector<int> behind;
    for (const auto& [r, view] : views) {
      auto it = view.by_seq.find(seq);
      if (it == view.by_seq.end()) {
        if (view.last_seq < seq) behind.push_back(r);
        continue;
      }
      const CollectiveRecord* record = it->second;
      auto same = std::find_if(issued.begin(), issued.end(), [&](const auto& entry) {
        return entry.first->fingerprint == record->fingerprint &&
               pass_of(entry.first->context) == pass_of(record->context);
      });
      if (same == issued.end()) {
        issued.push_back({record, {r}});
      } else {
        same->second.push_back(r);
      }
    }
    if (issued.size() <= 1 && (behind.empty() || !count_ranks_behind)) continue;
    if (!count_ranks_behind) behind.clear();
    std::ostringstream out;
    out << "ranks diverged at collective #" << seq << " of " << id << ":";
    for (const auto& [record, who] : issued) out << "\n    " << ranks_phrase(who) << " issued " << describe(*record);
    if (differ_only_in_reduce_scatter_size(issued)) {
      out << "\n    (the same group's reduce-scatter with different sizes: on some ranks some of its parameters got "
             "no gradient in this backward, as an expert that received no token does; "
             "FSDPModule::set_reduce_scatter_unused_params(true) reduces every parameter on every rank, as zeros "
             "where it got none)";
    }
    for (int r : behind) {
      const RankView& view = views.at(r);
      out << "\n    rank " << r << " has issued nothing on it";
      if (view.last_seq > 0) {
        const CollectiveRecord* last = view.by_seq.at(view.last_seq);
        out << " since #" << view.last_seq << ", " << seconds(last->issued_ago_s) << " ago";
      }
      const CollectiveRecord* elsewhere = waiting_record(*logs[r]);
      if (elsewhere != nullptr) {
        out << " (it waits for #" << elsewhere->seq << " of " << elsewhere->communicator << ": " << describe(*elsewhere)
            << ")";
      } else {
        out << " (stalled in user code, or finished?)";
      }
    }
    return out.str();
  }
  return "";
}

// Communicators in the order ranks first made them; the ones somebody waits
// on first, since that is where the job stands.
std::vector<RecordedCommunicator> communicators_by_interest(const std::vector<std::optional<FlightLog>>& logs) {
  std::vector<RecordedCommunicator> communicators;
  std::set<std::string> seen;
  std::set<std::string> waited_on;
  for (const auto& log : logs) {
    if (!log) continue;
    for (const auto& c : log->communicators) {
      if (seen.insert(c.id).second) communicators.push_back(c);
    }
    if (const CollectiveRecord* w = waiting_record(*log)) waited_on.insert(w->communicator);
  }
  std::stable_partition(communicators.begin(), communicators.end(),
                        [&](const RecordedCommunicator& c) { return waited_on.count(c.id) > 0; });
  return communicators;
}

}  // namespace

DivergenceOptions DivergenceOptions::from_env() {
  DivergenceOptions options;
  if (const char* text = std::getenv("FSDP2CPP_DIVERGENCE_TIMEOUT_S"); text != nullptr && *text != '\0') {
    auto value = parse_seconds(text);
    TORCH_CHECK(value.has_value(), "fsdp2cpp: FSDP2CPP_DIVERGENCE_TIMEOUT_S='", text,
                "' is not a number of seconds; set it to a non-negative decimal (0 turns divergence detection off)");
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::llround(*value * 1000)));
  }
  if (const char* text = std::getenv("FSDP2CPP_FLIGHT_RECORDER_SIZE"); text != nullptr && *text != '\0') {
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    TORCH_CHECK(end != text && *end == '\0' && value >= 1, "fsdp2cpp: FSDP2CPP_FLIGHT_RECORDER_SIZE='", text,
                "' is not a positive number of records; set it to an integer >= 1");
    options.recorder_capacity = static_cast<size_t>(value);
  }
  if (const char* text = std::getenv("FSDP2CPP_FLIGHT_RECORDER_DIR")) options.dump_dir = text;
  if (const char* text = std::getenv("FSDP2CPP_STRICT_COLLECTIVES"); text != nullptr && *text != '\0') {
    const std::string value = text;
    TORCH_CHECK(value == "0" || value == "1", "fsdp2cpp: FSDP2CPP_STRICT_COLLECTIVES='", value,
                "' is neither 0 nor 1; set it to 1 to check every collective's fingerprint on all ranks");
    options.strict = value == "1";
  }
  return options;
}

std::string find_divergence(const std::vector<std::optional<FlightLog>>& logs, bool count_ranks_behind) {
  // Ranks that issued different collectives are the cause wherever they are;
  // ranks left behind on another communicator (one waits in the next
  // collective while its peer failed in this one) are the consequence.
  const std::vector<RecordedCommunicator> communicators = communicators_by_interest(logs);
  for (const bool behind : {false, true}) {
    if (behind && !count_ranks_behind) break;
    for (const auto& c : communicators) {
      std::string text = diverged_on(c.id, c.global_ranks, logs, behind);
      if (!text.empty()) return text;
    }
  }
  return "";
}

std::string diagnose_divergence(const std::vector<std::optional<FlightLog>>& logs, int diagnosing_rank,
                                double waited_s) {
  std::ostringstream out;
  out << "the ranks stopped issuing the same collectives: rank " << diagnosing_rank << " waited " << seconds(waited_s)
      << " for one (FSDP2CPP_DIVERGENCE_TIMEOUT_S), and the ranks' flight recorders say:";
  const std::string divergence = find_divergence(logs);
  if (!divergence.empty()) {
    out << "\n  " << divergence;
  } else {
    out << "\n  every rank that answered issued the same collectives in the same order; the one waited for has "
           "not finished on any of them (a rank that did not answer, a slow network, or a stalled engine)";
  }
  out << "\n  each rank now:";
  for (size_t r = 0; r < logs.size(); ++r) {
    out << "\n    rank " << r << ": ";
    if (!logs[r]) {
      out << "did not answer (it exited, crashed, or is stuck where its watchdog cannot run)";
      continue;
    }
    if (const CollectiveRecord* w = waiting_record(*logs[r])) {
      out << "waiting " << seconds(w->wait_started_ago_s) << " for #" << w->seq << " of " << w->communicator << ": "
          << describe(*w);
    } else if (!logs[r]->records.empty()) {
      const CollectiveRecord& last = logs[r]->records.back();
      out << "in no collective; last issued #" << last.seq << " of " << last.communicator << " "
          << seconds(last.issued_ago_s) << " ago: " << describe(last) << " (" << to_string(last.state) << ")";
    } else {
      out << "has issued no collective";
    }
  }
  return out.str();
}

namespace {

uint64_t fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ULL) {
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

c10::Device device_of(const Communicator& comm) {
  if (comm.device_type() == c10::kCPU) return c10::Device(c10::kCPU);
  const c10::impl::VirtualGuardImpl impl(comm.device_type());
  return impl.getDevice();
}

// Every member's int64 values, [size, n] on the CPU.
at::Tensor all_gather_host(Communicator& comm, const at::Tensor& host_values) {
  const c10::Device device = device_of(comm);
  at::Tensor input = host_values.to(device);
  at::Tensor output = at::empty({comm.size() * input.numel()}, input.options());
  comm.all_gather_into_tensor(output, input).wait();
  return output.cpu().view({comm.size(), -1});
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::string::size_type start = 0;
  while (start < text.size()) {
    auto end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

}  // namespace

void check_ranks_agree(Communicator& comm, const std::vector<std::string>& lines, const std::string& what) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  const auto hash = static_cast<int64_t>(fnv1a(text));
  at::Tensor mine = at::empty({2}, at::kLong);
  mine[0] = hash;
  mine[1] = static_cast<int64_t>(text.size());
  const at::Tensor all = all_gather_host(comm, mine);
  bool agree = true;
  int64_t longest = 0;
  for (int r = 0; r < comm.size(); ++r) {
    agree = agree && all[r][0].item<int64_t>() == hash;
    longest = std::max(longest, all[r][1].item<int64_t>());
  }
  if (agree) return;
  // Exchange the texts themselves, padded to the longest, to name the
  // difference.
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  const c10::Device device = device_of(comm);
  at::Tensor input = bytes.to(device);
  at::Tensor output = at::empty({comm.size() * longest}, input.options());
  comm.all_gather_into_tensor(output, input).wait();
  const at::Tensor texts = output.cpu().view({comm.size(), longest});
  auto text_of = [&](int r) {
    const int64_t length = all[r][1].item<int64_t>();
    return std::string(static_cast<const char*>(texts[r].data_ptr()), static_cast<size_t>(length));
  };
  const std::vector<std::string> first = split_lines(text_of(0));
  const std::vector<int>& global = comm.global_ranks();
  for (int r = 1; r < comm.size(); ++r) {
    const std::vector<std::string> other = split_lines(text_of(r));
    if (other == first) continue;
    size_t i = 0;
    while (i < first.size() && i < other.size() && first[i] == other[i]) ++i;
    auto item = [](const std::vector<std::string>& items, size_t k) {
      return k < items.size() ? items[k] : std::string("nothing more (") + std::to_string(items.size()) + " items)";
    };
    std::vector<int> differing;
    for (int q = 1; q < comm.size(); ++q) {
      if (split_lines(text_of(q)) != first) differing.push_back(global[q]);
    }
    TORCH_CHECK(false, what, " differs between ranks (", comm.name(), "): rank ", global[r], " has ", item(other, i),
                "; rank ", global[0], " has ", item(first, i), ". Ranks that differ from rank ", global[0], ": ",
                join_ranks(differing),
                ". Every rank must build the same model and shard it the same way (same config, same layer count, "
                "same fully_shard calls and options, same requires_grad)");
  }
}

}  // namespace fsdp::collectives
