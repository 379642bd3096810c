#include "model.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::stream_check::detail {
namespace {

const char* or_default(const char* s, const char* fallback) { return s != nullptr ? s : fallback; }

constexpr const char* kNoPhase = "outside the FSDP phases";
constexpr const char* kNoOp = "code outside any op";

void join(Clock& into, const Clock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

}  // namespace

Model::Model(Options options) : options_(options) {
  new_stream("default (compute)");
  const int host = new_stream("host");
  (void)host;
  TORCH_INTERNAL_ASSERT(host == kHostStream);
}

int Model::new_stream(std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  const int id = static_cast<int>(streams_.size());
  Stream s{std::move(name), Clock(static_cast<size_t>(id) + 1, 0)};
  s.clock[id] = 1;
  streams_.push_back(std::move(s));
  return id;
}

void Model::name_stream(int stream, std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stream >= 0 && stream < static_cast<int>(streams_.size())) streams_[stream].name = std::move(name);
}

int Model::collective_stream(const void* key, const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = collective_streams_.find(key);
    if (it != collective_streams_.end()) return it->second;
  }
  const int id = new_stream(name);
  std::lock_guard<std::mutex> lock(mu_);
  collective_streams_.emplace(key, id);
  return id;
}

Clock& Model::clock_of(int stream) {
  if (stream < 0 || stream >= static_cast<int>(streams_.size())) stream = 0;
  return streams_[stream].clock;
}

Clock Model::record(int stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Clock& c = clock_of(stream);
  Clock snapshot = c;
  c[stream] += 1;
  return snapshot;
}

void Model::block(const Clock& clock, int stream) {
  std::lock_guard<std::mutex> lock(mu_);
  join(clock_of(stream), clock);
}

void Model::count_host_sync(const char* what, const char* phase) {
  host_syncs_.push_back(HostSync{or_default(what, "a host synchronization"), or_default(phase, kNoPhase)});
}

void Model::host_sync(const Clock& clock, const char* what, const char* phase) {
  std::lock_guard<std::mutex> lock(mu_);
  count_host_sync(what, phase);
  for (Stream& s : streams_) join(s.clock, clock);
}

void Model::host_sync_all(const char* what, const char* phase) {
  std::lock_guard<std::mutex> lock(mu_);
  count_host_sync(what, phase);
  Clock all;
  for (const Stream& s : streams_) join(all, s.clock);
  for (Stream& s : streams_) join(s.clock, all);
}

bool Model::ordered(const Access& a, int stream) {
  // The host's accesses are done when it issues later stream work.
  if (a.stream == stream || a.stream == kHostStream) return true;
  const Clock& c = clock_of(stream);
  return static_cast<size_t>(a.stream) < c.size() && c[a.stream] >= a.epoch;
}

std::string Model::stream_name(int stream) const {
  if (stream < 0 || stream >= static_cast<int>(streams_.size())) return "unknown";
  return streams_[stream].name;
}

std::string Model::describe(const Buffer& b) const {
  if (!b.name.empty()) return b.name;
  if (b.alloc_stream < 0) return "a buffer allocated before the checker started";
  return "a " + std::to_string(b.nbytes) + "-byte buffer made by " + b.alloc_op + " on the " +
         stream_name(b.alloc_stream) + " stream (" + b.alloc_phase + ")";
}

void Model::on_alloc(const void* ptr, size_t nbytes, int stream, const char* phase, const char* op, bool pinned) {
  std::lock_guard<std::mutex> lock(mu_);
  Buffer& b = buffers_[ptr];
  b = Buffer();
  b.alloc_stream = stream;
  if (stream == kHostStream) {
    b.memory = pinned ? Memory::kPinnedHost : Memory::kPageableHost;
    has_host_memory_.store(true, std::memory_order_relaxed);
  }
  b.nbytes = nbytes;
  b.alloc_phase = or_default(phase, kNoPhase);
  b.alloc_op = or_default(op, kNoOp);
  b.alloc_epoch = clock_of(stream)[static_cast<size_t>(stream)];
}

void Model::on_free(const void* ptr, const char* phase) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(ptr);
  if (it == buffers_.end()) return;
  const Buffer& b = it->second;
  // Host memory is not the caching allocator's: pageable memory is only ever
  // touched by the host or by copies the host waited for, and the pinned
  // allocator reuses a block only after the streams of its copies passed
  // their use (CachingHostAllocator_recordEvent in every non-blocking copy).
  if (b.alloc_stream >= 0 && b.memory == Memory::kDevice) {
    for (const Access& a : b.accesses) {
      // record_stream(R) makes the allocator record an event on R at the free
      // and reuse the block only after it: that covers whatever R's position
      // at the free covers (R's own accesses, and those R waited for).
      const bool covered_by_record =
          std::any_of(b.recorded_streams.begin(), b.recorded_streams.end(), [&](int r) { return ordered(a, r); });
      if (covered_by_record) continue;
      if (!ordered(a, b.alloc_stream)) {
        report(Report::Kind::kFreedInUse, b, a, b.alloc_stream, phase, "the host's free");
        break;
      }
    }
  }
  buffers_.erase(it);
}

Memory Model::memory_of(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = buffers_.find(ptr);
  return it == buffers_.end() ? Memory::kDevice : it->second.memory;
}

void Model::record_stream(const void* ptr, int stream) {
  std::lock_guard<std::mutex> lock(mu_);
  buffers_[ptr].recorded_streams.insert(stream);
}

void Model::name_buffer(const void* ptr, std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  buffers_[ptr].name = std::move(name);
}

void Model::access(const void* ptr, int64_t begin, int64_t end, bool write, int stream, const char* phase,
                   const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  Buffer& b = buffers_[ptr];
  bool reported = false;
  for (const Access& a : b.accesses) {
    if (reported) break;
    if (a.end <= begin || end <= a.begin || !(write || a.write) || ordered(a, stream)) continue;
    const Report::Kind kind = a.write ? (write ? Report::Kind::kWriteAfterWrite : Report::Kind::kReadAfterWrite)
                                      : Report::Kind::kWriteAfterRead;
    report(kind, b, a, stream, phase, op);
    reported = true;
  }
  // [Note: the allocation's other half] The caching allocator hands a block
  // freed on S to the next allocation on S at once: work queued on S for the
  // block's previous occupant may still run, ordered only before S's later
  // work. Another stream must therefore be ordered after S's position at the
  // allocation before it touches the block (a gradient buffer allocated on
  // the default stream and filled on a reduce-scatter stream without that
  // edge corrupts silently). Checked once per stream, after the accesses, so
  // that a missing edge to a write is reported as the race on that write.
  if (b.alloc_stream >= 0 && b.memory == Memory::kDevice && b.alloc_stream != stream &&
      b.alloc_ordered_on.insert(stream).second && !reported) {
    const Clock& c = clock_of(stream);
    if (static_cast<size_t>(b.alloc_stream) >= c.size() || c[b.alloc_stream] < b.alloc_epoch) {
      const Access allocation{b.alloc_stream, b.alloc_epoch, 0,         static_cast<int64_t>(b.nbytes),
                              true,           b.alloc_phase, b.alloc_op};
      report(Report::Kind::kUsedBeforeAllocationOrdered, b, allocation, stream, phase, op);
    }
  }
  // Drop what the new access dominates: any later access that conflicts with
  // a dropped one either is ordered after it (through the new access) or
  // conflicts with the new access too. A read does not dominate writes.
  b.accesses.erase(std::remove_if(b.accesses.begin(), b.accesses.end(),
                                  [&](const Access& a) {
                                    const bool covered = begin <= a.begin && a.end <= end;
                                    return covered && (write || !a.write) && ordered(a, stream);
                                  }),
                   b.accesses.end());
  b.accesses.push_back(
      Access{stream, clock_of(stream)[stream], begin, end, write, or_default(phase, kNoPhase), or_default(op, kNoOp)});
}

void Model::report(Report::Kind kind, const Buffer& b, const Access& first, int second_stream, const char* second_phase,
                   const char* second_op) {
  Report r;
  r.kind = kind;
  r.buffer = describe(b);
  r.first_stream = stream_name(first.stream);
  r.second_stream = stream_name(second_stream);
  r.first_phase = first.phase;
  r.second_phase = or_default(second_phase, kNoPhase);
  r.first_op = first.op;
  r.second_op = or_default(second_op, kNoOp);
  const std::string key = to_string(kind) + '|' + r.buffer + '|' + r.first_stream + '|' + r.second_stream + '|' +
                          r.first_phase + '|' + r.second_phase + '|' + r.first_op + '|' + r.second_op;
  if (!seen_.insert(key).second) return;
  const std::string first_desc = r.first_op + " on the " + r.first_stream + " stream (" + r.first_phase + ")";
  const std::string edge = "Missing edge: " + r.first_stream + " -> " + r.second_stream;
  // Only a host synchronization orders the host after a stream.
  const std::string waited_for_by =
      second_stream == kHostStream ? "synchronized by the host" : "waited for by " + r.second_stream;
  switch (kind) {
    case Report::Kind::kUsedBeforeAllocationOrdered:
      r.message = "stream-order race (" + to_string(kind) + "): " + r.second_op + " on the " + r.second_stream +
                  " stream (" + r.second_phase + ") touches " + r.buffer + ", which " + r.first_op +
                  " allocated on the " + r.first_stream + " stream (" + r.first_phase + "), but the " +
                  r.second_stream + " stream is not ordered after the " + r.first_stream +
                  " stream's position at the allocation: the caching allocator may have handed out a block that "
                  "work queued on " +
                  r.first_stream + " for its previous occupant still uses. " + edge + " (an event recorded on " +
                  r.first_stream + " after the allocation, waited for by " + r.second_stream +
                  "), or allocate the buffer on the " + r.second_stream + " stream.";
      break;
    case Report::Kind::kFreedInUse:
      r.message = "stream-order race (" + to_string(kind) + "): " + r.buffer + ", allocated on the " + r.second_stream +
                  " stream, was freed by the host (" + r.second_phase + ") while " + first_desc +
                  " may still access it; the caching allocator may hand the block to the next allocation on the " +
                  r.second_stream + " stream at once. " + edge +
                  " before the free (an event recorded after the access, waited for by the " + r.second_stream +
                  " stream), or record_stream(" + r.first_stream + ") on the buffer.";
      break;
    default: {
      const char* verb = kind == Report::Kind::kReadAfterWrite ? "reads" : "writes";
      const char* earlier = first.write ? "write" : "read";
      r.message = "stream-order race (" + to_string(kind) + "): " + r.second_op + " on the " + r.second_stream +
                  " stream (" + r.second_phase + ") " + verb + " " + r.buffer + ", but the " + earlier + " by " +
                  first_desc + " is not ordered before it, so a GPU may run them in either order. " + edge +
                  " (an event recorded on " + r.first_stream + " after the " + earlier + ", " + waited_for_by +
                  " before the access).";
    }
  }
  reports_.push_back(std::move(r));
}

std::vector<Report> Model::reports() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reports_;
}

void Model::clear_reports() {
  std::lock_guard<std::mutex> lock(mu_);
  reports_.clear();
  seen_.clear();
  thrown_ = 0;
}

std::vector<HostSync> Model::host_syncs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_syncs_;
}

void Model::clear_host_syncs() {
  std::lock_guard<std::mutex> lock(mu_);
  host_syncs_.clear();
}

std::optional<std::string> Model::take_unthrown() {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.on_race != OnRace::kThrow || thrown_ >= reports_.size()) return std::nullopt;
  return reports_[thrown_++].message;
}

std::vector<std::string> Model::unthrown() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (size_t i = thrown_; i < reports_.size(); ++i) out.push_back(reports_[i].message);
  return out;
}

}  // namespace fsdp::stream_check::detail

namespace fsdp::stream_check {

std::string to_string(Report::Kind kind) {
  switch (kind) {
    case Report::Kind::kReadAfterWrite: return "read after write";
    case Report::Kind::kWriteAfterRead: return "write after read";
    case Report::Kind::kWriteAfterWrite: return "write after write";
    case Report::Kind::kFreedInUse: return "freed while in use";
    case Report::Kind::kUsedBeforeAllocationOrdered: return "used before its allocation was ordered";
  }
  return "unknown";
}

}  // namespace fsdp::stream_check
