#include "fsdp2/custom_collectives.h"

#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "fsdp2/fully_shard.h"
#include "fsdp_param_group.h"
#include "fsdp_state.h"

namespace fsdp {

AllGather::~AllGather() = default;

at::Tensor AllGather::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
}

int64_t AllGather::received_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t world_size) const {
  return (world_size - 1) * input_numel * static_cast<int64_t>(c10::elementSize(dtype));
}

ReduceScatter::~ReduceScatter() = default;

at::Tensor ReduceScatter::allocate(c10::IntArrayRef sizes, c10::ScalarType dtype, c10::Device device) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
}

int64_t ReduceScatter::sent_bytes(int64_t input_numel, c10::ScalarType dtype, int64_t /*world_size*/) const {
  return input_numel * static_cast<int64_t>(c10::elementSize(dtype));
}

// ---- Int8AllGather ----

Int8AllGather::Int8AllGather(int64_t block_size) : block_size_(block_size) {
  TORCH_CHECK(block_size > 0, "Int8AllGather: the block size must be positive, got ", block_size);
}

int64_t Int8AllGather::num_blocks(int64_t numel) const { return (numel + block_size_ - 1) / block_size_; }

int64_t Int8AllGather::row_bytes(int64_t numel) const {
  const int64_t bytes = 4 * num_blocks(numel) + numel;
  return (bytes + 3) / 4 * 4;
}

int64_t Int8AllGather::received_bytes(int64_t input_numel, c10::ScalarType /*dtype*/, int64_t world_size) const {
  return (world_size - 1) * row_bytes(input_numel);
}

void Int8AllGather::quantize(const at::Tensor& input, const at::Tensor& row) const {
  TORCH_CHECK(input.dim() == 1 && at::isFloatingType(input.scalar_type()),
              "Int8AllGather: the input must be a 1-D floating-point tensor, got ", input.scalar_type(), " of shape ",
              input.sizes());
  const int64_t n = input.numel();
  const int64_t blocks = num_blocks(n);
  TORCH_CHECK(row.scalar_type() == at::kByte && row.dim() == 1 && row.numel() == row_bytes(n) && row.is_contiguous() &&
                  row.device() == input.device(),
              "Int8AllGather: the packed row must be a contiguous uint8 tensor of ", row_bytes(n), " bytes on ",
              input.device(), ", got ", row.scalar_type(), " of shape ", row.sizes(), " on ", row.device());
  at::NoGradGuard no_grad;
  // Blocks of block_size_ values in fp32; the tail block is padded with
  // zeros, which change neither its largest magnitude nor anything kept.
  at::Tensor x = input.to(at::kFloat);
  if (blocks * block_size_ != n) x = at::constant_pad_nd(x, {0, blocks * block_size_ - n});
  const at::Tensor grid = x.view({blocks, block_size_});
  const at::Tensor scale = grid.abs().amax(/*dim=*/1).div_(127.0f);
  // A block of zeros has scale 0: divide by 1 there, which keeps q = 0. A
  // NaN scale (a NaN in the block) also divides by 1 and dequantizes to NaN.
  const at::Tensor divisor = at::where(scale > 0, scale, at::ones_like(scale));
  const at::Tensor q = grid.div(divisor.unsqueeze(1)).round_().clamp_(-127, 127).to(at::kChar).view({-1});
  row.narrow(0, 0, 4 * blocks).view(at::kFloat).copy_(scale);
  row.narrow(0, 4 * blocks, n).view(at::kChar).copy_(q.narrow(0, 0, n));
  const int64_t tail = row.numel() - 4 * blocks - n;
  if (tail > 0) row.narrow(0, 4 * blocks + n, tail).zero_();
}

void Int8AllGather::dequantize(const at::Tensor& rows, const at::Tensor& output) const {
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
              "Int8AllGather: the packed rows must be a contiguous 2-D uint8 tensor, got ", rows.scalar_type(),
              " of shape ", rows.sizes());
  const int64_t world = rows.size(0);
  TORCH_CHECK(output.dim() == 1 && world > 0 && output.numel() % world == 0 && at::isFloatingType(output.scalar_type()),
              "Int8AllGather: the output must be a 1-D floating-point tensor of a multiple of ", world,
              " elements, got ", output.scalar_type(), " of shape ", output.sizes());
  const int64_t n = output.numel() / world;
  const int64_t blocks = num_blocks(n);
  TORCH_CHECK(rows.size(1) == row_bytes(n), "Int8AllGather: packed rows of ", rows.size(1), " bytes for ", n,
              " elements per rank, expected ", row_bytes(n));
  at::NoGradGuard no_grad;
  const at::Tensor scales = rows.narrow(1, 0, 4 * blocks).view(at::kFloat);  // {world, blocks}
  at::Tensor q = rows.narrow(1, 4 * blocks, n).view(at::kChar).to(at::kFloat);
  if (blocks * block_size_ != n) q = at::constant_pad_nd(q, {0, blocks * block_size_ - n});
  const at::Tensor values = q.view({world, blocks, block_size_}).mul_(scales.unsqueeze(2));
  output.view({world, n}).copy_(values.view({world, blocks * block_size_}).narrow(1, 0, n));
}

collectives::Work Int8AllGather::all_gather(const at::Tensor& output, const at::Tensor& input,
                                            collectives::Communicator& comm) {
  const int64_t world = comm.size();
  TORCH_CHECK(output.numel() == world * input.numel(), "Int8AllGather: the output has ", output.numel(),
              " elements for ", world, " ranks of ", input.numel());
  const int64_t n = input.numel();
  const int64_t bytes = row_bytes(n);
  // One byte buffer for every rank's scales and values: one collective.
  // NCCL gathers in place from this rank's row, Gloo from a row of its own.
  at::Tensor rows = at::empty({world * bytes}, input.options().dtype(at::kByte));
  const bool in_place = comm.backend_kind() == collectives::BackendKind::kNccl;
  at::Tensor row = in_place ? rows.narrow(0, comm.rank() * bytes, bytes) : at::empty({bytes}, rows.options());
  quantize(input, row);
  collectives::Work work = comm.all_gather_into_tensor(rows, row);
  // Every rank, this one included, takes the values from the gathered rows,
  // so that all unsharded parameters are the same bits. The closure keeps
  // both buffers alive until the collective finished, and a copy of this
  // object (the module may drop it before the wait).
  work.then([self = *this, rows, row, output, world, bytes] { self.dequantize(rows.view({world, bytes}), output); });
  return work;
}

// ---- FSDPModule::set_custom_all_gather / set_custom_reduce_scatter ----

namespace detail {
std::string fqn_in_sharded_roots(const torch::nn::Module& module);
}  // namespace detail

namespace {

// "module 'blocks.0' (Block)", "the root module (Net)".
std::string module_label(const detail::FSDPState& state) {
  const auto module = state.module();
  const std::string type = module ? module->name() : "?";
  std::string fqn = state.fqn();
  if (fqn.empty() && module) fqn = detail::fqn_in_sharded_roots(*module);
  if (!fqn.empty()) return "module '" + fqn + "' (" + type + ")";
  return (state.parent() || !state.initialized() ? "module " : "the root module ") + std::string("(") + type + ")";
}

// The group a custom collective is set on, checked to be between steps.
detail::FSDPParamGroup& group_for_custom(const detail::FSDPState& state, const char* method) {
  TORCH_CHECK(state.groups().size() <= 1, method, ": ", module_label(state), " has ", state.groups().size(),
              " parameter groups, one per mesh that shard_placement_fn chose (per-parameter meshes); custom "
              "collectives are set on a module with one group: give the parameters on other meshes to a submodule "
              "sharded by its own fully_shard call");
  detail::FSDPParamGroup* g = state.group();
  TORCH_CHECK(g != nullptr, method, ": ", module_label(state),
              " has no parameters of its own (its submodules' groups hold them all), so it has no all-gather or "
              "reduce-scatter to replace; call it on the modules whose parameters it should gather");
  TORCH_CHECK(g->training_state() == detail::TrainingState::kIdle && g->is_sharded() && !g->has_pending_all_gather() &&
                  !g->has_pending_reduce(),
              method, ": ", module_label(state),
              " is in the middle of a step (its parameters are unsharded or a collective of it is in flight); "
              "set custom collectives between steps: before the forward, or after backward and the optimizer "
              "step (and after reshard() if you unsharded it yourself)");
  return *g;
}

}  // namespace

void FSDPModule::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  group_for_custom(*state_, "set_custom_all_gather").set_custom_all_gather(std::move(comm));
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  group_for_custom(*state_, "set_custom_reduce_scatter").set_custom_reduce_scatter(std::move(comm));
}

}  // namespace fsdp
