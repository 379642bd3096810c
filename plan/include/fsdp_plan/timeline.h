// The time model: a discrete-event simulation of the ops a dry run recorded
// (dry_run.h, DryRun::ops()) on the streams FSDP2 runs them on, under a
// device profile, giving a step's time, its exposed communication, MFU, a
// table per phase and a Chrome trace of the simulated timeline.
// docs/planning.md, "How long a step takes", walks through it.
//
//   fsdp_plan::DryRun dry(options);
//   ... two training steps, as in dry_run.h ...
//   fsdp_plan::TimelineOptions t;
//   t.device = fsdp_plan::device_profile("h100");
//   fsdp_plan::StepTime time = fsdp_plan::simulate(dry.ops(), /*step=*/2, t);
//   std::cout << fsdp_plan::format_time(time);
//
// The simulation. The host issues the ops in the order the dry run recorded
// them, `host_launch_s` apart; each op runs on its stream (the compute
// stream, the all-gather copy-in, all-gather, reduce-scatter and all-reduce
// streams, and NCCL's stream for the compute stream's own collectives), in
// issue order on that stream, once the ops that wrote what it reads (and
// read or wrote what it writes) have ended: the data dependencies that
// FSDP's events enforce across streams; and two event edges that order
// more than data (timeline.cc, [Note: FSDP's event edges in the
// simulation]): an all-gather waits for the previous group's copy-out, a
// reduce-scatter copy-in for the previous reduce-scatter. On a profile whose
// host runs the compute (a CPU), compute ops run on the host itself.
//
// The cost of an op. A kernel takes max(flops / (peak * efficiency), bytes /
// (bandwidth * efficiency)) plus the device's per-kernel overhead, with the
// tensor-core peak for bf16/fp16 matmuls and attention and the vector peak
// otherwise. A collective over n ranks moving B bytes (its larger side) takes
// latency + (n - 1) hops + (n - 1) / n * B / bus bandwidth for an all-gather
// or reduce-scatter (a ring), twice that for an all-reduce, with the NVLink
// figures when the group lies within one node of `gpus_per_node` ranks and
// the network's otherwise (HSDP's shard and replicate groups each get
// theirs).
//
// With CPU offload, a copy between host and device memory takes at least its
// host bytes over the host link, and a kernel on host tensors only (the
// optimizer step) runs on the host thread at the host's memory bandwidth.
//
// What it does not model: the host's own synchronizations (none in a steady
// FSDP2 step on CUDA), the CUDA caching allocator's stream waits, contention
// between concurrent kernels and collectives for the SMs and memory, and
// clock changes under load. Each constant of the profiles says where it comes
// from (timeline.cc); none was fitted to the published runs docs/planning.md
// compares with.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp_plan/dry_run.h"

namespace fsdp_plan {

// What one device (and its links) can do.
struct DeviceProfile {
  std::string name;
  // Dense peaks, FLOP/s: tensor cores for bf16/fp16 matmuls, the vector
  // units for fp32 (LibTorch does not allow TF32 for matmuls by default).
  double peak_flops_bf16 = 0;
  double peak_flops_fp32 = 0;
  // Fractions of those peaks that large matmuls and attention kernels reach.
  double matmul_efficiency = 1;
  double attention_efficiency = 1;
  double memory_bandwidth = 0;  // bytes/s
  double memory_efficiency = 1;
  double kernel_overhead_s = 0;  // device time of an op beyond its work (launch, tail)
  double host_launch_s = 0;      // host time to issue one op (LibTorch's dispatch and the launch)
  // The compute runs on the host (a CPU): no separate host stream, and
  // host_launch_s is the host's work around each kernel (autograd's, the
  // allocator's), which delays the next op as the kernel does.
  bool host_computes = false;
  // On a profile whose host computes: the host's time to issue one
  // collective to the engine (Gloo's), and the time a collective waits for
  // its peers per second the host computed since its previous collective
  // (ranks that share cores reach it late: timeline.cc, [Note: Gloo's costs
  // under load]).
  double host_collective_s = 0;
  double collective_wait_per_compute = 0;
  // A measured CPU profile's ranks' threads per core, at least 1: the
  // factor its rates were divided by (and its times multiplied by).
  double threads_per_core = 1;
  // Ranks per node, and the links: bus bandwidth per rank in bytes/s as
  // nccl-tests reports it, latency per collective and per ring hop.
  int gpus_per_node = 8;
  double intra_node_bandwidth = 0;
  double inter_node_bandwidth = 0;
  double collective_latency_s = 0;
  double intra_node_hop_s = 0;
  double inter_node_hop_s = 0;
  // The host, for CPU offload: bytes/s of copies between pinned host memory
  // and the device (per direction, per GPU), and bytes/s one rank's share of
  // the CPU streams through host memory (its optimizer step). 0: unknown
  // (simulating an offloaded job then throws naming the field).
  double host_link_bandwidth = 0;
  double host_memory_bandwidth = 0;
  // Measured seconds of kernels by their call's signature (the CPU profile
  // times each distinct kernel of the plan); a kernel not in it takes the
  // roofline above.
  std::shared_ptr<const std::unordered_map<std::string, double>> measured_kernels;
  std::string sources;  // where the figures come from, one line
};

// The profiles that ship: "h100" (SXM5 80 GB HBM3, 700 W), "h100-hbm2e-500w"
// (SXM 96 GB HBM2e capped at 500 W: the GPUs of torchtitan's published
// Llama 3.1 runs), "h200" (SXM 141 GB HBM3e). Nodes of 8 GPUs over NVLink 4,
// 400 Gb/s per GPU across nodes. nullopt for another name.
std::optional<DeviceProfile> device_profile(const std::string& name);
std::vector<std::string> device_profile_names();

// This machine's CPU as one rank of `ranks` local ranks sees it, measured
// now with `threads` intra-op threads (timeline.cc's notes say why each
// figure is measured as it is):
//   - every distinct kernel of `ops` (its op, shapes, strides, dtypes and
//     other arguments) run on CPU tensors with its inputs in memory, not in
//     cache, by as many threads in step as the ranks can keep the cores
//     busy, the median of a few runs, times the ranks' threads per core
//     beyond one. Kernels that cannot run again (or move more than 256 MiB)
//     take a roofline of a float32 matmul's rate, a copy's bandwidth and an
//     op's fixed cost, shared the same way;
//   - the host's work around each kernel (host_launch_s), from a
//     calibration step of tiny layers;
//   - Gloo over loopback between `ranks` threads of this process that
//     compute between their collectives, as a step does: the time to issue
//     one, the latency, the wait per second computed before it, the
//     bandwidth (none for one rank).
// Must not run while a DryRun is alive (it needs real tensors, and makes a
// dry run of its calibration step). Takes a few seconds: about 6 runs of
// each distinct kernel and some 200 collectives. Throws c10::Error for
// ranks or threads below 1, and for more than 64 ranks (each a thread
// connected to every other).
DeviceProfile measure_cpu_profile(int ranks, int threads, const std::vector<OpRecord>& ops = {});

// The key of kernel `op` in DeviceProfile::measured_kernels: its op, its
// tensors' shapes, strides and dtypes and its other arguments; empty when the
// dry run could not describe its call.
const std::string& measured_kernel_key(const OpRecord& op);

struct TimelineOptions {
  DeviceProfile device;
  // For the report: tokens one rank processes per step, and the model FLOPs
  // of one step on one rank (6 * parameters * tokens plus attention, as
  // MFU is usually counted; 0: MFU is not reported).
  int64_t tokens = 0;
  double model_flops = 0;
};

// One op on the simulated timeline.
struct TimedOp {
  std::string name;
  std::string fsdp_phase;
  int64_t step = 0;
  StepPhase step_phase = StepPhase::kSetup;
  int stream = 0;
  bool collective = false;
  double issue_s = 0, start_s = 0, end_s = 0;
  int64_t flops = 0, bytes = 0;
};

// Time per step phase of the simulated step. The phases partition the step
// at the compute stream: forward until the first backward op computes,
// backward until the first optimizer op does, then the optimizer.
struct PhaseTime {
  StepPhase phase = StepPhase::kForward;
  double wall_s = 0;
  double compute_s = 0;        // the compute stream busy
  double communication_s = 0;  // some communication stream busy
  double exposed_s = 0;        // communication busy while the compute stream is idle
};

struct StepTime {
  std::string device;
  int64_t step = 0;
  // The step's time: from the end of the previous step's last op to the end
  // of this step's (from time 0 for the first step).
  double step_s = 0;
  double compute_s = 0;        // the compute stream busy within the step
  double communication_s = 0;  // union of the communication streams busy
  double exposed_communication_s = 0;
  int64_t flops = 0;  // executed (recomputation included)
  int64_t tokens = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // model FLOPs / (step time * bf16 peak); 0 when unknown
  std::vector<PhaseTime> phases;
  std::vector<TimedOp> ops;  // every op of the simulation, all steps
};

// Simulates every op of `ops` (all steps, so that a step starts where the
// previous one left the streams) and reports step `step` (1-based).
// REQUIRES: ops has ops of that step (throws c10::Error naming the step and
// the steps present otherwise); options.device has positive peaks and
// bandwidths (throws naming the profile's field otherwise).
StepTime simulate(const std::vector<OpRecord>& ops, int64_t step, const TimelineOptions& options);

// The report as text (step time, tokens/s, MFU, exposed communication, the
// table per phase) and JSON.
std::string format_time(const StepTime& time);
std::string time_json(const StepTime& time);

// The simulated timeline of `time.step` as Chrome trace JSON (the Trace
// Event Format Perfetto and chrome://tracing open): one row per stream (on
// a profile whose host computes, the compute row is the host; a GPU job's
// kernels on host tensors, CPU offload's optimizer, have a host row), each op a
// complete event named for it with its FSDP phase, FLOPs and bytes in args.
std::string chrome_trace(const StepTime& time);

// The name of a stream number (AllocationRecord::stream, OpRecord::stream).
std::string stream_name(int stream);

}  // namespace fsdp_plan
