#include "collectives/world.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <optional>
#include <set>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "backends.h"
#include "collectives/errors.h"
#include "divergence_monitor.h"
#include "fsdp_common/logging.h"
#include "join_ranks.h"

namespace fsdp::collectives {
namespace {

constexpr const char* kLauncherHint =
    "torchrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE (and LOCAL_RANK, LOCAL_WORLD_SIZE); "
    "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID but not MASTER_ADDR and MASTER_PORT; "
    "set them yourself when launching otherwise";

// Parses an integer variable in [min, max]; nullopt when unset and optional.
std::optional<int> env_int(const char* name, bool required, int min, int max) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    TORCH_CHECK(!required, "fsdp2cpp: env:// rendezvous: environment variable ", name, " is not set; ", kLauncherHint);
    return std::nullopt;
  }
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  TORCH_CHECK(errno == 0 && end != value && *end == '\0' && parsed >= min && parsed <= max,
              "fsdp2cpp: env:// rendezvous: environment variable ", name, "='", value, "' is not an integer in [", min,
              ", ", max, "]; ", kLauncherHint);
  return static_cast<int>(parsed);
}

bool is_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

// This node's entry of SLURM_TASKS_PER_NODE, e.g. "2(x3),1" with node 3 -> 1.
std::optional<int> slurm_tasks_on_node(const std::string& text, int node) {
  int first_node = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string entry = text.substr(pos, end - pos);
    char* end_tasks = nullptr;
    const long tasks = std::strtol(entry.c_str(), &end_tasks, 10);
    long repeat = 1;
    bool ok = end_tasks != entry.c_str();
    if (ok && *end_tasks == '(') {
      char* end_repeat = nullptr;
      ok = end_tasks[1] == 'x';
      if (ok) repeat = std::strtol(end_tasks + 2, &end_repeat, 10);
      ok = ok && end_repeat != end_tasks + 2 && end_repeat[0] == ')' && end_repeat[1] == '\0';
    } else {
      ok = ok && *end_tasks == '\0';
    }
    TORCH_CHECK(ok, "fsdp2cpp: env:// rendezvous: environment variable SLURM_TASKS_PER_NODE='", text,
                "' is not a list of N or N(xM) entries; set LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE instead");
    TORCH_CHECK(tasks >= 1 && repeat >= 1, "fsdp2cpp: env:// rendezvous: environment variable SLURM_TASKS_PER_NODE='",
                text, "' has an entry below 1");
    if (node < first_node + repeat) return static_cast<int>(tasks);
    first_node += static_cast<int>(repeat);
    pos = end + 1;
  }
  return std::nullopt;
}

std::string rank_key(int rank) { return "fsdp2cpp/rdzv/rank/" + std::to_string(rank); }

using detail::join_ranks;

// The keys in `keys` that the store does not hold; empty when the store
// itself cannot be asked (it is gone).
std::vector<int> missing_of(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<std::string>& keys,
                            const std::vector<int>& ranks) {
  std::vector<int> missing;
  try {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!store->check({keys[i]})) missing.push_back(ranks[i]);
    }
  } catch (const std::exception&) {
    return {};
  }
  return missing;
}

bool is_loopback(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

}  // namespace

World::World(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int local_rank, int local_size,
             std::string description)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      local_rank_(local_rank),
      local_size_(local_size),
      description_(std::move(description)) {
  if (const char* addr = std::getenv("MASTER_ADDR")) master_addr_ = addr;
}

World::~World() = default;

FlightRecorder& World::flight_recorder() { return monitor_->recorder(); }

EnvRendezvousSpec env_rendezvous_spec() {
  EnvRendezvousSpec spec;
  const char* addr = std::getenv("MASTER_ADDR");
  TORCH_CHECK(addr != nullptr && *addr != '\0',
              "fsdp2cpp: env:// rendezvous: environment variable MASTER_ADDR is not set; ", kLauncherHint);
  spec.master_addr = addr;
  spec.master_port = *env_int("MASTER_PORT", /*required=*/true, 1, 65535);
  std::optional<int> local_world_size, local_rank;
  if (is_set("RANK") || !is_set("SLURM_PROCID")) {
    spec.launcher = "torchrun";
    TORCH_CHECK(is_set("RANK"), "fsdp2cpp: env:// rendezvous: environment variable RANK is not set (nor ",
                "SLURM_PROCID, which srun sets); ", kLauncherHint);
    spec.world_size = *env_int("WORLD_SIZE", /*required=*/true, 1, INT_MAX);
    spec.rank = *env_int("RANK", /*required=*/true, 0, spec.world_size - 1);
    local_world_size = env_int("LOCAL_WORLD_SIZE", /*required=*/false, 1, spec.world_size);
    local_rank = env_int("LOCAL_RANK", /*required=*/false, 0, local_world_size.value_or(spec.world_size) - 1);
  } else {
    // srun: one task per rank, the task id is the rank.
    spec.launcher = "srun";
    spec.world_size = *env_int("SLURM_NTASKS", /*required=*/true, 1, INT_MAX);
    spec.rank = *env_int("SLURM_PROCID", /*required=*/true, 0, spec.world_size - 1);
    local_world_size = env_int("SLURM_NTASKS_PER_NODE", /*required=*/false, 1, spec.world_size);
    if (!local_world_size && is_set("SLURM_TASKS_PER_NODE")) {
      const int node = env_int("SLURM_NODEID", /*required=*/false, 0, INT_MAX).value_or(0);
      local_world_size = slurm_tasks_on_node(std::getenv("SLURM_TASKS_PER_NODE"), node);
      TORCH_CHECK(local_world_size.has_value(),
                  "fsdp2cpp: env:// rendezvous: environment variable SLURM_TASKS_PER_NODE='",
                  std::getenv("SLURM_TASKS_PER_NODE"), "' has no entry for node ", node, " (SLURM_NODEID)");
      TORCH_CHECK(*local_world_size <= spec.world_size, "fsdp2cpp: env:// rendezvous: SLURM_TASKS_PER_NODE gives ",
                  *local_world_size, " tasks on node ", node, ", more than SLURM_NTASKS=", spec.world_size);
    }
    local_rank = env_int("SLURM_LOCALID", /*required=*/false, 0, local_world_size.value_or(spec.world_size) - 1);
  }
  spec.local_rank = local_rank.value_or(-1);
  spec.local_world_size = local_world_size.value_or(-1);
  return spec;
}

std::shared_ptr<World> World::from_env(const RendezvousOptions& options) {
  const EnvRendezvousSpec spec = env_rendezvous_spec();
  const int port = spec.master_port, world_size = spec.world_size, rank = spec.rank;
  const std::string& host = spec.master_addr;
  const std::string description = c10::str("env://", host, ":", port);

  // Under torchrun the elastic agent already hosts a TCPStore at
  // MASTER_ADDR:MASTER_PORT and says so with TORCHELASTIC_USE_AGENT_STORE:
  // then every rank is a client and keys live under the restart attempt's
  // prefix, exactly as torch.distributed's env:// rendezvous does.
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool use_agent_store = agent_store != nullptr && std::string(agent_store) == "True";
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(port);
  store_options.isServer = rank == 0 && !use_agent_store;
  store_options.numWorkers = world_size;
  // Our own check-in below waits for the workers and names the missing ones.
  store_options.waitWorkers = false;
  store_options.timeout = options.timeout;
  store_options.multiTenant = true;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    if (store_options.isServer) {
      TORCH_CHECK(false, "fsdp2cpp: rendezvous ", description, ": rank 0 could not host the store at ", host, ":", port,
                  ": ", exception_text(e), ". Is the port in use, or MASTER_ADDR not an address of this host?");
    }
    TORCH_CHECK(false, "fsdp2cpp: rendezvous ", description, " timed out: rank ", rank, " could not reach the store ",
                use_agent_store ? "of the torchrun agent" : "of rank 0", " at ", host, ":", port, " within ",
                options.timeout.count(), " ms: ", exception_text(e),
                ". Check that rank 0 was started and that every rank has the same MASTER_ADDR and MASTER_PORT");
  }
  if (use_agent_store) {
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    store = c10::make_intrusive<c10d::PrefixStore>(
        c10::str("/worker/attempt_", attempt != nullptr && *attempt != '\0' ? attempt : "0"), store);
  }
  auto world =
      from_store(std::move(store), rank, world_size, description, options, spec.local_rank, spec.local_world_size);
  world->master_addr_ = host;
  return world;
}

std::shared_ptr<World> World::from_file(const std::string& path, int rank, int world_size,
                                        const RendezvousOptions& options) {
  TORCH_CHECK(world_size >= 1, "fsdp2cpp: file://", path, " rendezvous: world_size ", world_size,
              " must be at least 1");
  TORCH_CHECK(!path.empty(), "fsdp2cpp: file:// rendezvous needs a path every rank can see");
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  return from_store(std::move(store), rank, world_size, "file://" + path, options);
}

std::shared_ptr<World> World::from_store(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                                         std::string description, const RendezvousOptions& options, int local_rank,
                                         int local_world_size) {
  TORCH_CHECK(store, "fsdp2cpp: rendezvous ", description, ": the store is null");
  TORCH_CHECK(world_size >= 1, "fsdp2cpp: rendezvous ", description, ": world size ", world_size,
              " must be at least 1");
  TORCH_CHECK(rank >= 0 && rank < world_size, "fsdp2cpp: rendezvous ", description, ": rank ", rank,
              " is out of range for world size ", world_size, " (expected 0 <= rank < world size)");
  set_log_rank(rank);

  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r = 0; r < world_size; ++r) {
    keys.push_back(rank_key(r));
    ranks.push_back(r);
  }
  const std::string value = std::to_string(rank);
  try {
    store->set(keys[rank], std::vector<uint8_t>(value.begin(), value.end()));
    store->wait(keys, options.timeout);
  } catch (const std::exception& e) {
    const std::vector<int> missing = missing_of(store, keys, ranks);
    TORCH_CHECK(!missing.empty(), "fsdp2cpp: rendezvous ", description, " failed on rank ", rank, " of ", world_size,
                ": ", exception_text(e));
    TORCH_CHECK(false, "fsdp2cpp: rendezvous ", description, " timed out after ", options.timeout.count(),
                " ms on rank ", rank, " of ", world_size, ": missing rank(s) [", join_ranks(missing),
                "] never joined. Start every rank with the same rendezvous and world size, "
                "or raise RendezvousOptions::timeout if they start slowly");
  }
  FSDP2CPP_LOG_INFO(c10::str("rendezvous ", description, ": all ", world_size, " ranks joined"));

  auto world =
      std::shared_ptr<World>(new World(std::move(store), rank, world_size, local_rank >= 0 ? local_rank : rank,
                                       local_world_size >= 1 ? local_world_size : world_size, std::move(description)));
  world->monitor_ = std::make_shared<detail::DivergenceMonitor>(world->store_, rank, world_size, options.divergence);
  world->group_maker_ = options.group_maker;
  return world;
}

std::vector<int> World::all_ranks() const {
  std::vector<int> ranks(size_);
  for (int r = 0; r < size_; ++r) ranks[r] = r;
  return ranks;
}

namespace {

// new_group's members are distinct ranks of the world, this one among them,
// on a device type with an engine; returns this rank's rank in the group.
int check_members(const std::vector<int>& ranks, const std::string& members, int rank, int size,
                  const std::string& description) {
  TORCH_CHECK(!ranks.empty(), "fsdp2cpp: new_group on ", description, ": the member list is empty");
  std::set<int> seen;
  for (int r : ranks) {
    TORCH_CHECK(r >= 0 && r < size, "fsdp2cpp: new_group([", members, "]) on ", description, ": rank ", r,
                " is out of range for world size ", size, "; members are global ranks in [0, ", size, ")");
    TORCH_CHECK(seen.insert(r).second, "fsdp2cpp: new_group([", members, "]) on ", description, ": rank ", r,
                " is listed twice; each member must appear once");
  }
  const auto self = std::find(ranks.begin(), ranks.end(), rank);
  TORCH_CHECK(self != ranks.end(), "fsdp2cpp: new_group([", members, "]) on ", description, ": this rank (", rank,
              ") is not a member; only the members of a group call new_group for it");
  return static_cast<int>(self - ranks.begin());
}

// The engine of a group: the one asked for, or kAuto's (NCCL on CUDA, Gloo
// on CPU), which this build must have.
BackendKind backend_kind(BackendKind asked, c10::DeviceType device_type, const std::string& members) {
  BackendKind kind = asked;
  if (kind == BackendKind::kAuto) kind = device_type == c10::kCUDA ? BackendKind::kNccl : BackendKind::kGloo;
  if (kind == BackendKind::kNccl) {
    TORCH_CHECK(device_type == c10::kCUDA, "fsdp2cpp: new_group([", members,
                "]): NCCL moves CUDA tensors only, but device type cpu was asked for; use BackendKind::kGloo "
                "(or kAuto) for CPU communicators");
    TORCH_CHECK(detail::nccl_compiled(), "fsdp2cpp: new_group([", members,
                "]): this build has no NCCL (built without CUDA); rebuild with CUDA, or pass "
                "CommunicatorOptions::backend = BackendKind::kGloo to move CUDA tensors with Gloo");
  }
  return kind;
}

// Where Gloo listens: a network interface, a host address, or "" for gloo's
// default device (the address the host name resolves to).
struct GlooDevice {
  std::string host;
  bool is_interface = false;
};

GlooDevice gloo_device(const CommunicatorOptions& options, const std::string& master_addr) {
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') return {ifname, true};
  if (!options.gloo_interface.empty()) return {options.gloo_interface, true};
  // Local runs (and file://): every rank is on this host, and the default
  // device would resolve the host name, which in containers may not be
  // reachable.
  if (is_loopback(master_addr)) return {"127.0.0.1", false};
  return {};
}

// "<prefix>0", "<prefix>1", ... one key per member.
std::vector<std::string> member_keys(const std::string& prefix, size_t members) {
  std::vector<std::string> keys;
  for (size_t i = 0; i < members; ++i) keys.push_back(prefix + std::to_string(i));
  return keys;
}

// Gloo's full-mesh connect can return on one side of a pair before the
// other side has finished its handshake; a member that then destroys the
// group at once (an error, a group never used, a short program) closes the
// socket under its peer, which fails with "Connection closed by peer". So
// no member leaves new_group until every member's engine is up.
void wait_for_group_members(const c10::intrusive_ptr<c10d::Store>& group_store, const std::vector<int>& ranks,
                            int group_rank, std::chrono::milliseconds timeout, const std::string& name,
                            const std::string& description, int rank) {
  const std::string ready_prefix = "ready/";
  group_store->set(ready_prefix + std::to_string(group_rank), std::vector<uint8_t>{1});
  const std::vector<std::string> ready_keys = member_keys(ready_prefix, ranks.size());
  try {
    group_store->wait(ready_keys, timeout);
  } catch (const std::exception& e) {
    const std::vector<int> missing = missing_of(group_store, ready_keys, ranks);
    TORCH_CHECK(false, "fsdp2cpp: new_group: creating ", name, " on ", description, " failed on rank ", rank,
                missing.empty() ? std::string()
                                : c10::str(": member rank(s) [", join_ranks(missing),
                                           "] did not finish connecting within ", timeout.count(), " ms"),
                ": ", exception_text(e));
  }
}

}  // namespace

std::shared_ptr<Communicator> World::new_group(const std::vector<int>& ranks, c10::DeviceType device_type,
                                               const CommunicatorOptions& options) {
  const std::string members = join_ranks(ranks);
  const int group_rank = check_members(ranks, members, rank_, size_, description_);
  if (group_maker_) {
    std::shared_ptr<Communicator> group = group_maker_(ranks, device_type);
    TORCH_CHECK(group != nullptr, "fsdp2cpp: new_group([", members, "]) on ", description_,
                ": RendezvousOptions::group_maker returned no communicator; it must return one for every group");
    return group;
  }
  TORCH_CHECK(device_type == c10::kCPU || device_type == c10::kCUDA, "fsdp2cpp: new_group([", members,
              "]): device type ", c10::DeviceTypeName(device_type, true), " has no collective engine; use cpu or cuda");
  const BackendKind kind = backend_kind(options.backend, device_type, members);

  int index = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    index = group_counts_[members]++;
  }
  const std::string prefix = c10::str("fsdp2cpp/group/", members, "/", index);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  const std::string name = c10::str(to_string(kind), "[", members, "]");

  // Our own check-in, so that a group whose member never came names it.
  const std::string joined_prefix = "joined/";
  group_store->set(joined_prefix + std::to_string(group_rank), std::vector<uint8_t>{1});

  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    if (kind == BackendKind::kNccl) {
      backend = detail::make_nccl_backend(group_store, group_rank, static_cast<int>(ranks.size()), options.timeout);
    } else {
      const GlooDevice device = gloo_device(options, master_addr_);
      backend = detail::make_gloo_backend(group_store, group_rank, static_cast<int>(ranks.size()), options.timeout,
                                          device.host, device.is_interface);
    }
  } catch (const std::exception& e) {
    const std::vector<int> missing = missing_of(group_store, member_keys(joined_prefix, ranks.size()), ranks);
    TORCH_CHECK(false, "fsdp2cpp: new_group: creating ", name, " on ", description_, " failed on rank ", rank_,
                missing.empty()
                    ? std::string()
                    : c10::str(" (member rank(s) [", join_ranks(missing), "] never called new_group for it)"),
                ": ", exception_text(e));
  }
  wait_for_group_members(group_store, ranks, group_rank, options.timeout, name, description_, rank_);
  FSDP2CPP_LOG_DEBUG(c10::str("new_group ", name, " (#", index, " over these ranks), group rank ", group_rank));
  return std::make_shared<Communicator>(std::move(backend), kind, device_type, group_rank, ranks, options, monitor_,
                                        c10::str(name, "#", index));
}

std::shared_ptr<Communicator> World::shared_group(const std::vector<int>& ranks, c10::DeviceType device_type,
                                                  const CommunicatorOptions& options) {
  std::string key = std::to_string(static_cast<int>(device_type)) + "/" + to_string(options.backend) + ":";
  for (int r : ranks) key += std::to_string(r) + ",";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto existing = shared_groups_[key].lock()) return existing;
  }
  auto group = new_group(ranks, device_type, options);
  std::lock_guard<std::mutex> lock(mutex_);
  shared_groups_[key] = group;
  return group;
}

}  // namespace fsdp::collectives
