#include "fsdp_plan/timeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "collectives/communicator.h"
#include "collectives/world.h"
#include "kernel_call.h"

namespace fsdp_plan {
namespace {

// Streams (OpRecord::stream), and the host's own compute (CPU offload's
// optimizer step): kStreamCount rows in the trace.
constexpr int kStreamCount = 7;
constexpr int kCollectiveStream = 5;
constexpr int kHostCompute = 6;

// [Note: the shipped device profiles] Every figure is a public one or an
// estimate from public ones, and none was fitted to the published runs the
// planner is checked against (docs/planning.md lists them with the results):
//   - peaks: NVIDIA's H100 and H200 datasheets (SXM5: 989.4 TFLOP/s dense
//     bf16, 66.9 TFLOP/s fp32; HBM3 3.35 TB/s, H200's HBM3e 4.8 TB/s);
//   - matmul efficiency 0.7: large bf16 GEMMs under cuBLAS on H100 SXM run
//     at roughly 650-750 TFLOP/s; the low end of that range, as training
//     shapes are not all large (estimate);
//   - attention efficiency 0.35: FlashAttention-2 (PyTorch's flash SDPA
//     backend) reaches about 35% of an H100's peak (the FlashAttention-3
//     paper, Shah et al. 2024, abstract);
//   - memory efficiency 0.8: what copy and elementwise kernels reach of HBM's
//     peak (estimate; STREAM-like kernels on GPUs reach 80-90%);
//   - links: NVLink 4 moves 450 GB/s per direction per GPU; nccl-tests'
//     bus bandwidth for large all-gathers on 8 H100 SXM is about 80% of it
//     (360 GB/s); across nodes 400 Gb/s (50 GB/s) per GPU at the same 80%;
//     latencies of NCCL's ring: about 15 us per collective, 1 us per NVLink
//     hop and 5 us per network hop (estimates);
//   - the host: 6 us to dispatch and launch one ATen op from C++ (estimate:
//     LibTorch's dispatcher plus cudaLaunchKernel), 2 us of device overhead
//     per kernel;
//   - the host (CPU offload): PCIe 5.0 x16 moves 64 GB/s per direction;
//     pinned copies reach about 55 GB/s of it (estimate, as bandwidth tests
//     of pinned memory on such systems report); the optimizer step on the
//     CPU streams through host memory at 45 GB/s per rank (estimate: a DGX
//     H100's two Xeon 8480C have 8 channels of DDR5-4800 each, 614 GB/s for
//     8 GPUs, 77 GB/s per rank, of which elementwise loops reach about 60%);
//   - the 500 W cap of torchtitan's H100s: 0.85 of the 700 W board's
//     sustained tensor-core rate (estimate: the clock such a cap sustains
//     under dense GEMM load); their 96 GB of HBM2e at 2.4 TB/s (torchtitan's
//     docs/performance.md, which describes those machines).
constexpr const char* kSharedSources =
    "efficiencies, links and overheads as timeline.cc's [Note: the shipped device profiles] says";

DeviceProfile h100_sxm() {
  DeviceProfile p;
  p.name = "h100";
  p.peak_flops_bf16 = 989.4e12;
  p.peak_flops_fp32 = 66.9e12;
  p.matmul_efficiency = 0.7;
  p.attention_efficiency = 0.35;
  p.memory_bandwidth = 3.35e12;
  p.memory_efficiency = 0.8;
  p.kernel_overhead_s = 2e-6;
  p.host_launch_s = 6e-6;
  p.gpus_per_node = 8;
  p.intra_node_bandwidth = 360e9;
  p.inter_node_bandwidth = 40e9;
  p.collective_latency_s = 15e-6;
  p.intra_node_hop_s = 1e-6;
  p.inter_node_hop_s = 5e-6;
  p.host_link_bandwidth = 55e9;
  p.host_memory_bandwidth = 45e9;
  p.sources = "H100 SXM5 80 GB datasheet peaks; " + std::string(kSharedSources);
  return p;
}

DeviceProfile h100_hbm2e_500w() {
  DeviceProfile p = h100_sxm();
  p.name = "h100-hbm2e-500w";
  p.peak_flops_bf16 *= 0.85;
  p.peak_flops_fp32 *= 0.85;
  p.memory_bandwidth = 2.4e12;
  p.sources = "H100 SXM5 datasheet peaks at 0.85 for the 500 W cap, HBM2e at 2.4 TB/s (torchtitan's docs); " +
              std::string(kSharedSources);
  return p;
}

DeviceProfile h200_sxm() {
  DeviceProfile p = h100_sxm();
  p.name = "h200";
  p.memory_bandwidth = 4.8e12;
  p.sources = "H200 SXM 141 GB datasheet (H100's compute, HBM3e 4.8 TB/s); " + std::string(kSharedSources);
  return p;
}

void check_profile(const DeviceProfile& p) {
  const auto positive = [&](double v, const char* field) {
    TORCH_CHECK(v > 0 && std::isfinite(v), "fsdp_plan: device profile '", p.name, "' has ", field, " = ", v,
                "; it must be positive");
  };
  positive(p.peak_flops_bf16, "peak_flops_bf16");
  positive(p.peak_flops_fp32, "peak_flops_fp32");
  positive(p.matmul_efficiency, "matmul_efficiency");
  positive(p.attention_efficiency, "attention_efficiency");
  positive(p.memory_bandwidth, "memory_bandwidth");
  positive(p.memory_efficiency, "memory_efficiency");
  positive(p.intra_node_bandwidth, "intra_node_bandwidth");
  positive(p.inter_node_bandwidth, "inter_node_bandwidth");
  TORCH_CHECK(p.gpus_per_node >= 1, "fsdp_plan: device profile '", p.name, "' has gpus_per_node = ", p.gpus_per_node,
              "; it must be at least 1");
}

double kernel_seconds(const OpRecord& op, const DeviceProfile& p) {
  if (p.measured_kernels && op.call) {
    if (auto it = p.measured_kernels->find(measured_kernel_key(op)); it != p.measured_kernels->end()) {
      return it->second;
    }
  }
  const bool low_precision = op.dtype == c10::kBFloat16 || op.dtype == c10::kHalf;
  const double peak = low_precision ? p.peak_flops_bf16 : p.peak_flops_fp32;
  double compute = 0;
  if (op.attention) {
    compute = static_cast<double>(op.flops) / (peak * p.attention_efficiency);
  } else if (op.matmul) {
    compute = static_cast<double>(op.flops) / (peak * p.matmul_efficiency);
  }
  if (op.on_host && !p.host_computes) {
    TORCH_CHECK(p.host_memory_bandwidth > 0, "fsdp_plan: device profile '", p.name,
                "' has no host_memory_bandwidth, and ", op.name,
                " runs on the host (CPU offload's optimizer step); give the bytes/s one rank's CPU streams");
    return static_cast<double>(op.bytes) / p.host_memory_bandwidth + p.host_launch_s;
  }
  double memory = static_cast<double>(op.bytes) / (p.memory_bandwidth * p.memory_efficiency);
  if (op.host_link_bytes > 0 && !p.host_computes) {
    TORCH_CHECK(p.host_link_bandwidth > 0, "fsdp_plan: device profile '", p.name, "' has no host_link_bandwidth, and ",
                op.name, " copies between the host and the device (CPU offload); give the link's bytes/s");
    memory = std::max(memory, static_cast<double>(op.host_link_bytes) / p.host_link_bandwidth);
  }
  return std::max(compute, memory) + p.kernel_overhead_s;
}

// A ring over the group: n - 1 hops, each moving 1/n of the data, at the bus
// bandwidth of the slowest link the ring crosses.
double collective_seconds(const OpRecord& op, const DeviceProfile& p) {
  const int64_t n = op.group ? static_cast<int64_t>(op.group->size()) : 1;
  if (n <= 1 || op.bytes == 0) return p.collective_latency_s;
  std::set<int> nodes;
  for (int rank : *op.group) nodes.insert(rank / p.gpus_per_node);
  const bool crosses = nodes.size() > 1;
  const double bandwidth = crosses ? p.inter_node_bandwidth : p.intra_node_bandwidth;
  const double hop = crosses ? p.inter_node_hop_s : p.intra_node_hop_s;
  const double steps = static_cast<double>(n - 1);
  const double share = steps / static_cast<double>(n) * static_cast<double>(op.bytes) / bandwidth;
  const bool all_reduce = op.name.rfind("all_reduce", 0) == 0;
  return p.collective_latency_s + (all_reduce ? 2 : 1) * (steps * hop + share);
}

using Interval = std::pair<double, double>;

// The length of the union of `spans` within [from, to].
double covered(std::vector<Interval> spans, double from, double to) {
  std::sort(spans.begin(), spans.end());
  double total = 0, end = from;
  for (auto [s, e] : spans) {
    s = std::max(s, end);
    e = std::min(e, to);
    if (e > s) {
      total += e - s;
      end = e;
    }
  }
  return total;
}

// The length of `a`'s union within [from, to] not covered by `b`'s union.
double covered_only_by(const std::vector<Interval>& a, const std::vector<Interval>& b, double from, double to) {
  std::vector<Interval> both = a;
  both.insert(both.end(), b.begin(), b.end());
  return covered(both, from, to) - covered(b, from, to);
}

// The phases of a step partition its time at the compute stream (and the
// host's compute, CPU offload's optimizer step): forward until the first
// backward op starts computing, backward until the first optimizer op does
// (communication issued ahead of its phase, a prefetch, counts in the phase
// whose compute it overlaps).
void fill_phases(const std::vector<TimedOp>& ops, double from, double to, std::vector<PhaseTime>& rows) {
  double backward = to, optimizer = to;
  for (const TimedOp& op : ops) {
    if (op.collective || (op.stream != 0 && op.stream != kHostCompute)) continue;
    if (op.step_phase == StepPhase::kBackward) backward = std::min(backward, op.start_s);
    if (op.step_phase == StepPhase::kOptimizer) optimizer = std::min(optimizer, op.start_s);
  }
  backward = std::min(backward, optimizer);
  std::vector<Interval> compute, communication;
  for (const TimedOp& op : ops) (op.collective ? communication : compute).emplace_back(op.start_s, op.end_s);
  const std::pair<double, double> windows[] = {{from, backward}, {backward, optimizer}, {optimizer, to}};
  const StepPhase phases[] = {StepPhase::kForward, StepPhase::kBackward, StepPhase::kOptimizer};
  for (size_t i = 0; i < 3; ++i) {
    PhaseTime row;
    row.phase = phases[i];
    const auto [a, b] = windows[i];
    row.wall_s = b - a;
    row.compute_s = covered(compute, a, b);
    row.communication_s = covered(communication, a, b);
    row.exposed_s = covered_only_by(communication, compute, a, b);
    rows.push_back(row);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median time of `f` over `reps` runs after one warm-up.
template <typename F>
double median_seconds(int reps, F&& f) {
  f();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

const std::string& measured_kernel_key(const OpRecord& op) {
  static const std::string none;
  return op.call ? op.call->signature : none;
}

std::optional<DeviceProfile> device_profile(const std::string& name) {
  if (name == "h100") return h100_sxm();
  if (name == "h100-hbm2e-500w") return h100_hbm2e_500w();
  if (name == "h200") return h200_sxm();
  return std::nullopt;
}

std::vector<std::string> device_profile_names() { return {"h100", "h100-hbm2e-500w", "h200"}; }

namespace {

// Sets LibTorch's intra-op threads for its life; a thread the profile
// starts takes the setting with at::init_num_threads() (OpenMP keeps it
// per thread, and a new one starts with all the cores).
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) : previous_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~IntraOpThreads() { at::set_num_threads(previous_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  const int previous_;
};

// Threads that wait for each other at every step (std::barrier's
// arrive_and_wait, which C++17 lacks).
class StepBarrier {
 public:
  explicit StepBarrier(int threads) : threads_(threads) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == threads_) {
      arrived_ = 0;
      ++generation_;
      all_arrived_.notify_all();
      return;
    }
    all_arrived_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  const int threads_;
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

// Every distinct kernel of `ops` (by its call's signature), timed by `busy`
// threads at once, as that many of the job's ranks keep the cores busy
// side by side (their contention for the memory and the caches is measured,
// not modelled), and multiplied by `shared`, the ranks' threads per core
// beyond one: a kernel a few milliseconds long finishes within the
// scheduler's time slice, so timing more threads than cores would measure
// it unshared. Rank 0's times are kept. `untimed` counts the kernels left to
// the roofline.
std::shared_ptr<std::unordered_map<std::string, double>> time_distinct_kernels(const std::vector<OpRecord>& ops,
                                                                               int busy, double shared,
                                                                               int64_t& untimed) {
  std::vector<const OpRecord*> distinct;
  std::set<std::string> seen;
  for (const OpRecord& op : ops) {
    if (op.kind != OpRecord::Kind::kKernel) continue;
    if (!op.call || op.bytes > (int64_t{256} << 20)) {
      ++untimed;
      continue;
    }
    if (seen.insert(measured_kernel_key(op)).second) distinct.push_back(&op);
  }
  std::vector<std::vector<std::optional<double>>> times(static_cast<size_t>(busy));
  // The threads run each kernel in step: all evict the caches, then all run
  // it (one's eviction during another's timed run would be timed as
  // contention). Every thread runs the same calls, so all take the same
  // number of steps, an op that throws included.
  StepBarrier barrier(busy);
  const auto in_step = [&] {
    barrier.arrive_and_wait();
    detail::evict_caches();
    barrier.arrive_and_wait();
  };
  const auto time_all = [&](size_t rank) {
    at::init_num_threads();
    for (const OpRecord* op : distinct) times[rank].push_back(detail::time_call(*op->call, /*reps=*/5, in_step));
  };
  {
    std::vector<std::thread> others;
    for (size_t r = 1; r < times.size(); ++r) others.emplace_back(time_all, r);
    time_all(0);
    for (std::thread& t : others) t.join();
  }
  auto measured = std::make_shared<std::unordered_map<std::string, double>>();
  for (size_t i = 0; i < distinct.size(); ++i) {
    if (const std::optional<double>& seconds = times[0][i]) {
      (*measured)[measured_kernel_key(*distinct[i])] = *seconds * shared;
    } else {
      ++untimed;
    }
  }
  return measured;
}

// A training step of a chain of small layers (matmul, bias, SiLU forward;
// autograd's backward; a plain update of each weight): tensors so small that
// the step's time is almost all the host's work around the kernels.
void calibration_step(const std::vector<at::Tensor>& weights, const at::Tensor& input) {
  at::Tensor h = input;
  for (const at::Tensor& w : weights) h = at::silu(at::mm(h, w) + 1.0);
  h.sum().backward();
  at::NoGradGuard no_grad;
  for (const at::Tensor& w : weights) {
    w.sub_(w.grad(), 1e-3);
    w.mutable_grad().zero_();
  }
}

// [Note: the host's cost per kernel on a CPU] A step on a CPU is its kernels
// and the host's work around each: the dispatcher, autograd's graph (its
// nodes made in forward, run by its engine in backward), the allocator and
// the tensors' bookkeeping. Timing a kernel alone (time_call) counts only
// the first. So the profile runs a calibration step (calibration_step),
// records its kernels with a dry run of it (the plan's own definition of a
// kernel), and takes the step's time less its kernels' times, per kernel
// (a kernel that cannot run again alone counts `untimed_kernel_s`, an op's
// fixed cost).
// FSDP's own host work (its hooks, the copy-in's bookkeeping, issuing and
// waiting for the engine's collectives) is not in it.
double measure_host_cost_per_kernel(double untimed_kernel_s) {
  constexpr int kLayers = 16;
  const auto make_inputs = [] {
    std::vector<at::Tensor> weights;
    for (int i = 0; i < kLayers; ++i) weights.push_back(at::randn({8, 8}).requires_grad_(true));
    return std::make_pair(weights, at::randn({4, 8}));
  };
  std::vector<OpRecord> ops;
  {
    DryRunOptions options;
    options.engine = fsdp::collectives::BackendKind::kGloo;
    DryRun dry(options);
    const auto [weights, input] = make_inputs();
    calibration_step(weights, input);
    dry.begin(StepPhase::kForward);
    calibration_step(weights, input);
    for (const OpRecord& op : dry.ops()) {
      if (op.step == 1 && op.kind == OpRecord::Kind::kKernel) ops.push_back(op);
    }
  }
  TORCH_CHECK(!ops.empty(), "fsdp_plan: the CPU profile's calibration step recorded no kernel");
  double kernels_s = 0;
  for (const OpRecord& op : ops) {
    // Its tensors are tiny and stay in cache in the step as well.
    const std::optional<double> seconds =
        op.call ? detail::time_call(*op.call, /*reps=*/5, /*before_run=*/[] {}) : std::nullopt;
    kernels_s += seconds.value_or(untimed_kernel_s);
  }
  const auto [weights, input] = make_inputs();
  const double step_s = median_seconds(21, [&] { calibration_step(weights, input); });
  return std::max(0.0, (step_s - kernels_s) / static_cast<double>(ops.size()));
}

// [Note: Gloo's costs under load] What the engine of a CPU job costs on
// this machine: Gloo over loopback between `ranks` ranks (threads of this
// process, as many as the job's ranks on this machine). Between idle ranks
// a collective of a few bytes takes a few hundred microseconds; in a step it
// takes more, because the ranks compute between their collectives and reach
// each at different times, and with more ranks than cores much more: a rank
// that has reached the collective waits in Gloo while a peer without a
// core still computes, and the longer the computing between collectives,
// the longer that wait. So each rank computes a burst of small matmuls
// before each collective, as a step does, and a collective's cost is what
// the burst and the collective take together less what the burst takes
// with the cores shared evenly (`shared` threads per core). Two burst lengths
// give the cost's intercept (the latency) and its growth per second of
// computing before the collective (DeviceProfile::collective_wait_per_compute);
// a large all-gather gives the bus bandwidth (the ring formula of
// collective_seconds solved for it, at most `max_bandwidth`); the host's
// time to issue one is timed apart. Rank 0's medians.
struct GlooCosts {
  double issue_s = 0, latency_s = 0, wait_per_compute = 0, bandwidth = 0;
};

GlooCosts measure_gloo(int ranks, double shared, double max_bandwidth) {
  constexpr int kReps = 61;
  constexpr int64_t kLargeElements = int64_t{1} << 18;     // 1 MiB of float32 per rank
  constexpr double kShortBurst = 1e-3, kLongBurst = 6e-3;  // computing alone before each collective
  // Each rank computes with the job's intra-op threads (at::init_num_threads
  // below), as its kernels do; `shared` counts those threads per core.
  const at::Tensor a = at::randn({64, 64});
  const auto burst = [&a](int matmuls) {
    for (int i = 0; i < matmuls; ++i) (void)at::mm(a, a);
  };
  const double matmul_s = median_seconds(9, [&] { burst(100); }) / 100;
  const auto matmuls_for = [&](double seconds) { return std::max(1, static_cast<int>(seconds / matmul_s)); };
  struct Series {
    int64_t elements;
    int matmuls;
    std::vector<double> costs;  // the cycle less the burst with the cores shared evenly
  };
  auto store = c10::make_intrusive<c10d::HashStore>();
  GlooCosts costs;
  const auto rank_body = [&](int rank) {
    at::init_num_threads();
    fsdp::collectives::RendezvousOptions rendezvous;
    rendezvous.divergence.strict = false;
    const auto world = fsdp::collectives::World::from_store(store, rank, ranks, "fsdp_plan's CPU profile", rendezvous);
    const auto comm = world->new_group(world->all_ranks(), c10::kCPU);
    std::vector<Series> series = {{2, matmuls_for(kShortBurst), {}},
                                  {2, matmuls_for(kLongBurst), {}},
                                  {kLargeElements, matmuls_for(kShortBurst), {}}};
    std::vector<double> issue;
    for (Series& s : series) {
      const at::Tensor input = at::ones({s.elements});
      const at::Tensor output = at::empty({s.elements * ranks});
      const double burst_shared_s = shared * s.matmuls * matmul_s;
      for (int i = 0; i < kReps + 2; ++i) {
        const auto start = std::chrono::steady_clock::now();
        burst(s.matmuls);
        const auto issuing = std::chrono::steady_clock::now();
        fsdp::collectives::Work work = comm->all_gather_into_tensor(output, input);
        const double issued = seconds_since(issuing);
        work.wait();
        if (i < 2) continue;  // warm-up: connections, buffers
        s.costs.push_back(seconds_since(start) - burst_shared_s);
        issue.push_back(issued);
      }
    }
    comm->barrier().wait();
    if (rank != 0) return;
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double short_s = series[0].matmuls * matmul_s, long_s = series[1].matmuls * matmul_s;
    const double short_cost = median(series[0].costs), long_cost = median(series[1].costs);
    costs.issue_s = median(issue);
    costs.wait_per_compute = long_s > short_s ? std::max(0.0, (long_cost - short_cost) / (long_s - short_s)) : 0.0;
    costs.latency_s = std::max(short_cost - costs.wait_per_compute * short_s, costs.issue_s);
    const double n = ranks;
    // Loopback copies each byte at least twice (into the socket and out of
    // it): a noisy difference of medians cannot make it faster than that.
    const double moving_s = median(series[2].costs) - short_cost;
    const double bytes = (n - 1) / n * static_cast<double>(kLargeElements * ranks * 4);
    costs.bandwidth = moving_s > bytes / max_bandwidth ? bytes / moving_s : max_bandwidth;
  };
  // A rank that throws (Gloo cannot connect) makes its peers throw at the
  // timeout; the first error is rethrown.
  std::vector<std::exception_ptr> errors(static_cast<size_t>(ranks));
  const auto guarded = [&](int rank) {
    try {
      rank_body(rank);
    } catch (...) {
      errors[static_cast<size_t>(rank)] = std::current_exception();
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < ranks; ++r) others.emplace_back(guarded, r);
  guarded(0);
  for (std::thread& t : others) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return costs;
}

// The roofline of this CPU for the kernels that cannot run again: a float32
// matmul of the trainer's sizes, a causal attention, a copy much larger than
// the caches, and an op on one element (the fixed cost), divided among
// `oversubscribed` ranks per core.
void measure_roofline(double oversubscribed, DeviceProfile& p) {
  const at::Tensor a = at::randn({256, 256}), b = at::randn({256, 256});
  const double matmul_rate = 2.0 * 256 * 256 * 256 / median_seconds(9, [&] { (void)at::mm(a, b); });
  const at::Tensor q = at::randn({1, 4, 256, 32});
  const double attention_s =
      median_seconds(9, [&] { (void)at::scaled_dot_product_attention(q, q, q, {}, 0.0, /*is_causal=*/true); });
  const double attention_rate = 4.0 * 4 * 256 * 256 * 32 / 2 / attention_s;
  const at::Tensor big = at::ones({8 << 20});
  at::Tensor copy = at::empty({8 << 20});
  const double copy_s = median_seconds(5, [&] { copy.copy_(big); });
  const at::Tensor one = at::ones({1});
  const double op_s = median_seconds(201, [&] { (void)at::add(one, one); });
  p.peak_flops_fp32 = matmul_rate / oversubscribed;
  p.peak_flops_bf16 = p.peak_flops_fp32;  // bf16 on a CPU: measured as fp32 (an estimate)
  p.matmul_efficiency = 1;
  p.attention_efficiency = attention_rate / matmul_rate;
  p.memory_bandwidth = 2.0 * static_cast<double>(big.nbytes()) / copy_s / oversubscribed;
  p.memory_efficiency = 1;
  p.kernel_overhead_s = op_s * oversubscribed;
}

}  // namespace

DeviceProfile measure_cpu_profile(int ranks, int threads, const std::vector<OpRecord>& ops) {
  TORCH_CHECK(ranks >= 1 && threads >= 1, "fsdp_plan: measure_cpu_profile needs ranks >= 1 and threads >= 1 (got ",
              ranks, " and ", threads, ")");
  // Gloo's figures come from as many ranks (threads of this process, each
  // connected to every other) as the job runs on this machine.
  TORCH_CHECK(ranks <= 64,
              "fsdp_plan: a CPU profile measures a job whose ranks all run on this machine, at most 64 "
              "ranks (got ",
              ranks, "); plan a larger job on a GPU profile");
  const IntraOpThreads intra_op(threads);
  DeviceProfile p;
  p.name = "cpu";
  p.host_computes = true;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  const double shared = std::max(1.0, static_cast<double>(ranks) * threads / cores);
  p.threads_per_core = shared;
  measure_roofline(shared, p);
  int64_t untimed = 0;
  const int busy = std::clamp(static_cast<int>(cores) / threads, 1, ranks);
  p.measured_kernels = time_distinct_kernels(ops, busy, shared, untimed);
  p.host_launch_s = measure_host_cost_per_kernel(p.kernel_overhead_s / shared) * shared;
  // A job of one rank issues no collective.
  p.gpus_per_node = 1 << 20;
  p.intra_node_hop_s = 0;
  p.inter_node_hop_s = 0;
  if (ranks > 1) {
    const GlooCosts gloo = measure_gloo(ranks, shared, p.memory_bandwidth / 2);
    p.host_collective_s = gloo.issue_s;
    p.collective_latency_s = gloo.latency_s;
    p.collective_wait_per_compute = gloo.wait_per_compute;
    p.intra_node_bandwidth = p.inter_node_bandwidth = gloo.bandwidth;
  } else {
    p.intra_node_bandwidth = p.inter_node_bandwidth = p.memory_bandwidth;
  }
  char sources[480];
  std::snprintf(sources, sizeof(sources),
                "measured now with %d threads for %d ranks on %.0f cores: %zu distinct kernels timed (%lld by the "
                "roofline: %.1f GFLOP/s, %.1f GB/s, %.1f us per op), %.1f us of host work per kernel; Gloo: %.0f us "
                "per collective (%.0f us to issue) and %.2f s per s of computing before it, %.2f GB/s",
                threads, ranks, cores, p.measured_kernels->size(), static_cast<long long>(untimed),
                p.peak_flops_fp32 / 1e9, p.memory_bandwidth / 1e9, p.kernel_overhead_s * 1e6, p.host_launch_s * 1e6,
                p.collective_latency_s * 1e6, p.host_collective_s * 1e6, p.collective_wait_per_compute,
                p.intra_node_bandwidth / 1e9);
  p.sources = sources;
  return p;
}

std::string stream_name(int stream) {
  switch (stream) {
    case 0: return "compute";
    case 1: return "all-gather copy-in";
    case 2: return "all-gather";
    case 3: return "reduce-scatter";
    case 4: return "all-reduce";
    case kCollectiveStream: return "collectives of the compute stream";
    case kHostCompute: return "host (CPU offload's compute)";
  }
  return "stream " + std::to_string(stream);
}

namespace {

// The discrete-event simulation: every op of `ops` on the timeline, in order.
std::vector<TimedOp> run_timeline(const std::vector<OpRecord>& ops, const DeviceProfile& p) {
  std::vector<TimedOp> out;
  out.reserve(ops.size());
  std::vector<double> stream_free(kStreamCount, 0.0), stream_end(kStreamCount, 0.0);
  // NCCL runs a communicator's collectives in issue order on its one
  // internal stream, whichever FSDP stream issued them: a prefetched
  // all-gather and a reduce-scatter of the same group of ranks queue behind
  // each other. Keyed by the group's record (one per communicator).
  std::unordered_map<const void*, double> communicator_free;
  std::unordered_map<int64_t, double> written_at, accessed_at;  // by allocation: when its last writer / accessor ends
  double host = 0;
  // [Note: FSDP's event edges in the simulation] Beyond data, the runtime's
  // events order its streams. A CUDA job's dry run records them
  // (OpRecord::after, host_after) and they are followed as recorded. Without
  // them (a dry run without streams, or ops made by hand) the two that
  // matter are inferred (fsdp_param_group.cc): after each copy-out the
  // all-gather copy-in and all-gather streams wait for it, so an all-gather
  // runs at most one group ahead of the compute; and before a group's
  // reduce-scatter copy-in the compute stream waits for the previous group's
  // reduce-scatter (FSDP2's one reduce-scatter input in flight). Both are
  // kept as the end of the last such op issued.
  const bool events_recorded = std::any_of(
      ops.begin(), ops.end(), [](const OpRecord& op) { return !op.after.empty() || !op.host_after.empty(); });
  const auto end_of = [&out](int64_t index) {
    return index >= 0 && static_cast<size_t>(index) < out.size() ? out[static_cast<size_t>(index)].end_s : 0.0;
  };
  double copy_out_end = 0, reduce_scatter_end = 0;
  // On a CPU: the host's computing since it issued its last collective
  // (DeviceProfile::collective_wait_per_compute).
  double computed_since_collective = 0;
  for (const OpRecord& op : ops) {
    const bool collective = op.kind == OpRecord::Kind::kCollective;
    // On a CPU the kernels run on the host thread and the engine runs every
    // collective in turn on its worker.
    int stream = std::clamp(op.stream, 0, kCollectiveStream);
    if (p.host_computes) stream = collective ? 2 : 0;
    // A GPU job's kernel on host tensors only (CPU offload's optimizer step)
    // runs on the host thread, which issues nothing meanwhile.
    const bool on_cpu = op.on_host && !p.host_computes && !collective;
    if (on_cpu) stream = kHostCompute;
    double ready = 0;
    for (int64_t a : op.reads) {
      if (auto it = written_at.find(a); it != written_at.end()) ready = std::max(ready, it->second);
    }
    for (int64_t a : op.writes) {
      if (auto it = accessed_at.find(a); it != accessed_at.end()) ready = std::max(ready, it->second);
    }
    if (events_recorded) {
      for (int64_t k : op.after) ready = std::max(ready, end_of(k));
      for (int64_t k : op.host_after) host = std::max(host, end_of(k));
    } else if (!p.host_computes) {
      if (stream == 1 || stream == 2) ready = std::max(ready, copy_out_end);
      if (op.fsdp_phase.rfind("FSDP::reduce_scatter_copy_in", 0) == 0) ready = std::max(ready, reduce_scatter_end);
    }
    TimedOp t{op.name, op.fsdp_phase, op.step, op.step_phase, stream, collective, host, 0, 0, op.flops, op.bytes};
    // On a CPU the host's own work around a kernel (host_launch_s) delays
    // the next op as the kernel does.
    double cost =
        collective ? collective_seconds(op, p) : kernel_seconds(op, p) + (p.host_computes ? p.host_launch_s : 0.0);
    // A CPU's collective waits for its peers (the latency and the wait that
    // grows with the computing before it); the engine moves the next
    // collective's bytes meanwhile, so the waits of collectives issued back
    // to back overlap, and only the moving occupies the engine.
    double waiting = 0;
    if (p.host_computes) {
      if (collective) {
        const double late_peers = p.collective_wait_per_compute * computed_since_collective;
        cost += late_peers;
        waiting = std::min(cost, p.collective_latency_s + late_peers);
        computed_since_collective = 0;
      } else {
        computed_since_collective += cost;
      }
    }
    if ((p.host_computes && !collective) || on_cpu) {
      t.start_s = std::max(host, ready);
      host = t.start_s + cost;
    } else {
      host += collective && p.host_computes ? p.host_collective_s : p.host_launch_s;
      t.start_s = std::max({host, ready, stream_free[static_cast<size_t>(stream)]});
      double* communicator = collective && op.group ? &communicator_free[op.group.get()] : nullptr;
      if (communicator != nullptr) t.start_s = std::max(t.start_s, *communicator);
      stream_free[static_cast<size_t>(stream)] = t.start_s + cost - waiting;
      if (communicator != nullptr) *communicator = t.start_s + cost - waiting;
    }
    // A stream's ops end in their order.
    t.end_s = std::max(t.start_s + cost, stream_end[static_cast<size_t>(stream)]);
    stream_end[static_cast<size_t>(stream)] = t.end_s;
    if (op.fsdp_phase.rfind("FSDP::all_gather_copy_out", 0) == 0) copy_out_end = std::max(copy_out_end, t.end_s);
    if (collective && stream == 3) reduce_scatter_end = t.end_s;
    for (int64_t a : op.reads) accessed_at[a] = std::max(accessed_at[a], t.end_s);
    for (int64_t a : op.writes) {
      written_at[a] = t.end_s;
      accessed_at[a] = std::max(accessed_at[a], t.end_s);
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

StepTime simulate(const std::vector<OpRecord>& ops, int64_t step, const TimelineOptions& options) {
  const DeviceProfile& p = options.device;
  check_profile(p);
  std::set<int64_t> steps;
  for (const OpRecord& op : ops) steps.insert(op.step);
  TORCH_CHECK(steps.count(step) > 0, "fsdp_plan: simulate: no op of step ", step,
              " was recorded (steps present: ", c10::Join(", ", std::vector<int64_t>(steps.begin(), steps.end())),
              "); run that many steps in the dry run");
  StepTime out;
  out.device = p.name;
  out.step = step;
  out.ops = run_timeline(ops, p);

  double from = 0, to = 0;
  std::vector<Interval> compute, communication;
  std::vector<TimedOp> of_step;
  for (const TimedOp& t : out.ops) {
    if (t.step < step) from = std::max(from, t.end_s);
    if (t.step != step) continue;
    to = std::max(to, t.end_s);
    (t.collective ? communication : compute).emplace_back(t.start_s, t.end_s);
    out.flops += t.flops;
    of_step.push_back(t);
  }
  out.step_s = to - from;
  out.compute_s = covered(compute, from, to);
  out.communication_s = covered(communication, from, to);
  out.exposed_communication_s = covered_only_by(communication, compute, from, to);
  out.tokens = options.tokens;
  if (out.step_s > 0) {
    out.tokens_per_s = static_cast<double>(options.tokens) / out.step_s;
    out.mfu = options.model_flops / (out.step_s * p.peak_flops_bf16);
  }
  fill_phases(of_step, from, to, out.phases);
  return out;
}

std::string format_time(const StepTime& t) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line), "  step time       %.1f ms (step %lld, simulated on %s)\n", t.step_s * 1e3,
                static_cast<long long>(t.step), t.device.c_str());
  out += line;
  if (t.tokens > 0) {
    std::snprintf(line, sizeof(line), "  throughput      %.0f tokens/s per rank (%lld tokens per step)\n",
                  t.tokens_per_s, static_cast<long long>(t.tokens));
    out += line;
  }
  if (t.mfu > 0) {
    std::snprintf(line, sizeof(line), "  MFU             %.1f%% (model FLOPs over the bf16 peak)\n", 100 * t.mfu);
    out += line;
  }
  std::snprintf(line, sizeof(line), "  compute         %.1f ms busy, %.2f TFLOP executed\n", t.compute_s * 1e3,
                static_cast<double>(t.flops) / 1e12);
  out += line;
  std::snprintf(line, sizeof(line), "  communication   %.1f ms busy, %.1f ms exposed (%.1f%% of the step)\n",
                t.communication_s * 1e3, t.exposed_communication_s * 1e3,
                t.step_s > 0 ? 100 * t.exposed_communication_s / t.step_s : 0.0);
  out += line;
  out += "  phase           wall ms   compute ms   comm ms   exposed ms\n";
  for (const PhaseTime& r : t.phases) {
    std::snprintf(line, sizeof(line), "    %-12s %9.1f %12.1f %9.1f %12.1f\n", to_string(r.phase).c_str(),
                  r.wall_s * 1e3, r.compute_s * 1e3, r.communication_s * 1e3, r.exposed_s * 1e3);
    out += line;
  }
  return out;
}

std::string time_json(const StepTime& t) {
  nlohmann::ordered_json phases = nlohmann::ordered_json::array();
  for (const PhaseTime& r : t.phases) {
    phases.push_back({{"phase", to_string(r.phase)},
                      {"wall_s", r.wall_s},
                      {"compute_s", r.compute_s},
                      {"communication_s", r.communication_s},
                      {"exposed_s", r.exposed_s}});
  }
  const nlohmann::ordered_json j = {{"device", t.device},
                                    {"step", t.step},
                                    {"step_s", t.step_s},
                                    {"tokens_per_step", t.tokens},
                                    {"tokens_per_s", t.tokens_per_s},
                                    {"mfu", t.mfu},
                                    {"compute_s", t.compute_s},
                                    {"communication_s", t.communication_s},
                                    {"exposed_communication_s", t.exposed_communication_s},
                                    {"flops", t.flops},
                                    {"phases", phases}};
  return j.dump(2);
}

std::string chrome_trace(const StepTime& t) {
  nlohmann::json events = nlohmann::json::array();
  const auto row_name = [](int tid, const std::string& name) {
    return nlohmann::json{{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", tid}, {"args", {{"name", name}}}};
  };
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "simulated rank (" + t.device + ")"}}}});
  for (int s = 0; s < kStreamCount; ++s) events.push_back(row_name(s + 1, stream_name(s)));
  // Time 0 is the step's first op starting (a prefetch may start before the
  // previous step's last op ends).
  double origin = INFINITY;
  for (const TimedOp& op : t.ops) {
    if (op.step == t.step) origin = std::min(origin, op.start_s);
  }
  for (const TimedOp& op : t.ops) {
    if (op.step != t.step) continue;
    const std::string name = op.name.rfind("aten::", 0) == 0 ? op.name.substr(6) : op.name;
    events.push_back({{"name", name},
                      {"cat", op.collective ? "communication" : "compute"},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", op.stream + 1},
                      {"ts", (op.start_s - origin) * 1e6},
                      {"dur", (op.end_s - op.start_s) * 1e6},
                      {"args",
                       {{"fsdp_phase", op.fsdp_phase},
                        {"step_phase", to_string(op.step_phase)},
                        {"flops", op.flops},
                        {"bytes", op.bytes}}}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace fsdp_plan
