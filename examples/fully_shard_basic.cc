// fully_shard in one page: four residual blocks, each its own communication
// group, then the root; AdamW over the sharded parameters; a few steps on
// random data. Compiled by the build and run at 2 ranks by the tests
// (tests/examples); the examples in fsdp2/include/fsdp2/fully_shard.h and
// docs/fsdp2.md are excerpts of this file.
//
//   build/examples/fully_shard_basic --nproc 2
//   fsdprun --nproc 2 -- build/examples/fully_shard_basic
//   torchrun --nproc-per-node 2 --no-python build/examples/fully_shard_basic
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "collectives/world.h"
#include "device_mesh/device_mesh.h"
#include "fsdp2/clip_grad.h"
#include "fsdp2/fully_shard.h"
#include "fsdp2/module_call.h"
#include "launch/launch.h"

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) : fc(register_module("fc", torch::nn::Linear(dim, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + at::gelu(fc(x)); }
  torch::nn::Linear fc;
};
FSDP2CPP_MODULE(Block);  // instead of TORCH_MODULE(Block): block(x) runs FSDP's hooks

struct Net : torch::nn::Module {
  Net() {
    for (int i = 0; i < 4; ++i) blocks.push_back(register_module("b" + std::to_string(i), Block(64)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = b(h);
    return h;
  }
  std::vector<Block> blocks;
};

int main(int argc, char** argv) {
  if (auto rc = fsdp::launch::maybe_launch_local(argc, argv)) return *rc;  // --nproc N starts N ranks
  auto world = fsdp::collectives::World::from_env();                       // torchrun / srun / fsdprun / --nproc
  auto mesh = fsdp::init_device_mesh(world, c10::kCPU, {world->size()});
  torch::manual_seed(0);  // the same full model on every rank
  auto model = std::make_shared<Net>();
  fsdp::FullyShardOptions opts;
  opts.mesh = mesh;
  for (auto& block : model->blocks) fsdp::fully_shard(block, opts);  // submodules first
  fsdp::FSDPModule root = fsdp::fully_shard(model, opts);            // then the root
  torch::optim::AdamW optim(model->parameters(), 1e-3);              // after fully_shard
  torch::manual_seed(1 + world->rank());
  at::Tensor x = at::randn({8, 64}), y = at::randn({8, 64});  // this rank's batch, every step
  for (int step = 0; step < 5; ++step) {
    at::Tensor loss = at::mse_loss(fsdp::call_module(*model, x), y);  // the root through its hooks
    loss.backward();
    fsdp::clip_grad_norm_(root, 1.0);  // the norm over all shards
    optim.step();
    optim.zero_grad();
    std::printf("step %d loss %.4f\n", step, loss.item<double>());
  }
  return 0;
}
