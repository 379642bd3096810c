// World: the result of a rendezvous, and the factory of process groups.
//
// A World knows this process's global rank, the world size, its local rank
// on the node, and a c10d Store shared by all ranks. It creates Communicators
// for any subset of ranks (examples/downstream/main.cc):
//
//   auto world = fsdp::collectives::World::from_env();
//   ...
//   auto metrics = world->new_group(world->all_ranks(), c10::kCPU);
//   ...
//   metrics->all_reduce(global_loss, fsdp::collectives::ReduceOp::avg()).wait();
//
// Rendezvous methods:
//   env://   MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (required) and
//            LOCAL_RANK, LOCAL_WORLD_SIZE (optional) as torchrun and
//            Kubernetes launchers set them, or, when RANK is unset, srun's
//            SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
//            SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE (MASTER_ADDR and
//            MASTER_PORT are still needed: srun does not set them); rank 0 hosts a
//            c10d TCPStore at MASTER_ADDR:MASTER_PORT, unless
//            TORCHELASTIC_USE_AGENT_STORE=True says torchrun's agent hosts
//            it (then every rank joins it, under the prefix of
//            TORCHELASTIC_RESTART_COUNT's attempt, as torch.distributed does).
//   file://  a c10d FileStore at a path every rank can see (tests).
// Every rendezvous waits until all ranks have checked in, and fails with an
// error naming the rendezvous and the ranks that are missing after
// `timeout`; it never hangs.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include "collectives/communicator.h"
#include "collectives/divergence.h"
#include "collectives/flight_recorder.h"

namespace c10d {
class Store;
}

namespace fsdp::collectives {

namespace detail {
class DivergenceMonitor;
}

// What an env:// rendezvous reads from the environment, before it connects.
struct EnvRendezvousSpec {
  std::string master_addr;
  int master_port = 0;
  int rank = 0;
  int world_size = 1;
  // -1 when the launcher did not say.
  int local_rank = -1;
  int local_world_size = -1;
  // "torchrun" (RANK, WORLD_SIZE, ...) or "srun" (SLURM_PROCID, ...).
  std::string launcher;
};

// Reads the env:// variables: torchrun's when RANK is set, else srun's when
// SLURM_PROCID is set. Under srun the local world size is
// SLURM_NTASKS_PER_NODE, else this node's entry of SLURM_TASKS_PER_NODE
// ("2(x3),1": 2 tasks on each of nodes 0-2, 1 on node 3; SLURM_NODEID picks
// the entry), else unknown. Throws c10::Error naming the missing or
// malformed variable.
EnvRendezvousSpec env_rendezvous_spec();

struct RendezvousOptions {
  // How long to wait for every rank to join the rendezvous.
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  // The flight recorder and the diagnosis of ranks that stopped issuing the
  // same collectives (divergence.h), for every communicator the World makes.
  DivergenceOptions divergence = DivergenceOptions::from_env();
  // Makes the communicators of new_group and shared_group instead of an
  // engine, without the members' store barrier: for a simulated world whose
  // groups move no bytes (the planner's dry run, fsdp_plan/dry_run.h), and
  // which may be on any device type. Called with the checked member list
  // (global ranks, in group-rank order) and the device type. Empty: the
  // engines, as below.
  std::function<std::shared_ptr<Communicator>(const std::vector<int>& ranks, c10::DeviceType device_type)> group_maker;
};

class World {
 public:
  // env:// rendezvous over env_rendezvous_spec() (torchrun or srun). Throws
  // c10::Error naming the missing or malformed variable, or the ranks that
  // did not join within `options.timeout`.
  static std::shared_ptr<World> from_env(const RendezvousOptions& options = {});

  // file:// rendezvous through a FileStore at `path`. The file must not hold
  // a previous run's keys (use a fresh path per run).
  static std::shared_ptr<World> from_file(const std::string& path, int rank, int world_size,
                                          const RendezvousOptions& options = {});

  // Rendezvous over a store the caller made (TCPStore, FileStore, ...).
  // `description` names the rendezvous in errors.
  static std::shared_ptr<World> from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                           std::string description, const RendezvousOptions& options = {},
                                           int local_rank = -1, int local_world_size = -1);

  ~World();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // LOCAL_RANK / LOCAL_WORLD_SIZE, or rank / size when not given.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  std::vector<int> all_ranks() const;
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  const std::string& description() const { return description_; }
  // The record of every collective issued on this World's communicators
  // (flight_recorder.h).
  FlightRecorder& flight_recorder();

  // Creates a communicator over `ranks` (global ranks, in group-rank order).
  // Collective over the members of `ranks` only: every member calls it, in
  // the same order relative to its other new_group calls with the same
  // ranks; non-members do not call it. Throws when this rank is not in
  // `ranks`, on duplicates or out-of-range ranks, or when `device_type` has
  // no engine in this build (NCCL needs a CUDA build and a GPU).
  //
  // Gloo binds to the interface(s) in GLOO_SOCKET_IFNAME, else to
  // options.gloo_interface, else to 127.0.0.1 when MASTER_ADDR is unset or a
  // loopback address (local runs, file://), else to the address this host's
  // name resolves to. Gloo groups connect here and fail after
  // options.timeout, naming the members that never called new_group. It
  // returns once every member's engine is up (a store barrier), so a group
  // may be dropped right after creation without breaking its peers.
  // NCCL groups bind to the current CUDA device: set it first.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks, c10::DeviceType device_type,
                                          const CommunicatorOptions& options = {});

  // Like new_group, but returns the communicator an earlier shared_group call
  // made for the same ranks, device type and backend while it is still alive
  // (no communication then). For runtimes that need a group per module
  // (fsdp2's reshard-after-forward groups) without making one per module.
  // The members must agree on whether the group already exists, which they
  // do when they make the same calls in the same order.
  std::shared_ptr<Communicator> shared_group(const std::vector<int>& ranks, c10::DeviceType device_type,
                                             const CommunicatorOptions& options = {});

 private:
  World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int local_rank, int local_size,
        std::string description);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  int local_rank_;
  int local_size_;
  std::string description_;
  std::string master_addr_;
  // How many groups with the same member list this process created; part of
  // each group's store prefix so that two groups over the same ranks never
  // share rendezvous keys. Members create groups in the same order, so the
  // counts agree across ranks without communication.
  std::mutex mutex_;
  std::map<std::string, int> group_counts_;
  // Groups made by shared_group, by member list, device type and backend.
  std::map<std::string, std::weak_ptr<Communicator>> shared_groups_;
  // RendezvousOptions::group_maker.
  std::function<std::shared_ptr<Communicator>(const std::vector<int>&, c10::DeviceType)> group_maker_;
  // Shared with the communicators, which may outlive the World.
  std::shared_ptr<detail::DivergenceMonitor> monitor_;
};

}  // namespace fsdp::collectives
