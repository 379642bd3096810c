// Divergence: what happens when the ranks stop issuing the same collectives.
//
// Ranks that disagree about which collective comes next (a module skipped on
// one rank, one more micro-batch on one rank, data that ends early on one
// rank, a rank stalled in user code) would otherwise wait out the
// communicator's timeout and fail with an error that names neither the
// module nor the rank that went another way. Instead:
//
//  1. A Work::wait() (one without a timeout of its own: a caller that gives
//     one, as the checkpoint code does around its writes, bounds the wait
//     itself) that blocks for DivergenceOptions::timeout (default 30 s)
//     asks every rank, through the rendezvous store, for its FlightLog
//     (flight_recorder.h). Each rank's watchdog thread answers within a
//     fraction of a second, unless its main thread holds the store in a
//     blocking call (making a group); a rank that has not answered within
//     a few seconds is reported as not answering.
//  2. The waiting rank compares the logs (diagnose_divergence below) and
//     throws a c10::Error whose message is the diagnosis: the first
//     collective where the ranks disagree, each side's fingerprint, and
//     every rank's state, e.g.
//
//       ranks diverged at collective #57 of gloo[0,1,2,3]#0:
//         ranks 0,1 issued all_gather_into_tensor(Float, 2048 elements) for
//           FSDP::all_gather (layers.3) [in FSDP::pre_forward (layers.3)]
//         rank 2 issued reduce_scatter_tensor(AVG, Float, 8192 elements) for
//           FSDP::reduce_scatter (layers.2) [in FSDP::post_backward (layers.2)]
//         rank 3 has issued nothing on it since #55, 40.2 s ago (stalled in
//           user code?)
//
//  3. A rank that is not itself waiting (the stalled one) prints the
//     diagnosis and exits with status 1 a few seconds after it answered, so
//     that no rank outlives a job that cannot go on. With
//     DivergenceOptions::dump_dir set, every rank writes its log there as
//     JSON (flight_recorder_rank<r>.json) and each diagnosing rank writes its
//     diagnosis (divergence_rank<r>.txt).
//
// Strict mode (DivergenceOptions::strict) also checks, before every
// collective, that every member issues the same fingerprint (one all-gather
// of a few words, waited for on the host: a debugging aid, docs/debugging.md
// gives its cost), and fails on every member at once with both fingerprints.
//
// Detection watches host waits on Gloo, where every Work::wait() blocks the
// host. On NCCL a wait only orders the caller's stream and returns (work.h);
// the watchdog then polls the engine for the collective's completion, as
// ProcessGroupNCCL's own watchdog does, and one that has not completed
// DivergenceOptions::timeout after its wait is diagnosed the same way: the
// diagnosis printed on stderr, then the exit of (3.).
//
// A collective that the engine fails makes the waiting rank gather the logs
// too; when they show that the ranks issued different collectives (a
// reduce-scatter of one group with different sizes, say), the error names
// both, with the likely cause, instead of the engine's words alone, and the
// process ends as in (3.). Gloo ends the process that receives a message
// larger than the buffer posted for it from its own I/O thread
// ("op.preamble.length <= op.nbytes"): a terminate handler, installed with
// the first World that watches, prints the same diagnosis before the
// process ends.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "collectives/flight_recorder.h"

namespace fsdp::collectives {

class Communicator;

struct DivergenceOptions {
  // How long a Work::wait() may block before the ranks' logs are compared;
  // zero turns detection off (the communicator's timeout remains). Raise it
  // when one rank legitimately keeps the others waiting longer (evaluation
  // or a synchronous checkpoint on one rank only): a wait that long is
  // reported as a stall and stops the job.
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
  // Records kept per process (the ring's size).
  size_t recorder_capacity = 4096;
  // Where the logs and the diagnosis are written when one is made; empty:
  // nowhere.
  std::string dump_dir;
  // Check every collective's fingerprint on all members before issuing it.
  bool strict = false;

  // The defaults above, overridden by the environment:
  //   FSDP2CPP_DIVERGENCE_TIMEOUT_S   seconds (decimal), 0 = off
  //   FSDP2CPP_FLIGHT_RECORDER_SIZE   records per process, >= 1
  //   FSDP2CPP_FLIGHT_RECORDER_DIR    dump directory
  //   FSDP2CPP_STRICT_COLLECTIVES     1 = strict mode
  // Throws c10::Error naming a malformed variable and the values it takes.
  static DivergenceOptions from_env();
};

// The diagnosis of a hang from the logs of all ranks: `logs[r]` is rank r's
// log, or nullopt when rank r did not answer (it exited, crashed, or is
// stuck where its watchdog cannot publish). `waited_s` is how long the
// diagnosing rank `diagnosing_rank` had waited. Pure: no communication.
std::string diagnose_divergence(const std::vector<std::optional<FlightLog>>& logs, int diagnosing_rank,
                                double waited_s);

// The first collective where the ranks' logs disagree (what
// diagnose_divergence names first), or empty when every rank that answered
// issued the same collectives in the same order. With `count_ranks_behind`
// false, only ranks that issued different collectives count, not ranks that
// issued fewer (a stall). Pure.
std::string find_divergence(const std::vector<std::optional<FlightLog>>& logs, bool count_ranks_behind = true);

// Checks that every member of `comm` holds the same `lines` (a description
// of something all ranks must agree on, one item per line: a model's
// parameters, say). Collective over `comm`: one all-gather of a hash when the
// ranks agree, two more to find the difference when they do not. Throws
// c10::Error on every member when they differ, naming the first line where
// a rank differs from the group's first rank, e.g. "<what> differs between
// ranks: rank 2 has parameter 'w' of shape [688, 256]; rank 0 has parameter
// 'w' of shape [704, 256]". On CUDA communicators it synchronizes the host
// with the current stream.
void check_ranks_agree(Communicator& comm, const std::vector<std::string>& lines, const std::string& what);

}  // namespace fsdp::collectives
