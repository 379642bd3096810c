// The dry run: a program's own fully_shard runtime, run on the meta device
// over communicators that complete at once and move no bytes, so that one
// process plays one rank of a job of any world size and mesh (8, 128, 1024
// ranks) and says, to the byte, how much memory that rank would hold, in
// which phase its peak falls and what holds it, and which collectives it
// issues. Nothing is computed and nothing is communicated; every allocation
// is recorded. docs/planning.md walks through it.
//
//   fsdp_plan::DryRunOptions options;
//   options.world_size = 128;
//   fsdp_plan::DryRun dry(options);            // from here on, this thread builds meta tensors
//   auto model = std::make_shared<Net>();      // built on the meta device (meta_mode.h)
//   fsdp::FullyShardOptions opts;
//   opts.mesh = dry.mesh();                    // the simulated rank's mesh
//   for (auto& block : model->blocks) fsdp::fully_shard(block, opts);
//   fsdp::fully_shard(model, opts);
//   torch::optim::AdamW optim(model->parameters(), 1e-3);
//   dry.track(model);                          // parameters, gradients and optimizer state by name
//   for (int step = 0; step < 2; ++step) {
//     dry.begin(fsdp_plan::StepPhase::kForward);
//     at::Tensor loss = fsdp::call_module(*model, at::randn({8, 1024})).sum();
//     dry.begin(fsdp_plan::StepPhase::kBackward);
//     loss.backward();
//     dry.begin(fsdp_plan::StepPhase::kOptimizer);
//     optim.step();
//     optim.zero_grad();
//   }
//   fsdp_plan::MemoryReport report = dry.memory();
//
// What is recorded: every storage allocated and freed on the meta device
// while the DryRun lives (at::empty and friends, and the runtime's own
// storage resizing: reshard frees the all-gather output, unshard allocates
// it again), with its size, the step, the step phase and the innermost FSDP
// phase label current when it was made ("FSDP::all_gather_copy_in
// (layers.3)", phase.h), and the CUDA stream FSDP2 makes it on; and every
// collective with its size, group and phase; and every kernel (ATen op
// that does work) with its FLOPs, bytes and the storages it reads and writes.
//
// Fidelity. The runtime's own code runs, so its buffer lifetimes are what
// the dry run sees: change one and the predicted peak changes. In the dry
// run of a CUDA job (engine kNccl) the meta device has streams and events
// (plan/src/meta_streams.h), so the runtime takes its CUDA paths: a
// forward all-gather output lives until the next group's all-gather is
// issued, and every event and stream wait between FSDP's streams is
// recorded (OpRecord::after). In
// a CPU job's (kGloo) it has none, as the CPU has none. Kernels are
// modelled by their meta functions, which allocate their outputs; of their
// own scratch, a CUDA job's dry run adds cuBLAS's workspaces (one per
// cuBLAS handle and stream, made at the first matmul and never freed:
// DryRunOptions::blas_workspace_bytes) and flash attention's backward
// scratch (meta_mode.h). In a CUDA job's dry run, storages a CUDA run
// would hold in host memory (CPU offload's shards, gradients and optimizer
// state; what the program stages on the CPU) are recorded apart from the
// device's (plan/src/host_placement.h; MemoryReport::host_peak_bytes). What
// remains apart from a CUDA run: a buffer
// another stream used (record_stream) is taken as reusable when the host
// frees it, and other kernels' scratch; docs/planning.md lists both.
//
// Errors: the constructor throws c10::Error naming the option when the world
// size, rank or mesh shape is inconsistent, and when another DryRun is alive.
// Threading: one DryRun per process at a time; the thread that makes it runs
// the program (autograd's threads working for it are followed too).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "collectives/communicator.h"
#include "device_mesh/device_mesh.h"
#include "fsdp_plan/meta_mode.h"

namespace fsdp_plan {
namespace detail {
struct KernelCall;  // kernel_call.h
}  // namespace detail

// What holds memory, as a user sizing a job asks (PyTorch's FSDPMemTracker's
// categories, split where FSDP's own buffers are concerned).
enum class Holder {
  kParameters,           // the sharded parameters (and the model's buffers)
  kGradients,            // the sharded gradients the optimizer reads
  kOptimizerState,       // what the optimizer keeps between steps (AdamW's moments)
  kAllGather,            // all-gather inputs and outputs (copy-in and the collective)
  kUnshardedParameters,  // the unsharded parameters of the groups now all-gathered (copy-out)
  kReduceScatter,        // reduce-scatter (and HSDP all-reduce) inputs and outputs
  kUnreducedGradients,   // the full gradients autograd accumulated, before their reduce-scatter
  kActivations,          // forward tensors still alive when backward starts (saved for it)
  kWorkspaces,           // cuBLAS's workspaces (a CUDA job's), kept for the process's life
  kTemporaries,          // everything else: forward and backward intermediates, the loss
};
inline constexpr int kHolderCount = 10;
std::string to_string(Holder holder);

// The phases of a training step, as the program marks them with begin().
enum class StepPhase { kSetup, kForward, kBackward, kOptimizer };
std::string to_string(StepPhase phase);

// One collective the simulated rank issued.
struct CollectiveRecord {
  std::string op;     // "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", ...
  std::string group;  // the communicator's name, "nccl[0,1,...,7]"
  int64_t group_size = 0;
  int64_t bytes = 0;  // the larger side: all-gather output, reduce-scatter input, all-reduce tensor
  int64_t step = 0;
  std::string phase;  // the FSDP phase label current when it was issued
};

// One operation the simulated rank issued, in issue order: a kernel (an ATen
// op that does work on the device: not a view, not an allocation, and none
// of the ATen ops it called ran) or a collective. The time model
// (timeline.h) replays them.
struct OpRecord {
  enum class Kind { kKernel, kCollective };
  Kind kind = Kind::kKernel;
  std::string name;  // "aten::mm", "all_gather_into_tensor", ...
  // Kernels: floating-point operations of its matmuls and attention (a
  // multiply-add counts 2; causal attention half); 0 for every other op,
  // whose time is its memory traffic.
  int64_t flops = 0;
  // Kernels: bytes read and written (every tensor argument and result).
  // Collectives: the larger side (all-gather output, reduce-scatter input).
  int64_t bytes = 0;
  bool matmul = false;                  // a matmul (tensor cores)
  bool attention = false;               // scaled dot-product attention, forward or backward
  c10::ScalarType dtype = c10::kFloat;  // of its first floating-point tensor argument
  // The stream it runs on, as AllocationRecord::stream; a collective issued
  // outside FSDP's communication phases (gradient clipping's all-reduce) runs
  // on stream 5, NCCL's own stream for the compute stream's collectives.
  int stream = 0;
  std::shared_ptr<const std::vector<int>> group;  // collectives: the group's global ranks
  // Kernels: how to run it again on CPU tensors (null when it cannot be).
  std::shared_ptr<const detail::KernelCall> call;
  int64_t step = 0;
  StepPhase step_phase = StepPhase::kSetup;
  std::string fsdp_phase;
  // The storages it reads and writes, as indices into allocations(): the
  // data dependencies between streams that FSDP's events enforce.
  std::vector<int64_t> reads, writes;
  // Kernels of a CUDA job with host memory (CPU offload): whether every
  // tensor it touches is the host's, so it runs on the CPU (the offloaded
  // optimizer step), and the bytes of host tensors a kernel that also
  // touches the device's moves over the host link (a copy to or from the
  // host).
  bool on_host = false;
  int64_t host_link_bytes = 0;
  // The ops it waits for by the runtime's events, as indices into ops(): its
  // stream waited for them (an event recorded after them, blocked on; a
  // stream's wait for another), or the host did before issuing it (an event
  // or stream synchronize). Recorded when the meta device has streams (a
  // CUDA job: DryRunOptions::engine kNccl); empty in a CPU job's dry run.
  std::vector<int64_t> after, host_after;
};

// One storage the simulated rank allocated.
struct AllocationRecord {
  int64_t bytes = 0;
  // Sequence numbers of the allocation and the free in the run's event order
  // (INT64_MAX: still alive).
  int64_t allocated_at = 0;
  int64_t freed_at = 0;
  int64_t step = 0;  // 1-based; 0 = setup
  StepPhase step_phase = StepPhase::kSetup;
  std::string fsdp_phase;  // the innermost FSDP phase label, or empty
  int stream = 0;          // 0 compute, 1 all-gather copy-in, 2 all-gather, 3 reduce-scatter, 4 all-reduce
  std::string op;          // the ATen op that allocated it, when known
  // Host memory, not the device's (a CUDA job's CPU offload: its shards,
  // gradients and optimizer state; not in the caching allocator's figures).
  bool host = false;
};

// The memory of the simulated rank over the steps run.
struct MemoryReport {
  // The peak of the bytes the program's tensors held (storage sizes as
  // allocated, no rounding): what a CPU run's live heap bytes measure.
  int64_t peak_bytes = 0;
  // torch.cuda.max_memory_allocated() and max_memory_reserved() for the same
  // allocations, by the caching allocator's rules (caching_allocator.h).
  int64_t peak_allocated = 0;
  int64_t peak_reserved = 0;
  // Where peak_bytes falls: the step (1-based; 0 = setup), its phase, and the
  // innermost FSDP phase label then (empty outside the FSDP phases).
  int64_t peak_step = 0;
  StepPhase peak_step_phase = StepPhase::kSetup;
  std::string peak_fsdp_phase;
  // What held peak_bytes, by holder (raw bytes; they sum to peak_bytes).
  std::vector<int64_t> peak_by_holder = std::vector<int64_t>(kHolderCount, 0);
  // The peak of each step (steps 1..n), raw bytes.
  std::vector<int64_t> step_peaks;
  // Bytes held at the end of the last step (sharded state between steps).
  int64_t end_bytes = 0;
  // Host memory, apart from all of the above (a CUDA job with CPU offload:
  // the sharded parameters, gradients and optimizer state it keeps on the
  // CPU, and what it stages there): its peak (bytes as requested) and what
  // held it then, the peak of its pinned memory as PyTorch's pinned
  // allocator hands it out (each request rounded up to a power of two), and
  // what is held at the end. All 0 in a CPU job's dry run, whose device is
  // the host.
  int64_t host_peak_bytes = 0;
  std::vector<int64_t> host_peak_by_holder = std::vector<int64_t>(kHolderCount, 0);
  int64_t host_pinned_peak = 0;
  int64_t host_end_bytes = 0;
  int64_t allocations = 0;
};

struct DryRunOptions {
  // The job's world size and the rank this process plays (its shards, its
  // rows of uneven parameters).
  int world_size = 1;
  int rank = 0;
  // The mesh: empty for 1-D FSDP over all ranks, {R, S} for HSDP (R
  // replicas of S shard ranks, dims named "replicate" and "shard").
  std::vector<int64_t> mesh_shape;
  // Whose semantics the communicators follow (collectives/communicator.h):
  // NCCL, as a CUDA job runs (in-place all-gather, native reductions; NCCL's
  // own buffers are outside the caching allocator), or Gloo, to compare with
  // a CPU run: then the engine's buffers are allocated as Gloo allocates
  // them (an input-sized buffer per reduce-scatter until its wait; an
  // output-sized one per all-gather, for an instant: dry_backend.cc), and
  // attention is laid out as the CPU kernel lays it out (meta_mode.h).
  fsdp::collectives::BackendKind engine = fsdp::collectives::BackendKind::kNccl;
  // The bytes of one cuBLAS workspace in a CUDA job (engine kNccl). PyTorch
  // gives each cuBLAS handle one per stream it runs on, through the caching
  // allocator, and keeps it until the process ends
  // (aten/src/ATen/cuda/CublasHandlePool.cpp). A handle belongs to a thread:
  // the host thread's runs forward, autograd's device thread's runs backward
  // (activation checkpointing's recomputation included), so a step of
  // matmuls on the compute stream makes two. The default, 32 MiB, is
  // PyTorch's on Hopper (sm_90: the shipped device profiles) when
  // CUBLAS_WORKSPACE_CONFIG is unset; other GPUs get 8 MiB + 128 KiB. 0
  // leaves them out. A CPU job (kGloo) has none.
  int64_t blas_workspace_bytes = int64_t{32} << 20;
};

class DryRun {
 public:
  explicit DryRun(DryRunOptions options);
  ~DryRun();
  DryRun(const DryRun&) = delete;
  DryRun& operator=(const DryRun&) = delete;

  const DryRunOptions& options() const { return options_; }
  // The simulated rank's mesh, on the meta device: pass it to fully_shard.
  const fsdp::DeviceMesh& mesh() const { return *mesh_; }

  // Names the model's tensors for the report: its parameters (with
  // everything allocated before the first step, as kParameters), the
  // gradients they hold when the optimizer phase begins (kGradients), and
  // the gradients of a group when its post-backward starts
  // (kUnreducedGradients). Call after fully_shard. Optional: without it,
  // those bytes are reported as temporaries.
  void track(std::shared_ptr<torch::nn::Module> model);

  // Marks the start of a phase of the step; kForward starts a new step. What
  // the optimizer phase allocates and keeps is reported as kOptimizerState.
  void begin(StepPhase phase);

  MemoryReport memory() const;
  std::vector<CollectiveRecord> collectives() const;
  // Every allocation so far, in order.
  std::vector<AllocationRecord> allocations() const;
  // Every kernel and collective so far, in issue order.
  std::vector<OpRecord> ops() const;

  struct Recorder;  // internal (dry_run.cc)

 private:
  DryRunOptions options_;
  std::shared_ptr<Recorder> recorder_;
  std::optional<fsdp::DeviceMesh> mesh_;
  std::shared_ptr<torch::nn::Module> model_;
  uint64_t callback_ = 0;  // at::CallbackHandle of the phase-label observer
  std::optional<MetaMode> meta_;
};

// The report as text (one screen: peak allocated and reserved, the phase,
// the holders) and as JSON (the same fields, bytes as integers).
std::string format_memory(const MemoryReport& report);
std::string memory_json(const MemoryReport& report);

}  // namespace fsdp_plan
