// Communicator: collectives over one process group, on a real c10d engine.
//
// A Communicator is bound to a group of global ranks and to a device type.
// CPU communicators use c10d's Gloo; CUDA communicators use NCCL unless
// CommunicatorOptions::backend asks for Gloo (Gloo also moves CUDA tensors,
// which is how several ranks share one GPU in tests, as NCCL cannot).
// Communicators are made by World::new_group (world.h), collectively by the
// members of the group.
//
// Size conventions (NCCL's): for a group of size N,
//   all_gather_into_tensor:  output.numel() == N * input.numel(); rank r's
//                            input lands at output[r*n : (r+1)*n] (rank-major);
//   reduce_scatter_tensor:   input.numel() == N * output.numel(); rank r gets
//                            the reduction of input[r*n : (r+1)*n].
// Tensors must be contiguous, on the communicator's device type, and of the
// same dtype as each other. In-place use is allowed where NCCL allows it:
// the input of all_gather_into_tensor may be output's rank-r slice, and the
// output of reduce_scatter_tensor may be input's rank-r slice.
//
// Reductions: see reduce_op.h. AVG and PREMUL_SUM need floating-point (or
// complex) tensors; for integer dtypes they throw, since backends would round
// an integer average differently (reduce with SUM and divide yourself).
//
// Errors: every argument is checked before anything is enqueued (defined,
// on device_type(), dense and contiguous, equal dtypes, the size relations
// above); a violation throws c10::Error naming the operation, the
// communicator, the expected and the actual value.
//
// Streams: see work.h. Every method returns once the collective is enqueued.
// A Communicator is not thread-safe: issue collectives from one thread, in the
// same order on every member.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include "collectives/reduce_op.h"
#include "collectives/work.h"

namespace c10d {
class Backend;
}

namespace fsdp::collectives {

namespace detail {
class DivergenceMonitor;
}

enum class BackendKind {
  kAuto,  // Gloo for CPU, NCCL for CUDA
  kGloo,
  kNccl,
};

std::string to_string(BackendKind kind);

// 5 minutes, or FSDP2CPP_COLLECTIVE_TIMEOUT_S seconds (a positive decimal)
// when set, as fsdprun --collective-timeout sets it for every rank. Throws
// c10::Error naming the variable when it is malformed.
std::chrono::milliseconds default_collective_timeout();

struct CommunicatorOptions {
  BackendKind backend = BackendKind::kAuto;
  // Upper bound for any one collective; a peer that died or never joins
  // makes the survivors fail after this long, never hang. The default is
  // default_collective_timeout(). Ranks that stop issuing the same
  // collectives are usually stopped much earlier, by the divergence timeout
  // (divergence.h).
  std::chrono::milliseconds timeout = default_collective_timeout();
  // For Gloo: the network interface to use (GLOO_SOCKET_IFNAME overrides);
  // empty means the interface of the rendezvous host (loopback for local runs).
  std::string gloo_interface;
};

class Communicator {
 public:
  virtual ~Communicator();

  // This rank's index in the group, in [0, size()).
  int rank() const { return rank_; }
  // Number of ranks in the group.
  int size() const { return static_cast<int>(global_ranks_.size()); }
  // Global ranks of the members, in group-rank order.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  c10::DeviceType device_type() const { return device_type_; }
  // The engine whose semantics the communicator follows: its in-place rules,
  // native reductions and wait contract (work.h). While a stream-order
  // checker models NCCL (stream_check.h, docs/gpu.md) a CPU communicator
  // reports kNccl, and follows NCCL's wait contract, while Gloo moves its
  // bytes.
  BackendKind backend_kind() const;
  // The engine that moves the bytes: backend_kind() except in that model.
  BackendKind engine_kind() const { return backend_kind_; }
  // A stable, human-readable name, "<backend>[<global ranks>]" ("gloo[0,2]"),
  // used in errors and logs.
  const std::string& name() const { return name_; }
  // name() and which of the groups over these ranks this is, "gloo[0,2]#1":
  // unique in the World, the same on every member; flight records and
  // divergence diagnoses name communicators by it (divergence.h).
  const std::string& id() const { return id_; }
  // CommunicatorOptions::timeout: what the engine waits at most for a peer.
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  // Collectives issued so far (the sequence number of the last one).
  int64_t issued() const { return next_seq_; }

  // REQUIRES: output.numel() == size() * input.numel(); both contiguous, same
  // dtype, on device_type().
  Work all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input);

  // REQUIRES: input.numel() == size() * output.numel(); both contiguous, same
  // dtype, on device_type().
  // Gloo on CPU (size() > 1): the chunks are exchanged with one all-to-all and
  // reduced in wait(), on the waiting thread ([Note: Gloo reduce-scatter] in
  // communicator.cc); the input is not read after wait() returns.
  Work reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input, ReduceOp op);

  // In place on `tensor`.
  Work all_reduce(const at::Tensor& tensor, ReduceOp op);

  // In place: the root's `tensor` is copied to every rank's `tensor`.
  // REQUIRES: 0 <= root < size() (group rank).
  Work broadcast(const at::Tensor& tensor, int root);

  Work barrier();

  // Several all-gathers (or reduce-scatters) as one call, each pair obeying
  // the single-tensor conventions (pairs may differ in size and dtype). NCCL
  // runs them as one coalesced group; Gloo issues them back to back (and
  // reduces each reduce-scatter's chunks in wait(), as above). One Work
  // covers all of them; empty lists give an already-completed Work.
  Work all_gather_into_tensor_coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs);
  Work reduce_scatter_tensor_coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                       ReduceOp op);

  // The engine underneath, for what this interface does not cover.
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return backend_; }

  // Internal: made by World::new_group. `monitor` (the World's; may be null)
  // records every collective and diagnoses waits that block too long; `id`
  // defaults to name().
  Communicator(c10::intrusive_ptr<c10d::Backend> backend, BackendKind kind, c10::DeviceType device_type, int rank,
               std::vector<int> global_ranks, CommunicatorOptions options,
               std::shared_ptr<detail::DivergenceMonitor> monitor = nullptr, std::string id = "");

 private:
  void check_tensor(const at::Tensor& t, const char* op, const char* arg) const;
  // Checks pair `i` of a coalesced call: both tensors, equal dtypes, and the
  // larger one (output for all-gather, input for reduce-scatter) holding
  // size() times the other's elements.
  void check_coalesced_pair(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, size_t i,
                            bool output_is_larger, const char* op) const;
  // True when the engine computes `op` correctly for this collective itself.
  bool native_op(const ReduceOp& op) const;
  // Numbers the collective about to be issued, records it in the flight
  // recorder, and in strict mode checks that every member issues the same
  // (divergence.h). Returns the record's id (0 without a monitor). `op` is a
  // literal.
  int64_t begin_collective(const char* op, const char* reduction, const std::vector<at::Tensor>& inputs);
  void check_strict(int64_t record, const char* op, const char* reduction, const std::vector<at::Tensor>& inputs);
  // `work` with its flight record attached.
  Work recorded(Work work, int64_t record) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  BackendKind backend_kind_;  // the engine's
  c10::DeviceType device_type_;
  int rank_;
  std::vector<int> global_ranks_;
  CommunicatorOptions options_;
  std::string name_;
  std::shared_ptr<detail::DivergenceMonitor> monitor_;
  std::string id_;
  int recorder_index_ = -1;
  int64_t next_seq_ = 0;
};

}  // namespace fsdp::collectives
