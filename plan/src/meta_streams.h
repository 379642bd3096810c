// Internal: streams and events on the meta device, for the dry run of a CUDA
// job (dry_run.h). While a MetaStreams lives, c10::Stream, c10::StreamGuard
// and c10::Event work on the meta device as they do on CUDA (the FSDP
// runtime's StreamSet is enabled there, stream_check::meta_streams()), and
// what they order is reported to a MetaStreamListener: which op an event
// stands for (the last op issued on its stream when it was recorded), which
// stream waits for it, and when the host does; and the names the runtime
// gives its streams. Nothing runs behind the host,
// so every query and synchronization completes at once.
//
// Not modelled: record_stream (a buffer that another stream used is reusable
// as soon as the host frees it, as if that stream had caught up), and the
// streams of other devices.
//
// Threads: the current stream is per thread, as on CUDA; one MetaStreams at a
// time in the process (the dry run's rule).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Stream.h>

namespace fsdp_plan::detail {

// The dry run's side of the meta streams. Called on the thread that records,
// blocks or synchronizes; an op index is the one the listener gave the op.
class MetaStreamListener {
 public:
  virtual ~MetaStreamListener() = default;
  // The last op issued on `stream` so far, or -1 when none.
  virtual int64_t last_op_on(c10::StreamId stream) = 0;
  // `stream` waits for op `op` (an event recorded after it, blocked on).
  virtual void stream_waits(c10::StreamId stream, int64_t op) = 0;
  // The host waits for op `op` (an event or stream synchronize).
  virtual void host_waits(int64_t op) = 0;
  // The host waits for every stream (a device synchronize).
  virtual void host_waits_for_all() = 0;
  // The runtime named `stream` (fsdp::stream_check::name_stream: "all-gather
  // copy-in", "all-gather", "reduce-scatter", "all-reduce").
  virtual void stream_named(c10::StreamId stream, const std::string& name) = 0;
};

// Gives the meta device streams and events reporting to `listener` for its
// lifetime (installs a device guard, sets stream_check::set_meta_streams),
// and restores the meta device's own guard after.
class MetaStreams {
 public:
  explicit MetaStreams(MetaStreamListener* listener);
  ~MetaStreams();
  MetaStreams(const MetaStreams&) = delete;
  MetaStreams& operator=(const MetaStreams&) = delete;
};

// The calling thread's current meta stream (0, the default stream, when none
// was set or no MetaStreams lives).
c10::StreamId current_meta_stream();

}  // namespace fsdp_plan::detail
